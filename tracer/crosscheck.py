"""Cross-check a trace source against the reference (the interposer), call by call.

For every ``(rank, group_id)`` the other source's sequence of calls must equal the reference's,
one to one and in order, in op, size and dtype (and root where both know it). Sizes compare as
``count`` where both sides know it, else as ``msg_bytes`` (nsys has bytes but no dtype/count).
A ``barrier`` compares by op only: its payload, if any, is a backend detail (gloo records none;
ProcessGroupNCCL all-reduces one float32 element, which an NCCL log shows as an AllReduce: the
NCCL-log source compares against :func:`tracer.nccl.expect.expected_nccl_log` for that).

An all_to_all compares by its totals ``(in_elems, out_elems)`` where both sides know them
(:func:`tracer.events.all_to_all_elems`: a source that records only the per-peer count, an
NCCL log, has ``group_size * count`` each), and by ``count`` too where both know it: an uneven
all_to_all has no count (:func:`tracer.events.all_to_all_count`), so its totals are its size.

Sources without sizes. Where the *other* source has no size for a call (``count`` and
``msg_bytes`` both ``None``: an nsys report whose payload blobs are not decoded, see
:mod:`tracer.nsys.payload`), the pair is compared by op only, plus dtype and root where both
sides know them. Such pairs are counted in :attr:`SourceCheck.size_unknown` (matched or not)
and named in a note; they do not fail the check by themselves, so the call *sequence* is still
verified: a reference call missing in the other source, an extra call and an op that differs
fail as always. A size known on both sides that differs fails, and so does a size the other
source knows but the reference does not (``... unknown in reference``).

Where a backend *records* a call differently from how it was issued, a :class:`SourceProfile`
says so; nothing else is forgiven. The only one measured here (torch 2.13.0 CPU build, gloo,
``tests/distributed/phase_d/test_flight_recorder_gloo.py``) is :data:`FLIGHT_RECORDER_GLOO`:

- ``reduce_scatter_tensor`` is recorded as ``gloo:all_reduce`` of the full input:
  reference ``reduce_scatter(count=c)`` == FR ``all_reduce(count=group_size * c)``;
- send / recv (also inside ``batch_isend_irecv``) are not recorded at all: skipped, and counted
  in :attr:`SourceCheck.skipped`.

Measured on the same run and *not* different (no equivalence needed): ``all_gather_into_tensor``
and list ``all_gather`` (FR input = per-rank count), ``all_to_all_single`` (FR input and output
= this rank's totals, even or uneven; the parser derives the count by the common rule), ``barrier`` (``gloo:barrier``), ``ReduceOp.AVG``,
``all_reduce_coalesced`` (one entry with one size per tensor; the parser emits one event per
tensor, like the interposer).

Sequence alignment. The reference sees exactly one measurement window; another source may see
more (FR keeps the whole process lifetime). ``align`` says which of the other's calls form the
window, per ``(rank, group_id)``, after dropping the reference's unobservable ops:

- ``"exact"``: the other source covers exactly the window (FR:
  :func:`tracer.fr.parse.fr_window` of dumps taken at the window's start and end; nsys:
  a capture range equal to the window).
  Everything it holds is compared; extra calls fail.
- ``"tail"``: the other source ends where the window ends (one dump right after the window):
  its last ``len(reference)`` calls are the window; earlier ones are counted in
  ``outside_window``, not compared.
- a mapping ``{(rank, group_id): first_seq}``: the window starts at the other source's event
  with ``seq >= first_seq`` (e.g. FR's seq recorded when the window opened) and spans
  ``len(reference)`` calls.

Calls outside the window are counted in ``outside_window`` and named in a note, never compared:
a call the other source lost there does not fail this check. ``make verify-traffic`` checks
each step a source recorded outside the window against the prediction
(``verify/sources/steps.py``); a caller of ``"tail"`` or a seq mapping has to do the same.

Within a key, events are compared in the order given: every source emits its calls in issue
order (one FR dump per rank, in ``record_id`` order). They are deliberately not re-sorted by
``seq``: two process groups over the same ranks share a ``group_id`` but FR numbers each on its
own counter (the seq-mapping ``align`` assumes one process group per ``group_id``; use
:func:`tracer.fr.parse.fr_window` with ``"exact"`` otherwise).

Calls are paired with :class:`difflib.SequenceMatcher` on (op, size), or on op alone for a
``(rank, group_id)`` where the other source lacks some size, so a missing or extra call is
reported as such instead of shifting every later pair; then each pair is compared field by
field (size, dtype, root).
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tracer.events import OPS, SOURCES, CollectiveEvent, all_to_all_elems

Key = tuple  # (rank, group_id)


@dataclass(frozen=True, kw_only=True)
class Equivalence:
    """A call that a backend records as a different op / size than it was issued.

    The reference event ``reference_op(count=c)`` is expected in the other source as
    ``other_op(count=c * scale)`` where ``scale`` is 1 or the group size
    (``count_scale="group_size"``); ``msg_bytes`` scales the same way.
    """

    reference_op: str
    other_op: str
    count_scale: str = "1"
    measured_on: str
    note: str

    def __post_init__(self) -> None:
        for name in ("reference_op", "other_op"):
            if getattr(self, name) not in OPS:
                raise ValueError(f"Invalid Equivalence {name}={getattr(self, name)!r}. "
                                 f"Must be one of {OPS}.")
        if self.count_scale not in ("1", "group_size"):
            raise ValueError(f"Invalid Equivalence count_scale={self.count_scale!r}. "
                             "Must be '1' or 'group_size'.")


@dataclass(frozen=True, kw_only=True)
class SourceProfile:
    """What one source on one backend records differently from the reference."""

    source: str
    backend: str | None = None
    equivalences: tuple[Equivalence, ...] = ()
    unobserved_ops: frozenset[str] = frozenset()
    note: str = ""

    def equivalence_for(self, op: str) -> Equivalence | None:
        """The equivalence whose ``reference_op`` is ``op``, if any."""
        return next((e for e in self.equivalences if e.reference_op == op), None)


#: Flight Recorder on gloo, measured on torch 2.13.0 CPU build (4 ranks, world + subgroup).
FLIGHT_RECORDER_GLOO = SourceProfile(
    source="flight_recorder",
    backend="gloo",
    equivalences=(
        Equivalence(
            reference_op="reduce_scatter",
            other_op="all_reduce",
            count_scale="group_size",
            measured_on="torch 2.13.0+cpu, gloo",
            note="ProcessGroupGloo runs reduce_scatter_tensor as an all_reduce of the full "
                 "input and FR records it as gloo:all_reduce with input_sizes = n x count",
        ),
    ),
    unobserved_ops=frozenset({"send", "recv"}),
    note="gloo send/recv/batch_isend_irecv leave no FR entry (torch 2.13.0+cpu)",
)

#: Profiles by (source, backend); a pair not listed compares without any equivalence.
PROFILES: dict[tuple[str, str | None], SourceProfile] = {
    ("flight_recorder", "gloo"): FLIGHT_RECORDER_GLOO,
}


def profile_for(source: str, backend: str | None) -> SourceProfile:
    """The registered profile of ``source`` on ``backend``, else one with no equivalences."""
    return PROFILES.get((source, backend)) or SourceProfile(source=source, backend=backend)


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: a pair that differs, a call missing in the other source, or an extra
    one (``reference`` or ``other`` is ``None``)."""

    rank: int | None
    group_id: str | None
    seq: int | None
    other_seq: int | None
    reference: str | None
    other: str | None
    reason: str

    def __str__(self) -> str:
        where = f"rank {self.rank} group {self.group_id}"
        if self.seq is not None:
            where += f" seq {self.seq}"
        if self.other_seq is not None and self.other_seq != self.seq:
            where += f" (other seq {self.other_seq})"
        return (f"{where}: {self.reason}: reference {self.reference or '-'} "
                f"vs other {self.other or '-'}")


