"""The canonical collective record shared by every trace source.

Glossary (one size convention everywhere, NCCL's):

- ``count``: elements **per rank** as NCCL's ``ncclXxx(count=...)`` argument: the message
  for all_reduce / broadcast / reduce, the *send* count of all_gather, the *receive* count of
  reduce_scatter, the per-peer count of all_to_all, the message of send / recv, the *send*
  count of each rank of gather and the *receive* count of each rank of scatter (NCCL 2.28+
  ``ncclGather`` / ``ncclScatter``, ``docs/api/colls.rst``: the root receives / sends
  ``nranks * count``).
- ``in_elems`` / ``out_elems``: all_to_all only: the elements of this rank's whole input and
  output tensor (every peer's chunk, its own included); ``None`` for every other op and where
  a source cannot know them. An all_to_all's ``count`` follows from them by one rule that
  every source applies (:func:`all_to_all_count`): ``in_elems // group_size`` when
  ``in_elems == out_elems`` and ``group_size`` divides it (the even case: the per-peer
  count), else ``None`` (an uneven all_to_all has no single NCCL count; gloo only).
- ``msg_bytes``: ``count * dtype_bytes`` (what NCCL's nsys payload calls "Message size [bytes]");
  ``None`` when ``count`` is (an uneven all_to_all).
- ``group_id``: an identity of the communicator that is equal on every member (for torch
  process groups: the sorted world ranks joined by commas, e.g. ``"0,1,2,3"``; for NCCL logs:
  the commId, or parent+color for split comms).
- ``group_rank``: this rank's index inside the group; ``root`` is the root's (or, for
  send / recv, the peer's) group rank.
- ``seq``: 0-based index of the call among this rank's calls on this group.
- ``t_wait_start_ns`` / ``t_waited_ns``: for an *asynchronous* call whose work handle the
  training thread waited on, when that ``wait()`` was called and when it returned (the
  interposer's clock; ``None`` for synchronous calls, handles never waited on, and every
  other source). ``[t_start_ns, t_waited_ns]`` is the call's in-flight interval as the
  training thread sees it; ``[t_wait_start_ns, t_waited_ns]`` the time it blocked on it.

Derived quantities (the nccl-tests array size S, bus factors) live in one table in
``verify/traffic/formulas.py``; this module only stores what a source observed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

#: Canonical op names (snake case, torch.distributed's vocabulary).
OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "barrier",
    "gather",
    "scatter",
)

#: Size in bytes of each dtype, by torch's dtype name (``str(torch.float32)[6:]``).
DTYPE_BYTES: dict[str, int] = {
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: Trace sources known to the harness.
SOURCES: tuple[str, ...] = ("interposer", "flight_recorder", "nccl_log", "nsys", "profiler")


#: Integer fields and their width in :data:`EVENT_SCHEMA` (bits, signed).
_INT_BITS: dict[str, int] = {
    "rank": 32, "group_size": 32, "group_rank": 32, "seq": 64, "count": 64, "dtype_bytes": 32,
    "msg_bytes": 64, "root": 32, "t_start_ns": 64, "t_end_ns": 64, "pid": 64, "cuda_dev": 32, "t_wait_start_ns": 64,
    "t_waited_ns": 64, "in_elems": 64, "out_elems": 64,
}

#: Optional string fields (``source``, ``op`` are checked against their vocabularies).
_STR_FIELDS = ("group_id", "dtype", "phase", "module", "source_ref", "host", "comm")
#: Ops whose ``root`` is a group rank: the root, or the peer of send / recv.
ROOTED_OPS: frozenset[str] = frozenset({"broadcast", "reduce", "gather", "scatter", "send", "recv"})


def impossible_reason(op: str, group_size: int | None, root: int | None,
                      group_rank: int | None = None) -> str | None:
    """Why a call with these values cannot have happened, or ``None``: a group of 0 ranks,
    or a root / peer (``op`` in :data:`ROOTED_OPS`) or a ``group_rank`` outside
    ``[0, group_size)``. Unknown values (``None``) are not judged. The parsers report such a
    record as an issue, not an event, where the record itself states the group size (an NCCL
    COLL line's ``[nranks=N]``, a Flight Recorder entry's process group)."""
    if group_size is not None and group_size < 1:
        return f"group size {group_size}: a communicator has at least 1 rank"
    if op in ROOTED_OPS and root is not None and (root < 0 or (group_size and root >= group_size)):
        what = "peer" if op in ("send", "recv") else "root"
        return f"{op} {what} {root} outside the group's ranks 0..{(group_size or 1) - 1}"
    if group_rank is not None and (group_rank < 0 or (group_size and group_rank >= group_size)):
        return f"group rank {group_rank} outside the group's ranks 0..{(group_size or 1) - 1}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveEvent:
    """One collective (or point-to-point) call as seen by one rank through one source.

    Fields that a source cannot know are ``None`` (for example an nsys range has
    ``msg_bytes`` but no dtype). ``msg_bytes`` is filled from ``count * dtype_bytes`` when
    omitted. ``in_elems`` / ``out_elems`` belong to all_to_all only; where they and
    ``group_size`` are known, ``count`` must be :func:`all_to_all_count` of them.

    Raises:
        ValueError: ``op`` is not one of :data:`OPS`, ``source`` not one of :data:`SOURCES`,
            an integer field is not an int or does not fit its :data:`EVENT_SCHEMA` column
            (int32 / int64), a string field is not a str, a size is negative, ``msg_bytes`` disagrees with
            ``count * dtype_bytes``, ``in_elems`` / ``out_elems`` are set on another op than
            all_to_all or disagree with ``count`` (:func:`all_to_all_count`), or the wait times are out of order (``t_end_ns <=
            t_wait_start_ns <= t_waited_ns``, or ``t_wait_start_ns`` without ``t_waited_ns``).
    """

    source: str
    op: str
    rank: int | None = None
    group_id: str | None = None
    group_size: int | None = None
    group_rank: int | None = None
    seq: int | None = None
    count: int | None = None
    dtype: str | None = None
    dtype_bytes: int | None = None
    msg_bytes: int | None = None
    root: int | None = None
    phase: str | None = None
    module: str | None = None
    t_start_ns: int | None = None
    t_end_ns: int | None = None
    source_ref: str = ""
    pid: int | None = None
    host: str | None = None
    cuda_dev: int | None = None
    comm: str | None = None
    t_wait_start_ns: int | None = None
    t_waited_ns: int | None = None
    in_elems: int | None = None
    out_elems: int | None = None

    def __post_init__(self) -> None:
        for name, bits in _INT_BITS.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)
                                      or not -(1 << (bits - 1)) <= value < 1 << (bits - 1)):
                raise ValueError(f"Invalid CollectiveEvent {name}={value!r}. Must be an int "
                                 f"that fits int{bits} ({self.source_ref}).")
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"Invalid CollectiveEvent {name}={value!r}. Must be a str or "
                                 f"None ({self.source_ref!r}).")
        self._check_wait_times()
        if self.op not in OPS:
            raise ValueError(f"Invalid CollectiveEvent op={self.op!r}. Must be one of {OPS}.")
        if self.source not in SOURCES:
            raise ValueError(
                f"Invalid CollectiveEvent source={self.source!r}. Must be one of {SOURCES}."
            )
        if self.dtype is not None and self.dtype_bytes is None and self.dtype in DTYPE_BYTES:
            object.__setattr__(self, "dtype_bytes", DTYPE_BYTES[self.dtype])
        self._check_all_to_all()
        for name in ("count", "dtype_bytes", "msg_bytes", "group_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Invalid CollectiveEvent {name}={value}. Must be >= 0.")
        if self.count is not None and self.dtype_bytes is not None:
            expected = self.count * self.dtype_bytes
            if self.msg_bytes is None:
                object.__setattr__(self, "msg_bytes", expected)
                if expected >= 1 << 63:
                    raise ValueError(
                        f"Invalid CollectiveEvent count={self.count}. Must give msg_bytes = count "
                        f"* dtype_bytes that fits int64, not {expected} ({self.source_ref}).")
            elif self.msg_bytes != expected:
                raise ValueError(
                    f"Invalid CollectiveEvent msg_bytes={self.msg_bytes}. Must equal "
                    f"count * dtype_bytes = {self.count} * {self.dtype_bytes} = {expected} "
                    f"({self.source_ref})."
                )

    def _check_all_to_all(self) -> None:
        if self.in_elems is None and self.out_elems is None:
            return
        if self.op != "all_to_all":
            raise ValueError(f"Invalid CollectiveEvent in_elems={self.in_elems}, out_elems="
                             f"{self.out_elems} for op={self.op!r}. Must be None but for "
                             f"all_to_all ({self.source_ref}).")
        for name in ("in_elems", "out_elems"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"Invalid CollectiveEvent {name}={getattr(self, name)}. Must be "
                                 f">= 0 ({self.source_ref}).")
        if self.in_elems is None or self.out_elems is None or not self.group_size:
            return
        want = all_to_all_count(self.in_elems, self.out_elems, self.group_size)
        if self.count != want or (want is None and self.msg_bytes is not None):
            raise ValueError(
                f"Invalid CollectiveEvent count={self.count} for an all_to_all with in_elems="
                f"{self.in_elems}, out_elems={self.out_elems}, group_size={self.group_size}. Must "
                f"be {want} (tracer.events.all_to_all_count), msg_bytes None with it "
                f"({self.source_ref}).")

    def _check_wait_times(self) -> None:
        if self.t_wait_start_ns is None and self.t_waited_ns is None:
            return
        if self.t_waited_ns is None:
            raise ValueError(f"Invalid CollectiveEvent t_wait_start_ns={self.t_wait_start_ns} "
                             f"with t_waited_ns=None. Must give both or neither ({self.source_ref}).")
        times = [t for t in (self.t_end_ns, self.t_wait_start_ns, self.t_waited_ns) if t is not None]
        if times != sorted(times):
            raise ValueError(
                f"Invalid CollectiveEvent wait times t_end_ns={self.t_end_ns}, "
                f"t_wait_start_ns={self.t_wait_start_ns}, t_waited_ns={self.t_waited_ns}. Must "
                f"be in that order: a handle is waited on after its issue returns ({self.source_ref}).")

    @property
    def in_flight_ns(self) -> int | None:
        """``t_waited_ns - t_start_ns``: issue to wait return, for waited asynchronous calls."""
        if self.t_start_ns is None or self.t_waited_ns is None:
            return None
        return self.t_waited_ns - self.t_start_ns

    def replace(self, **changes) -> CollectiveEvent:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


#: Arrow schema of a table of :class:`CollectiveEvent` (one column per field, same order).
EVENT_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("rank", pa.int32()),
        pa.field("group_id", pa.string()),
        pa.field("group_size", pa.int32()),
        pa.field("group_rank", pa.int32()),
        pa.field("seq", pa.int64()),
        pa.field("count", pa.int64()),
        pa.field("dtype", pa.string()),
        pa.field("dtype_bytes", pa.int32()),
        pa.field("msg_bytes", pa.int64()),
        pa.field("root", pa.int32()),
        pa.field("phase", pa.string()),
        pa.field("module", pa.string()),
        pa.field("t_start_ns", pa.int64()),
        pa.field("t_end_ns", pa.int64()),
        pa.field("source_ref", pa.string(), nullable=False),
        pa.field("pid", pa.int64()),
        pa.field("host", pa.string()),
        pa.field("cuda_dev", pa.int32()),
        pa.field("comm", pa.string()),
        pa.field("t_wait_start_ns", pa.int64()),
        pa.field("t_waited_ns", pa.int64()),
        pa.field("in_elems", pa.int64()),
        pa.field("out_elems", pa.int64()),
    ]
)

#: Columns added after the first release: a file without them reads back with them all null.
LATER_COLUMNS = ("t_wait_start_ns", "t_waited_ns", "in_elems", "out_elems")

assert [f.name for f in EVENT_SCHEMA] == [f.name for f in dataclasses.fields(CollectiveEvent)]
assert _INT_BITS == {f.name: f.type.bit_width for f in EVENT_SCHEMA if pa.types.is_integer(f.type)}
assert set(_STR_FIELDS) == {f.name for f in EVENT_SCHEMA if f.type == pa.string()} - {"source", "op"}


def to_table(events: Iterable[CollectiveEvent]) -> pa.Table:
    """Events as an Arrow table with :data:`EVENT_SCHEMA`."""
    columns: dict[str, list] = {f.name: [] for f in EVENT_SCHEMA}
    for ev in events:
        for name, values in columns.items():
            values.append(getattr(ev, name))
    return pa.Table.from_pydict(columns, schema=EVENT_SCHEMA)


def write_parquet(events: Iterable[CollectiveEvent], path: str | Path) -> Path:
    """Write events to a Parquet file with :data:`EVENT_SCHEMA`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(to_table(events), path)
    return path


