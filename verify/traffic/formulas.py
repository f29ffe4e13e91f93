"""The traffic model: per-collective factors and the closed forms of docs/spec.md §2 (one
table).

Accounting (nccl-tests, PERFORMANCE.md; docs/spec.md §2): for a call over a group of n ranks
with per-rank ``count`` (NCCL's convention), the total array size is

    S = count            for all_reduce, broadcast, reduce
    S = n * count        for all_gather, reduce_scatter, all_to_all, gather, scatter

and with a bandwidth-optimal algorithm each member receives on average ``f(n) * S``
elements, f = 2(n-1)/n for all_reduce, (n-1)/n**2 for gather and scatter (only the root
receives, or only it sends: (n-1)·count in all), and (n-1)/n otherwise. The *step figure* of
a mode is the mean over all W ranks of the sum of f(n)·S over the calls each rank takes part
in. Each rank records its own copy of a call, so the W-average is
``sum(f·S over all ranks' events) / W``. An uneven all_to_all (members' chunks of different
sizes: DMuon's gloo aligned groups) has no single count and no S; each member contributes the
elements it sends (:func:`avg_elems`), and those sum to what the members receive.

nccl-tests' busbw factor describes the busiest rank (1 for broadcast / reduce), a different
quantity: reports show the busiest rank's own sum in a separate column, never mixed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: Ops whose nccl-tests array size is n * count (gather / scatter: nccl-tests
#: src/gather.cu and src/scatter.cu, ``GetBw``: ``count * nranks * typesize``).
_TIMES_N = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})


def array_elems(op: str, count: int, group_size: int) -> int:
    """nccl-tests' total array size S in elements (see module docstring)."""
    return group_size * count if op in _TIMES_N else count


def avg_recv_factor(op: str, group_size: int) -> float:
    """f(n): mean elements received per member per element of S (bandwidth-optimal).

    Point-to-point calls are outside the model of docs/spec.md §2: a ``recv`` receives its
    count (f = 1), a ``send`` receives nothing, a ``barrier`` carries no payload.
    """
    n = group_size
    if op == "recv":
        return 1.0
    if op in ("send", "barrier") or n <= 1:
        return 0.0
    if op in ("gather", "scatter"):
        return (n - 1) / n**2
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def avg_elems(op: str, count: int | None, group_size: int, *, in_elems: int | None = None,
              self_elems: int | None = None) -> float:
    """f(n)·S of one call as seen by one member (contribution to the W-average numerator).

    An all_to_all whose own chunk ``self_elems`` is known contributes the elements it sends,
    ``in_elems - self_elems``: summed over the members that is what they all receive, so the
    W-average stays total link traffic / W; an uneven all_to_all (no single ``count``,
    :func:`tracer.events.all_to_all_count`) has no other f(n)·S. Even, it is (n-1)·count,
    the formula's value."""
    if op == "all_to_all" and in_elems is not None and self_elems is not None:
        return float(in_elems - self_elems)
    return avg_recv_factor(op, group_size) * array_elems(op, count, group_size)


@dataclass(frozen=True)
class ClosedForm:
    """A mode's dedicated-param traffic per step as a multiple of P_M, by phase.

    ``text`` is the formula as printed in reports; ``phases`` maps phase -> factor of P_M.
    ``seed_phases`` is the seed document's reading where it differs (HSDP replicate terms).
    ``reuse_phases`` maps phase -> factor of P_M^r, the elements moved again because their
    unit runs more than once per forward (weight sharing: ``verify.traffic.predict.
    reused_elems``; 0 without reuse, so the forms above are unchanged), ``reuse_text`` is
    that term as printed. ``kept_phases`` maps phase -> factor of P_M^L, the elements of the
    unit DMuon's Z3 keeps allocated from its forward into the backward, which it does not
    re-broadcast (``docs/protocol.md`` steps 2-3; ``verify.traffic.predict.
    kept_elems``), ``kept_text`` is that term as printed.
    """

    text: str
    phases: dict[str, float]
    seed_phases: dict[str, float] | None = None
    reuse_phases: dict[str, float] | None = None
    reuse_text: str = ""
    kept_phases: dict[str, float] | None = None
    kept_text: str = ""

    def at(self, phase: str, p_m: float, p_m_reused: float = 0, p_m_kept: float = 0) -> float:
        """The form's elements in ``phase`` at P_M = ``p_m``, P_M^r = ``p_m_reused`` and
        P_M^L = ``p_m_kept``."""
        reuse = (self.reuse_phases or {}).get(phase, 0.0)
        kept = (self.kept_phases or {}).get(phase, 0.0)
        return self.phases.get(phase, 0.0) * p_m + reuse * p_m_reused + kept * p_m_kept

    def total_at(self, p_m: float, p_m_reused: float = 0, p_m_kept: float = 0) -> float:
        """The form's elements over all phases (:meth:`at`)."""
        phases = {*self.phases, *(self.reuse_phases or {}), *(self.kept_phases or {})}
        return sum(self.at(ph, p_m, p_m_reused, p_m_kept) for ph in phases)

    def terms_text(self, p_m_reused: float = 0, p_m_kept: float = 0) -> str:
        """The P_M^r and P_M^L terms as printed after :attr:`text`, those that are not 0."""
        return (self.reuse_text if p_m_reused else "") + (self.kept_text if p_m_kept else "")

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    @property
    def seed_total(self) -> float | None:
        return None if self.seed_phases is None else sum(self.seed_phases.values())


