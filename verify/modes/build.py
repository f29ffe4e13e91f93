"""How each mode of the harness wraps the model and builds its optimizer (one function each).

Every builder runs on every rank inside an initialised process group and returns a
:class:`Built`: the wrapped model, one optimizer object exposing ``step()``, ``zero_grad()``
and ``ns_calls``, and the :class:`verify.traffic.predict.RunLayout` the predictor needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.ownership.select import matrix_shapes, select_params
from dmuon.ownership.plan import specs_from_named_parameters

from verify.modes.baselines import MatrixMuon, NaiveShardedMuon, ZeroOneMuon
from verify.traffic.predict import (DMUON_HIERARCHIES, DMUON_REST_MODES, RunLayout, dmuon_coalesce_bytes,
                                    dmuon_flattens, dmuon_policy_backend, dmuon_reduce_by_gather,
                                    dmuon_uneven_aligned)
from verify.modes.variants import split_mode, variant_targets
from verify.workload.usermodel import block_names

#: Hyper-parameters every mode uses (Muon's and AdamW's torch defaults except the lrs).
MUON_LR = 0.02
ADAMW_LR = 3e-3
DDP_BUCKET_CAP_MB = 25


@dataclass
class Built:
    """A mode ready to train on this rank."""

    model: nn.Module
    optimizer: object
    layout: RunLayout
    dedicated: dmuon.DedicatedParams | None = None
    #: The mode's ``dmuon.optim.qk_clip.QKClip`` (``--qk-clip``, DMuon modes), else ``None``.
    qk_clip: object | None = None


class _Pair:
    """Two optimizers stepped as one (a baseline's Muon + AdamW), counting NS calls."""

    def __init__(self, muon, adamw, ns_calls: Callable[[], int]) -> None:
        self.muon, self.adamw, self._ns_calls = muon, adamw, ns_calls

    @property
    def ns_calls(self) -> int:
        return self._ns_calls()

    def step(self) -> None:
        with dmuon.phase("optimizer"):
            self.muon.step()
            self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.adamw.zero_grad()


def muon_names(model: nn.Module) -> tuple[str, ...]:
    """Muon targets: DMuon's default selection (``dmuon.ownership.select``), the same in every mode."""
    return tuple(n for n, _, _ in select_params(model, None, None))


def _mesh(mode: str, world: int, device: str):
    if "hsdp" in mode:
        if world % 2 or world < 4:
            raise ValueError(
                f"Invalid world_size={world} for {mode}: HSDP runs on a (2, W/2) mesh and "
                "needs an even W >= 4."
            )
        return init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,))


