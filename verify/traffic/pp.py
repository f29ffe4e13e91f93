"""The prediction of a pipeline-parallel (PP) run: mesh ``("pp", "dp_shard")`` = S × N, W = S·N,
stage s on world ranks ``s·N .. s·N + N - 1`` (rank ``s·N + j``), the pipeline group of
data-parallel index j the ranks ``{s·N + j}`` over s.

Derived from the documented protocol (``docs/protocol.md``, "Pipeline parallelism";
``docs/traffic-model.md``, "Pipeline parallelism") and the planner, never from the runtime (this
module imports ``dmuon.ownership.plan`` through :mod:`verify.traffic.predict` and nothing else of
``dmuon``):

- **Per stage** (its params :attr:`PPRunLayout.stage_names`): the plain prediction
  (:func:`verify.traffic.predict.predict_step`) of the stage's own data-parallel layout on its N
  ranks (owners planned over the stage's slice), with the stage's ranks and groups mapped to
  world ranks. One step of M micro-batches moves a stage's dedicated params once: the first
  forward broadcasts, the M-th backward reduces, and Z3 keeps its copies for the step (no
  re-broadcast): Z3's calls are Z2's. DMuon's replicated rest is all-reduced once per step.
  ``ddp-muon`` (the reference): DDP's buckets of the stage module, all-reduced once per step
  (torch's schedules run the first M - 1 backwards under ``no_sync``).
- **The stage-to-stage P2P** (phase :data:`PIPELINE`, no dedicated share): per boundary b
  (stages b and b + 1), data-parallel index j and micro-batch: stage b's rank sends the
  activation (:attr:`PPRunLayout.pp_activations`: A_b elements) to stage b + 1's rank of its
  pipeline group, which receives it; in backward stage b + 1 sends the activation's grad (A_b
  elements) back. ``root`` is the peer's group rank (its stage index). The schedule's order
  changes no call of the multiset.

Closed form (W-average per step): the dedicated calls Σ_s 2(N-1)/N·P_s / S = 2(N-1)/N·P_M/S
(forward and backward (N-1)/N·P_M/S each) in every mode here; the P2P phase's elements
received, 2M·Σ_b A_b / S (:meth:`PPRunLayout.pipeline_closed_form`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from tracer.events import group_id_from_ranks

from verify.traffic.formulas import ClosedForm, closed_form
from verify.traffic.predict import (
    ClosedFormCheck,
    Expected,
    RunLayout,
    ns_calls_per_step,
    predict_step,
)

#: Modes that run with PP (``--pp S``): DMuon with the rest replicated by DMuon (``dmuon-ddp``
#: then runs as Z2: nothing wraps the stage), Z2, Z3 held for the step; ``ddp-muon``, the
#: reference (DDP-wrapped stage modules, torch's Muon on every rank).
PP_MODES = ("ddp-muon", "dmuon-ddp", "dmuon-z2", "dmuon-z3")
#: The phase of the stage-to-stage send / recv (the harness's tag, ``verify.modes.pp``).
PIPELINE = "pipeline"


def pp_skip_reason(mode: str, world_size: int, pp: int) -> str | None:
    """Why ``mode`` cannot run with ``--pp pp`` at W = ``world_size`` (``None``: it can)."""
    if mode not in PP_MODES:
        return f"no pipeline-parallel variant (--pp runs {', '.join(PP_MODES)})"
    if world_size % pp or world_size // pp < 2:
        return f"the mesh is S x N = {pp} x W/{pp}: needs S | W and N >= 2, have W={world_size}"
    return None


def _remap(gid: str, offset: int) -> str:
    return group_id_from_ranks([int(r) + offset for r in gid.split(",")])


@dataclass(frozen=True)
class PPRunLayout(RunLayout):
    """A :class:`RunLayout` on an ``S × N`` mesh (``shard_size`` = N, ``replicate_size`` = 1).

    Attributes (besides RunLayout's; ``params`` are the whole model's, in model order):
        pp_size: S, the stages (>= 2; a run without PP is a :class:`RunLayout`).
        microbatches: M, the schedule's micro-batches per step (>= 1).
        stage_names: per stage, the names of the params its module holds (each param in one).
        pp_activations: per boundary b = 0 .. S-2, ``(numel, dtype)`` of one micro-batch's
            activation stage b sends to stage b + 1 (and its grad, sent back).
    """

    kind: ClassVar[str] = "pp"
    flat_allowed: ClassVar[bool] = False

    pp_size: int = 1
    microbatches: int = 1
    stage_names: tuple[tuple[str, ...], ...] = ()
    pp_activations: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        s, m = self.pp_size, self.microbatches
        for name, v, low in (("pp_size", s, 2), ("microbatches", m, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Invalid {name}={v!r} for a PPRunLayout. Must be an int >= {low}.")
        if self.mode not in PP_MODES:
            raise ValueError(f"Invalid mode={self.mode!r} for a PPRunLayout. Must be one of {PP_MODES}.")
        if self.replicate_size != 1:
            raise ValueError(f"Invalid replicate_size={self.replicate_size} for a PPRunLayout. Must be 1 "
                             "(each stage a 1-D data-parallel slice).")
        if self.is_dmuon and self.dmuon_rest != "replicate":
            raise ValueError(f"Invalid dmuon_rest={self.dmuon_rest!r} with pp_size > 1. Must be "
                             "'replicate' (the harness's stages are wrapped by nothing).")
        if len(self.stage_names) != s:
            raise ValueError(f"Invalid stage_names: {len(self.stage_names)} stages for pp_size={s}. "
                             "Must list the params of every stage.")
        held = [n for names in self.stage_names for n in names]
        every = [p.name for p in self.params]
        if sorted(held) != sorted(every):
            raise ValueError("Invalid stage_names: must hold every param of the model exactly once "
                             f"(extra or repeated: {sorted(set(held) - set(every) or {n for n in held if held.count(n) > 1})}, "
                             f"missing: {sorted(set(every) - set(held))}).")
        if len(self.pp_activations) != s - 1:
            raise ValueError(f"Invalid pp_activations: {len(self.pp_activations)} boundaries for "
                             f"pp_size={s}. Must be S - 1 = {s - 1}.")

    @property
    def world_size(self) -> int:
        return self.pp_size * self.shard_size

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["stage_names"] = [list(x) for x in self.stage_names]
        d["pp_activations"] = [list(x) for x in self.pp_activations]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PPRunLayout:
        """Inverse of :meth:`to_dict` (:meth:`RunLayout.from_dict`'s errors; ``pp_size`` required)."""
        cls.check_kind(d)
        if "pp_size" not in d:
            raise ValueError("Invalid layout for PPRunLayout.from_dict: missing pp_size. Must come "
                             "from PPRunLayout.to_dict (a layout.json of a --pp run).")
        own = ("pp_size", "microbatches", "stage_names", "pp_activations", "kind")
        base = RunLayout.from_dict({k: v for k, v in d.items() if k not in own})
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)},
                   pp_size=int(d["pp_size"]), microbatches=int(d.get("microbatches", 1)),
                   stage_names=tuple(tuple(x) for x in d.get("stage_names", ())),
                   pp_activations=tuple((int(n), t) for n, t in d.get("pp_activations", ())))

    # ------------------------------------------------------------------- stages
    def stage_layout(self, s: int) -> RunLayout:
        """Stage ``s``'s own data-parallel layout on its N ranks (local ranks 0..N-1): its
        params, its Muon targets, Z3 held for the step (``reshard_after_forward=False``: Z2's
        calls, docs/protocol.md "Pipeline parallelism")."""
        names = set(self.stage_names[s])
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        base.update(params=tuple(p for p in self.params if p.name in names),
                    muon_names=tuple(n for n in self.muon_names if n in names),
                    frozen_names=tuple(n for n in self.frozen_names if n in names),
                    module_calls=tuple((m, c) for m, c in self.module_calls
                                       if any(n.startswith(m + ".") for n in names)),
                    reshard_after_forward=False if self.is_dmuon else self.reshard_after_forward,
                    dmuon_block_order=(), label="")
        return RunLayout(**base)

    def stage_p_m(self) -> list[int]:
        """P_s per stage: elements of the stage's Muon targets."""
        return [self.stage_layout(s).p_m() for s in range(self.pp_size)]

    # ------------------------------ the kind's answers (RunLayout's class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every call of one step on every rank (module docstring): the stages' calls and the
        P2P of :func:`predict_p2p`."""
        n = self.shard_size
        out: list[Expected] = []
        for s in range(self.pp_size):
            off = s * n
            out += [dataclasses.replace(c, rank=c.rank + off, group_id=_remap(c.group_id, off))
                    for c in predict_step(self.stage_layout(s))]
        return out + predict_p2p(self)

    def ns_calls_per_step(self) -> int:
        """NS calls per step over all ranks: each stage's (once per matrix in the DMuon modes,
        on each of the stage's N ranks in ``ddp-muon``)."""
        return sum(ns_calls_per_step(self.stage_layout(s)) for s in range(self.pp_size))

    def closed_form_check(self) -> ClosedFormCheck:
        """:func:`pp_closed_form` at P_M (no reuse or kept-unit term: Z3 holds for the step)."""
        return ClosedFormCheck(pp_closed_form(self), self.p_m(), 0, 0)

    def all_closed_forms(self) -> dict[str, float]:
        """Phase -> the closed form of every element moved in it (not only the dedicated ones),
        W-average per step: :data:`PIPELINE` -> :meth:`pipeline_closed_form`."""
        return {PIPELINE: self.pipeline_closed_form()}

    def pipeline_closed_form(self) -> float:
        """The P2P's elements received per rank and step, W-average: 2M·Σ_b A_b / S (each
        boundary's N activations and N grads per micro-batch over W = S·N ranks)."""
        return 2 * self.microbatches * sum(a for a, _ in self.pp_activations) / self.pp_size

    def dmuon_view(self) -> None:
        """``None``: each stage is its own data-parallel layout, not one."""
        return None

    def ns_plan(self) -> None:
        """``None``: each stage plans its own matrices over its N ranks; the harness's bound is
        written for one mesh (``dmuon-plan --pp`` prints each stage's balance)."""
        return None

    def report_fields(self) -> dict:
        """``{"tp_size": 1, "pp_size": S, "microbatches": M, "stage_p_m": [P_s]}``."""
        return {"tp_size": 1, "pp_size": self.pp_size, "microbatches": self.microbatches,
                "stage_p_m": self.stage_p_m()}


