"""torch.profiler (Kineto) Chrome traces -> canonical collective events: a source on every backend.

Input: the JSON that ``torch.profiler.profile(...).export_chrome_trace(path)`` writes (``.json``
or ``.json.gz``; gzip is known by its first bytes, whatever the name), one file per rank (a
folder: every ``*.json`` / ``*.json.gz`` in it; ``dmuon-trace profiler`` names every other
entry, and every file that is not a trace, as not read). Which
events carry the collectives depends on the backend; measured on torch 2.13.0 (CPU build, gloo,
``tests/tracer/test_profiler.py`` on ``../shared/fixtures/profiler/`` and on real runs):

- **``record_param_comms``** (``cat`` ``cpu_op``): ProcessGroupNCCL (and MPI / UCC) wrap every
  call in it (``RECORD_PARAM_COMMS`` in ``torch/csrc/distributed/c10d/ParamCommsUtils.hpp``);
  its ``args`` use the keys of ``torch/csrc/profiler/util.h``: ``Collective name``, ``In msg
  nelems``, ``Out msg nelems``, ``dtype`` (a ScalarType name such as ``Float``), ``Group size``,
  ``Process Group Ranks``, ``Process Group Name``, ``Seq``. Where a trace has any, they are the
  events (one per call) and the group comes from ``Process Group Ranks``; an all_to_all's
  nelems are its ``in_elems`` / ``out_elems``. Gloo on the CPU build
  emits none (checked on torch 2.13.0); this path is written from those key names and tested on
  events built from them, not yet on a real NCCL trace.
- **``c10d::*`` dispatcher ops** (``cat`` ``cpu_op``, the issuing thread): every backend. Name,
  ``Input Dims`` and ``Concrete Inputs`` (scalar arguments: the root of broadcast / reduce /
  gather / scatter, the peer of send / recv) give op, per-rank count and root; an
  all_to_all's ``in_elems`` / ``out_elems`` are its input and output dims
  (``c10d::alltoall_base_``: ``Input Dims`` ``[[out], [in], ...]``; its split sizes are
  ``Concrete Inputs`` 3 and 4 as text, ``"[7, 7, 5, 5]"``, or ``"[]"`` when even, measured on
  torch 2.13 gloo), the number of splits gives the group size where the trace does not, and
  the count follows :func:`tracer.events.all_to_all_count`. The
  ``ProcessGroup`` argument is not recorded (its ``Concrete Inputs`` entry is empty), so
  ``group_id`` is only known when the trace lists a single process group
  (``distributedInfo.pg_config``); ``group_size`` is derived where the shapes imply it
  (all_gather_into_tensor: output / input, reduce_scatter_tensor: input / output).
  ``_c10d_functional::*`` ops are wrappers that issue a nested ``c10d::*`` op and are skipped
  (one event per logical call). A ``c10d::*`` op that runs inside another one on the same
  thread is the same call dispatched again (a ``TorchDispatchMode`` such as the interposer or
  ``CommDebugMode`` calls the op it intercepts: measured, every call then shows twice) and is
  skipped too, counted under ``nested c10d::<op>``. Tensor-list arguments carry no dtype (``Input type``
  ``TensorList``): the dtype comes from the backend's own annotation, next item.
- **``gloo:<op>``** (``cat`` ``user_annotation``, gloo's worker threads or the issuing thread
  for send / recv): ProcessGroupGloo's record of running the work, with the input's dims and
  dtype (``Input type``, a C++ type name such as ``float`` or ``c10::BFloat16``). Each
  ``c10d::*`` op is paired with the earliest unpaired compatible ``gloo:`` event that starts
  after it (same op; same dims; ``reduce_scatter_tensor`` runs as ``gloo:all_reduce`` of the
  full input), which gives its dtype. Unpaired ``gloo:`` events are counted, never dropped
  silently.

Sizes follow :mod:`tracer.events` (NCCL's per-rank ``count``), like the interposer. Times are
the trace's clock (Kineto ``ts`` / ``dur`` in µs, as ns), not comparable across sources.
``seq`` numbers each rank's events per ``group_id`` (per rank where the group is unknown).
``phase`` is not in the trace. ``rank`` comes from ``distributedInfo.rank``, else from
``rank<N>`` in the file name. ``source_ref`` is ``file#ts``.

This module needs no torch (``dmuon-trace profiler`` runs anywhere).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tracer.events import DTYPE_BYTES, CollectiveEvent, all_to_all_count, group_id_from_ranks, write_parquet
from tracer.inputs import GZIP_ERRORS, folder_entries, gzip_problem, is_gzip, not_regular

SOURCE = "profiler"
PARAM_COMMS = "record_param_comms"

#: Kineto ``Input type`` (C++ type names of caffe2 TypeMeta) -> torch dtype name.
CPP_DTYPES: dict[str, str] = {
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long int": "int64", "int": "int32", "short int": "int16", "signed char": "int8",
    "unsigned char": "uint8", "bool": "bool", "unsigned int": "uint32",
    "long unsigned int": "uint64", "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
}

#: ``record_param_comms`` ``dtype`` (c10::ScalarType names) -> torch dtype name.
SCALAR_TYPES: dict[str, str] = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "UInt32": "uint32", "UInt64": "uint64", "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
}


@dataclass(frozen=True)
class _C10dOp:
    """How to read one ``c10d::`` op: canonical op, which input holds the per-rank tensors,
    whether that input is a list (one event per tensor when ``per_tensor``), which
    ``Concrete Inputs`` index holds the root / peer, and the backend annotation it runs as."""

    op: str
    arg: int | None
    is_list: bool
    root_arg: int | None = None
    per_tensor: bool = False
    gloo: str | None = None
    gloo_dims: str = "same"  # "same" dims; "full": the all_reduce of the whole input; "any"


#: ``c10d::`` op name -> reading (schemas: ``torch/csrc/distributed/c10d/Ops.cpp``, torch 2.13).
C10D_OPS: dict[str, _C10dOp] = {
    "allreduce_": _C10dOp("all_reduce", 0, True, per_tensor=True, gloo="all_reduce"),
    "allreduce_coalesced_": _C10dOp("all_reduce", 0, True, per_tensor=True, gloo="all_reduce"),
    "broadcast_": _C10dOp("broadcast", 0, True, root_arg=2, gloo="broadcast"),
    "reduce_": _C10dOp("reduce", 0, True, root_arg=3, gloo="reduce"),
    "_allgather_base_": _C10dOp("all_gather", 1, False, gloo="all_gather"),
    "allgather_": _C10dOp("all_gather", 1, True, gloo="all_gather"),
    "allgather_coalesced_": _C10dOp("all_gather", 1, True, per_tensor=True, gloo="all_gather"),
    "allgather_into_tensor_coalesced_": _C10dOp("all_gather", 1, True, per_tensor=True, gloo="all_gather"),
    "_reduce_scatter_base_": _C10dOp("reduce_scatter", 0, False, gloo="all_reduce", gloo_dims="full"),
    "reduce_scatter_": _C10dOp("reduce_scatter", 0, True, gloo="reduce_scatter"),
    "reduce_scatter_tensor_coalesced_": _C10dOp("reduce_scatter", 0, True, per_tensor=True,
                                                gloo="all_reduce", gloo_dims="full"),
    "alltoall_base_": _C10dOp("all_to_all", 1, False, gloo="all_to_all"),
    "alltoall_": _C10dOp("all_to_all", 1, True, gloo="all_to_all"),
    "gather_": _C10dOp("gather", 1, True, root_arg=3, gloo="gather"),
    # the root's annotation lists every rank's input, the others' their output: pair by name
    "scatter_": _C10dOp("scatter", 0, True, root_arg=3, gloo="scatter", gloo_dims="any"),
    "send": _C10dOp("send", 0, True, root_arg=2, gloo="send"),
    "recv_": _C10dOp("recv", 0, True, root_arg=2, gloo="recv"),
    "recv_any_source_": _C10dOp("recv", 0, True, gloo="recv"),
    "barrier": _C10dOp("barrier", None, False, gloo="barrier"),
    "monitored_barrier_": _C10dOp("barrier", None, False),
}

#: ``record_param_comms`` ``Collective name`` -> canonical op (ProcessGroupNCCL's names);
#: ``None``: markers that move no data of their own (counted as ignored).
PARAM_COMMS_NAMES: dict[str, str | None] = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast", "_broadcast_oop": "broadcast",
    "reduce": "reduce", "_reduce_oop": "reduce",
    "all_gather": "all_gather", "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_allv": "all_to_all", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recvAnySource": "recv", "barrier": "barrier",
    "wait": None, "coalesced": None, "init": None,
}

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")


@dataclass
class ProfilerTrace:
    """What one rank's trace gave.

    Attributes:
        path: the file read.
        rank: the rank (``distributedInfo.rank`` or ``rank<N>`` in the name), ``None`` if neither.
        kind: ``"record_param_comms"`` or ``"c10d_ops"``: which events became collectives.
        process_groups: ``distributedInfo.pg_config`` (name, desc, size, ranks), if present.
        events: the collectives, in issue order.
        backend_events: ``gloo:`` annotations seen; ``backend_unpaired`` of them matched no
            ``c10d::`` op (listed in :attr:`issues`).
        ignored: names of skipped wrapper / marker events, with counts.
        issues: what could not be read (unknown ``c10d::`` ops, unpaired annotations), never
            silently dropped.
    """

    path: str
    rank: int | None
    kind: str
    process_groups: list[dict] = field(default_factory=list)
    events: list[CollectiveEvent] = field(default_factory=list)
    backend_events: int = 0
    backend_unpaired: int = 0
    ignored: collections.Counter = field(default_factory=collections.Counter)
    issues: list[str] = field(default_factory=list)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _load(path: Path) -> dict:
    try:
        opener = gzip.open if is_gzip(path) else open  # gzip by its first bytes, any name
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except GZIP_ERRORS + (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        what = gzip_problem(exc) if not isinstance(exc, (ValueError, RecursionError)) else exc
        raise ValueError(f"Invalid profiler trace {str(path)!r}: {what}. Must be the JSON of "
                         "torch.profiler's export_chrome_trace (.json or .json.gz).") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"Invalid profiler trace {str(path)!r}: no 'traceEvents' list. Must be "
                         "the JSON of torch.profiler's export_chrome_trace.")
    return data


def _rank_of(path: Path, info: dict, rank: int | None) -> int | None:
    if rank is not None:
        return rank
    if isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def _ts_ns(ev: dict) -> tuple[int, int]:
    t0 = round(float(ev.get("ts", 0.0)) * 1000)
    return t0, t0 + round(float(ev.get("dur", 0.0)) * 1000)


def _dtype(name: str | None, table: dict[str, str]) -> str | None:
    dt = table.get(name or "")
    return dt if dt in DTYPE_BYTES else None


def _param_comms_event(ev: dict, rank: int | None, ref: str) -> CollectiveEvent | str | None:
    args = ev.get("args", {})
    name = args.get("Collective name", "")
    if name not in PARAM_COMMS_NAMES:
        return f"{ref}: unknown record_param_comms Collective name {name!r}"
    op = PARAM_COMMS_NAMES[name]
    if op is None:
        return None
    n = args.get("Group size")
    ranks = args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except json.JSONDecodeError:
            ranks = None
    group_id = group_id_from_ranks(ranks) if isinstance(ranks, list) and ranks else None
    n_in, n_out = args.get("In msg nelems"), args.get("Out msg nelems")
    count = {"reduce_scatter": n_out, "scatter": n_out, "barrier": None}.get(op, n_in)
    totals = {}
    if op == "all_to_all":  # the whole input and output: the count follows them
        totals = {"in_elems": n_in, "out_elems": n_out}
        count = all_to_all_count(n_in, n_out, n)
    dtype = None if op == "barrier" else _dtype(args.get("dtype"), SCALAR_TYPES)
    t0, t1 = _ts_ns(ev)
    return CollectiveEvent(
        source=SOURCE, op=op, rank=rank, group_id=group_id, group_size=n, count=count, dtype=dtype,
        t_start_ns=t0, t_end_ns=t1, source_ref=ref, comm=args.get("Process Group Name"),
        pid=ev.get("pid") if isinstance(ev.get("pid"), int) else None, **totals,
    )


@dataclass
class _Annot:
    name: str
    t0: int
    dims: list
    dtypes: list
    paired: bool = False


def _c10d_events(ev: dict, spec: _C10dOp, rank: int | None, ref: str,
                 group: tuple[str | None, int | None]) -> list[tuple[dict, CollectiveEvent]]:
    """One canonical event per call (per tensor of coalesced calls), with the dims the backend
    annotation must show (for pairing)."""
    args = ev.get("args", {})
    dims, types, concrete = args.get("Input Dims", []), args.get("Input type", []), args.get("Concrete Inputs", [])
    root = None
    if spec.root_arg is not None and spec.root_arg < len(concrete):
        try:
            root = int(concrete[spec.root_arg])
        except (TypeError, ValueError):
            root = None
    group_id, group_size = group
    t0, t1 = _ts_ns(ev)
    common = dict(source=SOURCE, op=spec.op, rank=rank, group_id=group_id, root=root,
                  t_start_ns=t0, t_end_ns=t1, source_ref=ref,
                  pid=ev.get("pid") if isinstance(ev.get("pid"), int) else None)
    if spec.arg is None:  # barrier: no user payload (the interposer records none either)
        return [({"dims": None}, CollectiveEvent(group_size=group_size, **common))]
    shapes = dims[spec.arg] if spec.arg < len(dims) else []
    shapes = shapes if spec.is_list else [shapes]
    dtype = _dtype(types[spec.arg] if spec.arg < len(types) else None, CPP_DTYPES)
    if not spec.is_list and spec.op in ("all_gather", "reduce_scatter", "all_to_all"):
        other = dims[1 - spec.arg] if len(dims) > 1 else None
        mine, full = _numel(shapes[0]), _numel(other) if other is not None else None
        if spec.op == "all_gather" and mine and full:
            group_size = full // mine
        if spec.op == "reduce_scatter" and mine and full:
            group_size = full // mine
    totals = {}
    if spec.op == "all_to_all":
        group_size, totals = _all_to_all_totals(dims, concrete, spec.is_list, group_size)
    out = []
    tensors = shapes if spec.per_tensor else shapes[:1]
    for shape in tensors:
        count = _numel(shape)
        if spec.op == "all_to_all":
            count = all_to_all_count(totals.get("in_elems"), totals.get("out_elems"), group_size)
        want = [shape]
        if spec.gloo_dims == "full":
            want = [dims[1] if len(dims) > 1 else shape]
        elif spec.gloo_dims == "any":
            want = None
        out.append(({"dims": want, "dims_all": shapes if spec.per_tensor else None},
                    CollectiveEvent(group_size=group_size, count=count, dtype=dtype, **totals,
                                    **common)))
    return out


def _split_sizes(value) -> list[int] | None:
    """A ``Concrete Inputs`` entry holding an ``int[]`` (``"[7, 7, 5, 5]"``) as a list."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        items = [x for x in value[1:-1].split(",") if x.strip()]
    else:
        return None
    try:
        return [int(x) for x in items]
    except (TypeError, ValueError):
        return None


