"""The prediction of a context-parallel (CP) run: mesh ``("dp_shard", "cp")`` = N × C, W = N·C,
rank (d, c) = world rank ``d·C + c``, the CP group of data-parallel index d the ranks
``{d·C + c}`` over c.

Derived from the documented protocol (``docs/protocol.md``; ``docs/traffic-model.md``, "Context
parallelism"; ``docs/user-guide.md``, "Meshes") and the planner, never from the runtime (this
module imports ``dmuon.ownership.plan`` through :mod:`verify.traffic.predict` and nothing else
of ``dmuon``):

- **DMuon's dedicated traffic**: both dims are declared shard dims
  (``shard_dims=("dp_shard", "cp")``), so the shard group is all N·C ranks in mesh order (group
  rank = world rank) and every DMuon call is the plain prediction
  (:func:`verify.traffic.predict.predict_step`) of the 1-D layout at N_eff = N·C
  (:meth:`CPRunLayout.dense_view`); the replicated rest is one world all_reduce per dtype.
  ``ddp-muon`` (the reference): DDP over the world group, the same 1-D rule at W.
- **The attention's K/V exchange** (phase :data:`CONTEXT`, no dedicated share), per CP group,
  attention layer and step (``examples/cp_attention.py``): forward, two all_gathers (K, V) of
  this rank's part, a = B_r·H·(L/C)·D_h elements (``count`` = a, the sender's count); backward,
  two all_reduces of the whole sequence's grad, C·a elements each.

Closed form (W-average per step): the dedicated calls are the 1-D form at N_eff = N·C (DMuon:
forward and backward (N_eff-1)/N_eff·P_M; Z3 adds its backward re-broadcast less the kept
unit); the K/V phase's elements received, Σ_l [2(C-1)·a_l + 2·2(C-1)/C·C·a_l] = 6(C-1)·Σ_l a_l
(:meth:`CPRunLayout.context_closed_form`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from tracer.events import group_id_from_ranks

from verify.traffic.predict import (
    ClosedFormCheck,
    Expected,
    RunLayout,
    ns_calls_per_step,
    predict_step,
)

#: Modes that run with CP (``--cp C``): DMuon Z2 / Z3 with the rest replicated by DMuon
#: (``dmuon-ddp`` then runs as Z2: nothing wraps the model), ``ddp-muon`` the reference (DDP
#: over all W ranks, torch's Muon on every rank).
CP_MODES = ("ddp-muon", "dmuon-ddp", "dmuon-z2", "dmuon-z3")
#: The phase of the attention's K/V all_gather and its backward all_reduce (the harness's tag,
#: ``verify.modes.cp``).
CONTEXT = "context"


def cp_skip_reason(mode: str, world_size: int, cp: int) -> str | None:
    """Why ``mode`` cannot run with ``--cp cp`` at W = ``world_size`` (``None``: it can)."""
    if mode not in CP_MODES:
        return f"no context-parallel variant (--cp runs {', '.join(CP_MODES)})"
    if world_size % cp or world_size // cp < 2:
        return f"the mesh is N x C = W/{cp} x {cp}: needs C | W and N >= 2, have W={world_size}"
    return None


@dataclass(frozen=True)
class CPRunLayout(RunLayout):
    """A :class:`RunLayout` on an ``N × C`` mesh (``shard_size`` = N, the dp_shard dim;
    ``replicate_size`` = 1).

    Attributes (besides RunLayout's):
        cp_size: C, >= 2 (a run without CP is a :class:`RunLayout`).
        cp_layers: ``(module, elems, dtype)`` per attention layer: a, the elements of this
            rank's part of K (and of V) one forward all-gathers (B_r·H·(L/C)·D_h), their dtype.
    """

    kind: ClassVar[str] = "cp"
    flat_allowed: ClassVar[bool] = False

    cp_size: int = 1
    cp_layers: tuple[tuple[str, int, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.cp_size
        if isinstance(c, bool) or not isinstance(c, int) or c < 2:
            raise ValueError(f"Invalid cp_size={c!r} for a CPRunLayout. Must be an int >= 2 (C; "
                             "a run without context parallelism is a RunLayout).")
        if self.mode not in CP_MODES:
            raise ValueError(f"Invalid mode={self.mode!r} for a CPRunLayout. Must be one of {CP_MODES}.")
        if self.replicate_size != 1:
            raise ValueError(f"Invalid replicate_size={self.replicate_size} for a CPRunLayout. Must be 1 "
                             "(the harness's CP mesh is ('dp_shard', 'cp')).")
        if self.is_dmuon and self.dmuon_rest != "replicate":
            raise ValueError(f"Invalid dmuon_rest={self.dmuon_rest!r} with cp_size > 1. Must be "
                             "'replicate' (nothing wraps the harness's CP model).")
        if not self.cp_layers:
            raise ValueError("Invalid cp_layers=(): a CP run exchanges K/V in at least one "
                             "attention layer. Must list (module, elems, dtype) per layer.")
        for m, a, t in self.cp_layers:
            if isinstance(a, bool) or not isinstance(a, int) or a < 1:
                raise ValueError(f"Invalid cp_layers entry ({m!r}, {a!r}, {t!r}): elems must be an int >= 1.")

    @property
    def world_size(self) -> int:
        return self.shard_size * self.cp_size

    @property
    def n_eff(self) -> int:
        """N_eff = N·C: the ranks DMuon's shard group spans."""
        return self.shard_size * self.cp_size

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["cp_layers"] = [list(x) for x in self.cp_layers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CPRunLayout:
        """Inverse of :meth:`to_dict` (:meth:`RunLayout.from_dict`'s errors; ``cp_size`` required)."""
        cls.check_kind(d)
        if "cp_size" not in d:
            raise ValueError("Invalid layout for CPRunLayout.from_dict: missing cp_size. Must come "
                             "from CPRunLayout.to_dict (a layout.json of a --cp run).")
        own = ("cp_size", "cp_layers", "kind")
        base = RunLayout.from_dict({k: v for k, v in d.items() if k not in own})
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunLayout)},
                   cp_size=int(d["cp_size"]),
                   cp_layers=tuple((m, int(a), t) for m, a, t in d.get("cp_layers", ())))

    def dense_view(self) -> RunLayout:
        """The 1-D data-parallel layout of all W = N·C ranks (``shard_size`` = N_eff): DMuon's
        shard group over ``("dp_shard", "cp")`` in mesh order, DDP's world group."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunLayout)}
        base.update(shard_size=self.n_eff, label="")
        return RunLayout(**base)

    # ------------------------------ the kind's answers (RunLayout's class docstring)
    def predict_calls(self) -> list[Expected]:
        """Every call of one step on every rank: the 1-D prediction at N_eff and
        :func:`predict_context`."""
        return predict_step(self.dense_view()) + predict_context(self)

    def ns_calls_per_step(self) -> int:
        """The 1-D count at N_eff (once per matrix in the DMuon modes, on every rank in ``ddp-muon``)."""
        return ns_calls_per_step(self.dense_view())

    def closed_form_check(self) -> ClosedFormCheck:
        """The 1-D closed form at N = N_eff = N·C (its reuse and kept-unit terms included)."""
        return self.dense_view().closed_form_check()

    def all_closed_forms(self) -> dict[str, float]:
        """:data:`CONTEXT` -> :meth:`context_closed_form` (every element of the K/V exchange)."""
        return {CONTEXT: self.context_closed_form()}

    def context_closed_form(self) -> float:
        """The K/V exchange's elements received per rank and step, W-average: 6(C-1)·Σ_l a_l
        (two all_gathers, (C-1)·a each; two all_reduces of C·a, 2(C-1)/C·C·a each)."""
        return 6 * (self.cp_size - 1) * sum(a for _, a, _ in self.cp_layers)

    def dmuon_view(self) -> RunLayout | None:
        """The 1-D layout at N_eff in the DMuon modes (its buckets name the units and owners)."""
        return self.dense_view().dmuon_view()

    def ns_plan(self):
        """The plan over N_eff ranks (owners run each matrix's NS once)."""
        return self.dense_view().ns_plan()

    def report_fields(self) -> dict:
        """``{"tp_size": 1, "cp_size": C, "n_eff": N·C}``."""
        return {"tp_size": 1, "cp_size": self.cp_size, "n_eff": self.n_eff}


def predict_context(layout: CPRunLayout) -> list[Expected]:
    """The K/V exchange of one step on every rank (module docstring), phase :data:`CONTEXT`,
    no dedicated share."""
    n, c = layout.shard_size, layout.cp_size
    out: list[Expected] = []
    for d in range(n):
        ranks = [d * c + k for k in range(c)]
        gid = group_id_from_ranks(ranks)
        for module, a, dtype in layout.cp_layers:
            for rank in ranks:
                for _ in ("k", "v"):
                    out.append(Expected(rank, CONTEXT, "all_gather", gid, c, a, dtype, None, module, 0))
                    out.append(Expected(rank, CONTEXT, "all_reduce", gid, c, c * a, dtype, None, module, 0))
    return out
