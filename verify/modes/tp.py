"""``--tp T``: the harness's modes on an ``("shard", "tp")`` mesh of (W/T) × T.

The built-in TinyGPT's MLPs are tensor parallel (torch's ``parallelize_module``:
``mlp.fc1`` ``ColwiseParallel``, ``mlp.fc2`` ``RowwiseParallel``, on ``mesh["tp"]``); the
attention matrices stay replicated over TP. Then, in torchtitan's order:

- ``dmuon-z2`` / ``dmuon-z3``: ``dmuon.dedicate_params(model, mesh)`` on the whole mesh, then
  ``fully_shard(model, mesh=mesh["shard"], ignored_params=set(dm))``, ``DMuon``;
  ``dmuon-hsdp-z2`` / ``dmuon-hsdp-z3`` the same on a ``("replicate", "shard", "tp")`` mesh
  (2, W/(2T), T), ``fully_shard`` on ``mesh["replicate", "shard"]``;
- ``naive-fsdp2-z2`` / ``naive-fsdp2-z3`` (the baseline): ``fully_shard`` of each module holding
  a Muon param and of the root on ``mesh["shard"]`` (FSDP2 × TP), and :class:`NaiveTPMuon`,
  which all_gathers each full gradient in the step and runs Newton–Schulz on every rank.

The data-parallel index of rank ``s·T + t`` is s: the T ranks of a TP group read the same
rows of the global batch (:func:`tp_loss`). DTensor's own collectives (redistributions inside
the TP layers' forward and backward) are tagged with phase ``tp`` (:func:`tp_phase`), except
inside the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim import Optimizer

import dmuon
from dmuon import annotate
from dmuon.optim.muon_math import MUON_DEFAULTS, adjust_lr, zeropower_via_newtonschulz
from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes, select_params
from tracer.context import current_phase
from verify._compat import all_gather_single
from verify.modes.workload import Running, Workload
from verify.traffic.tp import TP_MODES, TPRunLayout, tp_skip_reason
from verify.traffic.predict import dmuon_coalesce_bytes, dmuon_reduce_by_gather, dmuon_uneven_aligned
from verify.workload.data import ByteCorpus, local_slice
from verify.workload.model import GPTConfig, TinyGPT

#: The TP plan of the built-in TinyGPT's blocks (module name within a block -> style).
TP_PLAN = {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


def tp_mesh(world: int, tp: int, device: str, hsdp: bool = False):
    """The ``("shard", "tp")`` mesh (W/T, T), or (``hsdp``) ``("replicate", "shard", "tp")``
    (2, W/(2T), T).

    Raises:
        ValueError: T < 2 or T does not divide W (or 2T, for ``hsdp``).
    """
    if tp < 2 or world % (tp * (2 if hsdp else 1)):
        raise ValueError(f"Invalid --tp {tp} at W={world}. Must be >= 2 and divide W (HSDP: W/2).")
    if hsdp:
        return init_device_mesh(device, (2, world // (2 * tp), tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("shard", "tp"))


def parallelize_blocks(model: nn.Module, mesh) -> list[tuple[str, str]]:
    """Apply :data:`TP_PLAN` to every block; returns ``(module, style)`` in model order.

    Raises:
        ValueError: the model has no ``blocks`` with those modules (``--tp`` needs the
            built-in model), or T does not divide a sharded dim.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not blocks:
        raise ValueError("Invalid --model for --tp: the TP plan needs the built-in TinyGPT "
                         "(blocks.<i>.mlp.fc1 / fc2).")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out = []
    for i, block in enumerate(blocks):
        mods = dict(block.named_modules())
        for name, style in TP_PLAN.items():
            lin = mods.get(name)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"Invalid --model for --tp: blocks.{i} has no Linear {name}.")
            out.append((f"blocks.{i}.{name}", style))
        parallelize_module(block, mesh["tp"], {n: styles[s]() for n, s in TP_PLAN.items()})
    return out


