"""DMuon as torchtitan's optimizer (torchtitan 0.3.0, its ``partial_dtensor`` SPMD backend).

torchtitan builds a model on the meta device, runs the model's own parallelize function
(tensor parallel, activation checkpointing, compile, then FSDP2 over every param), initialises
the weights, and then builds the optimizer from ``model_parts`` (one part per pipeline stage
module of this rank). DMuon must dedicate its matrices after tensor parallelism and before
FSDP2 (``fully_shard(..., ignored_params=set(dm))``), so it comes in at two places:

- :func:`parallelize_fn` wraps the model's parallelize function (llama3's
  ``parallelize_llama``, or any that shards through ``torchtitan.distributed.fsdp``): the
  function runs as it is; at its first ``fully_shard`` (TP is done by then) DMuon dedicates
  the model on the data-parallel dims of torchtitan's ``ParallelDims`` meshes
  (:func:`mesh_dims`), and every ``fully_shard`` of the call leaves the dedicated params to
  DMuon. The handle is kept on the model (:func:`dedicated_of`).
- :func:`pipelining_fn` wraps the model's pipelining function (llama3's ``pipeline_llm``)
  under pipeline parallelism: the schedule it builds runs each ``step`` inside
  :func:`dmuon.pipeline_step` over every model part's handle (:func:`pipeline_schedule`), the
  shape inference of torchtitan's shapeless stages left uncounted.
- :func:`build_optimizers` (and :func:`optimizer_config`, the config torchtitan's trainer
  builds with ``model_parts=``) makes one :class:`~dmuon.DMuon` over every model part, with
  each part's handle (several parts: ``dmuon/optim/parts.py``), inside a container that is a
  torchtitan ``OptimizersContainer``: ``step``, ``zero_grad``, LR schedulers, hooks and its
  flat DCP state dict work as with torchtitan's own optimizers.

Gradients follow torchtitan's convention: its loss is each rank's token sum divided by the
global token count and its FSDP2 units do not divide (``disable_fsdp_gradient_division``),
so the grads are summed over the data-parallel ranks. DMuon's owners sum too
(``set_gradient_divide_factor(1)``), so clipping sees the same norm.

Nothing here imports torchtitan at ``import dmuon``; torchtitan is imported when a function
below runs (pyproject's ``torchtitan`` extra: ``make test-torchtitan`` installs it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from dmuon.api import dedicate_params
from dmuon.optim.optimizer import DMuon
from dmuon.runtime.dedicated_params import DedicatedParams

#: The attribute of a model part that holds its :class:`DedicatedParams` handle.
DEDICATED_ATTR = "_dmuon_dedicated"
#: The only torchtitan SPMD backend whose params stay plain tensors (or DTensors on the
#: model-parallel dims) until FSDP2 shards them: the others make every param a DTensor over
#: the data-parallel dims too, which DMuon cannot dedicate.
BACKEND = "partial_dtensor"
#: The attribute of a ``ParallelDims`` that keeps :func:`dedicating_mesh`'s roots under PP.
STAGE_ROOTS_ATTR = "_dmuon_stage_roots"


def mesh_dims(parallel_dims) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
    """The ``ParallelDims`` mesh dims DMuon dedicates on: ``(names, replicate_dim,
    shard_dims)``. Local, no collective.

    Dense models: ``dp_replicate`` (when its degree is > 1) as the replicate dim, ``fsdp``
    (torchtitan's dp_shard × cp, always present) as the shard dim, ``tp`` (when > 1) model
    parallel. Expert parallel (``ep`` > 1): the sparse mesh, ``dp_replicate`` as the replicate
    dim and ``efsdp`` and ``ep`` as shard dims (every dense matrix's owners span all of them;
    each expert stack moves over ``efsdp``). ``pp`` is never among them: a rank's model parts
    are dedicated on its own stage's slice (several model parts: :func:`build_optimizers`).

    Raises:
        ValueError: ``parallel_dims.spmd_backend`` is not ``"partial_dtensor"``, or ep > 1 with
            tp > 1 (torchtitan's sparse mesh then lacks the ``tp`` dim of the dense matrices).
    """
    backend = getattr(parallel_dims, "spmd_backend", BACKEND)
    if backend != BACKEND:
        raise ValueError(
            f"Invalid parallel_dims.spmd_backend={backend!r} for DMuon. Must be {BACKEND!r}: "
            "under the other backends torchtitan makes every param a DTensor over the "
            "data-parallel dims before FSDP2, which DMuon cannot dedicate. Set "
            f"parallelism.spmd_backend={BACKEND!r}.")
    rep = ("dp_replicate",) if parallel_dims.dp_replicate > 1 else ()
    if parallel_dims.ep > 1:
        if parallel_dims.tp > 1:
            raise ValueError(
                f"Invalid parallel dims ep={parallel_dims.ep}, tp={parallel_dims.tp} for DMuon. "
                "torchtitan's expert mesh (dp_replicate, efsdp, ep) has no tp dim, so DMuon "
                "cannot place the tensor-parallel matrices on it: use tp=1 with expert "
                "parallelism.")
        return rep + ("efsdp", "ep"), (rep[0] if rep else None), ("efsdp", "ep")
    tp = ("tp",) if parallel_dims.tp > 1 else ()
    return rep + ("fsdp",) + tp, (rep[0] if rep else None), ("fsdp",)


def dedicate(model: nn.Module, parallel_dims, **kwargs) -> DedicatedParams:
    """``dmuon.dedicate_params`` on the mesh of :func:`mesh_dims` (this rank's pipeline stage
    slice), with torchtitan's summed grads (module docstring); ``kwargs`` go to
    ``dedicate_params`` (``reshard_after_forward``, ``mp_policy``, ``predicate``, ...). The
    handle is kept as ``model._dmuon_dedicated``. Collective over the mesh (the setup check).

    Raises:
        ValueError: as :func:`mesh_dims` and ``dedicate_params``.
    """
    names, replicate_dim, shard_dims = mesh_dims(parallel_dims)
    mesh = dedicating_mesh(parallel_dims, names)
    dm = dedicate_params(model, mesh, replicate_dim=replicate_dim, shard_dims=shard_dims, **kwargs)
    dm.set_gradient_divide_factor(1)  # the owners' reduced grads: the sum, as torchtitan's FSDP2
    setattr(model, DEDICATED_ATTR, dm)
    return dm


def dedicating_mesh(parallel_dims, names: Sequence[str]):
    """The ``DeviceMesh`` over ``names`` (:func:`mesh_dims`) that DMuon dedicates on. Local
    (no process group is made).

    Without pipeline parallelism it is torchtitan's ``parallel_dims.get_mesh(names)``. With
    ``pp`` > 1 it is the same ranks and the same process groups, but as the slice of a mesh that
    names ``pp``: every torchtitan mesh is unflattened from its 1-D ``("world",)`` mesh, which
    is then the root of every slice, and DMuon recognises a pipeline stage's data-parallel mesh
    by a root over the world with a ``"pp"`` dim (``dmuon.ownership.topology.stage_ranks``;
    without it the stage's mesh is refused as one that does not span the world). The root is
    ``DeviceMesh.from_group`` over torchtitan's own groups of ``("pp", *names)``, made once per
    ``parallel_dims`` and kept on it.
    """
    names = tuple(names)
    if getattr(parallel_dims, "pp", 1) <= 1:
        return parallel_dims.get_mesh(list(names) if len(names) > 1 else names[0])
    from torch.distributed.device_mesh import DeviceMesh

    full = ("pp",) + names
    roots = parallel_dims.__dict__.setdefault(STAGE_ROOTS_ATTR, {})
    root = roots.get(full)
    if root is None:
        tt = parallel_dims.get_mesh(list(full))
        root = DeviceMesh.from_group([parallel_dims.get_mesh(n).get_group() for n in full],
                                     tt.device_type, mesh=tt.mesh, mesh_dim_names=full)
        roots[full] = root
    return root[names] if len(names) > 1 else root[names[0]]


def dedicated_of(model: nn.Module) -> DedicatedParams:
    """The handle :func:`dedicate` (or :func:`parallelize_fn`) kept on ``model``.

    Raises:
        ValueError: ``model`` was not dedicated (names its type and the fix).
    """
    dm = getattr(model, DEDICATED_ATTR, None)
    if not isinstance(dm, DedicatedParams):
        raise ValueError(
            f"Invalid model part {type(model).__name__}: DMuon dedicated none of its params. "
            "Parallelize it with dmuon.integrations.torchtitan.parallelize_fn(<the model's "
            "parallelize function>) (ModelSpec.parallelize_fn), or call "
            "dmuon.integrations.torchtitan.dedicate(model, parallel_dims) before FSDP2.")
    return dm


def parallelize_fn(parallelize: Callable, **dedicate_kwargs) -> Callable:
    """``parallelize`` (a torchtitan ``ModelSpec.parallelize_fn``, called as
    ``parallelize(model, *, parallel_dims, parallelism, ...)``) with DMuon: at its first
    ``fully_shard`` through ``torchtitan.distributed.fsdp`` (after tensor parallelism) the
    model is dedicated (:func:`dedicate`, with that call's ``mp_policy`` and
    ``reshard_after_forward`` unless ``dedicate_kwargs`` set them), and every ``fully_shard``
    of the call gets ``ignored_params`` = the dedicated params. The same signature and return.

    Raises:
        ValueError: ``parallelism.spmd_backend`` is not ``"partial_dtensor"`` (before any
            collective), or ``parallelize`` never called ``fully_shard`` (nothing dedicated).
    """

    @functools.wraps(parallelize)
    def wrapped(model, *args, parallel_dims, parallelism=None, **kwargs):
        backend = getattr(parallelism, "spmd_backend", BACKEND)
        if backend != BACKEND:
            raise ValueError(
                f"Invalid parallelism.spmd_backend={backend!r} for DMuon. Must be {BACKEND!r} "
                "(dmuon.integrations.torchtitan.mesh_dims says why).")
        with _dedicating_fully_shard(model, parallel_dims, dedicate_kwargs) as seen:
            out = parallelize(model, *args, parallel_dims=parallel_dims,
                              **({} if parallelism is None else {"parallelism": parallelism}),
                              **kwargs)
        if not seen:
            raise ValueError(
                f"Invalid parallelize function {getattr(parallelize, '__name__', parallelize)!r} "
                "for DMuon: it never called torchtitan.distributed.fsdp.fully_shard, so DMuon "
                "dedicated nothing. Call dmuon.integrations.torchtitan.dedicate(model, "
                "parallel_dims) yourself after tensor parallelism and pass "
                "ignored_params=set(dm) to fully_shard.")
        return out

    return wrapped


@contextlib.contextmanager
def _dedicating_fully_shard(model: nn.Module, parallel_dims, dedicate_kwargs: dict):
    """torchtitan's ``fully_shard`` (the name its FSDP helpers call) replaced for the block by
    one that dedicates ``model`` first and passes ``ignored_params``; yields a list that is
    non-empty once a call came."""
    from torchtitan.distributed import fsdp as tt_fsdp

    original, seen = tt_fsdp.fully_shard, []

    def fully_shard(module, *args, **kwargs):
        if not seen:
            kw = dict(dedicate_kwargs)
            if "mp_policy" in kwargs:
                kw.setdefault("mp_policy", kwargs["mp_policy"])
            kw.setdefault("reshard_after_forward", bool(kwargs.get("reshard_after_forward", True)))
            seen.append(dedicate(model, parallel_dims, **kw))
        ignored = set(kwargs.pop("ignored_params", None) or ()) | set(seen[0])
        return original(module, *args, ignored_params=ignored, **kwargs)

    tt_fsdp.fully_shard = fully_shard
    try:
        yield seen
    finally:
        tt_fsdp.fully_shard = original


def pipelining_fn(pipelining: Callable) -> Callable:
    """``pipelining`` (a torchtitan ``ModelSpec.pipelining_fn``: llama3's ``pipeline_llm``,
    called as ``pipelining(model, *, parallelize_fn, ...)`` and returning ``(schedule,
    model_parts, has_first_stage, has_last_stage)``) with DMuon: it runs as it is (the
    ``parallelize_fn`` it is given must be :func:`parallelize_fn`'s, which dedicates each model
    part), then the schedule's ``step`` is made DMuon's (:func:`pipeline_schedule`), so
    torchtitan's trainer, which calls ``pp_schedule.step(...)`` itself, needs no change. The
    same signature and return.

    Raises:
        ValueError: a model part was not dedicated (as :func:`dedicated_of`), or as
            :func:`pipeline_schedule`.
    """

    @functools.wraps(pipelining)
    def wrapped(model, *args, **kwargs):
        schedule, parts, *rest = pipelining(model, *args, **kwargs)
        pipeline_schedule(schedule, parts)
        return (schedule, parts, *rest)

    return wrapped


#: The attribute of a schedule whose ``step`` :func:`pipeline_schedule` wrapped.
SCHEDULE_ATTR = "_dmuon_model_parts"


def pipeline_schedule(schedule, model_parts: Sequence[nn.Module]):
    """Make ``schedule.step`` (a ``torch.distributed.pipelining`` schedule over this rank's
    ``model_parts``, built by torchtitan's ``pipeline_llm``) run each step inside
    :func:`dmuon.pipeline_step` with every part's handle, so each dedicated grad reaches its
    owner once, after the step's last micro-batch's backward. Returns ``schedule``; a second
    call on the same schedule does nothing. Local, no collective.

    torchtitan builds its ``PipelineStage`` objects without ``input_args`` / ``output_args``,
    so a schedule's first ``step`` (and its first after a switch between ``eval`` and training)
    infers the stages' shapes by running one forward and one input-grad backward through each
    stage module before the first micro-batch (torch's ``_initialize_pp_stages``).
    ``dmuon.pipeline_step`` refuses such stages, since it would count that pass as a
    micro-batch. Here the inference runs with each handle's ``no_sync()`` (it reduces nothing;
    torch then clears whatever it left in the grads) and ``dmuon.pipeline_step`` is entered
    right after it, inside ``step``: every backward it counts is a micro-batch's.

    Raises:
        ValueError: a part not dedicated (as :func:`dedicated_of`); the schedule has no
            ``_initialize_pp_stages`` (a torch whose schedules infer shapes elsewhere: build
            the stages with ``input_args`` / ``output_args`` and use ``dmuon.pipeline_step``
            around ``schedule.step`` instead); at ``step``, as ``dmuon.pipeline_step``.
        RuntimeError: at the end of a ``step`` that never called ``_initialize_pp_stages``.
    """
    if getattr(schedule, SCHEDULE_ATTR, None) is not None:
        return schedule
    initialize = getattr(schedule, "_initialize_pp_stages", None)  # torch's, private
    if not callable(initialize):
        raise ValueError(
            f"Invalid schedule of type {type(schedule).__name__} for DMuon's torchtitan "
            "integration: it has no _initialize_pp_stages, where this torch infers the stages' "
            "shapes. Build the PipelineStage objects with input_args/output_args and run "
            "schedule.step inside dmuon.pipeline_step(schedule, handles) yourself.")
    handles = [dedicated_of(part) for part in model_parts]
    from dmuon.pipeline import pipeline_step

    step, open_steps = schedule.step, []

    def initialize_uncounted(*args, **kwargs):
        with contextlib.ExitStack() as quiet:
            for dm in handles:
                quiet.enter_context(dm.no_sync())
            out = initialize(*args, **kwargs)
        if open_steps and open_steps[-1] is not None:  # once per step, after the inference
            stack, open_steps[-1] = open_steps[-1], None
            # the schedule stores the returned (forward, backward) flags right after this
            # returns; the forward one now, so dmuon.pipeline_step sees the shapes known
            for flag in ("_stage_forward_initialized", "_stages_forward_initialized"):
                if hasattr(schedule, flag):
                    setattr(schedule, flag, bool(out[0]))
            stack.enter_context(pipeline_step(schedule, handles if len(handles) > 1
                                              else handles[0]))
        return out

    @functools.wraps(step)
    def dmuon_step(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            open_steps.append(stack)
            try:
                out = step(*args, **kwargs)
            finally:
                unopened = open_steps.pop() is not None
            if unopened:
                raise RuntimeError(
                    f"DMuon: {type(schedule).__name__}.step never called "
                    "_initialize_pp_stages, so dmuon.pipeline_step was not entered and the "
                    "dedicated grads were reduced at the first micro-batch's backward. Build "
                    "the stages with input_args/output_args and run schedule.step inside "
                    "dmuon.pipeline_step(schedule, handles) yourself.")
            return out

    schedule._initialize_pp_stages = initialize_uncounted
    schedule.step = dmuon_step
    setattr(schedule, SCHEDULE_ATTR, list(model_parts))
    return schedule


#: DMuon's hyperparameters a torchtitan config may set (``DMuon``'s keyword arguments).
HPARAMS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "eps", "adjust_lr_fn",
           "adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")


def build_optimizers(model_parts: Sequence[nn.Module], parallel_dims=None, **hparams):
    """One :class:`~dmuon.DMuon` over every param of ``model_parts`` (this rank's model parts:
    one, or one per pipeline stage module), each part's handle from :func:`dedicated_of`, in a
    torchtitan ``OptimizersContainer`` (``optimizers == [the DMuon]``). ``hparams``: DMuon's
    keyword arguments (:data:`HPARAMS`). ``parallel_dims``, when given, is checked against the
    mesh the parts were dedicated on. Collective (DMuon's agreement, over the stage's ranks).

    Raises:
        ValueError: a part not dedicated, a part dedicated on another mesh than
            ``parallel_dims`` maps to, an unknown hyperparameter; as ``DMuon``.
    """
    return _container_class()(_config(hparams), model_parts=list(model_parts),
                              parallel_dims=parallel_dims)


def optimizer_config(**hparams):
    """The torchtitan optimizer config (``Trainer.Config.optimizer``) whose
    ``build(model_parts=...)`` is :func:`build_optimizers`: ``optimizer_config(lr=0.02,
    adamw_lr=3e-4)``."""
    return _config(hparams)


def _config(hparams: dict):
    unknown = sorted(set(hparams) - set(HPARAMS))
    if unknown:
        raise ValueError(f"Invalid DMuon hyperparameters {unknown}. Must be among {list(HPARAMS)}.")
    return _container_class().Config(dmuon_kwargs=dict(hparams))


@functools.cache
def _container_class():
    """The ``OptimizersContainer`` subclass (made on first use: it imports torchtitan)."""
    from dataclasses import dataclass, field
    from typing import Any

    import torch.distributed.checkpoint.state_dict as dcp_sd
    from torch.optim import Optimizer
    from torchtitan.components.optimizer import OptimizersContainer

    flat = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=True)

    class DMuonOptimizers(OptimizersContainer):
        """torchtitan's optimizer container holding one DMuon (module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            dmuon_kwargs: dict[str, Any] = field(default_factory=dict)
            """DMuon's keyword arguments (lr, adamw_lr, ...)."""

        def __init__(self, config: Config, *, model_parts: list[nn.Module],
                     parallel_dims=None) -> None:
            if config.param_groups:
                raise ValueError(
                    f"Invalid param_groups={config.param_groups!r} for DMuon: DMuon picks its "
                    "Muon matrices when dedicating and steps the rest with AdamW; set its "
                    "hyperparameters with dmuon_kwargs.")
            handles = [dedicated_of(part) for part in model_parts]
            if parallel_dims is not None:
                _check_meshes(handles, parallel_dims)
            params = [p for part in model_parts for p in part.parameters()]
            self.model_parts = list(model_parts)
            self.optimizers = [DMuon(params, dedicated=handles if len(handles) > 1 else handles[0],
                                     **config.dmuon_kwargs)]
            Optimizer.__init__(self, params, {})

        def state_dict(self) -> dict[str, Any]:
            """Flat, keyed by each param's FQN in its model part (torch DCP's
            ``get_optimizer_state_dict`` over :func:`parts_holder`), as torchtitan's own
            container keys one optimizer per part."""
            return dcp_sd.get_optimizer_state_dict(parts_holder(self.model_parts),
                                                   self.optimizers[0], options=flat)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            dcp_sd.set_optimizer_state_dict(parts_holder(self.model_parts), self.optimizers[0],
                                            state_dict, options=flat)

    return DMuonOptimizers


def parts_holder(model_parts: Sequence[nn.Module]) -> nn.Module:
    """One module whose ``named_parameters`` name each param of ``model_parts`` by its FQN in
    its own part: the part itself when there is one; else the parts merged, submodule by
    submodule (a submodule held by one part is that part's own module, FSDP2's included; one
    held by several, e.g. torchtitan's ``layers`` of each pipeline part, becomes a plain
    container of theirs). torch DCP's optimizer state dict maps every param of the optimizer
    to a name of the model it is given, and one DMuon steps every part of the rank: per part
    it raised ``KeyError`` on the other parts' params. Local, no collective.

    Raises:
        ValueError: two parts hold a param under the same FQN (parts of one model, as
            torchtitan's ``pipeline_llm`` cuts them, never do).
    """
    parts = list(model_parts)
    return parts[0] if len(parts) == 1 else _merged_modules(parts, "")


def _merged_modules(modules: list[nn.Module], prefix: str) -> nn.Module:
    holder = nn.Module()
    for m in modules:
        for name, p in m.named_parameters(recurse=False):
            if hasattr(holder, name):
                raise ValueError(
                    f"Invalid model_parts: two parts hold a param named {prefix + name!r}. "
                    "Each param of a rank's model parts needs its own FQN (torchtitan's "
                    "pipeline_llm keeps the whole model's names in every part).")
            holder.register_parameter(name, p)
    children: dict[str, list[nn.Module]] = {}
    for m in modules:
        for name, child in m.named_children():
            if next(child.parameters(), None) is not None:
                children.setdefault(name, []).append(child)
    for name, held in children.items():
        holder.register_module(name, held[0] if len(held) == 1
                               else _merged_modules(held, f"{prefix}{name}."))
    return holder


def _check_meshes(handles: list[DedicatedParams], parallel_dims) -> None:
    names, _, _ = mesh_dims(parallel_dims)
    mesh = parallel_dims.get_mesh(list(names) if len(names) > 1 else names[0])
    want = sorted(int(r) for r in mesh.mesh.reshape(-1).tolist())
    for i, dm in enumerate(handles):
        got = sorted(int(r) for r in torch.tensor(dm.mesh_ranks).reshape(-1).tolist())
        if got != want:
            raise ValueError(
                f"Invalid model_parts[{i}]: dedicated on ranks {got}, but parallel_dims maps "
                f"to the mesh {names} of ranks {want}. Dedicate every part with "
                "dmuon.integrations.torchtitan.dedicate(part, parallel_dims).")