@dataclass
class SourceCheck:
    """Result of :func:`crosscheck` for one source.

    Attributes:
        source: the other source's name.
        events: the other source's events inside the window (compared).
        matched: pairs that agree.
        unmatched: disagreeing pairs + reference calls missing in the other + extra calls.
        passed: ``unmatched == 0`` and at least one call was compared.
        mismatches: every disagreement, human readable via ``str()``.
        skipped: reference calls of ops the source cannot record on this backend.
        outside_window: other-source events before/after the window, not compared.
        size_unknown: compared pairs (in ``matched`` or ``unmatched``) whose size could not be
            compared because the other source has none for the call (module docstring).
        notes: what the reader should know about how the comparison was made.
    """

    source: str
    events: int = 0
    matched: int = 0
    unmatched: int = 0
    passed: bool = False
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: int = 0
    outside_window: int = 0
    size_unknown: int = 0
    notes: list[str] = field(default_factory=list)

    def as_report(self) -> dict:
        """The ``report.json`` ``sources[source]`` entry:
        ``{events, matched, unmatched, pass, size_unknown}``."""
        return {"events": self.events, "matched": self.matched, "unmatched": self.unmatched,
                "pass": self.passed, "size_unknown": self.size_unknown}

    def lines(self) -> list[str]:
        """Summary line, notes, then one line per mismatch."""
        head = (f"{self.source}: {'PASS' if self.passed else 'FAIL'} events={self.events} "
                f"matched={self.matched} unmatched={self.unmatched} skipped={self.skipped} "
                f"outside_window={self.outside_window} size_unknown={self.size_unknown}")
        return [head] + [f"  note: {n}" for n in self.notes] + [f"  {m}" for m in self.mismatches]


