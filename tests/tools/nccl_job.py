"""TEST TOOL: render one NCCL_DEBUG_FILE per rank from a run's interposer events.

Used only to test the plumbing of ``verify.sources.nccl_source`` where no GPU exists. The text is
synthetic (line formats from :mod:`tests.tools.nccl_render`, NCCL 2.21 by default); it is never
evidence of what NCCL does. Each file holds what a real one would around a measured window:
INIT lines for the world communicator and for every process group of the events, the same
calls once before the window (a warm-up step), channel chatter of the INIT subsystem, the
window itself, and a trailing world all_gather (the harness's gather to rank 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.tools import nccl_render as R
from tracer.events import CollectiveEvent
from verify.sources.nccl_source import LogWindow

HOST = "node0"


def _pid(rank: int) -> int:
    return 41000 + rank


def _comm_id(group_id: str) -> str:
    return "0x" + hashlib.sha1(group_id.encode()).hexdigest()[:16]


def render_job(folder: Path, events_by_rank: Mapping[int, Sequence[CollectiveEvent]], *,
               world_size: int, version: str = "2.21") -> list[LogWindow]:
    """Write ``nccl.<host>.<pid>.log`` per rank; return each rank's window (line numbers).

    ``events_by_rank``: the interposer's window events of each rank, in issue order.
    """
    folder.mkdir(parents=True, exist_ok=True)
    world = ",".join(map(str, range(world_size)))
    windows = []
    for rank in range(world_size):
        pid, lines = _pid(rank), []
        head = R.prefix(HOST, _pid(rank), _pid(rank), rank)
        groups = [world] + sorted({ev.group_id for ev in events_by_rank[rank]} - {world})
        comm = {gid: f"0x55{rank:02x}{i:04x}a0" for i, gid in enumerate(groups)}
        for gid in groups:
            members = [int(r) for r in gid.split(",")]
            lines.append(head + R.init_line(
                version=version, comm=comm[gid], rank=members.index(rank),
                nranks=len(members), cuda_dev=rank, comm_id=_comm_id(gid)))
        opcount = {gid: 0 for gid in groups}

        def coll(ev: CollectiveEvent) -> str:
            opcount[ev.group_id] += 1
            nccl = ev.replace(source="nccl_log", comm=comm[ev.group_id], host=HOST, pid=pid,
                              cuda_dev=rank, t_start_ns=None)
            return R.event_line(nccl, opcount=opcount[ev.group_id] - 1)

        lines += [coll(ev) for ev in events_by_rank[rank]]  # a warm-up step, outside
        lines.append(head + "Channel 00/02 :    0   1   2   3")
        first = len(lines)
        lines += [coll(ev) for ev in events_by_rank[rank]]
        lines.append(head + "Connected all rings")
        last = len(lines)
        gather = CollectiveEvent(source="nccl_log", op="all_gather", count=8, dtype="uint8",
                                 group_id=world, group_size=world_size)
        lines.append(coll(gather))
        path = folder / f"nccl.{HOST}.{pid}.log"
        path.write_text("\n".join(lines) + "\n")
        windows.append(LogWindow(rank, pid, str(path), first, last))
    return windows
