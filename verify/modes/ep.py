"""``--ep E``: DMuon on an expert-parallel mesh ``("shard", "ep")`` of (W/E) × E, or (HSDP)
``("replicate", "shard", "ep")`` of (2, W/(2E), E).

The workload is the reference EP layer's tiny model (``examples/ep_moe.py``:
:func:`examples.ep_moe.tiny_qwen3_moe_ep`, a tiny Qwen3-MoE whose sparse blocks are ``EPMoE``,
vocab 256 for the byte corpus), its expert stacks ``Shard(0)`` on ``mesh["ep"]``
(``shard_experts``), then ``dmuon.dedicate_params(model, mesh, rest="replicate")`` (nothing
wraps the model) and ``DMuon``. Every rank is its own data-parallel rank: rank r of W reads rows
``[r·B/W, (r+1)·B/W)`` of the step's global batch (:func:`ep_source`).

The harness records, with its own wrapper around each EPMoE's exchange
(:class:`RoutingRecorder`): the per-expert assignment counts ``(X,)`` of every layer forward
in the measured window (the routing the prediction of the token all_to_all needs,
``verify.traffic.ep.predict_activations``), and the phase ``activations`` on the layer's
all_to_alls, in forward (counts, dispatch, combine) and in backward (the two transposes:
identity autograd functions around the exchange open the phase when the combine's gradient
arrives and close it after the dispatch's transpose).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon import annotate
from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes
from verify.modes.workload import Running, Workload
from verify.traffic.ep import ACTIVATIONS, EP_MODES, EPRunLayout, ep_skip_reason
from verify.traffic.predict import dmuon_coalesce_bytes, dmuon_reduce_by_gather, dmuon_uneven_aligned
from verify.workload.data import ByteCorpus, local_slice
from verify.workload.usermodel import ModelSource

#: The model's name in reports.
EP_MODEL = "tiny-qwen3-moe-ep"


def ep_mesh(world: int, ep: int, device: str, hsdp: bool = False):
    """The ``("shard", "ep")`` mesh (W/E, E), or (``hsdp``) ``("replicate", "shard", "ep")``
    (2, W/(2E), E).

    Raises:
        ValueError: E < 2 or E does not divide W (2E, for ``hsdp``).
    """
    if ep < 2 or world % (ep * (2 if hsdp else 1)):
        raise ValueError(f"Invalid --ep {ep} at W={world}. Must be >= 2 and divide W (HSDP: W/2).")
    if hsdp:
        return init_device_mesh(device, (2, world // (2 * ep), ep), mesh_dim_names=("replicate", "shard", "ep"))
    return init_device_mesh(device, (world // ep, ep), mesh_dim_names=("shard", "ep"))


def ep_source(*, global_batch: int, seq_len: int, seed: int, tp: int = 1) -> ModelSource:
    """The EP workload as a ``--model`` source: the unsharded tiny Qwen3-MoE with EPMoE blocks
    (vocab 256, positions up to ``seq_len``) and next-byte cross-entropy on this rank's rows:
    those of data-parallel index ``rank // tp`` of ``W / tp`` (``tp`` > 1: the TP × EP run,
    ``verify.modes.tpep``, whose TP groups share their rows)."""
    corpus = ByteCorpus.from_stdlib()

    def loss_fn(model: nn.Module, rank: int, step: int) -> torch.Tensor:
        x, y = corpus.global_batch(step, global_batch, seq_len, seed=seed)
        world = dist.get_world_size() if dist.is_initialized() else 1
        x, y = local_slice(x, rank // tp, world // tp), local_slice(y, rank // tp, world // tp)
        device = next(model.parameters()).device
        logits = model(input_ids=x.to(device)).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1))

    def factory():
        from examples.ep_moe import tiny_qwen3_moe_ep

        return tiny_qwen3_moe_ep(None, seed=seed, vocab_size=256, max_position_embeddings=seq_len), loss_fn

    return ModelSource(EP_MODEL, factory)


class _Tag:
    """The ``activations`` phase (or ``phase``) opened in one backward node and closed in a
    later one (also ``verify.modes.cp``'s K/V exchange)."""

    def __init__(self, phase: str = ACTIVATIONS) -> None:
        self.open: list = []
        self.phase = phase

    def enter(self) -> None:
        cm = annotate.phase(self.phase)
        cm.__enter__()
        self.open.append(cm)

    def exit(self) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)


