"""Per-rank traffic of one training step at any scale, by aggregation (no per-rank call list).

:func:`verify.traffic.predict.predict_step` lists every call of every rank: W copies of nearly the
same list, and W plans. At W=1024 that is hours for a MoE. Here the ranks fall into classes:
every call on the shard axis (broadcast / reduce of a DMuon bucket, FSDP2's all_gather /
reduce_scatter) and on the world (DDP) is issued by every rank with the same size; only
DMuon-HSDP's replicate-axis reduce and broadcast of a bucket are issued by the R ranks of one
column s of the mesh. So a step is a common tally plus one tally per shard index s, and the
busiest rank is the s with the largest extra: O(#buckets + #FSDP groups + N) per mode, with
one plan. The sums equal those over :func:`predict_step`'s list exactly (tested).

Accounting: :mod:`verify.traffic.formulas` (nccl-tests' S and the W-average f(n)·S per call,
docs/spec.md §2); ``*_avg_*`` are W-averages, ``*_max_*`` the busiest rank's own sum, never
mixed. "Dedicated" is the Muon-target part (a call's f·S times dedicated_count / count, as
:mod:`verify.compare`).

DMuon's aligned groups of unequal buckets (gloo, ``RunLayout.dmuon_uneven_aligned``) move as
all_to_alls whose sizes depend on the member: a shard-axis one on its shard index s (tallied
per s, exact), a replicate-axis one on its replicate index r too, which a per-s tally cannot
hold: it is tallied at its column's mean, exact for every average; the busiest-rank figures
take that mean for it.

DMuon HSDP runs are modelled hierarchical only: :func:`step_traffic` refuses a layout that
moves flat (``verify.traffic.predict.dmuon_flat``; ``dmuon-plan`` sizes NCCL jobs, where
``hierarchy="auto"`` is hierarchical).

``zero1-muon`` is the harness's ZeRO-1-style baseline (``verify.modes.baselines.ZeroOneMuon``): one
reduce_scatter and one all_gather over the world of an owner-aligned flat buffer (whole
matrices per owner, padded to the largest owner's total C), DDP for the other params. On an
HSDP mesh it still runs over the whole world, with a (1, W) plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dmuon.ownership.plan import OwnershipPlan, ParamSpec, plan_ownership

from verify.traffic.predict import (
    RunLayout,
    dmuon_broadcasts,
    dmuon_flat,
    kept_elems,
    kept_unit,
    layout_buckets,
    ns_calls_per_step,
    owner_numels,
    reused_elems,
)
from verify.traffic.rules import AxisCall, ddp_calls, fsdp_calls, padded_shard_numel, rest_calls
from verify.traffic.formulas import MODES, avg_elems, closed_form

#: Every mode :func:`step_traffic` knows: the harness's (``zero1-muon`` included).
ZERO1 = "zero1-muon"
SCALE_MODES = MODES

#: The axes a call runs on: the shard group (a row of the (R, N) mesh), the replicate group
#: (a column), or the whole world (DDP, ZeRO-1).
AXES = ("shard", "replicate", "world")


@dataclass
class Tally:
    """Sums over a set of calls, from one rank's view (units in the names)."""

    calls: int = 0
    avg_elems: float = 0.0
    """Sum of f(n)·S (elements a member receives on average, :func:`verify.traffic.formulas.avg_elems`)."""
    avg_bytes: float = 0.0
    ded_avg_elems: float = 0.0
    """The dedicated (Muon-target) share of ``avg_elems``."""
    ded_avg_bytes: float = 0.0
    by_axis: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    """axis -> [calls, avg_bytes]: what an α-β time model needs."""
    ded_by_phase: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, phase: str, op: str, axis: str, group_size: int, count: int, dtype_bytes: int,
            dedicated_count: int, times: int = 1) -> None:
        """Add ``times`` identical calls (per-rank ``count`` elements, NCCL's convention)."""
        elems = avg_elems(op, count, group_size)
        ded = elems * dedicated_count / count if count else 0.0
        self.add_elems(phase, axis, elems, dtype_bytes, ded, times)

    def add_elems(self, phase: str, axis: str, elems: float, dtype_bytes: int, ded: float,
                  times: int = 1) -> None:
        """Add ``times`` calls whose f(n)·S is ``elems`` (``ded`` of it dedicated): an uneven
        all_to_all, which has no count (:func:`verify.traffic.formulas.avg_elems`)."""
        elems, ded = elems * times, ded * times
        self.calls += times
        self.avg_elems += elems
        self.avg_bytes += elems * dtype_bytes
        self.ded_avg_elems += ded
        self.ded_avg_bytes += ded * dtype_bytes
        slot = self.by_axis[axis]
        slot[0] += times
        slot[1] += elems * dtype_bytes
        self.ded_by_phase[phase] += ded

    def plus(self, other: Tally) -> Tally:
        out = Tally()
        for t in (self, other):
            out.calls += t.calls
            out.avg_elems += t.avg_elems
            out.avg_bytes += t.avg_bytes
            out.ded_avg_elems += t.ded_avg_elems
            out.ded_avg_bytes += t.ded_avg_bytes
            for axis, (c, b) in t.by_axis.items():
                out.by_axis[axis][0] += c
                out.by_axis[axis][1] += b
            for ph, v in t.ded_by_phase.items():
                out.ded_by_phase[ph] += v
        return out