#: DMuon's HSDP modes and the 1-D mode each moves its dedicated params as when flat
#: (``dedicate_params(hierarchy=...)``; docs/traffic-model.md, "HSDP: flat or hierarchical").
FLAT_MODES = {"dmuon-hsdp-z2": "dmuon-z2", "dmuon-hsdp-z3": "dmuon-z3"}


def closed_form(mode: str, shard_size: int, replicate_size: int = 1, *, flat: bool = False) -> ClosedForm:
    """The closed form of ``mode`` (docs/spec.md §2) at N = shard_size, R = replicate_size.

    Modes: ddp-muon, zero1-muon, dmuon-ddp, naive-fsdp2-z2, naive-fsdp2-z3, dmuon-z2, dmuon-z3,
    naive-hsdp, dmuon-hsdp-z2, dmuon-hsdp-z3.

    HSDP: the replicate-axis reduce and broadcast of each matrix run over one replicate group
    of R ranks, so each costs (R-1)/(N·R)·P_M per rank on the W-average (the correction of
    docs/spec.md §2); the seed prices them at (R-1)/R·P_M each (``seed_phases``).

    ``flat`` (a DMuon HSDP mode whose run moved its dedicated params flat,
    ``verify.traffic.predict.dmuon_hierarchy``): the 1-D form of :data:`FLAT_MODES` at
    N = W = shard_size·replicate_size, printed with W (docs/traffic-model.md, "HSDP: flat or
    hierarchical"): Z2 2(W-1)/W, HSDP-Z2's total with no replicate phase; Z3
    3(W-1)/W − (W-1)/W·P_M^L, HSDP-Z3's total when P_M^L = P_M. No seed reading (it is about
    the replicate terms).

    Raises:
        ValueError: unknown mode, non-positive sizes, or ``flat`` with a mode outside
            :data:`FLAT_MODES`.
    """
    n, r = shard_size, replicate_size
    if n < 1 or r < 1:
        raise ValueError(f"Invalid shard_size={n}, replicate_size={r}. Must be >= 1.")
    if flat:
        if mode not in FLAT_MODES:
            raise ValueError(f"Invalid flat=True with mode={mode!r}. Must be one of {sorted(FLAT_MODES)} "
                             "(only DMuon's HSDP modes move flat or hierarchical).")
        return _over_world(closed_form(FLAT_MODES[mode], n * r))
    a = (n - 1) / n
    rep = (r - 1) / (n * r)
    seed_rep = (r - 1) / r
    # Weight sharing (P_M^r, ClosedForm.reuse_phases): Z3 re-sends a reused unit in forward
    # (DMuon's broadcast, FSDP2's all_gather); FSDP2 also re-gathers it in backward, with or
    # without reshard_after_forward (verify.traffic.rules); Z2 DMuon and DDP never re-send.
    fwd_again = {"forward": a}
    bwd_again = {"backward": a}
    both_again = {"forward": a, "backward": a}
    once, twice = " + (N-1)/N·P_M^r", " + 2(N-1)/N·P_M^r"
    # DMuon's Z3 keeps the last unit (P_M^L) from its forward into the backward: no backward
    # re-broadcast of it (docs/protocol.md steps 2-3)
    kept = dict(kept_phases={"backward": -a}, kept_text=" − (N-1)/N·P_M^L")
    table: dict[str, ClosedForm] = {
        "ddp-muon": ClosedForm("2(N-1)/N", {"backward": 2 * a}),
        "dmuon-ddp": ClosedForm("2(N-1)/N", {"forward": a, "backward": a}),
        # ZeRO-1-style Muon: reduce_scatter + all_gather of owner-aligned buffers in the step.
        "zero1-muon": ClosedForm("2(N-1)/N", {"optimizer": 2 * a}),
        "naive-fsdp2-z2": ClosedForm("3(N-1)/N", {"forward": a, "backward": a, "optimizer": a},
                                     reuse_phases=bwd_again, reuse_text=once),
        "naive-fsdp2-z3": ClosedForm(
            "4(N-1)/N", {"forward": a, "backward": 2 * a, "optimizer": a},
            reuse_phases=both_again, reuse_text=twice,
        ),
        "dmuon-z2": ClosedForm("2(N-1)/N", {"forward": a, "backward": a}),
        "dmuon-z3": ClosedForm("3(N-1)/N", {"forward": a, "backward": 2 * a},
                               reuse_phases=fwd_again, reuse_text=once, **kept),
        # naive HSDP = FSDP2 HSDP (reshard) + full-grad gather: AG fwd + AG/RS bwd + the
        # replicate all_reduce of a 1/N shard + AG in the step.
        "naive-hsdp": ClosedForm(
            "4(N-1)/N + 2(R-1)/(N·R)",
            {"forward": a, "backward": 2 * a + 2 * rep, "optimizer": a},
            reuse_phases=both_again, reuse_text=twice,
        ),
        "dmuon-hsdp-z2": ClosedForm(
            "2(W-1)/W",
            {"forward": a, "backward": a + rep, "replicate": rep},
            {"forward": a, "backward": a + seed_rep, "replicate": seed_rep},
        ),
        "dmuon-hsdp-z3": ClosedForm(
            "2(W-1)/W + (N-1)/N",
            {"forward": a, "backward": 2 * a + rep, "replicate": rep},
            {"forward": a, "backward": 2 * a + seed_rep, "replicate": seed_rep},
            reuse_phases=fwd_again, reuse_text=once, **kept,
        ),
    }
    if mode not in table:
        raise ValueError(f"Invalid mode={mode!r}. Must be one of {sorted(table)}.")
    return table[mode]


