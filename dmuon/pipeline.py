"""Pipeline parallelism: one reduce per step over a schedule's micro-batches.

torch's pipelining schedules (``torch.distributed.pipelining``: ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``) run one forward and one
backward per micro-batch through each stage module and tell a DDP or FSDP2 wrapper which
backward is the last (``no_sync`` / ``set_requires_gradient_sync``, ``stage.py``'s
``backward_maybe_with_nosync`` and ``perform_reduce_grad``). DMuon's hooks are not a wrapper
torch knows, so :func:`pipeline_step` tells each stage's handle instead, around
``schedule.step``::

    with dmuon.pipeline_step(schedule, dm):        # dm, or [dm_a, dm_b] for interleaved stages
        schedule.step(x, target=y, losses=losses)
    opt.step()
    opt.zero_grad()

Inside, every handle counts its model's backward passes: all but the schedule's
``n_microbatches``-th accumulate locally, the last reduces every dedicated grad to its owner
once (``DedicatedParams.pipeline_step``); under Z3 non-holders keep their copies for the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from dmuon.placement.dims import STAGE_MESH, STAGE_SLICE
from dmuon.runtime.dedicated_params import DedicatedParams

#: Schedules that split a backward into an input pass and a weight pass (zero bubble): the
#: weight grads of a micro-batch arrive in a pass DMuon's hooks do not see as a backward.
SPLIT_BACKWARD = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _stages(schedule) -> list:
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    if hasattr(schedule, "_stage"):
        return [schedule._stage]
    return []


def check_schedule(schedule, dedicated) -> tuple[list[DedicatedParams], int]:
    """The handles of ``dedicated`` (one or a list) and the schedule's micro-batch count,
    checked against ``schedule`` (local, every rank, before any collective).

    Raises:
        ValueError: a schedule DMuon cannot see (not a ``torch.distributed.pipelining``
            schedule; one that splits backward into input and weight passes; a stage whose
            shapes are inferred at the first step, which runs a forward and backward DMuon
            would count as a micro-batch), a stage module without a handle or a handle whose
            model is no stage of the schedule, or a handle's mesh that holds another rank of
            the schedule's pipeline group (mismatched stage meshes). Each names the object,
            the value and the fix.
    """
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except ImportError:  # pragma: no cover - torch without pipelining
        _PipelineSchedule = ()
    handles = list(dedicated) if isinstance(dedicated, list | tuple) else [dedicated]
    for i, dm in enumerate(handles):
        if not isinstance(dm, DedicatedParams):
            raise ValueError(
                f"Invalid dedicated[{i}]={dm!r} (type {type(dm).__name__}). Must be the "
                "DedicatedParams of a stage module (dmuon.dedicate_params(stage_module, "
                f"{STAGE_SLICE})), or a list of them.")
    if not isinstance(schedule, _PipelineSchedule) or not _stages(schedule):
        raise ValueError(
            f"Invalid schedule={schedule!r} (type {type(schedule).__name__}): DMuon cannot see "
            "its micro-batches. Must be a torch.distributed.pipelining schedule (ScheduleGPipe, "
            "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS) over PipelineStage "
            "objects; for hand-written accumulation use dm.no_sync() instead.")
    name = type(schedule).__name__
    if name in SPLIT_BACKWARD:
        raise ValueError(
            f"Invalid schedule of type {name}: it splits each backward into an input pass and a "
            "weight pass, and DMuon cannot see which weight pass is a stage's last. Use "
            "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS.")
    stages = _stages(schedule)
    models = {id(dm.model): dm for dm in handles}
    for stage in stages:
        meta = getattr(stage, "_user_meta", None)
        initialized = getattr(schedule, "_stage_forward_initialized",
                              getattr(schedule, "_stages_forward_initialized", True))
        if meta is not None and not initialized and (meta.inputs is None or meta.outputs is None):
            raise ValueError(
                f"Invalid stage {stage.stage_index} of {name}: built without input_args and "
                "output_args, so its first schedule.step infers shapes by running a forward and a "
                "backward through the stage module, which DMuon would count as a micro-batch. "
                "Build it with shapes: PipelineStage(module, stage_index, num_stages, device, "
                "input_args=<one micro-batch's input>, output_args=<its output>).")
        if id(stage.submod) not in models:
            raise ValueError(
                f"Invalid dedicated for {name}: stage {stage.stage_index}'s module "
                f"({type(stage.submod).__name__}) has no DedicatedParams among the "
                f"{len(handles)} given. Call dmuon.dedicate_params on every stage module this "
                "rank holds (before PipelineStage is built around it) and pass all the handles: "
                "dmuon.pipeline_step(schedule, [dm_a, dm_b]).")
        group = getattr(stage, "group", None)
        if group is not None and dist.is_initialized():
            pipe_ranks = set(dist.get_process_group_ranks(group))
            dm = models[id(stage.submod)]
            mesh = {int(r) for r in _flat(dm.mesh_ranks)}
            shared = sorted(pipe_ranks & mesh)
            if mesh and shared != [dist.get_rank()]:
                raise ValueError(
                    f"Invalid mesh of the handle of stage {stage.stage_index}: mismatched stage "
                    f"meshes. Its ranks {sorted(mesh)} hold the ranks {shared} of the pipeline "
                    f"group {sorted(pipe_ranks)}, so DMuon would average grads across stages. "
                    "Dedicate each stage module on its stage's data-parallel slice, the pipeline "
                    f"dim left out: {STAGE_SLICE} of {STAGE_MESH}.")
    submods = {id(s.submod) for s in stages}
    for i, dm in enumerate(handles):
        if id(dm.model) not in submods:
            raise ValueError(
                f"Invalid dedicated[{i}]: its model ({type(dm.model).__name__}) is no stage "
                f"module of this rank's {name} (stages {[s.stage_index for s in stages]}). "
                "Pass the handles of this rank's stage modules only.")
    return handles, int(schedule._n_microbatches)


def _flat(rows) -> list:
    if rows is None:
        return []
    if isinstance(rows, list | tuple):
        return [x for r in rows for x in _flat(r)]
    return [rows]


@contextlib.contextmanager
def pipeline_step(schedule, dedicated) -> Iterator[None]:
    """Run one ``schedule.step(...)`` inside: each dedicated grad of the stage modules is
    reduced to its owner once, after the step's last micro-batch's backward (module
    docstring).

    Args:
        schedule: the ``torch.distributed.pipelining`` schedule (``ScheduleGPipe``,
            ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``) whose stages
            were built with ``input_args`` / ``output_args``.
        dedicated: the :class:`DedicatedParams` of this rank's stage module, or a list of them
            (one per stage module of an interleaved schedule).

    Raises:
        ValueError: as :func:`check_schedule` (before anything runs).
        RuntimeError: as ``DedicatedParams.pipeline_step`` (at exit).
    """
    handles, microbatches = check_schedule(schedule, dedicated)
    with contextlib.ExitStack() as stack:
        for dm in handles:
            stack.enter_context(dm.pipeline_step(microbatches))
        yield