@dataclass
class StepTraffic:
    """One mode's step on a (R, N) mesh: a tally every rank has, plus one per shard index."""

    mode: str
    replicate_size: int
    shard_size: int
    p_m: int
    """Elements of the Muon-target params."""
    common: Tally
    extra: dict[int, Tally]
    """shard index s -> the calls only the ranks (r, s) of column s issue."""
    ns_calls: int
    """Newton–Schulz invocations per step over all ranks."""
    param_bytes_max: int
    """Bytes of dedicated params resident on the fullest rank between steps."""
    momentum_bytes_max: int
    """Bytes of Muon momentum on the fullest rank."""
    p_m_pad: int | None = None
    """``zero1-muon``: W·C, the owner-aligned buffer its closed form is evaluated at."""
    p_m_reused: int = 0
    """P_M^r: elements re-sent for units that run more than once per forward
    (:func:`verify.traffic.predict.reused_elems`)."""
    p_m_kept: int = 0
    """P_M^L: elements of the unit DMuon's Z3 keeps from its forward into the backward, not
    re-broadcast (:func:`verify.traffic.predict.kept_elems`)."""

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size

    def rank_tally(self, s: int) -> Tally:
        """Everything a rank with shard index ``s`` issues."""
        return self.common.plus(self.extra[s]) if s in self.extra else self.common

    def _avg(self, attr: str) -> float:
        extra = sum(getattr(t, attr) for t in self.extra.values()) * self.replicate_size
        return getattr(self.common, attr) + extra / self.world_size

    def _max(self, attr: str) -> float:
        return getattr(self.common, attr) + max((getattr(t, attr) for t in self.extra.values()), default=0)

    @property
    def ded_avg_elems(self) -> float:
        """W-average dedicated elements per rank-step (compare with the closed form × P_M)."""
        return self._avg("ded_avg_elems")

    @property
    def ded_avg_bytes(self) -> float:
        return self._avg("ded_avg_bytes")

    @property
    def ded_max_bytes(self) -> float:
        return self._max("ded_avg_bytes")

    @property
    def total_avg_bytes(self) -> float:
        return self._avg("avg_bytes")

    @property
    def calls_avg(self) -> float:
        return self._avg("calls")

    @property
    def calls_max(self) -> int:
        return int(self._max("calls"))

    def closed_form_elems(self) -> float:
        """docs/spec.md §2's closed form × P_M (``zero1-muon``: 2(W-1)/W at P_M^pad = W·C)."""
        if self.mode == ZERO1:
            return 2 * (self.world_size - 1) / self.world_size * self.p_m_pad
        form = closed_form(self.mode, self.shard_size, self.replicate_size)
        return form.total_at(self.p_m, self.p_m_reused, self.p_m_kept)

    def closed_form_text(self) -> str:
        if self.mode == ZERO1:
            return "2(W-1)/W at P_M^pad"
        form = closed_form(self.mode, self.shard_size, self.replicate_size)
        return form.text + form.terms_text(self.p_m_reused, self.p_m_kept)


