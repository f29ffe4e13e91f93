"""PyTorch Flight Recorder (FR): parse dumps into :class:`CollectiveEvent`.

Enabling and dumping: :mod:`tracer.fr.dump`; loading a file safely: :mod:`tracer.fr.load`
(both re-exported here).

FR is a ring buffer in c10d's C++ layer that records every collective a process group issues
(gloo and NCCL). On torch 2.13 (measured on the CPU build, gloo) a dump is a dict::

    {"version": "2.10", "pg_config": {...}, "pg_status": {...}, "comm_lib_version": "",
     "entries": [{"record_id", "pg_id", "process_group": [name, desc], "collective_seq_id",
                  "p2p_seq_id", "op_id", "profiling_name": "gloo:all_reduce",
                  "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
                  "state", "is_p2p", "retired", "time_created_ns", "frames"?, ...}]}

returned as JSON bytes by ``torch._C._distributed_c10d._dump_fr_trace_json()`` or pickle bytes
by ``_dump_fr_trace()``. Facts measured on torch 2.13 gloo (4 ranks, every collective on the
world and on a subgroup; see ``tests/distributed/phase_d/test_flight_recorder_gloo.py``):

- Recording is on by default; ``TORCH_FR_BUFFER_SIZE=0`` turns it off. The size is read once
  per process, when the recorder is first touched (first process group or first dump), so it
  must be in the environment before ``init_process_group``.
- profiling names: ``gloo:all_reduce`` (also ``reduce_scatter_tensor``, recorded as an
  all_reduce of the full input, and ``all_reduce_coalesced``, one entry with one size per
  tensor), ``gloo:reduce``, ``gloo:broadcast``, ``gloo:all_gather`` (both
  ``all_gather_into_tensor`` and list ``all_gather``; output ``[n, count]``),
  ``gloo:all_to_all`` (``all_to_all_single``; input and output = this rank's whole tensors,
  n x the per-peer count when even; an uneven one (splits 7,7,7,7 in, 7,7,5,5 out) is
  ``input_sizes [[28]]``, ``output_sizes [[24]]``, no splits),
  ``gloo:barrier`` (no tensors), ``gloo:gather`` (inputs ``[[count]]`` on every rank, outputs
  ``[[n, count]]`` on the root only), ``gloo:scatter`` (outputs ``[[count]]`` on every rank,
  inputs ``[[n, count]]`` on the root only).
- send / recv / ``batch_isend_irecv`` are **not recorded** on gloo (they consume an ``op_id``
  but no entry and no ``collective_seq_id``).
- ``state`` stays ``"scheduled"`` forever on gloo (states come from CUDA events). This parser
  keeps every entry whatever its state: FR records a call when it is issued, which is what the
  interposer records too; the per-state counts are reported by :class:`FlightRecorderRead`.
- ``pg_config`` is keyed by pg name, but gloo registers every group under ``""``, so only the
  last registered group survives (a member of a subgroup sees ``ranks: "[]"``). Group
  membership therefore comes from, in order: the caller's ``pg_ranks``; the ``"dmuon"`` block
  that :func:`dump_flight_recorder` adds; ``pg_config[pg name]`` (NCCL); a single non-empty
  ``pg_config`` entry when the dump holds a single group. Otherwise ``group_id`` is ``None``.

NCCL profiling names (``nccl:_allgather_base``, ``nccl:_reduce_scatter_base``,
``nccl:send 0->1``, ...) come from ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` and
torch 2.13's own analyser (``torch/distributed/flight_recorder/components/types.py``); they are
not measured here (no GPU).

Event fields: ``seq = collective_seq_id - 1`` (0-based, this group's collectives since the
group was created; it survives ring-buffer wrap-around). p2p entries get ``seq=None`` (FR
numbers them on a separate ``p2p_seq_id`` counter); events keep dump order (``record_id``).
``t_start_ns`` is ``time_created_ns`` (FR's system clock, ns since the Unix epoch, *not*
``time.perf_counter_ns``), ``t_end_ns`` is ``time_discovered_completed_ns`` where non-zero.
``comm`` holds FR's pg name, ``source_ref`` is ``"<file>#<record_id>"``. A coalesced entry
(several input sizes, e.g. ``all_reduce_coalesced``) gives one event per tensor, as the
interposer and NCCL's log do, all with the entry's ``seq`` and ``source_ref``
``"<file>#<record_id>.<i>"``. An all_to_all carries its input and output totals
(``in_elems`` / ``out_elems``) and the count :func:`tracer.events.all_to_all_count` gives
them (``None`` when uneven, or when the group size is unknown).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from tracer.events import (
    DTYPE_BYTES,
    CollectiveEvent,
    all_to_all_count,
    group_id_from_ranks,
    write_parquet,
)
from tracer.fr.dump import (  # enabling and dumping live there; re-exported (__all__)
    CONTEXT_KEY,
    DEFAULT_BUFFER_ENTRIES,
    ENV_BUFFER_SIZE,
    ENV_BUFFER_SIZE_LEGACY,
    dump_flight_recorder,
    flight_recorder_enabled,
    flight_recorder_env,
)
from tracer.fr.load import PICKLE_ALLOWED_GLOBALS, PickleRefused, _short, load_dump
from tracer.inputs import folder_entries, not_regular
from tracer.progress import byte_progress

__all__ = [
    "CONTEXT_KEY", "DEFAULT_BUFFER_ENTRIES", "ENV_BUFFER_SIZE", "ENV_BUFFER_SIZE_LEGACY",
    "FR_DTYPES", "FR_OPS", "PICKLE_ALLOWED_GLOBALS", "FlightRecorderRead", "PickleRefused",
    "dump_flight_recorder", "flight_recorder_enabled", "flight_recorder_env", "fr_window",
    "load_dump", "read_flight_recorder", "read_flight_recorder_paths", "register_cli",
    "summary_lines",
]

#: c10 ScalarType names (what FR writes in ``input_dtypes``) -> torch dtype names.
FR_DTYPES: dict[str, str] = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
    "ComplexHalf": "complex32",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
    "Float8_e4m3fnuz": "float8_e4m3fnuz",
    "Float8_e5m2fnuz": "float8_e5m2fnuz",
}
#: Element sizes for dtypes that :data:`tracer.events.DTYPE_BYTES` does not list.
_EXTRA_DTYPE_BYTES = {"uint16": 2, "complex32": 4, "complex64": 8, "complex128": 16,
                      "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}

#: FR op name (after ``backend:``) -> canonical op. Sources: gloo names measured on torch 2.13;
#: NCCL names from ProcessGroupNCCL.cpp and torch 2.13's FR analyser (COLLECTIVES, P2P).
FR_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "_broadcast_oop": "broadcast",
    "reduce": "reduce",
    "_reduce_oop": "reduce",
    "all_gather": "all_gather",
    "_allgather_base": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "ALLGATHER_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "REDUCE_SCATTER_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "barrier": "barrier",
    "all_reduce_barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "gather": "gather",
    "scatter": "scatter",
}

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_P2P_META = re.compile(r"^(\d+)\s*(->|<-)\s*(\d+)$")


# ------------------------------------------------------------------------------- parsing
@dataclass
class FlightRecorderRead:
    """What :func:`read_flight_recorder` found in one or more dumps.

    Attributes:
        events: canonical events, in file order then ``record_id`` order.
        unreadable: ``"<file>#<record_id> (entry <i>): <reason>"`` for every entry that could
            not become an event (an op not in FR_OPS, inconsistent or out-of-range sizes, mixed
            dtypes, a missing ``process_group``, invalid UTF-8, ...), and ``"<file>: <reason>"``
            for every file that is not a readable dump; nothing is dropped silently.
        warnings: ``"<file>...: <reason>"`` for damaged values that were left out while the
            entry (or file) was kept: a ``time_created_ns`` that is not an int ns (``t_start_ns``
            empty), a ``pg_config`` / ``"dmuon"`` block of the wrong shape (group ranks then
            come from elsewhere or stay unknown), a pickle loaded with ``allow_pickle``.
        states: number of entries per FR ``state`` (gloo: all ``"scheduled"``).
        files: the dump files read.
        skipped_files: ``"<file>: <reason>"`` for every file (or folder entry) not read at
            all: not a dump, a refused pickle, unreadable, a damaged gzip, not a regular file
            (a FIFO, a broken symlink); each is in ``unreadable`` too.
    """

    events: list[CollectiveEvent] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    states: collections.Counter = field(default_factory=collections.Counter)
    files: list[Path] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)

    def extend(self, other: FlightRecorderRead) -> None:
        """Append ``other``'s results to this one."""
        self.events += other.events
        self.unreadable += other.unreadable
        self.warnings += other.warnings
        self.states.update(other.states)
        self.files += other.files
        self.skipped_files += other.skipped_files

    def skip(self, path: str | Path, reason: str) -> None:
        """Record that the file ``path`` was not read, and why."""
        self.unreadable.append(f"{path}: {reason}")
        self.skipped_files.append(f"{path}: {reason}")