@contextlib.contextmanager
def tp_phase():
    """Tag DTensor's redistributions with phase ``tp`` (outside the optimizer step) while
    the block runs: wraps ``redistribute_local_tensor`` where torch 2.13's DTensor calls it
    (``_redistribute``, ``_api``, ``_dispatch``), and restores it on exit."""
    import torch.distributed.tensor._api as api
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as red

    original = red.redistribute_local_tensor

    def tagged(*args, **kwargs):
        if current_phase() == "optimizer":
            return original(*args, **kwargs)
        with annotate.phase("tp"):
            return original(*args, **kwargs)

    mods = (red, api, dispatch)
    for m in mods:
        m.redistribute_local_tensor = tagged
    try:
        yield
    finally:
        for m in mods:
            m.redistribute_local_tensor = original


def tp_loss(corpus, *, global_batch: int, seq_len: int, seed: int, tp: int) -> Callable:
    """``loss_fn(model, rank, step)``: next-byte cross-entropy on the rows of data-parallel
    index ``rank // T`` of ``W / T`` (the TP group's shared rows)."""

    def loss_fn(model: nn.Module, rank: int, step: int) -> torch.Tensor:
        x, y = corpus.global_batch(step, global_batch, seq_len, seed=seed)
        dp = dist.get_world_size() // tp
        x, y = local_slice(x, rank // tp, dp), local_slice(y, rank // tp, dp)
        device = next(p for p in model.parameters()).device
        logits = model(x.to(device))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1))

    return loss_fn