# ----- per-mode builders ------------------------------------------------------------------------
def _nbytes(spec: ParamSpec) -> int:
    """Bytes per element of ``spec``'s dtype."""
    return _dtype_bytes(spec.dtype)


_ELEMENT_BYTES: dict[str, int] = {}


def _add(t: Tally, calls: list[AxisCall]) -> None:
    """The shared FSDP2 / DDP rules (:mod:`verify.traffic.rules`) into a tally."""
    for c in calls:
        t.add(c.phase, c.op, c.axis, c.group_size, c.count, _dtype_bytes(c.dtype), c.dedicated_count)


def _dmuon(layout: RunLayout, plan: OwnershipPlan) -> tuple[Tally, dict[int, Tally]]:
    """DMuon's buckets (:func:`verify.traffic.predict.layout_buckets`: per unit, owner and
    dtype, cut at the bucket cap), in the dtypes of the protocol (mixed precision: broadcasts
    in param_dtype, reduces in reduce_dtype, the replicate broadcast in the master dtype);
    each reduce also carries one usage element per param (no dedicated payload). Forward
    and Z3 backward broadcasts per bucket: :func:`verify.traffic.predict.dmuon_broadcasts`
    (Z3 reuse, and the unit Z3 keeps into the backward)."""
    n, r = layout.shard_size, layout.replicate_size
    common, extra = Tally(), defaultdict(Tally)
    groups: dict[tuple[str, str], list] = {}
    buckets = layout_buckets(layout, plan)
    kept = kept_unit(layout, buckets)
    for b in buckets:
        if b.aligned:  # one all_gather / reduce_scatter per channel for the group (below)
            groups.setdefault((b.module, b.dtype), []).append(b)
            continue
        g, dtype, numel = b.owner, b.dtype, b.numel
        cast, red = _dtype_bytes(layout.cast_dtype(dtype)), _dtype_bytes(layout.reduce_dtype(dtype))
        forward, backward = dmuon_broadcasts(layout, b, kept)
        common.add("forward", "broadcast", "shard", n, numel, cast, numel, times=forward)
        common.add("backward", "broadcast", "shard", n, numel, cast, numel, times=backward)
        usage = len(b.names)
        common.add("backward", "reduce", "shard", n, numel + usage, red, numel)
        if r > 1:
            col = extra[g % n]
            col.add("backward", "reduce", "replicate", r, numel + usage, red, numel)
            col.add("replicate", "broadcast", "replicate", r, numel, _dtype_bytes(dtype), numel)
    for (_, dtype), group in groups.items():
        owned = {b.owner: b for b in group}
        elems = [owned[g].numel for g in range(n * r)]
        usage = [elems[g] + len(owned[g].names) for g in range(n * r)]
        held = [sum(elems[i * n + s] for i in range(r)) for s in range(n)]
        held_usage = [sum(usage[i * n + s] for i in range(r)) for s in range(n)]
        cast, red = _dtype_bytes(layout.cast_dtype(dtype)), _dtype_bytes(layout.reduce_dtype(dtype))
        forward, backward = dmuon_broadcasts(layout, group[0], kept)  # one unit: every member alike
        if len(set(held)) == 1:  # an all_gather / reduce_scatter; on gloo the same f·S
            common.add("forward", "all_gather", "shard", n, held[0], cast, held[0], times=forward)
            common.add("backward", "all_gather", "shard", n, held[0], cast, held[0], times=backward)
        else:  # uneven all_to_all: shard index s sends its part to N - 1 peers
            for s_col in range(n):
                sent = (n - 1) * held[s_col]
                extra[s_col].add_elems("forward", "shard", sent, cast, sent, times=forward)
                extra[s_col].add_elems("backward", "shard", sent, cast, sent, times=backward)
        if len(set(held_usage)) == 1:
            common.add("backward", "reduce_scatter", "shard", n, held_usage[0], red, held[0])
        else:  # sends every part but its own
            for s_col in range(n):
                extra[s_col].add_elems("backward", "shard", sum(held_usage) - held_usage[s_col], red,
                                       sum(held) - held[s_col])
        if r > 1:
            for s_col in range(n):
                col = [elems[i * n + s_col] for i in range(r)]
                col_usage = [usage[i * n + s_col] for i in range(r)]
                if len(set(col_usage)) == 1:
                    extra[s_col].add("backward", "reduce_scatter", "replicate", r, col_usage[0], red, col[0])
                else:  # the column's mean: its ranks differ by r (module docstring)
                    extra[s_col].add_elems("backward", "replicate", (r - 1) / r * sum(col_usage), red,
                                           (r - 1) / r * sum(col))
                if len(set(col)) == 1:
                    extra[s_col].add("replicate", "all_gather", "replicate", r, col[0], _dtype_bytes(dtype), col[0])
                else:
                    extra[s_col].add_elems("replicate", "replicate", (r - 1) / r * sum(col),
                                           _dtype_bytes(dtype), (r - 1) / r * sum(col))
    return common, dict(extra)