def _all_to_all_totals(dims: list, concrete: list, is_list: bool,
                       group_size: int | None) -> tuple[int | None, dict]:
    """``(group_size, {in_elems, out_elems})`` of a ``c10d::alltoall_base_`` (dims: output,
    input; ``Concrete Inputs`` 3 and 4: the output and input split sizes, ``"[]"`` when
    even) or ``c10d::alltoall_`` (lists of the output and input tensors, one per peer). The
    group size is the number of splits (or of tensors) where the call has them."""
    if len(dims) < 2:
        return group_size, {}
    if is_list:
        outs, ins = dims[0] or [], dims[1] or []
        return (len(ins) or group_size), {"in_elems": sum(_numel(d) for d in ins),
                                          "out_elems": sum(_numel(d) for d in outs)}
    for arg in (4, 3):
        splits = _split_sizes(concrete[arg]) if arg < len(concrete) else None
        if splits:
            group_size = len(splits)
            break
    return group_size, {"in_elems": _numel(dims[1]), "out_elems": _numel(dims[0])}


def _pair_dtypes(calls: list[tuple[str, dict, CollectiveEvent]], annots: list[_Annot],
                 trace: ProfilerTrace) -> list[CollectiveEvent]:
    """Give each c10d call the dtype of its backend annotation (module docstring)."""
    by_name: dict[str, list[_Annot]] = collections.defaultdict(list)
    for a in sorted(annots, key=lambda a: a.t0):
        by_name[a.name].append(a)
    out = []
    done_coalesced: dict[int, str | None] = {}
    for c10d_name, want, ev in calls:
        spec = C10D_OPS[c10d_name]
        dtype = ev.dtype
        key = id(want.get("dims_all")) if want.get("dims_all") is not None else None
        if key is not None and key in done_coalesced:  # one annotation per coalesced call
            dtype = dtype or done_coalesced[key]
            out.append(ev.replace(dtype=dtype) if dtype != ev.dtype else ev)
            continue
        target = want.get("dims_all") or want["dims"]
        match = None
        for a in by_name.get(spec.gloo or "", []):
            if a.paired or a.t0 < ev.t_start_ns:
                continue
            if want["dims"] is None or a.dims == target:
                match = a
                break
        if match is not None:
            match.paired = True
            if dtype is None and match.dtypes:
                dtype = _dtype(match.dtypes[0], CPP_DTYPES)
        if key is not None:
            done_coalesced[key] = dtype
        out.append(ev.replace(dtype=dtype) if dtype != ev.dtype else ev)
    unpaired = [a for a in annots if not a.paired]
    trace.backend_unpaired = len(unpaired)
    trace.issues += [f"{trace.path}: gloo:{a.name} at ts {a.t0} ns (dims {a.dims}) matches no "
                     "c10d op" for a in unpaired]
    return out