@dataclass(frozen=True)
class _Expected:
    """A reference event as the other source should record it."""

    event: CollectiveEvent
    op: str
    count: int | None
    msg_bytes: int | None
    error: str | None = None

    @property
    def elems(self) -> tuple[int, int] | None:
        """``(in_elems, out_elems)`` where this is an all_to_all that has them."""
        return _elems(self.op, self.count, self.event.group_size, self.event.in_elems,
                      self.event.out_elems) if self.op == self.event.op else None


def _elems(op, count, group_size, in_elems, out_elems) -> tuple[int, int] | None:
    pair = all_to_all_elems(op, count, group_size, in_elems, out_elems)
    return None if None in pair else pair


def _event_elems(ev: CollectiveEvent) -> tuple[int, int] | None:
    return _elems(ev.op, ev.count, ev.group_size, ev.in_elems, ev.out_elems)


def _describe(op: str, count, msg_bytes, dtype, root, elems=None) -> str:
    parts = [op]
    if count is not None:
        parts.append(f"count={count}")
    if elems is not None:
        parts.append(f"in_elems={elems[0]} out_elems={elems[1]}")
    if dtype is not None:
        parts.append(dtype)
    if msg_bytes is not None:
        parts.append(f"msg_bytes={msg_bytes}")
    if root is not None:
        parts.append(f"root={root}")
    return " ".join(parts)


def _describe_event(ev: CollectiveEvent) -> str:
    elems = (ev.in_elems, ev.out_elems) if ev.in_elems is not None or ev.out_elems is not None else None
    return _describe(ev.op, ev.count, ev.msg_bytes, ev.dtype, ev.root, elems)


def _describe_expected(x: _Expected) -> str:
    text = _describe_event(x.event)
    if (x.op, x.count) != (x.event.op, x.event.count):
        text += f" [recorded as {_describe(x.op, x.count, x.msg_bytes, None, None)}]"
    return text


def _expect(ev: CollectiveEvent, profile: SourceProfile) -> _Expected:
    eq = profile.equivalence_for(ev.op)
    if eq is None:
        return _Expected(ev, ev.op, ev.count, ev.msg_bytes)
    if eq.count_scale == "1":
        return _Expected(ev, eq.other_op, ev.count, ev.msg_bytes)
    if ev.group_size is None:
        return _Expected(ev, eq.other_op, None, None,
                         error=f"group_size unknown, cannot apply equivalence ({eq.note})")
    n = ev.group_size
    return _Expected(ev, eq.other_op,
                     None if ev.count is None else ev.count * n,
                     None if ev.msg_bytes is None else ev.msg_bytes * n)


def _group(events: Iterable[CollectiveEvent]) -> dict[Key, list[CollectiveEvent]]:
    by_key: dict[Key, list[CollectiveEvent]] = defaultdict(list)
    for ev in events:
        by_key[(ev.rank, ev.group_id)].append(ev)
    return by_key