def _over_world(form: ClosedForm) -> ClosedForm:
    """A 1-D form evaluated at N = W, its printed terms written with W (the group is the world)."""
    def world(text: str) -> str:
        return text.replace("N", "W")
    return dataclasses.replace(form, text=world(form.text), reuse_text=world(form.reuse_text),
                               kept_text=world(form.kept_text))


#: Modes whose Muon params are FSDP2-sharded on dim 0 (the naive baselines): their traffic
#: follows the padded sizes, so their closed form is evaluated at P_M^pad (docs/traffic-model.md).
#: DMuon modes move whole matrices and never pad; DDP does not shard.
PADDED_MODES = frozenset({"naive-fsdp2-z2", "naive-fsdp2-z3", "naive-hsdp", "zero1-muon"})


def owner_aligned_p_m(owner_numels: list[int]) -> int:
    """P_M^pad of ZeRO-1-style Muon: W·C, C = the largest owner's total (``owner_numels[g]``
    is owner g's elements). Each rank's chunk of the owner-aligned flat buffer holds whole
    matrices and is padded to C, so both collectives move W·C elements in all."""
    return len(owner_numels) * max(owner_numels)


def padded_numel(shape: tuple[int, ...], shard_size: int) -> int:
    """Elements of a param with dim 0 padded up to a multiple of N = ``shard_size``:
    N·ceil(d0/N)·(d1·…) (FSDP2's ``Shard(0)`` padding; 1 for a 0-d param).

    Raises:
        ValueError: ``shard_size`` < 1.
    """
    if shard_size < 1:
        raise ValueError(f"Invalid {shard_size=}. Must be >= 1.")
    if not shape:
        return 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // shard_size) * shard_size * rest


def closed_form_p_m(mode: str, shapes: list[tuple[int, ...]], shard_size: int,
                    owner_numels: list[int] | None = None) -> int:
    """The P_M a mode's closed form is evaluated at: the Muon params' elements, padded to a
    multiple of N on dim 0 for the FSDP2-sharded :data:`PADDED_MODES` (P_M^pad), to W·C for
    ``zero1-muon`` (:func:`owner_aligned_p_m`, needs ``owner_numels``), as they are otherwise.

    Raises:
        ValueError: ``zero1-muon`` without ``owner_numels``.
    """
    if mode == "zero1-muon":
        if not owner_numels:
            raise ValueError("Invalid owner_numels=None for zero1-muon. Must list each owner's elements.")
        return owner_aligned_p_m(owner_numels)
    if mode in PADDED_MODES:
        return sum(padded_numel(s, shard_size) for s in shapes)
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        total += n
    return total


#: Every mode the harness knows, in report order.
MODES = (
    "ddp-muon",
    "zero1-muon",
    "dmuon-ddp",
    "naive-fsdp2-z2",
    "naive-fsdp2-z3",
    "dmuon-z2",
    "dmuon-z3",
    "naive-hsdp",
    "dmuon-hsdp-z2",
    "dmuon-hsdp-z3",
)