class _EntryError(Exception):
    """An FR entry that cannot become an event (collected, not raised to the caller)."""


_INT32_MAX, _INT64_MAX = (1 << 31) - 1, (1 << 63) - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_text(value, what: str) -> str:
    """``value`` as a string that UTF-8 can encode (no lone surrogates from invalid bytes)."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise _EntryError(f"{what}={_short(value)} is not a string")
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _EntryError(f"{what}={_short(text)} holds invalid UTF-8") from None
    return text


def _names(entry: dict, key: str) -> list[str]:
    value = entry.get(key) or []
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _EntryError(f"{key}={_short(value)} is not a list of names")
    return value


def _dtype(fr_names: list[str]) -> str | None:
    names = set(fr_names)
    if not names:
        return None
    if len(names) > 1:
        raise _EntryError(f"mixed dtypes {sorted(names)} in one entry")
    (name,) = names
    if name not in FR_DTYPES:
        raise _EntryError(f"unknown FR dtype {_short(name)} (known: {sorted(FR_DTYPES)})")
    return FR_DTYPES[name]


def _sizes(entry: dict, key: str) -> list[list[int]]:
    """``entry[key]`` as a list of shapes of non-negative ints, each with <= int64 elements."""
    value = entry.get(key) or []
    if not isinstance(value, list) or not all(
            isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in value):
        raise _EntryError(f"{key}={_short(value)} is not a list of shapes of ints >= 0")
    if any(prod(s) > _INT64_MAX for s in value):
        raise _EntryError(f"{key}={_short(value)} has more than 2^63-1 elements in a tensor")
    return value


def _numel(sizes: Sequence[Sequence[int]]) -> int:
    return sum(prod(s) for s in sizes)


def _parse_ranks(value) -> list[int]:
    """World ranks from a list or its JSON text; raises ``ValueError`` naming the value."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise ValueError(f"ranks {_short(value)} are not a JSON list") from None
    if not isinstance(value, list | tuple) or not all(
            _is_int(r) and 0 <= r <= _INT32_MAX for r in value):
        raise ValueError(f"ranks {_short(value)} are not a list of ints in [0, 2^31)")
    return list(value)


