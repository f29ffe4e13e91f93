"""PyTorch Flight Recorder (FR): enable it, dump it, parse dumps into :class:`CollectiveEvent`.

FR is a ring buffer in c10d's C++ layer that records every collective a process group issues
(gloo and NCCL). On torch 2.13 (measured on the CPU build, gloo) a dump is a dict::

    {"version": "2.10", "pg_config": {...}, "pg_status": {...}, "comm_lib_version": "",
     "entries": [{"record_id", "pg_id", "process_group": [name, desc], "collective_seq_id",
                  "p2p_seq_id", "op_id", "profiling_name": "gloo:all_reduce",
                  "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
                  "state", "is_p2p", "retired", "time_created_ns", "frames"?, ...}]}

returned as JSON bytes by ``torch._C._distributed_c10d._dump_fr_trace_json()`` or pickle bytes
by ``_dump_fr_trace()``. Facts measured on torch 2.13 gloo (4 ranks, every collective on the
world and on a subgroup; see ``tests/distributed/test_flight_recorder_gloo.py``):

- Recording is on by default; ``TORCH_FR_BUFFER_SIZE=0`` turns it off. The size is read once
  per process, when the recorder is first touched (first process group or first dump), so it
  must be in the environment before ``init_process_group``.
- profiling names: ``gloo:all_reduce`` (also ``reduce_scatter_tensor``, recorded as an
  all_reduce of the full input, and ``all_reduce_coalesced``, one entry with one size per
  tensor), ``gloo:reduce``, ``gloo:broadcast``, ``gloo:all_gather`` (both
  ``all_gather_into_tensor`` and list ``all_gather``; output ``[n, count]``),
  ``gloo:all_to_all`` (``all_to_all_single``; input = n x the per-peer count),
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
``"<file>#<record_id>.<i>"``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from tqdm import tqdm

from tracer.events import DTYPE_BYTES, CollectiveEvent, group_id_from_ranks, write_parquet

#: Environment variable holding the number of FR entries kept per process (0 disables FR).
ENV_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
#: Older name that torch still reads when ``TORCH_FR_BUFFER_SIZE`` is unset.
ENV_BUFFER_SIZE_LEGACY = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: Default ring-buffer size: enough for many training steps of a small model.
DEFAULT_BUFFER_ENTRIES = 20_000
#: Key of the block :func:`dump_flight_recorder` adds to the dump (rank, groups' ranks, ...).
CONTEXT_KEY = "dmuon"

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


# ------------------------------------------------------------------------------- enabling
def flight_recorder_env(buffer_entries: int = DEFAULT_BUFFER_ENTRIES) -> dict[str, str]:
    """Environment to set (before ``init_process_group``) so FR keeps ``buffer_entries``.

    Raises:
        ValueError: ``buffer_entries`` is not an int >= 1.
    """
    if type(buffer_entries) is not int or buffer_entries < 1:
        raise ValueError(f"Invalid {buffer_entries=}. Must be an int >= 1 (entries per process).")
    return {ENV_BUFFER_SIZE: str(buffer_entries)}


def _dump_json_raw(include_collectives: bool = True) -> dict:
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(includeCollectives=include_collectives))


def flight_recorder_enabled() -> bool:
    """Whether FR records in this process.

    With a live process group the recorder itself is asked (an enabled recorder registers each
    group in ``pg_config``; a disabled one dumps ``pg_config: {}``). Without one, the answer
    comes from the environment: ``TORCH_FR_BUFFER_SIZE`` (else ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
    other than ``"0"``; unset counts as on (torch 2.13's default, measured on gloo).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return bool(_dump_json_raw(include_collectives=False).get("pg_config"))
    value = os.environ.get(ENV_BUFFER_SIZE, os.environ.get(ENV_BUFFER_SIZE_LEGACY))
    return value is None or value.strip() != "0"


def _process_group_context(rank: int) -> dict:
    """Rank, host, pid and every known group's ranks, keyed by the pg name FR records."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg_ranks = {}
    for pg, name in c10d._world.pg_names.items():  # private, but the only full registry
        pg_ranks[name] = sorted(dist.get_process_group_ranks(pg))
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "torch_version": torch.__version__,
        "pid": os.getpid(),
        "host": socket.gethostname().split(".")[0],
        "pg_ranks": pg_ranks,
    }


def dump_flight_recorder(
    out_dir: str | Path, rank: int, *, fmt: str = "json", include_stack_traces: bool = False
) -> Path:
    """Write this rank's FR dump to ``out_dir/fr_rank<rank>.json`` (or ``.pkl``).

    The file is FR's own dump (``_dump_fr_trace_json()`` for ``fmt="json"``, which has no stack
    frames; the unpickled ``_dump_fr_trace()`` for ``fmt="pickle"``, with Python ``frames`` per
    entry only if ``include_stack_traces``: symbolising them took ~10 s per rank on the first
    dump, measured on torch 2.13 CPU with 4 ranks on 2 cores) plus one extra top-level
    key, ``"dmuon"``: ``{rank, world_size, backend, torch_version, pid, host, pg_ranks}`` where
    ``pg_ranks`` maps every process group's name (as FR records it in ``process_group[0]``) to
    its sorted world ranks, because gloo's ``pg_config`` cannot be trusted for that (see the
    module docstring).

    Raises:
        ValueError: no default process group, ``rank`` is not this process's rank, ``fmt`` is
            unknown, or FR is disabled (``TORCH_FR_BUFFER_SIZE=0`` when the group was made).
    """
    import torch.distributed as dist

    if fmt not in ("json", "pickle"):
        raise ValueError(f"Invalid {fmt=}. Must be 'json' or 'pickle'.")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "Invalid call dump_flight_recorder() without a process group. Must be called after "
            "torch.distributed.init_process_group()."
        )
    if rank != dist.get_rank():
        raise ValueError(f"Invalid {rank=}. Must be this process's rank {dist.get_rank()}.")
    if not flight_recorder_enabled():
        raise ValueError(
            f"Invalid Flight Recorder state: disabled in this process "
            f"({ENV_BUFFER_SIZE}={os.environ.get(ENV_BUFFER_SIZE)!r}). Must be enabled before "
            f"init_process_group: set os.environ.update(flight_recorder_env()) first."
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    context = _process_group_context(rank)
    if fmt == "json":
        dump = _dump_json_raw()
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.json"
        path.write_text(json.dumps(dump))
    else:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(includeStackTraces=include_stack_traces))
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.pkl"
        path.write_bytes(pickle.dumps(dump))
    return path


# ------------------------------------------------------------------------------- parsing
@dataclass
class FlightRecorderRead:
    """What :func:`read_flight_recorder` found in one or more dumps.

    Attributes:
        events: canonical events, in file order then ``record_id`` order.
        unreadable: ``"<file>#<record_id>: <reason>"`` for every entry (or whole file) that
            could not become an event (an op not in FR_OPS, inconsistent
            sizes, mixed dtypes); nothing is dropped silently.
        states: number of entries per FR ``state`` (gloo: all ``"scheduled"``).
        files: the dump files read.
    """

    events: list[CollectiveEvent] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    states: collections.Counter = field(default_factory=collections.Counter)
    files: list[Path] = field(default_factory=list)

    def extend(self, other: FlightRecorderRead) -> None:
        """Append ``other``'s results to this one."""
        self.events += other.events
        self.unreadable += other.unreadable
        self.states.update(other.states)
        self.files += other.files