class _MarkInBackward(torch.autograd.Function):
    """Identity; its backward calls ``tag.enter()`` or ``tag.exit()`` (``action``): applied to
    the exchange's output it opens the phase in backward, to its input rows it closes it."""

    @staticmethod
    def forward(ctx, x, tag, action):
        ctx.mark = getattr(tag, action)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.mark()
        return grad, None, None


class RoutingRecorder:
    """Wraps every ``EPMoE`` of ``model``'s exchange (an instance attribute, removed by
    :meth:`close`): records ``(module, counts)`` of each forward while :attr:`on`, and tags the
    layer's all_to_alls with phase ``activations`` (module docstring).

    Raises:
        ValueError: ``model`` holds no EPMoE.
    """

    def __init__(self, model: nn.Module) -> None:
        from examples.ep_moe import EPMoE

        self.layers = [(n, m) for n, m in model.named_modules() if isinstance(m, EPMoE)]
        if not self.layers:
            raise ValueError(f"Invalid model {type(model).__name__} for --ep: holds no EPMoE layer.")
        self.on = False
        self.entries: list[tuple[str, list[int]]] = []
        self._tag = _Tag()
        for name, layer in self.layers:
            layer._exchange = self._wrap(name, layer._exchange)

    def _wrap(self, name: str, exchange):
        tag = self._tag

        def recorded(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            if self.on:
                self.entries.append((name, counts.tolist()))
            with annotate.phase(ACTIVATIONS):
                out = exchange(_MarkInBackward.apply(rows, tag, "exit"), counts)
            return _MarkInBackward.apply(out, tag, "enter")

        return recorded

    def check_closed(self) -> None:
        """Raise if a backward opened the phase and never closed it (a step's tags leak).

        Raises:
            RuntimeError: naming the open tags.
        """
        if self._tag.open:
            n = len(self._tag.open)
            while self._tag.open:
                self._tag.exit()
            raise RuntimeError(f"verify.modes.ep: {n} 'activations' phase tag(s) opened in a "
                               "backward were not closed: the exchange's input got no gradient.")

    def layer_specs(self) -> tuple[tuple[str, int, int, str], ...]:
        """``(module, X, D, dtype)`` per EPMoE (``EPRunLayout.ep_layers``)."""
        return tuple((n, m.n_experts, m.d_model, str(m.router.dtype).removeprefix("torch."))
                     for n, m in self.layers)

    def gathered(self) -> tuple:
        """``EPRunLayout.ep_routing`` from every rank's entries (one ``all_gather_object``, a
        collective: every rank, after the measured window)."""
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.entries)
        lengths = {len(e) for e in every}
        if len(lengths) != 1:
            raise ValueError(f"Invalid routing record: the ranks recorded {sorted(lengths)} layer forwards.")
        return tuple((every[0][i][0], tuple(tuple(e[i][1]) for e in every)) for i in range(len(every[0])))

    def close(self) -> None:
        for _, layer in self.layers:
            layer.__dict__.pop("_exchange", None)