def _pg_name(entry: dict) -> str:
    group = entry.get("process_group")
    if not isinstance(group, list | tuple) or not group:
        raise _EntryError(f"process_group={_short(group)} is not a non-empty [name, desc] list")
    return _check_text(group[0], "process_group[0]")


def _context_of(dump: dict, where: str, warnings: list[str]) -> dict:
    context = dump.get(CONTEXT_KEY)
    if context is None:
        return {}
    if not isinstance(context, dict):
        warnings.append(f"{where}: {CONTEXT_KEY!r} block is a {type(context).__name__}, not a "
                        "dict; ignored (rank and group ranks come from elsewhere)")
        return {}
    out = dict(context)
    for key, ok in (("rank", lambda v: _is_int(v) and 0 <= v <= _INT32_MAX),
                    ("pid", lambda v: _is_int(v) and 0 <= v <= _INT64_MAX),
                    ("host", lambda v: isinstance(v, str) and _encodable(v)),
                    ("pg_ranks", lambda v: isinstance(v, dict))):
        if out.get(key) is not None and not ok(out[key]):
            warnings.append(f"{where}: {CONTEXT_KEY}.{key}={_short(out[key])} is malformed; "
                            "ignored")
            out[key] = None
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _group_ranks(dump: dict, names: set[str], context: dict,
                 pg_ranks: Mapping[str, Sequence[int]] | None, where: str,
                 warnings: list[str]) -> dict[str, list[int]]:
    """pg name -> world ranks, from the sources listed in the module docstring."""
    found: dict[str, list[int]] = {}
    config = dump.get("pg_config") or {}
    if not isinstance(config, dict):
        warnings.append(f"{where}: pg_config is a {type(config).__name__}, not a dict; ignored")
        config = {}
    parsed: dict[str, list[int]] = {}
    for name, cfg in config.items():
        try:
            if not isinstance(cfg, dict):
                raise ValueError(f"value is a {type(cfg).__name__}, not a dict")
            parsed[str(name)] = _parse_ranks(cfg.get("ranks", []))
        except ValueError as exc:
            warnings.append(f"{where}: pg_config[{_short(name)}]: {exc}; ignored")
    for name, ranks in parsed.items():
        if ranks and name in names:
            found[name] = ranks
    nonempty = [r for r in parsed.values() if r]
    if len(names) == 1 and len(config) == 1 and len(nonempty) == 1:
        found.setdefault(next(iter(names)), nonempty[0])
    for name, ranks in (context.get("pg_ranks") or {}).items():
        try:
            found[str(name)] = _parse_ranks(ranks)
        except ValueError as exc:
            warnings.append(f"{where}: {CONTEXT_KEY}.pg_ranks[{_short(name)}]: {exc}; ignored")
    for name, ranks in (pg_ranks or {}).items():
        found[str(name)] = sorted(int(r) for r in ranks)
    return found