def _dtype_bytes(name: str) -> int:
    """Bytes per element of the torch dtype ``name`` (e.g. ``"bfloat16"``: 2)."""
    if name not in _ELEMENT_BYTES:
        _ELEMENT_BYTES[name] = getattr(torch, name).itemsize
    return _ELEMENT_BYTES[name]


def _muon_bytes(layout: RunLayout) -> int:
    return sum(p.nbytes for p in layout.muon_specs())


def _build_dmuon(layout: RunLayout, plan: OwnershipPlan) -> StepTraffic:
    if dmuon_flat(layout):  # its rank classes are not the (R, N) ones this tally assumes
        raise ValueError(
            f"Invalid layout: {layout.mode} moving its dedicated params flat over W="
            f"{layout.world_size} (verify.traffic.predict.dmuon_hierarchy). Must be hierarchical "
            "here: the aggregate predictor models DMuon's HSDP protocol only; predict a flat run "
            "with verify.traffic.predict.predict_step (docs/traffic-model.md, \"HSDP: flat or "
            "hierarchical\").")
    common, extra = _dmuon(layout, plan)
    ded = set(layout.muon_names)
    if layout.dmuon_rest == "replicate":  # DMuon all-reduces the rest; nothing wraps the model
        _add(common, rest_calls(layout))
    elif layout.mode == "dmuon-ddp":
        _add(common, ddp_calls(layout, ded))
    else:
        _add(common, fsdp_calls(layout, ded))
    z2 = layout.mode == "dmuon-ddp" or not layout.reshard_after_forward
    # Z2 and DDP keep every dedicated param on every rank; Z3 keeps what its shard index s
    # holds after the replicate broadcast (the owners (., s)).
    params = _muon_bytes(layout) if z2 else max(plan.bytes_load_per_shard, default=0)
    return _result(layout, common, extra, params, max(plan.bytes_load, default=0))


def _build_ddp_muon(layout: RunLayout, plan: OwnershipPlan) -> StepTraffic:
    common = Tally()
    _add(common, ddp_calls(layout, set()))
    full = _muon_bytes(layout)
    return _result(layout, common, {}, full, full)


def _build_naive(layout: RunLayout, plan: OwnershipPlan) -> StepTraffic:
    common = Tally()
    _add(common, fsdp_calls(layout, set()))
    n = layout.shard_size
    sharded = 0
    for p in layout.muon_specs():
        c = padded_shard_numel(p.shape, n)
        common.add("optimizer", "all_gather", "shard", n, c, _nbytes(p), c)
        sharded += c * _nbytes(p)
    # FSDP2 shards the params (padded); the baseline keeps a full momentum on every rank.
    return _result(layout, common, {}, sharded, _muon_bytes(layout))


