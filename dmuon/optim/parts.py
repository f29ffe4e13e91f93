"""Several model parts, one optimizer: ``DMuon(params, dedicated=[dm_a, dm_b])``.

An interleaved pipeline schedule (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``) gives
each rank several stage modules, each with its own :class:`DedicatedParams` handle (one
``dedicate_params`` call per module, every call on the same data-parallel mesh).
:class:`DedicatedParts` shows the optimizer one handle made of them: every query the optimizer,
its clipping, its checkpoint and its agreement make is answered by the part that holds the
param, every per-step call (``before_step``, ``after_step``, ``take_back_grads``,
``after_zero_grad``) goes to every part in order. The optimizer steps each part's params with
that part's groups (``parts``). Local, no collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from dmuon.placement.dims import STAGE_SLICE
from dmuon.runtime.dedicated_params import DedicatedParams
from dmuon.runtime.state import TrainingState


def _ranks(dm: DedicatedParams) -> list[int]:
    return sorted(int(r) for r in torch.tensor(dm.mesh_ranks).reshape(-1).tolist()) if dm.mesh_ranks else []


def check_parts(dedicated: Sequence) -> list[DedicatedParams]:
    """The handles of ``dedicated`` (a list or tuple of them), checked (local, no collective).

    Raises:
        ValueError: empty, an element that is not a ``DedicatedParams`` (names its index and
            type), a handle given twice, or handles on different meshes ("mismatched stage
            meshes": names both handles' ranks and the fix).
    """
    parts = list(dedicated)
    if not parts:
        raise ValueError(
            "Invalid dedicated=[] (no handle). Pass the DedicatedParams of every model part this "
            "rank holds: DMuon(params, dedicated=[dm_a, dm_b]).")
    for i, dm in enumerate(parts):
        if not isinstance(dm, DedicatedParams):
            raise ValueError(
                f"Invalid dedicated[{i}]={dm!r} (type {type(dm).__name__}). Each must be the "
                "DedicatedParams handle returned by dmuon.dedicate_params(part, mesh) for one "
                "model part (a pipeline stage module).")
    for i, dm in enumerate(parts):
        for j in range(i):
            if parts[j] is dm:
                raise ValueError(
                    f"Invalid dedicated: the handle at index {i} is also at index {j}. Pass each "
                    "model part's handle once.")
    first = _ranks(parts[0])
    for i, dm in enumerate(parts[1:], start=1):
        if _ranks(dm) != first or (dm.stage_mesh is None) != (parts[0].stage_mesh is None):
            raise ValueError(
                f"Invalid dedicated: mismatched stage meshes. dedicated[0] was dedicated on the "
                f"mesh of ranks {parts[0].mesh_ranks}, dedicated[{i}] on ranks {dm.mesh_ranks}. "
                "One optimizer steps the parts of one rank over one data-parallel mesh: call "
                f"dedicate_params on every part with the same mesh ({STAGE_SLICE} of this "
                "rank's stage), or build one DMuon per mesh.")
    return parts


class DedicatedParts:
    """The handles of a rank's model parts as one (module docstring).

    Attributes:
        parts: the handles, in the order given.
        names: every dedicated param's name; where two parts use one name, each is prefixed
            ``parts[i].`` (only the optimizer's messages and its ``saved_by`` record read them).
        params: every dedicated param, part by part in each part's order.
    """

    def __init__(self, parts: Sequence[DedicatedParams]) -> None:
        self.parts = list(parts)
        raw = [n for dm in self.parts for n in dm.names]
        clash = len(set(raw)) != len(raw)
        self.names = [f"parts[{i}].{n}" if clash else n
                      for i, dm in enumerate(self.parts) for n in dm.names]
        self.params = [p for dm in self.parts for p in dm.params]
        self._grads_final_done: list[set[int]] = []  # per on_grads_final: the parts done
        self._part_of = {id(p): dm for dm in self.parts for p in dm.params}
        self.placements = {name: pl for name, pl in zip(
            self.names, (dm.placements[n] for dm in self.parts for n in dm.names))}

    # ------------------------------------------------------------------ what a handle answers
    def __iter__(self) -> Iterator:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, p: object) -> bool:
        return id(p) in self._part_of

    def part_of(self, p: torch.Tensor) -> DedicatedParams:
        """The handle that holds ``p`` (``KeyError`` for a param of no part)."""
        return self._part_of[id(p)]

    @property
    def stage_mesh(self):
        return self.parts[0].stage_mesh

    @property
    def mesh_ranks(self):
        return self.parts[0].mesh_ranks

    @property
    def groups(self):
        """The first part's groups: every part spans the same ranks (:func:`check_parts`), so
        the optimizer's calls over all of them (clipping's norm, the found-Inf flag) take one."""
        return self.parts[0].groups

    @property
    def buckets(self) -> list:
        return [b for dm in self.parts for b in dm.buckets]

    @property
    def state(self) -> TrainingState:
        """BACKWARD_DONE only when every part is (what clipping requires), else the first
        part's state that is not."""
        states = [dm.state for dm in self.parts]
        return next((s for s in states if s != TrainingState.BACKWARD_DONE), states[0])

    @property
    def shows_grad_view(self) -> bool:
        return all(dm.layout.shows_grad_view for dm in self.parts)

    def owned(self) -> list:
        return [p for dm in self.parts for p in dm.owned()]

    def placement_of(self, p):
        return self.part_of(p).placement_of(p)

    def owner_of(self, p) -> int:
        return self.part_of(p).owner_of(p)

    def unit_of(self, p) -> str:
        return self.part_of(p).unit_of(p)

    def block_of(self, p) -> str:
        return self.part_of(p).block_of(p)

    def unreduced_param(self) -> str | None:
        return next((n for n in (dm.unreduced_param() for dm in self.parts) if n is not None), None)

    def matrix_shapes(self) -> dict[int, tuple[int, int]]:
        """id(param) -> Muon's (rows, cols) view of it (``ParamSpec.matrix_shape``)."""
        return {k: v for dm in self.parts for k, v in matrix_shapes(dm).items()}

    # ------------------------------------------------------------------ per step, every part
    def on_grads_final(self, fn) -> None:
        """Call ``fn()`` once every part's grads are final: at the end of the backward that
        finishes the last part still open since the last call (or ``zero_grad``). An
        interleaved schedule ends its parts' last backward passes at different times, and
        ``fn`` (the optimizer's grad view and notes) reads every part's grads: called at the
        first part's end, it showed the next part's grads as DTensors before that part's
        backward passes added to them."""
        done: set[int] = set()
        self._grads_final_done.append(done)
        n = len(self.parts)

        def part_done(i: int) -> None:
            done.add(i)
            if len(done) == n:
                done.clear()
                fn()

        for i, dm in enumerate(self.parts):
            dm.on_grads_final(lambda i=i: part_done(i))

    def take_back_grads(self) -> None:
        for dm in self.parts:
            dm.take_back_grads()

    def show_grads(self, mesh) -> None:
        for dm in self.parts:
            dm.show_grads(mesh)

    def before_step(self) -> None:
        for dm in self.parts:
            dm.before_step()

    def after_step(self) -> None:
        for dm in self.parts:
            dm.after_step()

    def after_zero_grad(self) -> None:
        for done in self._grads_final_done:  # a step cut short: its parts start over
            done.clear()
        for dm in self.parts:
            dm.after_zero_grad()

    def sync_params(self) -> None:
        for dm in self.parts:
            dm.sync_params()

    def params_loaded(self) -> None:
        for dm in self.parts:
            dm.params_loaded()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for dm in self.parts:
                stack.enter_context(dm.no_sync())
            yield

    def close(self, *, sync: bool = True) -> None:
        for dm in self.parts:
            dm.close(sync=sync)


def matrix_shapes(dm: DedicatedParams) -> dict[int, tuple[int, int]]:
    """id(param) -> Muon's (rows, cols) view of each dedicated param of ``dm``."""
    spec_of = {sp.name: sp for sp in dm.layout.agreed_plan.specs}
    return {id(p): spec_of[n].matrix_shape for n, p in zip(dm.names, dm.params)}


def parts_of(dedicated) -> list[DedicatedParams]:
    """The handles behind ``dedicated`` (a :class:`DedicatedParts` or one handle)."""
    return dedicated.parts if isinstance(dedicated, DedicatedParts) else [dedicated]


def stage_mesh_of(dedicated):
    """The stage mesh of the first handle in ``dedicated`` (a handle or a list; ``None`` for
    anything else): the scope of the optimizer's agreement even when its checks raised."""
    items = dedicated if isinstance(dedicated, list | tuple) else [dedicated]
    return next((dm.stage_mesh for dm in items if isinstance(dm, DedicatedParams | DedicatedParts)), None)