def _window(others: list[CollectiveEvent], n_ref: int, align, key: Key,
            has_ref: bool) -> tuple[list[CollectiveEvent], int]:
    if align == "exact":
        return others, 0
    if align == "tail":
        window = others[len(others) - n_ref:] if n_ref else []
        return window, len(others) - len(window)
    if key not in align:
        if has_ref:
            raise ValueError(f"Invalid align: no first seq for (rank, group_id)={key}. Must map "
                             "every (rank, group_id) of the reference to the other's first seq.")
        return [], len(others)
    start = next((i for i, e in enumerate(others) if e.seq is not None and e.seq >= align[key]),
                 len(others))
    window = others[start:start + n_ref]
    return window, len(others) - len(window)


def _size_field(expected: Sequence[_Expected], others: Sequence[CollectiveEvent]) -> str:
    """``count`` where every call sized by it has one on both sides, else ``msg_bytes``;
    all_to_alls with totals are sized by them instead (:func:`_differences`)."""
    sized = [x for x in expected if x.op != "barrier" and x.elems is None]
    sized_o = [e for e in others if e.op != "barrier" and _event_elems(e) is None]
    if all(x.count is not None for x in sized) and all(e.count is not None for e in sized_o):
        return "count"
    return "msg_bytes"


def _sizeless(ev: CollectiveEvent) -> bool:
    """The other source has no size for this call (a barrier needs none)."""
    return (ev.op != "barrier" and ev.count is None and ev.msg_bytes is None
            and _event_elems(ev) is None)


def _differences(x: _Expected, ev: CollectiveEvent, size_field: str) -> list[str]:
    if x.error:
        return [x.error]
    diffs = []
    if x.op != ev.op:
        diffs.append("op differs")
    if x.op == "barrier" or ev.op == "barrier":
        return diffs
    mine, theirs = getattr(x, size_field), getattr(ev, size_field)
    if x.elems is not None and _event_elems(ev) is not None:  # all_to_all: its totals
        if x.elems[0] != _event_elems(ev)[0]:
            diffs.append("in_elems differs")
        if x.elems[1] != _event_elems(ev)[1]:
            diffs.append("out_elems differs")
        if x.count is not None and ev.count is not None and x.count != ev.count:
            diffs.append("count differs")
    elif _sizeless(ev):
        pass  # compared by op (dtype, root) only; counted in SourceCheck.size_unknown
    elif mine is None:
        diffs.append(f"{size_field} unknown in reference")
    elif theirs is None:  # other has a count but no msg_bytes (dtype unknown to it)
        diffs.append(f"{size_field} unknown in other")
    elif mine != theirs:
        diffs.append(f"{size_field} differs")
    if x.event.dtype is not None and ev.dtype is not None and x.event.dtype != ev.dtype:
        diffs.append("dtype differs")
    if x.event.root is not None and ev.root is not None and x.event.root != ev.root:
        diffs.append("root differs")
    return diffs