def _build_zero1(layout: RunLayout, plan: OwnershipPlan) -> StepTraffic:
    """The harness's ZeRO-1-style Muon (``verify.modes.baselines.ZeroOneMuon``, docs/spec.md
    §7): DDP all-reduces the other params; the step runs one reduce_scatter and one
    all_gather over the world of the owner-aligned flat buffer, C = the largest owner's total
    on a (1, W) plan."""
    common = Tally()
    _add(common, ddp_calls(layout, set(layout.muon_names)))
    w = layout.world_size
    specs = layout.muon_specs()
    if plan.mesh_shape != (1, w):
        plan = plan_ownership(specs, (1, w))
    c, elem_bytes = max(owner_numels(specs, plan)), _nbytes(specs[0])
    for op in ("reduce_scatter", "all_gather"):
        common.add("optimizer", op, "world", w, c, elem_bytes, c)
    out = _result(layout, common, {}, _muon_bytes(layout), c * elem_bytes)
    out.p_m_pad = w * c
    return out


def _result(layout, common, extra, param_bytes, momentum_bytes) -> StepTraffic:
    return StepTraffic(
        mode=layout.mode, replicate_size=layout.replicate_size, shard_size=layout.shard_size,
        p_m=layout.p_m(), common=common, extra=extra, ns_calls=ns_calls_per_step(layout),
        param_bytes_max=param_bytes, momentum_bytes_max=momentum_bytes,
        p_m_reused=reused_elems(layout), p_m_kept=kept_elems(layout),
    )


_BUILDERS: dict[str, Callable[[RunLayout, OwnershipPlan], StepTraffic]] = {
    "ddp-muon": _build_ddp_muon,
    "zero1-muon": _build_zero1,
    "dmuon-ddp": _build_dmuon,
    "naive-fsdp2-z2": _build_naive,
    "naive-fsdp2-z3": _build_naive,
    "dmuon-z2": _build_dmuon,
    "dmuon-z3": _build_dmuon,
    "naive-hsdp": _build_naive,
    "dmuon-hsdp-z2": _build_dmuon,
    "dmuon-hsdp-z3": _build_dmuon,
}


def step_traffic(layout: RunLayout, plan: OwnershipPlan | None = None, mode: str | None = None) -> StepTraffic:
    """One step of ``mode`` (default ``layout.mode``) on ``layout``'s mesh, aggregated.

    Args:
        layout: the model's params, Muon targets, mesh and wrapping.
        plan: the ownership plan of ``layout.muon_specs()`` on the mesh (computed if omitted;
            pass it to reuse one plan across modes of the same mesh).
        mode: one of :data:`SCALE_MODES`; ``zero1-muon`` reads the layout's params and DDP
            bucket cap only.

    Raises:
        ValueError: unknown mode, a plan for another mesh, or an FSDP group of mixed dtypes.
    """
    mode = layout.mode if mode is None else mode
    if mode not in SCALE_MODES:
        raise ValueError(f"Invalid {mode=}. Must be one of {SCALE_MODES}.")
    mesh = (layout.replicate_size, layout.shard_size)
    if plan is None:
        plan = layout.plan()
    elif plan.mesh_shape != mesh:
        raise ValueError(f"Invalid plan for mesh_shape={plan.mesh_shape}. Must be planned on {mesh}.")
    if mode != layout.mode:
        layout = dataclasses.replace(layout, mode=mode)
    return _BUILDERS[mode](layout, plan)