def predict_p2p(layout: PPRunLayout) -> list[Expected]:
    """The stage-to-stage send / recv of one step on every rank (module docstring), phase
    :data:`PIPELINE`, no dedicated share."""
    n, s_count, m = layout.shard_size, layout.pp_size, layout.microbatches
    out: list[Expected] = []
    for j in range(n):
        ranks = [s * n + j for s in range(s_count)]
        gid = group_id_from_ranks(ranks)
        for b, (numel, dtype) in enumerate(layout.pp_activations):
            lo, hi = ranks[b], ranks[b + 1]
            for _ in range(m):
                for rank, op, peer in ((lo, "send", b + 1), (hi, "recv", b),   # the activation
                                       (hi, "send", b), (lo, "recv", b + 1)):  # its grad
                    out.append(Expected(rank, PIPELINE, op, gid, s_count, numel, dtype, peer, None, 0))
    return out


def pp_closed_form(layout: PPRunLayout) -> ClosedForm:
    """docs/traffic-model.md, "Pipeline parallelism": each stage's dedicated calls at its N,
    2(N-1)/N·P_s (DMuon: forward and backward (N-1)/N·P_s; ``ddp-muon``: backward 2(N-1)/N·P_s),
    averaged over the S stages' ranks: as factors of P_M, the plain form at N divided by S."""
    mode = "dmuon-z2" if layout.is_dmuon else layout.mode
    form = closed_form(mode, layout.shard_size, 1)
    return ClosedForm(f"{form.text}/S (Σ_s {form.text}·P_s over S={layout.pp_size} stages)",
                      {ph: f / layout.pp_size for ph, f in form.phases.items()})