def _rank_of(path: Path, context: dict, rank: int | None) -> int | None:
    if rank is not None:
        return rank
    if context.get("rank") is not None:
        return context["rank"]
    matches = [int(m) for m in _RANK_IN_NAME.findall(path.name) if int(m) <= _INT32_MAX]
    return matches[-1] if matches else None


def _counts(op: str, in_sizes: list, out_sizes: list, group_size: int | None) -> list[int | None]:
    """Per-tensor NCCL counts of one entry; coalesced entries hold one size per tensor."""
    n_in, n_out = _numel(in_sizes), _numel(out_sizes)
    if op in ("all_reduce", "broadcast", "reduce", "send"):
        return [prod(s) for s in in_sizes]
    if op == "recv":
        return [prod(s) for s in out_sizes]
    if op == "gather":  # every rank's input is its send count; outputs ([n, c]) on the root only
        if out_sizes and group_size is not None and n_out != n_in * group_size:
            raise _EntryError(f"gather output {n_out} != input {n_in} x {group_size=}")
        return [prod(s) for s in in_sizes]
    if op == "scatter":  # every rank's output is its receive count; inputs on the root only
        if in_sizes and group_size is not None and n_in != n_out * group_size:
            raise _EntryError(f"scatter input {n_in} != output {n_out} x {group_size=}")
        return [prod(s) for s in out_sizes]
    if op == "all_gather":  # per-rank inputs; outputs stacked ([n, c]) or a list of n tensors
        # Functional all_gather_into_tensor (DTensor full_tensor) on gloo is recorded with
        # output_sizes [[1, *input]] (measured on torch 2.13.0+cpu): the input is authoritative.
        functional_gloo = len(in_sizes) == 1 and out_sizes == [[1, *in_sizes[0]]]
        if group_size is not None and n_out != n_in * group_size and not functional_gloo:
            raise _EntryError(f"all_gather output {n_out} != input {n_in} x {group_size=}")
        return [prod(s) for s in in_sizes]
    if op == "reduce_scatter":  # per-rank outputs; inputs flat ([n*c]) or a list of n tensors
        if group_size is not None and n_in != n_out * group_size:
            raise _EntryError(f"reduce_scatter input {n_in} != output {n_out} x {group_size=}")
        return [prod(s) for s in out_sizes]
    # all_to_all: FR has the whole input and output (one tensor, or one per peer); the count
    # follows the totals (tracer.events.all_to_all_count: None for an uneven all_to_all)
    return [all_to_all_count(n_in, n_out, group_size)]


def _time_ns(entry: dict, key: str, where: str, warnings: list[str]) -> int | None:
    """``entry[key]`` as ns (0 / absent: None); a damaged value is warned about and left out."""
    value = entry.get(key)
    if not value:
        return None
    if _is_int(value) and 0 < value <= _INT64_MAX:
        return value
    warnings.append(f"{where}: {key}={_short(value)} is not an int ns in [1, 2^63); left empty")
    return None