class _EntryError(Exception):
    """An FR entry that cannot become an event (collected, not raised to the caller)."""


def load_dump(path: str | Path) -> dict:
    """Load one FR dump: JSON, pickle (``_dump_fr_trace``), or a pickle re-serialised as JSON.

    Raises:
        ValueError: the file is neither, or lacks the ``entries``/``pg_status`` keys of a dump.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        dump = pickle.loads(raw) if raw[:1] == b"\x80" else json.loads(raw)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(
            f"Invalid Flight Recorder dump {str(path)!r}: not JSON or pickle ({exc}). Must be "
            "written by _dump_fr_trace_json(), _dump_fr_trace() or dump_flight_recorder()."
        ) from exc
    if not isinstance(dump, dict) or "pg_status" not in dump or "version" not in dump:
        raise ValueError(
            f"Invalid Flight Recorder dump {str(path)!r}: missing keys 'version'/'pg_status'. "
            "Must be a dump of torch.distributed's Flight Recorder."
        )
    return dump


def _dtype(fr_names: Sequence[str]) -> str | None:
    names = set(fr_names)
    if not names:
        return None
    if len(names) > 1:
        raise _EntryError(f"mixed dtypes {sorted(names)} in one entry")
    (name,) = names
    if name not in FR_DTYPES:
        raise _EntryError(f"unknown FR dtype {name!r} (known: {sorted(FR_DTYPES)})")
    return FR_DTYPES[name]


def _numel(sizes: Sequence[Sequence[int]]) -> int:
    return sum(prod(s) for s in sizes)


def _parse_ranks(value) -> list[int]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [int(r) for r in value]


def _group_ranks(dump: dict, pg_ranks: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """pg name -> world ranks, from the sources listed in the module docstring."""
    names = {str(e["process_group"][0]) for e in dump.get("entries", [])}
    found: dict[str, list[int]] = {}
    config = dump.get("pg_config") or {}
    for name, cfg in config.items():
        ranks = _parse_ranks(cfg.get("ranks", []))
        if ranks and name in names:
            found[name] = ranks
    nonempty = [_parse_ranks(c.get("ranks", [])) for c in config.values()]
    nonempty = [r for r in nonempty if r]
    if len(names) == 1 and len(config) == 1 and len(nonempty) == 1:
        found.setdefault(next(iter(names)), nonempty[0])
    context = dump.get(CONTEXT_KEY) or {}
    for name, ranks in (context.get("pg_ranks") or {}).items():
        found[str(name)] = [int(r) for r in ranks]
    for name, ranks in (pg_ranks or {}).items():
        found[str(name)] = sorted(int(r) for r in ranks)
    return found


def _rank_of(path: Path, dump: dict, rank: int | None) -> int | None:
    if rank is not None:
        return rank
    context = dump.get(CONTEXT_KEY) or {}
    if context.get("rank") is not None:
        return int(context["rank"])
    matches = _RANK_IN_NAME.findall(path.name)
    return int(matches[-1]) if matches else None


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
    # all_to_all: FR has the whole input (one tensor, or one per peer); count is per peer
    if group_size is None:
        return [None]
    if n_in % group_size:
        raise _EntryError(f"all_to_all input {n_in} not divisible by {group_size=}")
    return [n_in // group_size]


def _entry_events(entry: dict, *, ref: str, rank: int | None,
                  ranks: list[int] | None, context: dict) -> list[CollectiveEvent]:
    """The events of one FR entry: one, or one per tensor for a coalesced entry."""
    name = entry.get("profiling_name") or ""
    backend, _, rest = name.partition(":")
    if not rest:
        raise _EntryError(f"profiling_name {name!r} is not '<backend>:<op>'")
    fr_op, _, meta = rest.partition(" ")
    if fr_op not in FR_OPS:
        raise _EntryError(f"unsupported op {name!r}: no canonical op (tracer.events.OPS) for "
                          f"{fr_op!r}; see FR_OPS")
    op = FR_OPS[fr_op]
    group_size = len(ranks) if ranks else None
    root, dtype, counts = None, None, [None]
    if op != "barrier":
        dtype = _dtype((entry.get("input_dtypes") or []) + (entry.get("output_dtypes") or []))
        counts = _counts(op, entry.get("input_sizes") or [], entry.get("output_sizes") or [],
                         group_size)
        if not counts:
            raise _EntryError(f"{name} entry without tensors")
    if op in ("send", "recv"):
        m = _P2P_META.match(meta.strip())
        if m:  # "send <me>-><peer>", "recv <me><-<peer>", group ranks
            root = int(m.group(3))
    is_p2p = bool(entry.get("is_p2p")) or op in ("send", "recv")
    seq_id = entry.get("collective_seq_id")
    common = dict(
        source="flight_recorder",
        op=op,
        rank=rank,
        group_id=group_id_from_ranks(ranks) if ranks else None,
        group_size=group_size,
        group_rank=ranks.index(rank) if ranks and rank in ranks else None,
        seq=None if is_p2p or seq_id is None else int(seq_id) - 1,
        dtype=dtype,
        dtype_bytes=_EXTRA_DTYPE_BYTES.get(dtype) if dtype not in DTYPE_BYTES else None,
        root=root,
        t_start_ns=entry.get("time_created_ns") or None,
        t_end_ns=entry.get("time_discovered_completed_ns") or None,
        pid=context.get("pid"),
        host=context.get("host"),
        comm=str(entry["process_group"][0]),
    )
    if len(counts) == 1:
        return [CollectiveEvent(count=counts[0], source_ref=ref, **common)]
    return [CollectiveEvent(count=c, source_ref=f"{ref}.{i}", **common)
            for i, c in enumerate(counts)]


def read_flight_recorder(
    path: str | Path,
    *,
    rank: int | None = None,
    pg_ranks: Mapping[str, Sequence[int]] | None = None,
    strict: bool = False,
) -> FlightRecorderRead:
    """Parse one FR dump file into events (``source="flight_recorder"``).

    Args:
        path: a JSON dump, a pickle dump, or a pickle dump re-serialised as JSON.
        rank: the dump's world rank; default: the ``"dmuon"`` block, else ``rank<N>`` in the
            file name (``fr_rank3.json``, ``nccl_trace_rank_3``), else ``None``.
        pg_ranks: pg name (``process_group[0]``) -> world ranks, overriding the dump.
        strict: raise on the first entry that cannot become an event instead of listing it.

    Raises:
        ValueError: the file is not an FR dump, or (``strict``) an entry is unreadable.
    """
    path = Path(path)
    dump = load_dump(path)
    result = FlightRecorderRead(files=[path])
    rank = _rank_of(path, dump, rank)
    groups = _group_ranks(dump, pg_ranks)
    context = dump.get(CONTEXT_KEY) or {}
    for entry in sorted(dump.get("entries", []), key=lambda e: e.get("record_id", 0)):
        ref = f"{path}#{entry.get('record_id')}"
        result.states[str(entry.get("state"))] += 1
        try:
            pg_name = str(entry["process_group"][0])
            events = _entry_events(entry, ref=ref, rank=rank, ranks=groups.get(pg_name),
                                   context=context)
        except (_EntryError, KeyError, TypeError, ValueError) as exc:
            reason = f"{ref}: {exc}"
            if strict:
                raise ValueError(f"Invalid Flight Recorder entry {reason}. Must be a "
                                 "supported collective with consistent sizes.") from exc
            result.unreadable.append(reason)
            continue
        result.events += events
    return result


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(
                f"Invalid path {str(p)!r}: does not exist. Must be a dump file or a folder."
            )
    return files


def read_flight_recorder_paths(
    paths: Iterable[str | Path],
    *,
    pg_ranks: Mapping[str, Sequence[int]] | None = None,
    strict: bool = False,
    progress: bool = False,
) -> FlightRecorderRead:
    """:func:`read_flight_recorder` over files and folders (every file of a folder).

    Files that are not FR dumps are listed in ``unreadable`` (raised with ``strict``).

    Raises:
        ValueError: a path does not exist, or (``strict``) anything is unreadable.
    """
    total = FlightRecorderRead()
    for f in tqdm(_expand(paths), desc="fr dumps", disable=not progress):
        try:
            total.extend(read_flight_recorder(f, pg_ranks=pg_ranks, strict=strict))
        except ValueError as exc:
            if strict:
                raise
            total.unreadable.append(f"{f}: {exc}")
    return total


def fr_window(
    before: Iterable[CollectiveEvent], after: Iterable[CollectiveEvent]
) -> list[CollectiveEvent]:
    """FR events of a measurement window: those in ``after`` newer than anything in ``before``.

    ``before``/``after`` come from dumps taken at the window's start and end. Per
    ``(rank, pg name)`` the window starts after the largest ``seq`` seen in ``before``; p2p
    events (``seq=None``) are kept when their ``t_start_ns`` is later than the last event of
    ``before`` on that rank.
    """
    last_seq: dict[tuple, int] = {}
    last_t: dict = {}
    for ev in before:
        if ev.seq is not None:
            key = (ev.rank, ev.comm)
            last_seq[key] = max(last_seq.get(key, -1), ev.seq)
        if ev.t_start_ns is not None:
            last_t[ev.rank] = max(last_t.get(ev.rank, 0), ev.t_start_ns)
    out = []
    for ev in after:
        if ev.seq is not None:
            if ev.seq > last_seq.get((ev.rank, ev.comm), -1):
                out.append(ev)
        elif ev.t_start_ns is None or ev.t_start_ns > last_t.get(ev.rank, 0):
            out.append(ev)
    return out


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
    """Human-readable summary: events per op, groups, ranks, states, unreadable entries."""
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
    lines.append(f"{len(read.unreadable)} unreadable entries")
    lines += [f"  {u}" for u in read.unreadable]
    return lines


def _cli(args: argparse.Namespace) -> int:
    try:
        read = read_flight_recorder_paths(args.paths, pg_ranks=_parse_pg_ranks(args.pg_ranks),
                                          strict=args.strict, progress=True)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    out = write_parquet(read.events, args.out)
    print("\n".join(summary_lines(read)))
    print(f"wrote {len(read.events)} events to {out}")
    return 1 if (args.strict and read.unreadable) else 0


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
            "reduce_scatter recv count, all_to_all per-peer count), dtype, dtype_bytes,\n"
            "msg_bytes, t_start_ns (FR time_created_ns, epoch clock), comm (FR pg name),\n"
            "source_ref (file#record_id). Note: gloo records reduce_scatter_tensor as an\n"
            "all_reduce of the full input and does not record send/recv.\n\n"
            "Prints events per op, per group, ranks, FR states and unreadable entries."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="FR dump files or folders")
    p.add_argument("--out", required=True, help="output Parquet file (events)")
    p.add_argument("--pg-ranks", action="append", default=[], metavar="NAME=R0,R1,...",
                   help="world ranks of FR process group NAME (repeatable); overrides the dump")
    p.add_argument("--strict", action="store_true",
                   help="fail on the first unreadable entry instead of listing it")
    p.set_defaults(func=_cli)