#: ``--mixed-precision`` choices -> torch dtype of MixedPrecisionPolicy.param_dtype.
MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mp_policy(mixed_precision: str | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``--mixed-precision`` (reduce_dtype left None: param_dtype).

    Raises:
        ValueError: not a key of :data:`MIXED_PRECISION`.
    """
    if mixed_precision is None:
        return None
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"Invalid mixed_precision={mixed_precision!r}. Must be one of {sorted(MIXED_PRECISION)}.")
    return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[mixed_precision])


def _fsdp_wrap(model: nn.Module, mesh, reshard: bool, ignored: set, per_linear: list[str],
               mp: MixedPrecisionPolicy | None = None, blocks: bool = True) -> tuple[str, ...]:
    """fully_shard: optionally each module holding Muon params, then (``blocks``) each block
    (the elements of the model's largest ModuleList, ``verify.workload.usermodel.block_names``)
    not wrapped already (a ModuleList of bare Linear layers: the block is the Linear), then
    the root; returns the wrap order.

    The DMuon modes pass ``blocks=False``: once DMuon takes the matrices, a block's FSDP2 unit
    holds only its biases and norms (a few KiB), and each unit costs a latency-bound
    all_gather and reduce_scatter per step. Profiled with torch.profiler (W=4 gloo, the
    bench_step MLP): per-block units made FSDP2's own collectives most of dmuon-z2's step
    (74 ms/step against 38 ms with the root unit only). One root unit is what docs/user-guide.md
    recommends.
    """
    order = []
    modules = dict(model.named_modules())
    kw = {"mp_policy": mp} if mp is not None else {}
    for name in per_linear:
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=reshard, **kw)
        order.append(name)
    for name in (block_names(model) if blocks else ()):
        if name in order:  # fully_shard twice on one module fails
            continue
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None, **kw)
        order.append(name)
    # The root without reshard_after_forward: FSDP2's "auto" keeps it unsharded after forward.
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, **kw)
    order.append("")
    return tuple(order)


def build(mode: str, make_model: Callable[[], nn.Module], device: str = "cpu",
          mixed_precision: str | None = None, coalesce: str = "auto", rest: str = "wrapper",
          hierarchy: str = "auto", qk_clip_tau: float | None = None) -> Built:
    """Build ``mode`` on this rank: wrap ``make_model()`` and create its optimizer.

    ``coalesce``: DMuon's ``dedicate_params(coalesce=...)`` (the layout gets the target the
    documented rule gives for it: :func:`verify.traffic.predict.dmuon_coalesce_bytes`).
    ``mixed_precision`` (``"bf16"``, ``"fp16"``): DMuon modes get a ``MixedPrecisionPolicy``
    and every ``fully_shard`` call the same policy; DDP and the baselines' DDP stay fp32.
    ``rest``: the DMuon modes' ``dedicate_params(rest=...)`` (other modes ignore it). With
    ``"replicate"`` DMuon keeps the non-dedicated params itself and the model is wrapped by
    neither DDP nor ``fully_shard`` (dmuon-ddp then runs like dmuon-z2).
    ``hierarchy``: the DMuon modes' ``dedicate_params(hierarchy=...)``; the layout records it
    and the harness's own backend table entry (:func:`verify.traffic.predict.dmuon_flattens`),
    from which the predictor derives flat or hierarchical itself
    (:func:`verify.traffic.predict.dmuon_hierarchy`; on a 1-D mesh it changes nothing).

    ``qk_clip_tau``: ``--qk-clip``'s τ: the DMuon modes get MuonClip's QK-clip on their
    optimizer (:mod:`verify.measure.qk_clip`, ``Built.qk_clip``) and the layout its head count
    (``RunLayout.qk_clip_heads``, counted from the model); the other modes run without it.

    ``mode`` may be a variant (``"dmuon-z3[block]"``, :mod:`verify.modes.variants`): its
    knobs replace ``coalesce`` / ``hierarchy``, set ``dedicate_params(link=...)`` (the layout
    then takes the harness's tables of that backend, :func:`verify.traffic.predict.dmuon_policy_backend`)
    and which Muon targets are dedicated (:func:`verify.modes.variants.variant_targets`), and
    the layout records the label.

    Raises:
        ValueError: unknown mode, ``rest`` or ``hierarchy``, a world size the mode cannot use,
            or ``qk_clip_tau`` with a model without TinyGPT's attention (or a bad τ).
    """
    label = mode
    mode, knobs = split_mode(label)
    coalesce = knobs.get("coalesce", coalesce)
    hierarchy = knobs.get("hierarchy", hierarchy)
    link = knobs.get("link", "auto")  # dedicate_params(link=...): whose link policy DMuon follows
    if rest not in DMUON_REST_MODES:
        raise ValueError(f"Invalid rest={rest!r}. Must be one of {DMUON_REST_MODES}.")
    if hierarchy not in DMUON_HIERARCHIES:
        raise ValueError(f"Invalid hierarchy={hierarchy!r}. Must be one of {DMUON_HIERARCHIES}.")
    world = dist.get_world_size()
    model = make_model().to(device)
    targets = variant_targets(knobs.get("targets", "all"), muon_names(model),
                              {name: p.numel() for name, p in model.named_parameters()})
    matrices = matrix_shapes(model, targets)
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrices))
    mesh = _mesh(mode, world, device)
    r_size, n = (mesh.shape if mesh.ndim == 2 else (1, world))
    reshard = mode.endswith("z3") or mode == "naive-hsdp"
    backend = "nccl" if device.startswith("cuda") else "gloo"  # DMuon's coalescing depends on it
    policy = dmuon_policy_backend(link, backend)  # the harness's tables, by the link DMuon follows
    frozen = tuple(name for name, p in model.named_parameters() if not p.requires_grad)
    replicated = mode.startswith("dmuon-") and rest == "replicate"  # nothing wraps the model

    # DDP broadcasts the module's buffers from rank 0 before every forward
    buffers = tuple((str(b.dtype).removeprefix("torch."), b.numel()) for _, b in model.named_buffers())

    clip_heads = 0
    if qk_clip_tau is not None and mode.startswith("dmuon-"):
        from verify.measure.qk_clip import count_heads

        clip_heads = count_heads(model)  # the harness's own count, before any wrapping

    def layout(fsdp_modules=(), reshard_flag=reshard) -> RunLayout:
        return RunLayout(
            mode=mode,
            replicate_size=r_size,
            shard_size=n,
            params=specs,
            muon_names=targets,
            fsdp_modules=fsdp_modules,
            reshard_after_forward=reshard_flag,
            ddp_bucket_cap_bytes=DDP_BUCKET_CAP_MB * 1024 * 1024,
            dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, policy),
            dmuon_reduce_by_gather=dmuon_reduce_by_gather(policy),
            dmuon_uneven_aligned=dmuon_uneven_aligned(policy),
            mp_param_dtype=mp_name if (mode.startswith("dmuon-") or fsdp_modules) else None,
            ddp_buffers=buffers if mode in ("ddp-muon", "zero1-muon", "dmuon-ddp") and not replicated else (),
            frozen_names=frozen,
            dmuon_rest="replicate" if replicated else "wrapper",
            dmuon_hierarchy=hierarchy if mode.startswith("dmuon-") else "auto",
            dmuon_auto_flat=dmuon_flattens(policy),
            qk_clip_heads=clip_heads,
            label=label if label != mode else "",
        )

    mp = mp_policy(mixed_precision)
    mp_name = str(mp.param_dtype).removeprefix("torch.") if mp is not None else None

    if mode.startswith("dmuon-"):
        with warnings.catch_warnings():
            if "targets" in knobs:  # the variant leaves the other matrices to AdamW on purpose
                warnings.filterwarnings("ignore", "dmuon.dedicate_params: .* go to AdamW", UserWarning)
            dm = dmuon.dedicate_params(model, mesh, params=list(targets), reshard_after_forward=reshard,
                                       mp_policy=mp, coalesce=coalesce, rest=rest, hierarchy=hierarchy,
                                       link=link)
        bare = model  # DDP wraps it below; fully_shard keeps the object
        if replicated:
            fsdp_modules = ()
        elif mode == "dmuon-ddp":
            model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
            fsdp_modules = ()
        else:
            fsdp_modules = _fsdp_wrap(model, mesh, reshard, set(dm), [], mp, blocks=False)
        opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
        clip = None
        if qk_clip_tau is not None:
            from verify.measure.qk_clip import attach

            clip = attach(opt, bare, qk_clip_tau)
        return Built(model, opt, layout(fsdp_modules), dm, clip)

    if mode == "ddp-muon":
        named = dict(model.named_parameters())
        model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        muon = MatrixMuon([named[t] for t in targets], [matrices[t] for t in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        counter = _count_torch_muon_ns(muon.muon)
        return Built(model, _Pair(muon, adamw, counter), layout())

    if mode == "zero1-muon":
        named = dict(model.named_parameters())
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(targets))
        model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        muon = ZeroOneMuon([(t, named[t]) for t in targets], matrix_shapes=matrices, lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        return Built(model, _Pair(muon, adamw, lambda: muon.ns_calls), layout())

    if mode in ("naive-fsdp2-z2", "naive-fsdp2-z3", "naive-hsdp"):
        # the modules holding Muon params, children before parents (fully_shard's order), the
        # root excluded (wrapped last anyway)
        holders = {t.rpartition(".")[0] for t in targets} - {""}
        model_order = [s.module for s in specs]
        linear_modules = sorted(holders, key=lambda m: (-m.count("."), model_order.index(m)))
        fsdp_modules = _fsdp_wrap(model, mesh, reshard, set(), linear_modules, mp)
        named = dict(model.named_parameters())
        muon = NaiveShardedMuon([named[t] for t in targets], [matrices[t] for t in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        return Built(model, _Pair(muon, adamw, lambda: muon.ns_calls), layout(fsdp_modules))
    raise ValueError(f"Invalid mode={mode!r}.")


def _count_torch_muon_ns(opt: torch.optim.Muon) -> Callable[[], int]:
    """Count torch.optim.Muon's real NS calls: wrap its NS function during ``step()`` only."""
    import torch.optim._muon as muon_module

    calls = [0]
    original = muon_module._zeropower_via_newtonschulz

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    def pre(optimizer, args, kwargs):
        muon_module._zeropower_via_newtonschulz = counting

    def post(optimizer, args, kwargs):
        muon_module._zeropower_via_newtonschulz = original

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return lambda: calls[0]