def read_profiler_trace(path: str | Path, *, rank: int | None = None) -> ProfilerTrace:
    """Read one rank's Chrome trace (module docstring).

    Args:
        path: a ``.json`` or ``.json.gz`` file written by ``export_chrome_trace``.
        rank: the rank, overriding the trace's ``distributedInfo`` and the file name.

    Raises:
        ValueError: unreadable file, or not a Chrome trace.
    """
    path = Path(path)
    data = _load(path)
    info = data.get("distributedInfo") or {}
    pgs = [g for g in info.get("pg_config", []) if isinstance(g, dict)]
    rank = _rank_of(path, info, rank)
    raw = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    param_comms = [e for e in raw if e.get("name") == PARAM_COMMS]
    trace = ProfilerTrace(str(path), rank, "record_param_comms" if param_comms else "c10d_ops", pgs)
    if param_comms:
        for e in sorted(param_comms, key=lambda e: float(e.get("ts", 0))):
            got = _param_comms_event(e, rank, f"{path.name}#{e.get('ts')}")
            if isinstance(got, str):
                trace.issues.append(got)
            elif got is None:
                trace.ignored[e["args"].get("Collective name")] += 1
            else:
                trace.events.append(got)
        _number(trace.events)
        return trace
    single = (group_id_from_ranks(pgs[0]["ranks"]), len(pgs[0]["ranks"])) if len(pgs) == 1 else (None, None)
    calls, annots = [], []
    open_until: dict = {}  # tid -> end (ns) of the outermost c10d op running on that thread
    for e in sorted(raw, key=lambda e: float(e.get("ts", 0))):
        name = e.get("name", "")
        ref = f"{path.name}#{e.get('ts')}"
        if name.startswith("gloo:") and e.get("cat") == "user_annotation":
            args = e.get("args", {})
            annots.append(_Annot(name[5:], _ts_ns(e)[0], args.get("Input Dims", []), args.get("Input type", [])))
        elif name.startswith("c10d::") and e.get("cat") == "cpu_op":
            op = name[6:]
            t0, t1 = _ts_ns(e)
            if t0 < open_until.get(e.get("tid"), -1):
                trace.ignored[f"nested {name}"] += 1
                continue
            open_until[e.get("tid")] = t1
            if op not in C10D_OPS:
                trace.issues.append(f"{ref}: unknown c10d op {name!r} (not converted)")
                continue
            calls += [(op, want, ev) for want, ev in _c10d_events(e, C10D_OPS[op], rank, ref, single)]
        elif name.startswith("_c10d_functional"):
            trace.ignored[name] += 1
    trace.backend_events = len(annots)
    trace.events = _pair_dtypes(calls, annots, trace) if annots else [c[2] for c in calls]
    _number(trace.events)
    return trace