class NaiveTPMuon(Optimizer):
    """The FSDP2 × TP baseline's Muon: every rank gathers every full gradient and runs
    ``torch.optim.Muon``'s arithmetic on it, then applies its own piece of the update.

    Per Muon param, in order: ``all_gather_single`` of the FSDP2 shard of the grad over
    the shard axis (count: the shard's elements), then, for a TP param, of the TP shard over
    the TP group (count n/T); momentum (full shape) and Newton–Schulz on every rank.

    Args:
        params: DTensor params: FSDP2 ``Shard(0)`` on the shard axis, with or without a TP
            ``Shard(d)`` on ``mesh["tp"]``; dim 0 of the (TP-local) param divisible by N.
        tp_dims: name -> d of the TP params; names: the params' names.
        shard_group, tp_group: the groups of ``mesh["shard"]`` and ``mesh["tp"]``.

    Raises:
        ValueError: a param is not such a DTensor.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], tp_dims: dict[str, int],
                 shard_group, tp_group, **hyper) -> None:
        super().__init__([p for _, p in named], {**MUON_DEFAULTS, **hyper})
        self._name = {id(p): n for n, p in named}
        self._tp_dims = tp_dims
        self._groups = (shard_group, tp_group)
        self.ns_calls = 0
        for n, p in named:
            if not isinstance(p, DTensor):
                raise ValueError(f"Invalid param {n!r}: must be an FSDP2 DTensor (fully_shard).")

    @torch.no_grad()
    def step(self, closure=None):
        shard_group, tp_group = self._groups
        n_shard, t = dist.get_world_size(shard_group), dist.get_world_size(tp_group)
        s, ti = dist.get_group_rank(shard_group, dist.get_rank()), dist.get_group_rank(tp_group, dist.get_rank())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                name = self._name[id(p)]
                local = p.grad.to_local().contiguous()
                full_local = local.new_empty((local.shape[0] * n_shard, *local.shape[1:]))
                all_gather_single(full_local, local, group=shard_group)
                d = self._tp_dims.get(name)
                if d is None:
                    full = full_local
                else:
                    stacked = full_local.new_empty((full_local.shape[0] * t, *full_local.shape[1:]))
                    all_gather_single(stacked, full_local, group=tp_group)
                    full = torch.cat(stacked.chunk(t, dim=0), dim=d) if d else stacked
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(full)
                buf = state["momentum_buffer"]
                buf.lerp_(full, 1 - group["momentum"])
                update = full.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                with annotate.span("naive.newton_schulz"):
                    ortho = zeropower_via_newtonschulz(update, group["ns_coefficients"],
                                                       group["ns_steps"], group["eps"])
                self.ns_calls += 1
                piece = ortho if d is None else ortho.chunk(t, dim=d)[ti]
                piece = piece.chunk(n_shard, dim=0)[s].to(p.dtype)
                data = p.to_local()
                data.mul_(1 - group["lr"] * group["weight_decay"])
                data.add_(piece, alpha=-adjust_lr(group["lr"], group["adjust_lr_fn"], tuple(full.shape)))


def shard_problem(shapes: dict[str, tuple[int, ...]], tp_dims: dict[str, int], tp: int,
                  n: int) -> str | None:
    """Why the Muon matrices ``shapes`` (name -> shape) do not shard evenly: a TP-sharded one's
    dim (``tp_dims``: name -> 0 or 1) not a multiple of T, or its local rows not a multiple of
    the N data-parallel ranks (the closed forms assume no FSDP2 padding); ``None``: they do."""
    for name, shape in shapes.items():
        d = tp_dims.get(name)
        if d is not None and shape[d] % tp:
            return f"{name} has {shape[d]} {'rows' if d == 0 else 'columns'}, not a multiple of T={tp}"
        rows = shape[0] // (tp if d == 0 else 1)
        if rows % n:
            return f"{name} has {rows} local rows, not a multiple of N={n}"
    return None


def build_tp(mode: str, make_model: Callable[[], nn.Module], device: str, tp: int, *,
             tokens_per_rank: int, muon_lr: float, adamw_lr: float,
             mixed_precision: str | None = None, coalesce: str = "auto"):
    """Build ``mode`` (one of :data:`verify.traffic.tp.TP_MODES`) on the TP mesh.

    Args:
        tokens_per_rank: batch rows x sequence length of one data-parallel slice (the
            numel of a TP layer's activation is that times its features).
        mixed_precision: ``None`` or ``"bf16"`` / ``"fp16"``: the same
            ``MixedPrecisionPolicy`` for ``dedicate_params`` and every ``fully_shard``
            (``verify.modes.build.mp_policy``); DTensor's activations then travel in it.
        coalesce: DMuon's ``dedicate_params(coalesce=...)``; units form over the local
            shards' bytes (the layout gets the documented target,
            :func:`verify.traffic.predict.dmuon_coalesce_bytes`).

    Returns:
        ``(model, optimizer, layout, dm)``; ``dm`` is None for the baselines.

    Raises:
        ValueError: a mode without TP support, a bad ``tp``, or a dim that N or T does not divide.
    """
    from verify.modes.build import _Pair, _fsdp_wrap, mp_policy, muon_names

    if mode not in TP_MODES:
        raise ValueError(f"Invalid mode {mode!r} with --tp. Must be one of {TP_MODES}.")
    world = dist.get_world_size()
    hsdp = "hsdp" in mode
    mesh = tp_mesh(world, tp, device, hsdp)
    dp_mesh = mesh["replicate", "shard"] if hsdp else mesh["shard"]
    r_size = 2 if hsdp else 1
    model = make_model().to(device)
    targets = muon_names(model)
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrix_shapes(model, targets)))
    layers = parallelize_blocks(model, mesh)
    named = dict(model.named_parameters())
    tp_dims = tuple((n, p.placements[0].dim) for n, p in named.items()
                    if isinstance(p, DTensor) and n in targets)
    mp = mp_policy(mixed_precision)
    mp_name = str(mp.param_dtype).removeprefix("torch.") if mp is not None else None
    dtype = mp_name or str(next(iter(named.values())).dtype).removeprefix("torch.")
    modules = dict(model.named_modules())
    acts = tuple((m, style, tokens_per_rank * (modules[m].in_features if style == "colwise"
                                                else modules[m].out_features), dtype)
                 for m, style in layers)
    n = world // tp // r_size
    why = shard_problem({s.name: s.shape for s in specs if s.name in targets}, dict(tp_dims), tp, n)
    if why is not None:
        raise ValueError(f"Invalid --tp {tp} at W={world}: {why}.")
    reshard = mode.endswith("z3")
    backend = "nccl" if device.startswith("cuda") else "gloo"  # DMuon's coalescing depends on it
    frozen = tuple(name for name, p in model.named_parameters() if not p.requires_grad)

    def layout(fsdp_modules) -> TPRunLayout:
        return TPRunLayout(mode=mode, replicate_size=r_size, shard_size=n, params=specs,
                           muon_names=targets, fsdp_modules=fsdp_modules,
                           reshard_after_forward=reshard, tp_size=tp, tp_dims=tp_dims,
                           tp_activations=acts, mp_param_dtype=mp_name, frozen_names=frozen,
                           dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
                           dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
                           dmuon_uneven_aligned=dmuon_uneven_aligned(backend))

    if mode.startswith("dmuon-"):
        dm = dmuon.dedicate_params(model, mesh, params=list(targets), reshard_after_forward=reshard,
                                   mp_policy=mp, coalesce=coalesce)
        fsdp_modules = _fsdp_wrap(model, dp_mesh, reshard, set(dm), [], mp, blocks=False)
        opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=muon_lr, adamw_lr=adamw_lr)
        return model, opt, layout(fsdp_modules), dm
    holders = {t.rpartition(".")[0] for t in targets} - {""}
    model_order = [s.module for s in specs]
    linear_modules = sorted(holders, key=lambda m: (-m.count("."), model_order.index(m)))
    fsdp_modules = _fsdp_wrap(model, mesh["shard"], reshard, set(), linear_modules, mp)
    named = dict(model.named_parameters())
    muon = NaiveTPMuon([(t, named[t]) for t in targets], dict(tp_dims), mesh["shard"].get_group(),
                       mesh["tp"].get_group(), lr=muon_lr)
    adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=adamw_lr)
    return model, _Pair(muon, adamw, lambda: muon.ns_calls), layout(fsdp_modules), None


class TPWorkload(Workload):
    """``--tp T``: the TP-capable modes on :func:`tp_mesh`, the built-in model's blocks
    tensor-parallel (:func:`parallelize_blocks`), the rest under FSDP2 (``verify.modes.workload``)."""

    axes = ("tp",)
    model_why = "its TP plan is fixed on the built-in model (verify/modes/tp.py)"
    flat_why = "dedicate_params refuses 'flat' on a mesh with a 'tp' axis; 'auto' is hierarchical there"
    qk_clip_why = "the TP builder attaches no QK-clip"
    rest, rest_why = "wrapper", "DMuon does not replicate a tensor-parallel model's rest"
    numerics_why = "tensor parallel: the probe is written for whole matrices"
    whole_model = False

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        return tp_skip_reason(mode, world_size, cfg.tp)

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        if world_size % cfg.tp:
            fits = [str(t) for t in range(2, world_size + 1) if world_size % t == 0]
            return (f"Invalid --tp {cfg.tp} at W={world_size}{where}. Must divide W, the mesh being "
                    f"(W/T) x T: give --tp {' or '.join(fits) or '1'}, or an --nproc that {cfg.tp} divides.")
        from verify.modes.build import muon_names

        size = {k: getattr(cfg, k, getattr(GPTConfig, k)) for k in ("d_model", "n_layers", "n_heads")}
        with torch.device("meta"):  # the built-in model (TP runs no other), as build_tp shards it
            model = TinyGPT(GPTConfig(**size))
        targets = set(muon_names(model))
        tp_dims = {f"blocks.{i}.{m}.weight": 0 if style == "colwise" else 1
                   for i in range(len(model.blocks)) for m, style in TP_PLAN.items()}
        why = shard_problem({n: tuple(p.shape) for n, p in model.named_parameters() if n in targets},
                            tp_dims, cfg.tp, world_size // cfg.tp)
        if why is not None:
            return (f"Invalid --tp {cfg.tp} at W={world_size}{where}: the built-in model's {why} "
                    "(verify/modes/tp.py). Give a --tp and --nproc that split it evenly.")
        return None

    def start(self, mode: str, config, *, make_model, made: list, corpus, global_batch: int) -> Running:
        from verify.modes.build import ADAMW_LR, MUON_LR, Built

        self.check(config)
        dp = dist.get_world_size() // config.tp
        model, opt, layout, dm = build_tp(
            mode, make_model, config.device, config.tp,
            tokens_per_rank=global_batch // dp * config.seq_len, muon_lr=MUON_LR, adamw_lr=ADAMW_LR,
            mixed_precision=config.mixed_precision, coalesce=config.coalesce)
        loss_fn = tp_loss(corpus or ByteCorpus.from_stdlib(), global_batch=global_batch,
                          seq_len=config.seq_len, seed=config.seed, tp=config.tp)
        return Running(Built(model, opt, layout, dm), loss_fn, tagging=tp_phase())