def build_ep(mode: str, make_model, device: str, ep: int, *, muon_lr: float, adamw_lr: float,
             coalesce: str = "auto"):
    """Build ``mode`` (one of :data:`verify.traffic.ep.EP_MODES`) on the EP mesh.

    Returns:
        ``(model, optimizer, layout, dm, recorder)``: the layout's ``ep_routing`` is filled
        after the run (:meth:`RoutingRecorder.gathered`).

    Raises:
        ValueError: a mode without EP support, a bad ``ep``, or a model without EPMoE layers
            or whose expert count E does not divide.
    """
    from examples.ep_moe import EXPERT_STACKS, shard_experts

    from verify.modes.build import muon_names

    if mode not in EP_MODES:
        raise ValueError(f"Invalid mode {mode!r} with --ep. Must be one of {EP_MODES}.")
    world = dist.get_world_size()
    hsdp = "hsdp" in mode
    mesh = ep_mesh(world, ep, device, hsdp)
    model = make_model().to(device)
    targets = muon_names(model)
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrix_shapes(model, targets)))
    shard_experts(model, mesh["ep"])
    recorder = RoutingRecorder(model)
    experts = tuple(n for n in targets if n.rpartition(".")[2] in EXPERT_STACKS)
    reshard = mode.endswith("z3")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dm = dmuon.dedicate_params(model, mesh, params=list(targets), reshard_after_forward=reshard,
                               rest="replicate", coalesce=coalesce)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=muon_lr, adamw_lr=adamw_lr)
    layout = EPRunLayout(
        mode=mode, replicate_size=2 if hsdp else 1, shard_size=world // ep // (2 if hsdp else 1),
        params=specs, muon_names=targets, reshard_after_forward=reshard, dmuon_rest="replicate",
        frozen_names=tuple(n for n, p in model.named_parameters() if not p.requires_grad),
        dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
        dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
        dmuon_uneven_aligned=dmuon_uneven_aligned(backend),
        ep_size=ep, expert_names=experts, ep_layers=recorder.layer_specs())
    return model, opt, layout, dm, recorder


def experts_problem(ep: int) -> str | None:
    """Why the EP workload's model cannot split its experts over ``ep`` ranks, or ``None``."""
    from examples.ep_moe import TINY_QWEN3_MOE

    x = TINY_QWEN3_MOE["num_experts"]
    if x % ep:
        fits = " or ".join(str(e) for e in range(2, x + 1) if x % e == 0)
        return (f"Invalid --ep {ep}: the EP workload's {x} experts per layer must split evenly over "
                f"E ranks (examples/ep_moe.py, TINY_QWEN3_MOE). Give --ep {fits}.")
    return None


class EPWorkload(Workload):
    """``--ep E``: the EP-capable modes on :func:`ep_mesh`, the reference EP layer's tiny
    Qwen3-MoE (:func:`ep_source`), DMuon's rest replicated (``verify.modes.workload``)."""

    axes = ("ep",)
    model_why = "the EP workload is the reference layer's tiny Qwen3-MoE (examples/ep_moe.py)"
    flat_why = "dedicate_params refuses 'flat' on a mesh with an 'ep' axis"
    qk_clip_why = "the EP builder attaches no QK-clip"
    mixed_precision_why = "the EP builder runs fp32"
    rest = "replicate"
    numerics_why = "expert parallel: the probe is written for whole matrices"
    whole_model = False

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        return ep_skip_reason(mode, world_size, cfg.ep)

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        if world_size % cfg.ep:
            return (f"Invalid --ep {cfg.ep} at W={world_size}{where}. Must divide W, the mesh being "
                    f"(W/E) x E: give an --nproc that {cfg.ep} divides.")
        return experts_problem(cfg.ep)

    def source(self, config, global_batch: int) -> ModelSource:
        return ep_source(global_batch=global_batch, seq_len=config.seq_len, seed=config.seed)

    def start(self, mode: str, config, *, make_model, made: list, corpus, global_batch: int) -> Running:
        from verify.modes.build import ADAMW_LR, MUON_LR, Built

        self.check(config)
        model, opt, layout, dm, routing = build_ep(mode, make_model, config.device, config.ep,
                                                   muon_lr=MUON_LR, adamw_lr=ADAMW_LR,
                                                   coalesce=config.coalesce)
        return Running(Built(model, opt, layout, dm), made[-1][1], routing=routing)