def _entry_events(entry: dict, *, ref: str, where: str, rank: int | None,
                  ranks: list[int] | None, context: dict,
                  warnings: list[str]) -> list[CollectiveEvent]:
    """The events of one FR entry: one, or one per tensor for a coalesced entry."""
    name = entry.get("profiling_name") or ""
    if not isinstance(name, str):
        raise _EntryError(f"profiling_name={_short(name)} is not a string")
    _check_text(name, "profiling_name")
    backend, _, rest = name.partition(":")
    if not rest:
        raise _EntryError(f"profiling_name {_short(name)} is not '<backend>:<op>'")
    fr_op, _, meta = rest.partition(" ")
    if fr_op not in FR_OPS:
        raise _EntryError(f"unsupported op {_short(name)}: no canonical op (tracer.events.OPS) for "
                          f"{_short(fr_op)}; see FR_OPS")
    op = FR_OPS[fr_op]
    comm = _pg_name(entry)
    if isinstance(entry.get("recorder"), str):  # a merged dump (tracer.fr.dump.merge_dumps)
        comm = f"{comm}@{_check_text(entry['recorder'], 'recorder')}"
    group_size = len(ranks) if ranks else None
    root, dtype, counts, totals = None, None, [None], {}
    if op != "barrier":
        dtype = _dtype([*_names(entry, "input_dtypes"), *_names(entry, "output_dtypes")])
        in_sizes, out_sizes = _sizes(entry, "input_sizes"), _sizes(entry, "output_sizes")
        counts = _counts(op, in_sizes, out_sizes, group_size)
        if not counts:
            raise _EntryError(f"{name} entry without tensors")
        if op == "all_to_all":
            totals = dict(in_elems=_numel(in_sizes), out_elems=_numel(out_sizes))
    if op in ("send", "recv"):
        m = _P2P_META.match(meta.strip())
        if m and int(m.group(3)) <= _INT32_MAX:  # "send <me>-><peer>", "recv <me><-<peer>"
            root = int(m.group(3))
    is_p2p = bool(entry.get("is_p2p")) or op in ("send", "recv")
    seq_id = entry.get("collective_seq_id")
    if not is_p2p and seq_id is not None and not (_is_int(seq_id) and 0 <= seq_id <= _INT64_MAX):
        raise _EntryError(f"collective_seq_id={_short(seq_id)} is not an int in [0, 2^63)")
    common = dict(
        source="flight_recorder",
        op=op,
        rank=rank,
        group_id=group_id_from_ranks(ranks) if ranks else None,
        group_size=group_size,
        group_rank=ranks.index(rank) if ranks and rank in ranks else None,
        seq=None if is_p2p or not seq_id else seq_id - 1,
        dtype=dtype,
        dtype_bytes=_EXTRA_DTYPE_BYTES.get(dtype) if dtype not in DTYPE_BYTES else None,
        root=root,
        t_start_ns=_time_ns(entry, "time_created_ns", where, warnings),
        t_end_ns=_time_ns(entry, "time_discovered_completed_ns", where, warnings),
        pid=context.get("pid"),
        host=context.get("host"),
        comm=comm,
        **totals,
    )
    try:
        if len(counts) == 1:
            return [CollectiveEvent(count=counts[0], source_ref=ref, **common)]
        return [CollectiveEvent(count=c, source_ref=f"{ref}.{i}", **common)
                for i, c in enumerate(counts)]
    except ValueError as exc:  # a value that does not fit the event schema (e.g. 2^80 bytes)
        raise _EntryError(str(exc)) from None


def _record_id(entry: dict):
    rid = entry.get("record_id")
    return rid if _is_int(rid) and 0 <= rid <= _INT64_MAX else None


def read_flight_recorder(
    path: str | Path,
    *,
    rank: int | None = None,
    pg_ranks: Mapping[str, Sequence[int]] | None = None,
    strict: bool = False,
    allow_pickle: bool = False,
) -> FlightRecorderRead:
    """Parse one FR dump file into events (``source="flight_recorder"``).

    Every entry either becomes events or is listed in ``unreadable`` as
    ``"<file>#<record_id> (entry <i>): <reason>"`` with the rest parsed (see
    :class:`FlightRecorderRead`); a damaged value outside the fields an event needs is left
    out with a line in ``warnings``.

    Args:
        path: a JSON dump, a pickle dump, or a pickle dump re-serialised as JSON.
        rank: the dump's world rank; default: the ``"dmuon"`` block, else ``rank<N>`` in the
            file name (``fr_rank3.json``, ``nccl_trace_rank_3``), else ``None``.
        pg_ranks: pg name (``process_group[0]``) -> world ranks, overriding the dump.
        strict: raise on the first entry that cannot become an event instead of listing it.
        allow_pickle: load a pickle without restrictions (:func:`load_dump`).

    Raises:
        ValueError: the file is not an FR dump (:func:`load_dump`), or (``strict``) an entry
            is unreadable.
    """
    path = Path(path)
    dump = load_dump(path, allow_pickle=allow_pickle)
    result = FlightRecorderRead(files=[path])
    context = _context_of(dump, str(path), result.warnings)
    rank = _rank_of(path, context, rank)
    entries, names = [], set()
    for i, entry in enumerate(dump.get("entries", [])):
        rid = _record_id(entry) if isinstance(entry, dict) else None
        entries.append((rid if rid is not None else -1, i, entry))
        if isinstance(entry, dict):
            try:
                names.add(_pg_name(entry))
            except _EntryError:
                pass  # reported with the entry below
    groups = _group_ranks(dump, names, context, pg_ranks, str(path), result.warnings)
    for rid, i, entry in sorted(entries, key=lambda t: t[:2]):
        ref = f"{path}#{rid if rid >= 0 else f'entry{i}'}"
        where = f"{ref} (entry {i})"
        try:
            if not isinstance(entry, dict):
                raise _EntryError(f"entry is a {type(entry).__name__}, not a dict")
            result.states[_short(entry.get("state")).strip("'")] += 1
            if rid < 0:
                raise _EntryError(f"record_id={_short(entry.get('record_id'))} is not an "
                                  "int in [0, 2^63)")
            events = _entry_events(entry, ref=ref, where=where, rank=rank,
                                   ranks=groups.get(_pg_name(entry)), context=context,
                                   warnings=result.warnings)
        except (_EntryError, KeyError, TypeError, ValueError, OverflowError) as exc:
            reason = f"{where}: {exc}"
            if strict:
                raise ValueError(f"Invalid Flight Recorder entry {reason}. Must be a "
                                 "supported collective with consistent sizes.") from None
            result.unreadable.append(reason)
            continue
        result.events += events
    return result