def _number(events: list[CollectiveEvent]) -> None:
    seq: collections.Counter = collections.Counter()
    for i, ev in enumerate(events):
        events[i] = ev.replace(seq=seq[ev.group_id])
        seq[ev.group_id] += 1


#: Names of trace files in a folder (other entries of the folder are named as skipped).
TRACE_SUFFIXES = (".json", ".json.gz")


def trace_files(paths: Iterable[str | Path], skipped: list | None = None) -> list[Path]:
    """Files of ``paths``: each file as given, each folder's ``*.json`` / ``*.json.gz`` sorted.

    With ``skipped`` (a list), every other non-hidden entry of a folder is appended to it as
    ``(path, reason)``, and so is a file that is not a regular file (a FIFO, never opened);
    without it they are left out, as before.

    Raises:
        ValueError: a path does not exist or a folder holds no trace.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            entries = folder_entries(p)
            found = [f for f in entries if f.name.endswith(TRACE_SUFFIXES)]
            if skipped is not None:
                skipped += [(str(f), "not a trace file name (*.json, *.json.gz)")
                            for f in entries if f not in found]
            if not found:
                raise ValueError(f"Invalid trace folder {str(p)!r}: no *.json or *.json.gz. Must "
                                 "hold export_chrome_trace files, one per rank.")
        elif p.exists() or p.is_symlink():
            found = [p]
        else:
            raise ValueError(f"Invalid trace path {str(p)!r}: not found. Must be a file or folder.")
        for f in found:
            reason = not_regular(f)
            if reason is None:
                out.append(f)
            elif skipped is not None:
                skipped.append((str(f), reason))
    return out


def read_profiler_traces(paths: Iterable[str | Path],
                         skipped: list | None = None) -> list[ProfilerTrace]:
    """:func:`read_profiler_trace` of every file of :func:`trace_files`.

    With ``skipped`` (a list), files that cannot be read as traces (and folder entries that
    are not traces) are appended to it as ``(path, reason)`` and the others read; without
    it the first such file raises.

    Raises:
        ValueError: as :func:`trace_files` / :func:`read_profiler_trace`, or two files give the
            same rank.
    """
    traces = []
    for f in trace_files(paths, skipped):
        try:
            traces.append(read_profiler_trace(f))
        except ValueError as exc:
            if skipped is None:
                raise
            skipped.append((str(f), str(exc)))
    ranks = [t.rank for t in traces if t.rank is not None]
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ValueError(f"Invalid traces: ranks {dup} appear in more than one file. Must be one "
                         "trace per rank.")
    return traces


def summary_lines(traces: Sequence[ProfilerTrace]) -> list[str]:
    """Human-readable summary: events per op, per group, ranks, annotations, issues."""
    from tabulate import tabulate

    events = [ev for t in traces for ev in t.events]
    ops = collections.Counter(e.op for e in events)
    groups = collections.Counter(e.group_id or "unknown (not in the trace)" for e in events)
    kinds = collections.Counter(t.kind for t in traces)
    ranks = sorted({t.rank for t in traces if t.rank is not None})
    lines = [f"{len(traces)} trace(s), {len(events)} events, ranks {ranks}, from {dict(kinds)}"]
    lines.append(tabulate(sorted(ops.items()), headers=["op", "events"]))
    lines.append(tabulate(sorted(groups.items()), headers=["group (world ranks)", "events"]))
    annots = sum(t.backend_events for t in traces)
    unpaired = sum(t.backend_unpaired for t in traces)
    lines.append(f"backend annotations (gloo:*): {annots}, unpaired {unpaired}; ignored wrappers "
                 f"{dict(sum((t.ignored for t in traces), collections.Counter()))}")
    issues = [i for t in traces for i in t.issues]
    lines.append(f"{len(issues)} issue(s)")
    lines += [f"  {i}" for i in issues[:20]]
    return lines


def profiler_source_events(reference: Sequence[CollectiveEvent],
                           other: Sequence[CollectiveEvent]) -> tuple[list, list, str | None]:
    """The two event lists as the profiler can be compared with a reference.

    Where every profiler event knows its group, both lists are returned unchanged. Otherwise
    (gloo: the trace does not record the process group) each rank's calls are compared as one
    sequence in issue order: ``group_id`` is cleared on both sides, and a note says so.
    """
    if all(e.group_id is not None for e in other):
        return list(reference), list(other), None
    note = ("the trace records no process group for these calls: compared as one sequence per "
            "rank in issue order (op, count or an all_to_all's totals, dtype, root)")
    return ([e.replace(group_id=None) for e in reference],
            [e.replace(group_id=None) for e in other], note)


def register_cli(subparsers) -> None:
    """Add ``profiler TRACE... --out events.parquet`` to ``dmuon-trace``."""
    p = subparsers.add_parser(
        "profiler",
        help="torch.profiler (Kineto) Chrome traces -> canonical events (Parquet)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Parse torch.profiler Chrome traces (export_chrome_trace; .json or .json.gz, one\n"
            "per rank; a folder: every trace in it) into canonical collective events.\n\n"
            "Events: record_param_comms where the backend writes them (NCCL), else the\n"
            "c10d:: dispatcher ops, with the dtype from gloo's own gloo:<op> annotations.\n"
            "The rank comes from distributedInfo.rank or 'rank<N>' in the file name.\n\n"
            "Output: a Parquet file with tracer.events.EVENT_SCHEMA: source=profiler, op,\n"
            "rank, group_id (sorted world ranks; empty where the trace does not say: gloo\n"
            "with more than one process group), group_size where known, seq, count (NCCL\n"
            "convention), dtype, root, t_start_ns / t_end_ns (trace clock), source_ref\n"
            "(file#ts).\n\n"
            "Prints events per op, per group, ranks, backend annotations and issues.\n\n"
            "Gzipped traces are known by their first bytes, whatever the name. Every other\n"
            "entry of a folder, and a file that is not a trace, is named with its reason.\n\n"
            "Exit status: 0 events written, every file read; 2 bad arguments, a missing path,\n"
            "--out a folder or unwritable, or a file not read (the events of the others are\n"
            "written), or --strict and an issue; 3 no events found (nothing written)."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="TRACE", help="Chrome trace files or folders")
    p.add_argument("--out", required=True, help="output Parquet file (events)")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 when anything could not be read (unknown ops, unpaired "
                        "annotations, a file that is not a trace); with a file not read, "
                        "nothing is written")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK

    prog = "dmuon-trace profiler"
    skipped: list[tuple[str, str]] = []
    try:
        traces = read_profiler_traces(args.paths, skipped)
        if args.strict and skipped:
            raise ValueError(f"Invalid profiler trace {skipped[0][0]!r}: {skipped[0][1]} "
                             "(--strict: every file must be read)")
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    events = [ev for t in traces for ev in t.events]
    lines = summary_lines(traces)
    if skipped:
        lines = [f"files not read: {len(skipped)}", *(f"  {f}: {r}" for f, r in skipped), *lines]
    print("\n".join(lines))
    if not events:
        print(f"{prog}: error: no collective events in {len(traces)} trace(s)"
              + (f" ({len(skipped)} file(s) not read, first: {skipped[0][0]}: {skipped[0][1]})"
                 if skipped else "") + "; nothing written", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    out = write_parquet(events, args.out)
    print(f"wrote {len(events)} events to {out}")
    issues = [i for t in traces for i in t.issues]
    args.dropped = (len(issues), issues[0] if issues else "")  # tracer.cli: --lenient
    if skipped:
        print(f"{prog}: error: {len(skipped)} file(s) not read (listed above; first: "
              f"{skipped[0][0]}: {skipped[0][1]}); the events of the others were written",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.strict and issues:
        print(f"{prog}: error: --strict: {len(issues)} issue(s) (listed above); first: "
              f"{issues[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