def _type_family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def read_parquet(path: str | Path) -> list[CollectiveEvent]:
    """Read events written by :func:`write_parquet`.

    Every column of :data:`EVENT_SCHEMA` but :data:`LATER_COLUMNS` (null when absent) must be there with an integer type where the schema
    has one and a string type where it has a string (an all-null column may have Arrow's null
    type); ``source``, ``op`` and ``source_ref`` must have no nulls.

    Raises:
        ValueError: the file is not Parquet, lacks a column, has a column of another type
            (e.g. a float ``count`` or a string ``rank``), a null in a required column, or a
            row that is not a valid :class:`CollectiveEvent`; the message names the file, the
            column and (for rows) the ``source_ref``.
    """
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"Invalid events file {str(path)!r}: not readable as Parquet ({exc}). "
                         "Must be written by tracer.events.write_parquet (dmuon-trace ... --out).") from None
    for name in LATER_COLUMNS:  # files written before these columns existed
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, pa.int64()))
    missing = [f.name for f in EVENT_SCHEMA if f.name not in table.column_names]
    if missing:
        raise ValueError(
            f"Invalid events file {str(path)!r}: missing columns {missing}. Must be written "
            "by tracer.events.write_parquet (dmuon-trace ... --out)."
        )
    for f in EVENT_SCHEMA:
        col = table.column(f.name)
        found, want = _type_family(col.type), _type_family(f.type)
        if found != want and found != "null":
            raise ValueError(f"Invalid events file {str(path)!r}: column {f.name!r} has type "
                             f"{col.type}. Must be {want} ({f.type}).")
        if not f.nullable and col.null_count:
            raise ValueError(f"Invalid events file {str(path)!r}: column {f.name!r} has "
                             f"{col.null_count} null(s). Must be set on every row.")
    rows = table.select([f.name for f in EVENT_SCHEMA]).to_pylist()
    try:
        return [CollectiveEvent(**row) for row in rows]
    except ValueError as exc:
        raise ValueError(f"Invalid events file {str(path)!r}: {exc}") from None