# ----- α-β time -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CostModel:
    """An α-β model of one collective and a FLOP rate for NS (defaults: H100/H200-class nodes).

    A call over a group on one node costs ``intra_alpha_us + bytes / intra_gbps``, over
    several nodes ``inter_alpha_us + bytes / inter_gbps``, where bytes is the f(n)·S a member
    moves (bandwidth-optimal algorithms; the slowest link of a multi-node ring is the NIC).
    Ranks fill nodes in order: rank = r·N + s, ``gpus_per_node`` consecutive ranks per node.
    Calls are serial, with no overlap with compute: an upper bound on exposed communication.
    """

    gpus_per_node: int = 8
    intra_gbps: float = 360.0
    """NVLink bus bandwidth, GB/s (nccl-tests all_reduce busbw on 8x H100 SXM, NVLink 4)."""
    inter_gbps: float = 45.0
    """Per-GPU network bandwidth, GB/s (one 400 Gb/s InfiniBand NDR NIC per GPU, ~90% used)."""
    intra_alpha_us: float = 10.0
    """Latency per call on one node, µs."""
    inter_alpha_us: float = 20.0
    """Latency per call across nodes, µs."""
    tflops: float = 600.0
    """Achieved dense bf16 TFLOP/s of a GPU on NS's matrix products."""

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Invalid gpus_per_node={self.gpus_per_node!r}. Must be a positive int.")
        for name in ("intra_gbps", "inter_gbps", "tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}. Must be > 0.")
        for name in ("intra_alpha_us", "inter_alpha_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}. Must be >= 0.")

    def on_one_node(self, axis: str, replicate_size: int, shard_size: int) -> bool:
        """Whether every group on ``axis`` of the (R, N) mesh lies within one node."""
        g, n, w = self.gpus_per_node, shard_size, replicate_size * shard_size
        if axis == "shard":
            return all((r * n) // g == (r * n + n - 1) // g for r in range(replicate_size))
        if axis == "replicate":
            return all(s // g == ((replicate_size - 1) * n + s) // g for s in range(n))
        return w <= g

    def comm_s(self, tally: Tally, replicate_size: int, shard_size: int) -> float:
        """Seconds of a rank's calls in ``tally``."""
        total = 0.0
        for axis, (calls, nbytes) in tally.by_axis.items():
            if self.on_one_node(axis, replicate_size, shard_size):
                total += calls * self.intra_alpha_us * 1e-6 + nbytes / (self.intra_gbps * 1e9)
            else:
                total += calls * self.inter_alpha_us * 1e-6 + nbytes / (self.inter_gbps * 1e9)
        return total

    def busiest_comm_s(self, st: StepTraffic) -> float:
        """Seconds of communication on the slowest rank of one step."""
        r, n = st.replicate_size, st.shard_size
        return max([self.comm_s(st.rank_tally(s), r, n) for s in st.extra] or [self.comm_s(st.common, r, n)])

    def ns_s(self, flops: float) -> float:
        return flops / (self.tflops * 1e12)


def ns_flops_busiest(st: StepTraffic, plan: OwnershipPlan) -> float:
    """NS FLOPs on the busiest rank: the fullest owner for DMuon, every matrix otherwise;
    ZeRO-1-style Muon's owners on its (1, W) plan."""
    if st.mode.startswith("dmuon-"):
        return max(plan.ns_load, default=0)
    if st.mode == ZERO1:
        if plan.mesh_shape != (1, st.world_size):
            plan = plan_ownership(list(plan.specs), (1, st.world_size))
        return max(plan.ns_load, default=0)
    return float(sum(plan.ns_cost.values()))


def split_ns_s(rows: int, cols: int, team: int, model: CostModel, ns_steps: int = 5,
               dtype_bytes: int = 2) -> float:
    """Modelled seconds of one NS call on a ``(rows, cols)`` matrix shared by ``team`` ranks
    of one node: column blocks of the wide orientation (m, n/team) each; per iteration each
    computes its Gram part (m·m·n/team multiply-adds), all_reduces the (m, m) Gram
    (2(k-1)/k·m² elements of ``dtype_bytes``), forms A·A redundantly (m³) and its own block
    of B·X (m·m·n/team). ``team=1`` is the single-owner call (no all_reduce)."""
    m, n = min(rows, cols), max(rows, cols)
    macs = 2 * m * m * math.ceil(n / team) + m**3
    t = ns_steps * model.ns_s(2 * macs)
    if team > 1:
        nbytes = 2 * (team - 1) / team * m * m * dtype_bytes
        t += ns_steps * (model.intra_alpha_us * 1e-6 + nbytes / (model.intra_gbps * 1e9))
    return t


def layout_modes(replicate_size: int) -> Sequence[str]:
    """The modes that apply on an (R, N) mesh: the 1-D ones for R = 1, the HSDP ones else."""
    if replicate_size == 1:
        return ("ddp-muon", ZERO1, "naive-fsdp2-z2", "naive-fsdp2-z3", "dmuon-ddp", "dmuon-z2", "dmuon-z3")
    return ("naive-hsdp", "dmuon-hsdp-z2", "dmuon-hsdp-z3")
