"""The byte-counting seam: record every collective this rank issues, as ``CollectiveEvent``s.

Seam. Every ``torch.distributed`` collective, whatever issued it, reaches the dispatcher as
one operator call before any backend runs:

- ``c10d::*`` ops (``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::send`` ...): the
  ``ProcessGroup`` methods call them, so they carry the Python functions
  (``dist.all_reduce``, ``dist.all_gather_into_tensor`` -> ``all_gather_single``, P2P,
  ``batch_isend_irecv``, ``async_op=True``), FSDP2's all-gathers / reduce-scatters and HSDP's
  replicate all-reduce, and DDP's C++ ``Reducer`` bucket all-reduce and construction-time
  broadcasts (``ProcessGroup::allreduce`` in C++ dispatches ``c10d::allreduce_``).
- ``_c10d_functional::*`` / ``_c10d_functional_autograd::*`` / ``_dtensor::*`` ops: functional
  collectives used by DTensor ``redistribute`` / ``full_tensor()``.

:class:`Interposer` is a ``TorchDispatchMode``: its handler runs for each such op, records it,
and calls the op unchanged (results are bit-identical). While a mode handles an op, the mode is
popped, so ops *nested inside* a collective (the ``c10d::_allgather_base_`` a functional
all-gather issues, ``all_gather_into_tensor`` -> ``all_gather_single``) never reach it: each
logical call is recorded once, at its outermost op. Dispatch modes are thread-local state;
autograd captures it at ``backward()`` and restores it on its worker threads
(``at::ThreadLocalState``), so hooks run by autograd (DDP's reducer, FSDP2's post-backward,
DMuon's hooks) are seen. Collectives issued from threads the user starts themselves are not.

Sizes follow :mod:`tracer.events` (NCCL's ``count``): the message for all_reduce / broadcast /
reduce / send / recv; the input (send) count for all_gather; the output (recv) count for
reduce_scatter; the per-peer count for all_to_all (with its totals ``in_elems`` /
``out_elems``).

- Coalesced calls (``allgather_into_tensor_coalesced_``, ``reduce_scatter_tensor_coalesced_``,
  ``allreduce_coalesced_``, ``_coalescing_manager``, functional ``*_coalesced``) give **one
  event per tensor**, with the same times: ProcessGroupNCCL launches one ``ncclAllGather`` /
  ``ncclReduceScatter`` / ``ncclAllReduce`` per tensor inside one ``ncclGroupStart/End``, and
  NCCL logs one line per call (torch ``ProcessGroupNCCL::allgather_into_tensor_coalesced``).
- ``batch_isend_irecv`` gives one send / recv event per P2P op (NCCL logs one Send/Recv each).
- ``all_to_all_single`` / list ``all_to_all``: ``in_elems`` / ``out_elems`` are this rank's
  input and output totals, and ``count`` follows :func:`tracer.events.all_to_all_count`
  (``in_elems / group_size`` when the totals are equal and divide evenly: equal splits or
  none; else ``count`` and ``msg_bytes`` are ``None``). Uneven splits are written into
  ``source_ref`` (NCCL logs them as per-peer Send/Recv lines).
- ``barrier`` has no user payload: ``count``/``dtype`` are ``None`` (ProcessGroupNCCL runs it
  as an AllReduce of one float32 element, which an NCCL log shows).
- ``root`` is a *group* rank: the root of broadcast / reduce, the peer of send / recv (``None``
  for ``recv`` from any source). ``c10d`` ops already receive group ranks.
- ``gather`` / ``scatter``: ``count`` is each rank's send count (gather's input) or receive
  count (scatter's output), ``root`` the root's group rank, as NCCL 2.28+ logs
  ``ncclGather`` / ``ncclScatter``.

Times: ``t_start_ns`` / ``t_end_ns`` are :func:`tracer.context.now_ns` just before and after
the op call. For asynchronous ops (``async_op=True``, functional collectives, everything on
NCCL) the end is the return of the *issue*, not completion of the transfer.

Waits: for a c10d call (``async_op=True``: DMuon's broadcasts and reduces, FSDP2's
all-gathers; see below for ``async_op=False``) the interposer keeps the returned ``Work`` until its ``wait()`` is
called from Python and writes ``t_wait_start_ns`` / ``t_waited_ns`` (when ``wait()`` was
called and returned) on the call's events: ``[t_start_ns, t_waited_ns]`` is the call's
in-flight interval from the training thread's view. While any interposer is active,
``torch.distributed.Work.wait`` is replaced by a timing wrapper that calls the original
unchanged (results, errors, ``timeout`` and the other methods are untouched); it is restored
when the last one exits. Only the first ``wait()`` of a handle counts. Synchronous calls
(``async_op=False``) get them too: on gloo the c10d op returns before the transfer ends and
``torch/distributed/distributed_c10d.py`` waits right after (a sync broadcast whose peer was
200 ms late returned from the op in 0.48 ms), so that wait is where the training thread is
blocked. Left without wait times: handles never waited on or waited from C++ (DDP's
reducer), and functional collectives (whose ``wait_tensor`` is not tracked).

Process: every event carries ``pid`` (``os.getpid()``) and ``host`` (``socket.gethostname()``),
read once at the first recorded call, so that sources which only know the process (an nsys
report) can be mapped to ranks (:func:`verify.sources.nsys_verify.assign_ranks`).

``seq`` counts this rank's recorded calls per ``group_id`` (0-based). Two process groups over
the same ranks share a ``group_id`` and hence one counter. A process group that is not
registered with ``torch.distributed`` (built by hand) gets ``group_id=None``.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tracer import context
from tracer.events import CollectiveEvent, all_to_all_count, group_id_from_ranks

#: Namespaces of collective ops the interposer inspects; every other op passes straight through.
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")

#: Ops in those namespaces that move no data of their own.
_IGNORED = frozenset(
    {
        "c10d::check_for_nan",
        "_c10d_functional::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
    }
)


@dataclass(frozen=True, slots=True)
class _Call:
    """One logical collective found in an op's arguments (before group / timing)."""

    op: str
    count: int | None
    dtype: str | None
    root: int | None = None
    note: str = ""
    in_elems: int | None = None
    out_elems: int | None = None


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _msg(op: str, t: torch.Tensor, count: int | None = None, root: int | None = None) -> _Call:
    return _Call(op, t.numel() if count is None else count, _dtype_name(t), root)