def all_to_all_count(in_elems: int | None, out_elems: int | None,
                     group_size: int | None) -> int | None:
    """An all_to_all's ``count`` from its totals (module docstring): ``in_elems // group_size``
    when ``in_elems == out_elems`` and ``group_size`` divides it, else ``None``; ``None`` too
    when any input is unknown (``group_size`` 0 or ``None``)."""
    if in_elems is None or out_elems is None or not group_size:
        return None
    if in_elems != out_elems or in_elems % group_size:
        return None
    return in_elems // group_size


def all_to_all_elems(op: str, count: int | None, group_size: int | None, in_elems: int | None,
                     out_elems: int | None) -> tuple[int | None, int | None]:
    """``(in_elems, out_elems)`` of a call as comparison keys use them: as given for an
    all_to_all that has them; ``group_size * count`` each for one that has only a count (a
    source that records no totals, e.g. an NCCL log: by :func:`all_to_all_count` a count
    implies ``in_elems == out_elems == group_size * count``); ``(None, None)`` for other ops."""
    if op != "all_to_all":
        return None, None
    if in_elems is None and out_elems is None and count is not None and group_size:
        return group_size * count, group_size * count
    return in_elems, out_elems


def group_id_from_ranks(ranks: Sequence[int]) -> str:
    """The group identity used for torch process groups: sorted world ranks, comma-joined."""
    return ",".join(str(r) for r in sorted(ranks))
