"""``--tp T --ep E``: DMuon on a TP × EP mesh ``("dp_shard", "ep", "tp")`` of (W/(E·T), E, T),
the data-parallel dims declared ``shard_dims=("dp_shard", "ep")`` (torchtitan's names).

The workload is the EP run's tiny Qwen3-MoE (:func:`verify.modes.ep.ep_source`, the reference
EP layer, ``examples/ep_moe.py``) with, as MoE models are trained:

- its expert stacks ``Shard(0)`` on ``mesh["ep"]`` (``shard_experts``);
- every attention tensor parallel on ``mesh["tp"]`` (:func:`parallelize_attention`: q, k, v
  ``ColwiseParallel``, o ``RowwiseParallel``); the attentions' q / k norm weights frozen
  (:func:`freeze_qk_norms`: plain params inside the TP region, whose grads are partial sums
  over ``tp`` that no wrapper of plain params sums);
- ``dmuon.dedicate_params(model, mesh, rest="wrapper", shard_dims=("dp_shard", "ep"))``, then
  FSDP2 on the data-parallel ranks of each TP column (``fully_shard`` of the root on
  ``mesh["ep"]``, or the flattened ``("dp_shard", "ep")`` where dp_shard > 1) with the
  dedicated params ignored, and ``DMuon``.

The T ranks of a TP group read the same rows: data-parallel index ``rank // T`` of ``W / T``.
The harness tags DTensor's redistributions with phase ``tp`` (``verify.modes.tp.tp_phase``)
and records the routing and tags the token all_to_alls with phase ``activations``
(``verify.modes.ep.RoutingRecorder``), as the TP and EP runs do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes
from verify.modes.ep import RoutingRecorder, ep_source, experts_problem
from verify.modes.tp import tp_phase
from verify.modes.workload import Running, Workload
from verify.traffic.predict import dmuon_coalesce_bytes, dmuon_reduce_by_gather, dmuon_uneven_aligned
from verify.traffic.tpep import TPEP_MODES, TPEPRunLayout, tpep_skip_reason
from verify.workload.usermodel import ModelSource

#: The TP plan of each attention (module name within ``self_attn`` -> style).
ATTENTION_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
#: The mesh's dim names.
TPEP_DIMS = ("dp_shard", "ep", "tp")


def tpep_mesh(world: int, tp: int, ep: int, device: str):
    """The ``("dp_shard", "ep", "tp")`` mesh (W/(E·T), E, T).

    Raises:
        ValueError: T or E < 2, or E·T does not divide W.
    """
    if tp < 2 or ep < 2 or world % (tp * ep):
        raise ValueError(f"Invalid --tp {tp} --ep {ep} at W={world}. Must be >= 2 each with E·T "
                         "dividing W (the mesh is (W/(E·T), E, T)).")
    return init_device_mesh(device, (world // (ep * tp), ep, tp), mesh_dim_names=TPEP_DIMS)


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not layers:
        raise ValueError(f"Invalid model {type(model).__name__} for --tp with --ep: needs a Hugging "
                         "Face decoder (model.layers.<i>.self_attn), the EP run's tiny Qwen3-MoE.")
    return layers


def freeze_qk_norms(model: nn.Module) -> None:
    """Freeze every attention's q / k norm weight (module docstring); a model whose attentions
    have none is left as it is."""
    for layer in _layers(model):
        for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if norm is not None and getattr(norm, "weight", None) is not None:
                norm.weight.requires_grad_(False)


def parallelize_attention(model: nn.Module, tp_mesh) -> list[tuple[str, str]]:
    """Apply :data:`ATTENTION_PLAN` to every ``model.layers.<i>.self_attn``; returns
    ``(module, style)`` in model order.

    Raises:
        ValueError: a layer has no Linear of the plan, or T does not divide its sharded dim
            (raised by ``parallelize_module``).
    """
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        for name in ATTENTION_PLAN:
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise ValueError(f"Invalid model for --tp with --ep: layer {i}'s self_attn has no Linear {name}.")
            out.append((f"{prefix[id(attn)]}.{name}", ATTENTION_PLAN[name]))
        parallelize_module(attn, tp_mesh, {n: styles[s]() for n, s in ATTENTION_PLAN.items()})
    return out


def build_tpep(mode: str, make_model: Callable[[], nn.Module], device: str, tp: int, ep: int, *,
               tokens_per_rank: int, muon_lr: float, adamw_lr: float, coalesce: str = "auto"):
    """Build ``mode`` (one of :data:`verify.traffic.tpep.TPEP_MODES`) on the TP × EP mesh.

    Args:
        tokens_per_rank: batch rows x sequence length of one data-parallel slice (a TP layer's
            activation numel is that times its features).

    Returns:
        ``(model, optimizer, layout, dm, recorder)`` as ``verify.modes.ep.build_ep``: the
        layout's ``ep_routing`` is filled after the run (:meth:`RoutingRecorder.gathered`).

    Raises:
        ValueError: a mode without TP × EP support, bad ``tp`` / ``ep``, a model without EPMoE
            layers or attentions, or a dim that E or T does not divide.
    """
    from examples.ep_moe import EXPERT_STACKS, shard_experts

    from verify.modes.build import _fsdp_wrap, muon_names

    if mode not in TPEP_MODES:
        raise ValueError(f"Invalid mode {mode!r} with --tp and --ep. Must be one of {TPEP_MODES}.")
    world = dist.get_world_size()
    mesh = tpep_mesh(world, tp, ep, device)
    n = world // (ep * tp)
    model = make_model().to(device)
    freeze_qk_norms(model)
    targets = muon_names(model)
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrix_shapes(model, targets)))
    shard_experts(model, mesh["ep"])
    layers = parallelize_attention(model, mesh["tp"])
    recorder = RoutingRecorder(model)
    experts = tuple(t for t in targets if t.rpartition(".")[2] in EXPERT_STACKS)
    named = dict(model.named_parameters())
    tp_dims = tuple((name, p.placements[0].dim) for name, p in named.items()
                    if isinstance(p, DTensor) and name in targets and p.device_mesh.mesh_dim_names == ("tp",))
    modules = dict(model.named_modules())
    dtype = str(next(iter(named.values())).dtype).removeprefix("torch.")
    acts = tuple((m, style, tokens_per_rank * (modules[m].in_features if style == "colwise"
                                               else modules[m].out_features), dtype)
                 for m, style in layers)
    reshard = mode.endswith("z3")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dm = dmuon.dedicate_params(model, mesh, params=list(targets), reshard_after_forward=reshard,
                               rest="wrapper", coalesce=coalesce, shard_dims=("dp_shard", "ep"))
    dp_mesh = mesh["ep"] if n == 1 else mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    fsdp_modules = _fsdp_wrap(model, dp_mesh, reshard, set(dm), [], None, blocks=False)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=muon_lr, adamw_lr=adamw_lr)
    layout = TPEPRunLayout(
        mode=mode, replicate_size=1, shard_size=n, params=specs, muon_names=targets,
        fsdp_modules=fsdp_modules, reshard_after_forward=reshard, dmuon_rest="wrapper",
        frozen_names=tuple(name for name, p in model.named_parameters() if not p.requires_grad),
        dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
        dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
        dmuon_uneven_aligned=dmuon_uneven_aligned(backend),
        tp_size=tp, ep_size=ep, tp_dims=tp_dims, tp_activations=acts, expert_names=experts,
        ep_layers=recorder.layer_specs())
    return model, opt, layout, dm, recorder


class TPEPWorkload(Workload):
    """``--tp T --ep E``: DMuon Z2 / Z3 on :func:`tpep_mesh`, the EP run's tiny Qwen3-MoE
    (:func:`verify.modes.ep.ep_source`, each TP group on one data-parallel slice) with its
    attention on ``tp`` and its experts on ``ep``, the rest under FSDP2 (module docstring;
    ``verify.modes.workload``)."""

    axes = ("tp", "ep")
    model_why = "the TP x EP workload is the EP run's tiny Qwen3-MoE (examples/ep_moe.py)"
    flat_why = "dedicate_params refuses 'flat' on a mesh with 'tp' and 'ep' axes"
    qk_clip_why = "the TP x EP builder attaches no QK-clip"
    mixed_precision_why = "the TP x EP builder runs fp32"
    rest, rest_why = "wrapper", "DMuon does not replicate a tensor-parallel model's rest"
    numerics_why = "tensor and expert parallel: the probe is written for whole matrices"
    whole_model = False

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        return tpep_skip_reason(mode, world_size, cfg.tp, cfg.ep)

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        if world_size % (cfg.tp * cfg.ep):
            return (f"Invalid --tp {cfg.tp} --ep {cfg.ep} at W={world_size}{where}. E·T = "
                    f"{cfg.tp * cfg.ep} must divide W, the mesh being (W/(E·T)) x E x T: give an "
                    f"--nproc that {cfg.tp * cfg.ep} divides.")
        from examples.ep_moe import TINY_QWEN3_MOE

        heads = TINY_QWEN3_MOE["num_key_value_heads"]  # q, k, v split by whole heads over T
        if heads % cfg.tp:
            return (f"Invalid --tp {cfg.tp} with --ep {cfg.ep}: the attention's {heads} KV heads "
                    "must split evenly over T ranks (examples/ep_moe.py, TINY_QWEN3_MOE). Give "
                    f"--tp {' or '.join(str(t) for t in range(2, heads + 1) if heads % t == 0)}.")
        return experts_problem(cfg.ep)

    def source(self, config, global_batch: int) -> ModelSource:
        return ep_source(global_batch=global_batch, seq_len=config.seq_len, seed=config.seed, tp=config.tp)

    def start(self, mode: str, config, *, make_model, made: list, corpus, global_batch: int) -> Running:
        from verify.modes.build import ADAMW_LR, MUON_LR, Built

        self.check(config)
        dp = dist.get_world_size() // config.tp
        model, opt, layout, dm, routing = build_tpep(
            mode, make_model, config.device, config.tp, config.ep,
            tokens_per_rank=global_batch // dp * config.seq_len, muon_lr=MUON_LR, adamw_lr=ADAMW_LR,
            coalesce=config.coalesce)
        return Running(Built(model, opt, layout, dm), made[-1][1], tagging=tp_phase(), routing=routing)