def _first(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    assert len(tensors) >= 1, "c10d op with an empty tensor list"
    return tensors[0]


def _all_to_all(inp: torch.Tensor, out: torch.Tensor | None, out_splits, in_splits,
                group_size: int) -> _Call:
    """all_to_all of ``inp`` into ``out`` (dim-0 splits; functional calls have no ``out``:
    its size follows from ``out_splits``). Totals in ``in_elems`` / ``out_elems``, ``count``
    by :func:`tracer.events.all_to_all_count`; uneven splits are noted."""
    row_elems = inp.numel() // inp.shape[0] if inp.dim() > 0 and inp.shape[0] > 0 else 1
    in_splits, out_splits = [int(s) for s in in_splits], [int(s) for s in out_splits]
    in_elems = inp.numel()
    if out is not None:
        out_elems = out.numel()
    else:
        out_elems = sum(out_splits) * row_elems if out_splits else in_elems
    note = ""
    if len(set(in_splits + out_splits)) > 1:
        note = f"uneven all_to_all in_splits={in_splits} out_splits={out_splits} {row_elems=}"
    return _Call("all_to_all", all_to_all_count(in_elems, out_elems, group_size), _dtype_name(inp),
                 None, note, in_elems, out_elems)


def _all_to_all_list(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                     group_size: int) -> _Call:
    """all_to_all of lists (one tensor per peer): totals and ``count`` as :func:`_all_to_all`."""
    numels_in, numels_out = [t.numel() for t in inputs], [t.numel() for t in outputs]
    in_elems, out_elems = sum(numels_in), sum(numels_out)
    note = "" if len(set(numels_in + numels_out)) == 1 else \
        f"uneven all_to_all in={numels_in} out={numels_out}"
    return _Call("all_to_all", all_to_all_count(in_elems, out_elems, group_size),
                 _dtype_name(inputs[0]), None, note, in_elems, out_elems)


# Each handler maps the op's bound arguments to the logical calls it makes; the group comes
# from the argument named ``process_group`` (c10d) or ``group_name`` (functional).
_Handler = Callable[[dict[str, Any], int], list[_Call]]

_C10D: dict[str, _Handler] = {
    "allreduce_": lambda a, n: [_msg("all_reduce", _first(a["tensors"]))],
    "allreduce_coalesced_": lambda a, n: [_msg("all_reduce", t) for t in a["tensors"]],
    "broadcast_": lambda a, n: [_msg("broadcast", _first(a["tensors"]), root=a["root_rank"])],
    "reduce_": lambda a, n: [_msg("reduce", _first(a["tensors"]), root=a["root_rank"])],
    "gather_": lambda a, n: [_msg("gather", _first(a["input_tensors"]), root=a["root_rank"])],
    "scatter_": lambda a, n: [_msg("scatter", _first(a["output_tensors"]), root=a["root_rank"])],
    "allgather_": lambda a, n: [_msg("all_gather", _first(a["input_tensors"]))],
    "_allgather_base_": lambda a, n: [_msg("all_gather", a["input_tensor"])],
    "allgather_coalesced_": lambda a, n: [_msg("all_gather", t) for t in a["input_list"]],
    "allgather_into_tensor_coalesced_": lambda a, n: [_msg("all_gather", t) for t in a["inputs"]],
    "reduce_scatter_": lambda a, n: [_msg("reduce_scatter", _first(a["output_tensors"]))],
    "_reduce_scatter_base_": lambda a, n: [_msg("reduce_scatter", a["output_tensor"])],
    "reduce_scatter_tensor_coalesced_": lambda a, n: [
        _msg("reduce_scatter", t) for t in a["outputs"]
    ],
    "alltoall_base_": lambda a, n: [
        _all_to_all(a["input"], a["output"], a["output_split_sizes"], a["input_split_sizes"], n)
    ],
    "alltoall_": lambda a, n: [_all_to_all_list(a["input_tensors"], a["output_tensors"], n)],
    "barrier": lambda a, n: [_Call("barrier", None, None)],
    "monitored_barrier_": lambda a, n: [_Call("barrier", None, None)],
    "send": lambda a, n: [_msg("send", _first(a["tensors"]), root=a["dst"])],
    "recv_": lambda a, n: [_msg("recv", _first(a["tensors"]), root=a["src"])],
    "recv_any_source_": lambda a, n: [_msg("recv", _first(a["tensors"]))],
}

_FUNCTIONAL: dict[str, _Handler] = {
    "all_reduce": lambda a, n: [_msg("all_reduce", a["input"])],
    "all_reduce_": lambda a, n: [_msg("all_reduce", a["input"])],
    "all_reduce_coalesced": lambda a, n: [_msg("all_reduce", t) for t in a["inputs"]],
    "all_reduce_coalesced_": lambda a, n: [_msg("all_reduce", t) for t in a["inputs"]],
    "all_gather_into_tensor": lambda a, n: [_msg("all_gather", a["input"])],
    "all_gather_into_tensor_out": lambda a, n: [_msg("all_gather", a["input"])],
    "all_gather_into_tensor_coalesced": lambda a, n: [
        _msg("all_gather", t) for t in a["inputs"]
    ],
    "reduce_scatter_tensor": lambda a, n: [
        _msg("reduce_scatter", a["input"], a["input"].numel() // n)
    ],
    "reduce_scatter_tensor_out": lambda a, n: [
        _msg("reduce_scatter", a["input"], a["input"].numel() // n)
    ],
    "reduce_scatter_tensor_coalesced": lambda a, n: [
        _msg("reduce_scatter", t, t.numel() // n) for t in a["inputs"]
    ],
    "all_to_all_single": lambda a, n: [
        _all_to_all(a["input"], None, a["output_split_sizes"], a["input_split_sizes"], n)
    ],
    "broadcast": lambda a, n: [_msg("broadcast", a["input"], root=a["src"])],
    "broadcast_": lambda a, n: [_msg("broadcast", a["input"], root=a["src"])],
    "isend": lambda a, n: [_msg("send", a["tensor"], root=a["dst"])],
    "irecv": lambda a, n: [_msg("recv", a["tensor"], root=a["src"])],
    "batch_p2p_ops": lambda a, n: [
        _msg("send" if kind == "isend" else "recv", t, root=peer)
        for kind, peer, t in zip(a["op_list"], a["peer_list"], a["tensors"], strict=True)
    ],
}

_HANDLERS: dict[str, _Handler] = {f"c10d::{k}": v for k, v in _C10D.items()}
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    _HANDLERS.update({f"{_ns}::{k}": v for k, v in _FUNCTIONAL.items()})
_HANDLERS["_dtensor::shard_dim_alltoall"] = lambda a, n: [  # the output holds as many elements
    _all_to_all(a["input"], None, [], [], n)
]
_PASS = object()  # route: not a collective
_UNRECORDED = object()  # route: a collective the interposer cannot represent


# ------------------------------------------------------------------------------ wait timing
#: ``fn(work, t_wait_start_ns, t_waited_ns)`` of each active interposer.
_WaitListener = Callable[[Any, int, int], None]
_wait_listeners: list[_WaitListener] = []
_wait_lock = threading.Lock()
_ORIGINAL_WAIT = dist.Work.wait


def _timed_wait(self, *args, **kwargs):
    """``torch.distributed.Work.wait`` while an interposer is active: the original, timed."""
    t_wait_start_ns = context.now_ns()
    out = _ORIGINAL_WAIT(self, *args, **kwargs)
    t_waited_ns = context.now_ns()
    for fn in list(_wait_listeners):
        fn(self, t_wait_start_ns, t_waited_ns)
    return out


def _add_wait_listener(fn: _WaitListener) -> None:
    with _wait_lock:
        if not _wait_listeners:
            dist.Work.wait = _timed_wait
        _wait_listeners.append(fn)


def _remove_wait_listener(fn: _WaitListener) -> None:
    with _wait_lock:
        if fn in _wait_listeners:
            _wait_listeners.remove(fn)
        if not _wait_listeners:
            dist.Work.wait = _ORIGINAL_WAIT


def _work_of(out: Any) -> dist.Work | None:
    """The ``Work`` a c10d op returned (alone or last in its result tuple), or ``None``."""
    if isinstance(out, (tuple, list)) and out:
        out = out[-1]
    if not isinstance(out, torch.ScriptObject):
        return None
    try:
        return dist.Work.unbox(out)
    except (RuntimeError, TypeError):  # another TorchScript class
        return None


@dataclass(frozen=True, slots=True)
class _Group:
    group_id: str | None
    group_size: int
    group_rank: int


def _unbox(pg: Any) -> dist.ProcessGroup:
    """The Python ``ProcessGroup`` of an op argument (a TorchScript object or a group name)."""
    if isinstance(pg, str):
        return dist.distributed_c10d._resolve_process_group(pg)
    if isinstance(pg, dist.ProcessGroup):
        return pg
    return dist.ProcessGroup.unbox(pg)


class Interposer(TorchDispatchMode):
    """Record every collective this process issues while active, plus DMuon spans.

    Usage (inside each rank, default process group initialised)::

        with Interposer() as ip:
            train_step()
        ip.events  # list[CollectiveEvent], source="interposer", in issue order
        ip.spans   # list[tracer.context.Span] ended while active

    Attributes:
        events: recorded :class:`~tracer.events.CollectiveEvent` (``rank`` = world rank;
            ``phase`` = :func:`tracer.context.current_phase` and ``module`` = module of
            :func:`tracer.context.current_span` at issue time; ``pid`` / ``host`` of this
            process).
        spans: DMuon spans that ended while active (from every thread of this process).
            Calls get ``t_wait_start_ns`` / ``t_waited_ns`` when their handle's ``wait()``
            returns (module docstring, "Waits").
        unrecorded: ``(op name, reason)`` of collectives seen but not representable.

    Entering adds one dispatch mode, one span listener and one wait listener (the first active
    interposer patches ``torch.distributed.Work.wait``); exiting removes them (no global state
    remains, pending handles are dropped). An instance records one session: entering it again raises ``ValueError``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[CollectiveEvent] = []
        self.spans: list[context.Span] = []
        self.unrecorded: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._seq: dict[str | None, int] = {}
        self._groups: dict[Any, _Group] = {}
        self._arg_names: dict[Any, list[str]] = {}
        self._routes: dict[Any, Any] = {}
        self._used = False
        self._rank: int | None = None
        self._pid: int | None = None
        self._host: str | None = None
        self._pending: dict[int, tuple[dist.Work, list[int]]] = {}  # id(work) -> (work, events)

    # ----------------------------------------------------------------------- mode lifecycle
    def __enter__(self) -> Interposer:
        if self._used:
            raise ValueError(
                "Invalid reuse of an Interposer: it was already entered once. Must create a "
                "new Interposer() for each recording."
            )
        self._used = True
        context.add_span_listener(self._on_span)
        _add_wait_listener(self._on_wait)
        try:
            return super().__enter__()
        except BaseException:
            self._detach()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._detach()

    def _detach(self) -> None:
        context.remove_span_listener(self._on_span)
        _remove_wait_listener(self._on_wait)
        with self._lock:
            self._pending.clear()

    def _on_wait(self, work: dist.Work, t_wait_start_ns: int, t_waited_ns: int) -> None:
        with self._lock:
            entry = self._pending.get(id(work))
            if entry is None or entry[0] is not work:
                return  # not issued while recording, or already waited on once
            del self._pending[id(work)]
            for i in entry[1]:
                self.events[i] = self.events[i].replace(
                    t_wait_start_ns=t_wait_start_ns, t_waited_ns=t_waited_ns)

    def _on_span(self, span: context.Span) -> None:
        with self._lock:
            self.spans.append(span)

    # ---------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = self._routes.get(func)
        if route is None:
            route = self._routes[func] = self._route(func)
        if route is _PASS:  # every non-collective op: straight through
            return func(*args, **kwargs)
        if route is _UNRECORDED:
            self._note_unrecorded(func._schema.name)
            return func(*args, **kwargs)
        bound = self._bind(func, args, kwargs)
        phase = context.current_phase()
        span = context.current_span()
        t_start_ns = context.now_ns()
        out = func(*args, **kwargs)
        t_end_ns = context.now_ns()
        group = self._group(bound.get("process_group", bound.get("group_name")))
        calls = route(bound, group.group_size)
        indices = self._record(calls, group, phase, span[1] if span else None, t_start_ns, t_end_ns)
        work = _work_of(out) if func.namespace == "c10d" else None
        if work is not None and indices:
            with self._lock:
                self._pending[id(work)] = (work, indices)
        return out

    @staticmethod
    def _route(func) -> _Handler | object:
        """The handler of ``func``, :data:`_PASS` or :data:`_UNRECORDED`."""
        if func.namespace not in NAMESPACES:
            return _PASS
        name = func._schema.name
        if name in _IGNORED:
            return _PASS
        return _HANDLERS.get(name, _UNRECORDED)

    def _bind(self, func, args, kwargs) -> dict[str, Any]:
        names = self._arg_names.get(func)
        if names is None:
            names = self._arg_names[func] = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return bound

    def _group(self, pg_arg: Any) -> _Group:
        """Identity of the op's process group, cached per group name / ProcessGroup object."""
        if isinstance(pg_arg, str):
            group = self._groups.get(pg_arg)
            if group is not None:
                return group
        pg = _unbox(pg_arg)  # the registered Python object: stable while the group lives
        key = pg_arg if isinstance(pg_arg, str) else pg
        group = self._groups.get(key)
        if group is None:
            try:
                group_id = group_id_from_ranks(dist.get_process_group_ranks(pg))
            except (ValueError, RuntimeError, KeyError):
                group_id = None  # a ProcessGroup built by hand, unknown to torch.distributed
            group = self._groups[key] = _Group(group_id, pg.size(), pg.rank())
        return group

    def _record(self, calls, group, phase, module, t_start_ns, t_end_ns) -> list[int]:
        """Append one event per call; returns their indices in :attr:`events`."""
        if self._rank is None:  # at the first call, in the process that records
            self._rank = dist.get_rank()
            self._pid, self._host = os.getpid(), socket.gethostname()
        with self._lock:
            first = len(self.events)
            for call in calls:
                seq = self._seq.get(group.group_id, 0)
                self._seq[group.group_id] = seq + 1
                ref = f"interposer:rank{self._rank}:#{len(self.events)}"
                self.events.append(
                    CollectiveEvent(
                        source="interposer",
                        op=call.op,
                        rank=self._rank,
                        group_id=group.group_id,
                        group_size=group.group_size,
                        group_rank=group.group_rank,
                        seq=seq,
                        count=call.count,
                        dtype=call.dtype,
                        root=call.root,
                        phase=phase,
                        module=module,
                        t_start_ns=t_start_ns,
                        t_end_ns=t_end_ns,
                        source_ref=f"{ref} {call.note}" if call.note else ref,
                        pid=self._pid,
                        host=self._host,
                        in_elems=call.in_elems,
                        out_elems=call.out_elems,
                    )
                )
            return list(range(first, len(self.events)))

    def _note_unrecorded(self, name: str) -> None:
        reason = "unknown collective op (not in tracer.interposer's table)"
        with self._lock:
            first = all(n != name for n, _ in self.unrecorded)
            self.unrecorded.append((name, reason))
        if first:
            warnings.warn(
                f"Interposer saw {name} and did not record it: {reason}. Traffic totals of "
                "this run miss it.",
                RuntimeWarning,
                stacklevel=3,
            )