def _expand(paths: Iterable[str | Path], read: FlightRecorderRead | None = None) -> list[Path]:
    """Files of ``paths``: files as given, every non-hidden entry of a folder. Entries that
    are not regular files (a FIFO, a broken symlink, a folder behind a symlink) are not
    opened: recorded in ``read`` (:meth:`FlightRecorderRead.skip`) when given."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = folder_entries(p)
        elif p.exists() or p.is_symlink():
            found = [p]
        else:
            raise ValueError(
                f"Invalid path {str(p)!r}: does not exist. Must be a dump file or a folder."
            )
        for f in found:
            reason = not_regular(f)
            if reason is None:
                files.append(f)
            elif read is not None:
                read.skip(f, reason)
    return files


def read_flight_recorder_paths(
    paths: Iterable[str | Path],
    *,
    pg_ranks: Mapping[str, Sequence[int]] | None = None,
    strict: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
) -> FlightRecorderRead:
    """:func:`read_flight_recorder` over files and folders (every non-hidden entry of a
    folder; gzipped dumps are read decompressed).

    Files that are not FR dumps (including refused pickles, damaged gzip, unreadable files)
    and folder entries that are not regular files (never opened) are listed in
    ``skipped_files`` and ``unreadable`` (raised with ``strict``). ``progress`` shows a bar on stderr, by bytes, when the inputs
    exceed :data:`tracer.progress.PROGRESS_MIN_BYTES` and stderr is a terminal.

    Raises:
        ValueError: a path does not exist, or (``strict``) anything is unreadable.
    """
    total = FlightRecorderRead()
    files = _expand(paths, total)
    if strict and total.skipped_files:
        raise ValueError(f"Invalid Flight Recorder input {total.skipped_files[0]}. Must be a "
                         "dump file.")
    with byte_progress(files, desc="fr dumps", enabled=progress) as bar:
        for f in files:
            try:
                total.extend(read_flight_recorder(f, pg_ranks=pg_ranks, strict=strict,
                                                  allow_pickle=allow_pickle))
            except ValueError as exc:
                if strict:
                    raise
                total.skip(f, str(exc))
            except OSError as exc:  # unreadable file (permissions, vanished): one issue
                if strict:
                    raise ValueError(f"Invalid Flight Recorder dump {str(f)!r}: {exc}") from None
                total.skip(f, f"cannot read ({exc})")
            bar.update(f)
    return total


def fr_window(
    before: Iterable[CollectiveEvent], after: Iterable[CollectiveEvent]
) -> list[CollectiveEvent]:
    """FR events of a measurement window: those in ``after`` that ``before`` did not hold.

    ``before``/``after`` come from dumps taken at the window's start and end. An entry is the
    same in both when its rank, pg name, ``seq``, op and ``t_start_ns`` (FR's
    ``time_created_ns``) agree, so the window is ``after`` less ``before`` entry by entry
    (``record_id`` is not used: a dump merging two recorders renumbers it). That holds where a
    group's ``seq`` restarted under a pg name an earlier group used: a process forked after its
    parent ran a default group inherits the parent's ring (a fresh ``"0"`` counts from 0 again
    below the inherited entries), and a job that re-creates its default group does the same.
    Events without a time fall back to order: per ``(rank, pg name)`` after the largest
    ``seq`` in ``before``; p2p events (``seq=None``) are kept then.
    """
    seen: set[tuple] = set()
    last_seq: dict[tuple, int] = {}
    for ev in before:
        key = _entry_key(ev)
        if key is not None:
            seen.add(key)
        if ev.seq is not None:
            comm_key = (ev.rank, ev.comm)
            last_seq[comm_key] = max(last_seq.get(comm_key, -1), ev.seq)
    out = []
    for ev in after:
        key = _entry_key(ev)
        if key is not None:
            if key not in seen:
                out.append(ev)
        elif ev.seq is None or ev.seq > last_seq.get((ev.rank, ev.comm), -1):
            out.append(ev)
    return out


def _entry_key(ev: CollectiveEvent) -> tuple | None:
    """``(rank, pg name, seq, op, t_start_ns)`` of an FR event: what tells one entry from
    another in two dumps of one ring; ``None`` without a time."""
    if ev.t_start_ns is None:
        return None
    return (ev.rank, ev.comm, ev.seq, ev.op, ev.t_start_ns)


# ------------------------------------------------------------------------------- CLI
def _parse_pg_ranks(items: Sequence[str]) -> dict[str, list[int]]:
    out = {}
    for item in items or []:
        name, sep, ranks = item.partition("=")
        try:
            out[name] = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            sep = ""
        if not sep or not name or not out.get(name):
            raise ValueError(f"Invalid --pg-ranks {item!r}. Must be NAME=R0,R1,... e.g. 1=1,2,3.")
    return out


def summary_lines(read: FlightRecorderRead) -> list[str]:
    """Human-readable summary: events per op, groups, ranks, states, unreadable entries and
    warnings."""
    from tabulate import tabulate

    ops = collections.Counter(e.op for e in read.events)
    groups = collections.Counter(
        e.group_id if e.group_id is not None else f"unknown (pg {e.comm})" for e in read.events
    )
    ranks = sorted({e.rank for e in read.events if e.rank is not None})
    lines = [f"{len(read.files)} dump(s), {len(read.events)} events, ranks {ranks}, "
             f"FR states {dict(read.states)}"]
    lines.append(tabulate(sorted(ops.items()), headers=["op", "events"]))
    lines.append(tabulate(sorted(groups.items()), headers=["group (world ranks)", "events"]))
    if read.skipped_files:
        lines.append(f"files not read: {len(read.skipped_files)}")
        lines += [f"  {u}" for u in read.skipped_files]
    skipped = set(read.skipped_files)
    entries = [u for u in read.unreadable if u not in skipped]
    lines.append(f"{len(entries)} unreadable entries")
    lines += [f"  {u}" for u in entries]
    if read.warnings:
        lines.append(f"{len(read.warnings)} warnings (values left out, entries kept)")
        lines += [f"  {w}" for w in read.warnings]
    return lines


def _cli(args: argparse.Namespace) -> int:
    from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK

    prog = "dmuon-trace fr"
    if args.allow_pickle:
        print(f"{prog}: warning: --allow-pickle: pickled dumps are loaded without restrictions "
              "and can run any code; use it only for files you trust", file=sys.stderr)
    try:
        import warnings

        with warnings.catch_warnings():  # the CLI warned once above, not once per file
            warnings.simplefilter("ignore")
            read = read_flight_recorder_paths(
                args.paths, pg_ranks=_parse_pg_ranks(args.pg_ranks), strict=args.strict,
                progress=True, allow_pickle=args.allow_pickle)
        before = None
        if args.since:  # the dumps taken at the window's start: keep what came after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                before = read_flight_recorder_paths(
                    args.since, pg_ranks=_parse_pg_ranks(args.pg_ranks), strict=args.strict,
                    allow_pickle=args.allow_pickle).events
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(summary_lines(read)))
    entries = [u for u in read.unreadable if u not in set(read.skipped_files)]
    args.dropped = (len(entries), entries[0] if entries else "")  # tracer.cli: --lenient
    if before is not None:
        dumped = len(read.events)
        read.events[:] = fr_window(before, read.events)
        print(f"--since: {len(read.events)} of {dumped} events are newer than the "
              f"{len(before)} events of the earlier dumps (the window)")
    if not read.events and before is not None and dumped:
        print(f"{prog}: error: no event is newer than the --since dumps' (all {dumped} were "
              "recorded before them); nothing written. Are the --since dumps the window's "
              "start, of the same job?", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    if not read.events:
        readable = len(read.files)
        print(f"{prog}: error: no Flight Recorder events in {len(_expand(args.paths))} file(s) "
              f"({readable} readable dump(s); {len(read.unreadable)} unreadable entries or "
              "files" + (f", first: {read.unreadable[0]}" if read.unreadable else "") + "); "
              "nothing written. Are these dumps of torch.distributed's Flight Recorder "
              "(dump_flight_recorder, _dump_fr_trace_json)?", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    if read.unreadable and not read.skipped_files:
        print(f"{prog}: warning: {len(read.unreadable)} unreadable entries (listed above); "
              f"first: {read.unreadable[0]}", file=sys.stderr)
    out = write_parquet(read.events, args.out)
    print(f"wrote {len(read.events)} events to {out}")
    if read.skipped_files:
        print(f"{prog}: error: {len(read.skipped_files)} file(s) not read (listed above; "
              f"first: {read.skipped_files[0]}); the events of the others were written",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def register_cli(subparsers) -> None:
    """Add ``fr PATH... --out events.parquet`` to ``dmuon-trace``."""
    p = subparsers.add_parser(
        "fr",
        help="PyTorch Flight Recorder dumps -> canonical events (Parquet)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Parse PyTorch Flight Recorder dumps into canonical collective events.\n\n"
            "Inputs: files or folders (every file in a folder) holding dumps made by\n"
            "_dump_fr_trace_json() (JSON), _dump_fr_trace() (pickle), a pickle re-serialised\n"
            "as JSON, or dmuon's dump_flight_recorder() (JSON plus a 'dmuon' block with the\n"
            "rank and every group's world ranks). The rank comes from that block or from\n"
            "'rank<N>' in the file name.\n\n"
            "Output: a Parquet file with tracer.events.EVENT_SCHEMA, one row per FR entry:\n"
            "source=flight_recorder, op (all_reduce, all_gather, reduce_scatter, broadcast,\n"
            "reduce, all_to_all, send, recv, barrier), rank, group_id (sorted world ranks,\n"
            "comma-joined; empty when unknown), group_size, group_rank, seq\n"
            "(collective_seq_id - 1), count (NCCL convention: all_gather send count,\n"
            "reduce_scatter recv count, all_to_all per-peer count, empty for an uneven\n"
            "all_to_all), in_elems / out_elems (all_to_all totals), dtype, dtype_bytes,\n"
            "msg_bytes, t_start_ns (FR time_created_ns, epoch clock), comm (FR pg name),\n"
            "source_ref (file#record_id). Note: gloo records reduce_scatter_tensor as an\n"
            "all_reduce of the full input and does not record send/recv.\n\n"
            "Prints events per op, per group, ranks, FR states and unreadable entries.\n\n"
            "Pickles: a file starting with byte 0x80 is unpickled by a restricted unpickler\n"
            "that refuses every global (os.system, eval, any class): a crafted pickle runs\n"
            "nothing and is listed as unreadable, naming the file. --allow-pickle lifts\n"
            "this, with a warning.\n\n"
            "Gzipped dumps (known by their first bytes, whatever the name) are read\n"
            "decompressed. Every entry of a folder is read or named with its reason (not a\n"
            "dump, a refused pickle, a damaged gzip, not a regular file).\n\n"
            "A dump holds every collective since the process started (earlier runs in the\n"
            "same process, setup calls): --since DUMPS, the dumps taken at the start of a\n"
            "window (make verify-traffic writes <mode>/fr_before/), keeps only the events\n"
            "newer than those (per rank and process group, by sequence number), e.g. to\n"
            "check a run's window with dmuon-verify check.\n\n"
            "Exit status: 0 events written, every file read; 2 bad arguments, a missing path,\n"
            "--out a folder or unwritable, --strict and an unreadable entry or file (nothing\n"
            "written), or a file not read (the events of the others are written; the summary\n"
            "names it); 3 no events found (nothing written)."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="FR dump files or folders")
    p.add_argument("--out", required=True, help="output Parquet file (events)")
    p.add_argument("--since", nargs="+", metavar="DUMPS",
                   help="FR dumps (files or folders) taken at the start of the window: write "
                        "only the events newer than those")
    p.add_argument("--pg-ranks", action="append", default=[], metavar="NAME=R0,R1,...",
                   help="world ranks of FR process group NAME (repeatable); overrides the dump")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 2) on the first unreadable entry or file instead of "
                        "listing it")
    p.add_argument("--allow-pickle", action="store_true",
                   help="load pickled dumps without restrictions (they can run code: only for "
                        "files you trust); by default a pickle naming anything but plain data "
                        "is refused")
    p.set_defaults(func=_cli)
