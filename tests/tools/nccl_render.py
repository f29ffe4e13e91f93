"""TEST TOOL: render CollectiveEvent records and INIT lines in NCCL_DEBUG=INFO line format.

Used only by the parser's tests and benchmark to produce logs whose content is known
exactly. Rendered text is synthetic: it is never evidence of what NCCL does (the real
fixtures under ``shared/fixtures/nccl/`` are). Formats follow the ``INFO(...)`` calls of
NCCL's ``src/enqueue.cc`` (COLL) and ``src/init.cc`` (INIT) at the named release:

- ``"2.4"``:  ``comm %p rank %d nranks %d cudaDev %d nvmlDev %d - Init COMPLETE``
- ``"2.18"``: ``comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init COMPLETE``
- ``"2.21"``: ``ncclCommInitRank comm ...`` (2.18 fields); splits as ``ncclCommSplit ... parent %p color %d key %d commId ...``
- ``"2.24"``: like 2.21; splits without commId: ``... parent %p splitCount %d color %d key %d - Init COMPLETE``
- ``"2.29"``: START lines get a ``[Rank %d] `` prefix.
"""

from __future__ import annotations

import datetime as _dt

from tracer.events import CollectiveEvent
from tracer.nccl.formats import DATATYPE_NUMBERS

#: Canonical op -> NCCL COLL op name.
NCCL_NAME = {"all_reduce": "AllReduce", "all_gather": "AllGather",
             "reduce_scatter": "ReduceScatter", "broadcast": "Broadcast", "reduce": "Reduce",
             "send": "Send", "recv": "Recv", "all_to_all": "AlltoAll", "gather": "Gather",
             "scatter": "Scatter"}  # Gather / Scatter: NCCL 2.28+

VERSIONS = ("2.4", "2.18", "2.21", "2.24", "2.29")


def _v(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def prefix(host: str, pid: int, tid: int, cuda_dev: int, t_start_ns: int | None = None) -> str:
    """``[YYYY-mm-dd HH:MM:SS.ffffff] host:pid:tid [dev] NCCL INFO `` (timestamp optional,
    rendered as UTC with microseconds)."""
    head = ""
    if t_start_ns is not None:
        t = _dt.datetime.fromtimestamp(t_start_ns // 1000 / 1e6, _dt.timezone.utc)
        head = f"[{t.strftime('%Y-%m-%d %H:%M:%S')}.{t.microsecond:06d}] "
    return f"{head}{host}:{pid}:{tid} [{cuda_dev}] NCCL INFO "


def init_line(*, version: str, comm: str, rank: int, nranks: int, cuda_dev: int,
              comm_id: str | None = None, parent: str | None = None, color: int | None = None,
              key: int | None = None, split_count: int | None = None,
              state: str = "COMPLETE") -> str:
    """INIT message (without prefix) of ``version`` (one of :data:`VERSIONS`)."""
    v = _v(version)
    body = f"comm {comm} rank {rank} nranks {nranks} cudaDev {cuda_dev} nvmlDev {cuda_dev}"
    if v >= (2, 18):
        body += f" busId {0x1000 * (cuda_dev + 1):x}"
    if parent is not None:
        body += f" parent {parent}"
        if v >= (2, 24):
            body += f" splitCount {split_count}"
        body += f" color {color} key {key}"
        if v < (2, 23):
            body += f" commId {comm_id}"
    elif v >= (2, 16):
        body += f" commId {comm_id}"
    if v >= (2, 21):
        body = ("ncclCommSplit " if parent is not None else "ncclCommInitRank ") + body
    if v >= (2, 29) and state == "START":
        body = f"[Rank {rank}] " + body
    return f"{body} - Init {state}"


def coll_line(ev: CollectiveEvent, *, opcount: int = 0, sendbuff: str = "0x7f0000000000",
              recvbuff: str = "0x7f0000100000", stream: str = "0x55aa00000000",
              redop: int = 0) -> str:
    """COLL message (without prefix) for ``ev`` (op, count, dtype, root, comm, group_size).
    Send prints ``sendbuff (nil)`` as NCCL 2.14+ does.

    Raises:
        ValueError: ``ev`` is an uneven all_to_all (no count): NCCL has no such COLL line.
    """
    if ev.op == "all_to_all" and ev.count is None:
        raise ValueError(f"Invalid event {ev.source_ref}: an uneven all_to_all (in_elems="
                         f"{ev.in_elems}, out_elems={ev.out_elems}) has no NCCL COLL line. Must "
                         "be rendered from a run NCCL could make (NCCL logs per-peer Send/Recv).")
    if ev.op == "send":
        sendbuff, recvbuff = "(nil)", sendbuff
    elif ev.op == "recv":
        sendbuff = "(nil)"
    nranks = f" [nranks={ev.group_size}]" if ev.group_size is not None else ""
    return (f"{NCCL_NAME[ev.op]}: opCount {opcount:x} sendbuff {sendbuff} recvbuff {recvbuff} "
            f"count {ev.count} datatype {DATATYPE_NUMBERS[ev.dtype]} op {redop} "
            f"root {ev.root if ev.root is not None else 0} comm {ev.comm}{nranks} stream {stream}")


def event_line(ev: CollectiveEvent, *, tid: int | None = None, **kw) -> str:
    """Full physical line (prefix + COLL message, no newline) for ``ev`` using its host,
    pid, cuda_dev and t_start_ns."""
    return prefix(ev.host, ev.pid, tid or ev.pid, ev.cuda_dev, ev.t_start_ns) + coll_line(ev, **kw)


def destroy_line(*, comm: str, rank: int, nranks: int, cuda_dev: int) -> str:
    """``comm %p rank %d nranks %d cudaDev %d busId %lx - Destroy COMPLETE`` (no prefix;
    ``src/init.cc``, ``commDestroy``)."""
    return (f"comm {comm} rank {rank} nranks {nranks} cudaDev {cuda_dev} "
            f"busId {0x1000 * (cuda_dev + 1):x} - Destroy COMPLETE")


def torch_comm_line(*, pg: str, pg_name: str, rank: int, comm: str, tid: int,
                    cuda_dev: int) -> str:
    """PyTorch's glog line naming a comm pointer (``ProcessGroupNCCL.cpp``), the device index
    streamed as a raw character as PyTorch does (``c10::DeviceIndex`` is an ``int8_t``)."""
    return (f"I0527 15:16:57.738664 {tid} ProcessGroupNCCL.cpp:2183] [PG {pg} ({pg_name}) "
            f"Rank {rank}] ProcessGroupNCCL created ncclComm_ {comm} on CUDA device: "
            f"{chr(cuda_dev)}")


def timestamp_text(year: int, month: int, day: int, hour: int, minute: int, second: int,
                   frac: str = "") -> str:
    """``[YYYY-mm-dd HH:MM:SS[.frac]] `` with any field values (also impossible ones)."""
    dot = f".{frac}" if frac else ""
    return f"[{year:04d}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d}{dot}] "
