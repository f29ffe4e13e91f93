"""Rank-side tasks of the torchtitan pipeline-parallel test: torchtitan 0.3.0's llama3 (the
recipe of ``titan_tasks.model_config``, :data:`PP_LAYERS` layers) cut into model parts by
torchtitan's own ``pipeline_llm`` on its own ``ParallelDims`` meshes (``pp 2 × dp_shard 2``),
each part parallelized by ``parallelize_llama`` through ``dmuon.integrations.torchtitan.
parallelize_fn``, the whole pipelining function wrapped by the integration's
``pipelining_fn`` (which makes the schedule's ``step`` DMuon's), DMuon over every part from the
integration's factory; against ``titan_tasks.oracle`` on the whole model and the whole batch.

What ``titan_tasks`` steers for CPU holds here too (importing it does it), and nothing else is
steered, with one exception: torchtitan 0.3.0's trainer calls ``pp_schedule.step(arg_mbs=...,
kwarg_mbs=..., target_mbs=...)`` (micro-batches it split itself), which torch 2.13's schedules
do not take (their ``step(*args, target=..., losses=..., loss_kwargs=..., **kwargs)`` splits the
local batch into ``n_microbatches`` along dim 0 itself). The task calls it in torch's form, with
what the trainer passes: the tokens on the first stage, the labels and the list of losses on the
last, ``positions`` to every stage and ``loss_kwargs={"global_valid_tokens": ...}``.

The schedule is torchtitan's ``Interleaved1F1B`` (torch's ``ScheduleInterleaved1F1B``, run by
its action runtime with FSDP2's ``UNSHARD`` / ``REDUCE_GRAD`` / ``RESHARD``): 4 virtual stages,
2 per pipeline rank, so each rank holds 2 model parts (stages ``p`` and ``p + 2``); torchtitan's
split with ``pipeline_parallel_last_stage_less_layers=0`` puts one decoder layer in each
(the embedding with layer 0, the norm and head with layer 3), so every part has matrices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.distributed.parity import titan_tasks as TT
from tests.distributed.parity.dmuon_tasks import ADAMW_LR, MUON_LR

from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402,I001
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as tt_dist  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.llama3.parallelize import parallelize_llama  # noqa: E402
from torchtitan.tools.utils import device_type  # noqa: E402

import dmuon  # noqa: E402
from dmuon.integrations import torchtitan as dmt  # noqa: E402

#: Decoder layers: one per virtual stage.
PP_LAYERS = 4
#: Rows per micro-batch (torchtitan's pipeline_parallel_microbatch_size): each data-parallel
#: rank's 2 rows are 2 micro-batches.
MICROBATCH_ROWS = 1


def parallelism(schedule: str) -> ParallelismConfig:
    return ParallelismConfig(spmd_backend="partial_dtensor", pipeline_parallel_degree=2,
                             data_parallel_shard_degree=2, pipeline_parallel_schedule=schedule,
                             pipeline_parallel_microbatch_size=MICROBATCH_ROWS,
                             pipeline_parallel_last_stage_less_layers=0)


def pp_loss(pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: int):
    """torchtitan's loss callable's form (``(loss, extra)``): this micro-batch's token sum over
    the global token count (``titan_tasks.token_sum_loss``)."""
    return TT.token_sum_loss(pred, labels, global_valid_tokens), None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (compared without a collective), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _full(parts) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(TT.full_params(part))
    return out


def train(steps: int, schedule: str = "Interleaved1F1B", left_out: int | None = None) -> dict:
    """On 4 ranks: torchtitan's ``pp 2 × dp_shard 2`` meshes, the llama3 of
    ``titan_tasks.model_config`` (:data:`PP_LAYERS` layers) built on the meta device and cut by
    ``dmt.pipelining_fn(pipeline_llm)`` with ``dmt.parallelize_fn(parallelize_llama)``,
    materialised and initialised part by part (seed 0 on every rank), DMuon over every part from
    ``dmt.build_optimizers(model_parts, parallel_dims)``; ``steps`` steps on this rank's rows,
    torchtitan's ``clip_grad_norm_`` (with its ``pp_mesh``) measuring the grad norm before each.
    ``left_out``: the control, that model part (its index on this rank) is left out of the
    optimizer (no norm measured). Returns this rank's parts' full params at init and after each step, the norms,
    the stage indices, the dedicated names, the container's state-dict keys, its base class, the
    NS count, whether its state dict came back unchanged through ``load_state_dict`` and the
    message ``dmuon.pipeline_step`` refuses torchtitan's schedule with (its
    stages are built without shapes)."""
    par = parallelism(schedule)
    tt_dist.set_spmd_backend(par.spmd_backend)
    dims = ParallelDims.from_config(par, dist.get_world_size())
    dims.build_mesh()
    batch_mesh = dims.get_mesh("batch")
    b, nb = batch_mesh.get_local_rank(), batch_mesh.size()
    local_rows = TT.ROWS // nb
    cfg = TT.model_config(par, PP_LAYERS)
    with torch.device("meta"):
        model = cfg.build()
    sched, parts, first, last = dmt.pipelining_fn(pipeline_llm)(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", local_batch_size=local_rows),
        parallelism=par, compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp",
        device=torch.device(device_type), model_config=cfg,
        parallelize_fn=dmt.parallelize_fn(parallelize_llama), loss_fn=pp_loss)
    for part in parts:  # gloo has no PREMUL_SUM (titan_tasks); the same sum in SUM
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    torch.manual_seed(0)  # as the trainer: to_empty + init_weights per part
    for part in parts:
        part.to_empty(device=device_type)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
    init = _full(parts)
    handles = [dmt.dedicated_of(part) for part in parts]
    try:  # torchtitan's stages infer their shapes: the plain wrapper refuses them
        with dmuon.pipeline_step(sched, handles):
            pass
        refusal = ""
    except ValueError as e:  # raised on every rank before anything ran
        refusal = str(e)
    kept = parts if left_out is None else [p for i, p in enumerate(parts) if i != left_out]
    opts = dmt.build_optimizers(kept, dims, lr=MUON_LR, adamw_lr=ADAMW_LR)
    rows = slice(b * local_rows, (b + 1) * local_rows)
    pp_mesh = dims.get_optional_mesh("pp")
    after, norms = [], []
    for step in range(steps):
        ids, labels, pos = (t[rows] for t in TT.batch(step))
        losses = [] if last else None
        sched.step(*((ids,) if first else ()), target=labels if last else None, losses=losses,
                   loss_kwargs={"global_valid_tokens": labels.numel() * nb},
                   return_outputs=False, positions=pos)
        if left_out is None:  # (the left-out part's dedicated grads are no DTensors: no
            # optimizer shows them, and torch's norm refuses the mix)
            norm = tt_dist.clip_grad_norm_([p for part in parts for p in part.parameters()],
                                           TT.MAX_NORM, foreach=True, pp_mesh=pp_mesh)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opts.step()
        opts.zero_grad()
        for dm in handles:
            dm.sync_params()
        after.append(_full(parts))
    state = opts.state_dict()  # flat, FQN-keyed (torch DCP), as torchtitan's checkpointer saves
    saved = {k: _local(v).clone() if torch.is_tensor(v) else v for k, v in state.items()}
    opts.load_state_dict(state)  # the round trip torchtitan's checkpointer makes on resume
    reloaded = opts.state_dict()
    same = sorted(reloaded) == sorted(saved) and all(
        (_local(reloaded[k]).equal(v) if torch.is_tensor(v) else reloaded[k] == v)
        for k, v in saved.items())
    out = {"init": init, "steps": after, "norms": norms, "refusal": refusal,
           "stages": [s.stage_index for s in getattr(sched, "_stages", None) or [sched._stage]], "schedule": type(sched).__name__,
           "dedicated": sorted(n for dm in handles for n in dm.names),
           "state_keys": sorted(state), "state_reloaded": same, "ns_calls": opts.optimizers[0].ns_calls,
           "kind": type(opts).__mro__[1].__name__}
    for dm in handles:
        dm.close()
    return out