def _compare_key(key: Key, expected: list[_Expected], others: list[CollectiveEvent],
                 result: SourceCheck, source: str) -> None:
    rank, group_id = key
    size_field = _size_field(expected, others)
    by_op = any(_sizeless(e) for e in others)  # pair on op alone: sizes cannot all be matched

    def sig_x(x: _Expected):
        if by_op or x.op == "barrier":
            return (x.op, None)
        return (x.op, x.elems if x.elems is not None else getattr(x, size_field))

    def sig_o(e: CollectiveEvent):
        if by_op or e.op == "barrier":
            return (e.op, None)
        return (e.op, _event_elems(e) if _event_elems(e) is not None else getattr(e, size_field))

    def missing(x: _Expected) -> None:
        result.mismatches.append(Mismatch(rank, group_id, x.event.seq, None,
                                          _describe_expected(x), None, f"missing in {source}"))

    def extra(e: CollectiveEvent) -> None:
        result.mismatches.append(Mismatch(rank, group_id, None, e.seq, None,
                                          f"{_describe_event(e)} ({e.source_ref})",
                                          f"extra in {source}"))

    matcher = difflib.SequenceMatcher(a=[sig_x(x) for x in expected],
                                      b=[sig_o(e) for e in others], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        pairs = list(zip(expected[i1:i2], others[j1:j2]))
        for x, e in pairs:
            diffs = _differences(x, e, size_field)
            if x.op != "barrier" and _sizeless(e):
                result.size_unknown += 1
            if diffs:
                result.unmatched += 1
                result.mismatches.append(Mismatch(
                    rank, group_id, x.event.seq, e.seq, _describe_expected(x),
                    f"{_describe_event(e)} ({e.source_ref})", ", ".join(diffs)))
            else:
                result.matched += 1
        for x in expected[i1 + len(pairs):i2]:
            result.unmatched += 1
            missing(x)
        for e in others[j1 + len(pairs):j2]:
            result.unmatched += 1
            extra(e)


def crosscheck(
    reference: Sequence[CollectiveEvent],
    other: Sequence[CollectiveEvent],
    *,
    source: str,
    backend: str | None = None,
    profile: SourceProfile | None = None,
    align: str | Mapping[Key, int] = "exact",
) -> SourceCheck:
    """Compare ``other`` (events of ``source``) one to one against ``reference``.

    Args:
        reference: the reference events (normally the interposer's) of one window.
        other: the other source's events; every one must have ``source == source``.
        source: the other source's name (one of :data:`tracer.events.SOURCES`).
        backend: ``"gloo"`` / ``"nccl"``; selects the profile from :data:`PROFILES`.
        profile: explicit profile (overrides ``backend``).
        align: ``"exact"``, ``"tail"`` or ``{(rank, group_id): first_seq}`` (module docstring).

    Returns:
        A :class:`SourceCheck`; ``as_report()`` gives
        ``{events, matched, unmatched, pass, size_unknown}``.

    Raises:
        ValueError: unknown ``source`` or ``align``, or an ``other`` event of another source.
    """
    if source not in SOURCES:
        raise ValueError(f"Invalid {source=}. Must be one of {SOURCES}.")
    if not (align in ("exact", "tail") or isinstance(align, Mapping)):
        raise ValueError(f"Invalid {align=}. Must be 'exact', 'tail' or a mapping "
                         "{(rank, group_id): first_seq}.")
    wrong = [e for e in other if e.source != source]
    if wrong:
        raise ValueError(f"Invalid other event source={wrong[0].source!r} "
                         f"({wrong[0].source_ref}). Must be {source!r} for every event.")
    profile = profile or profile_for(source, backend)
    result = SourceCheck(source=source)
    if profile.equivalences or profile.unobserved_ops:
        result.notes.append(f"profile {profile.source}/{profile.backend}: " + "; ".join(
            [f"{e.reference_op} as {e.other_op} ({e.measured_on})" for e in profile.equivalences]
            + ([f"not recorded: {sorted(profile.unobserved_ops)}"]
               if profile.unobserved_ops else [])))
    observed = [e for e in reference if e.op not in profile.unobserved_ops]
    result.skipped = len(reference) - len(observed)
    ref_by_key, other_by_key = _group(observed), _group(other)
    for key in sorted(set(ref_by_key) | set(other_by_key), key=repr):
        expected = [_expect(e, profile) for e in ref_by_key.get(key, [])]
        window, outside = _window(other_by_key.get(key, []), len(expected), align, key,
                                  key in ref_by_key)
        result.events += len(window)
        result.outside_window += outside
        _compare_key(key, expected, window, result, source)
    compared = result.matched + result.unmatched
    if result.outside_window:
        result.notes.append(f"{result.outside_window} {source} event(s) outside the window not "
                            "compared: a call lost there does not fail this check (check those "
                            "steps' completeness separately)")
    if result.size_unknown:
        result.notes.append(f"{result.size_unknown} of {compared} pairs compared by op only "
                            f"(dtype / root where both know them): {source} has no size for "
                            "them, so their sizes are not verified")
    if compared == 0:
        result.notes.append("nothing compared: no observable reference call and no "
                            f"{source} event in the window")
    result.passed = result.unmatched == 0 and compared > 0
    return result
