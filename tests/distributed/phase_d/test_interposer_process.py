"""The interposer stamps every event with its process (pid, host), and those pids map an nsys
report's processes to ranks (verify.sources.nsys_verify.assign_ranks), on real gloo ranks."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from tracer.events import CollectiveEvent
from tracer.interposer import Interposer
from verify.sources.nsys_verify import assign_ranks

pytestmark = pytest.mark.distributed


def _record_task():
    sub = dist.new_group([0, 1])
    with Interposer() as ip:
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2), src=1, group=sub)
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
    return ip.events, os.getpid(), socket.gethostname()


def test_events_carry_pid_and_host_and_map_nsys_processes_to_ranks(pool2):
    results = pool2.run(_record_task)
    pids = [pid for _, pid, _ in results]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two rank processes, not this one
    for rank, (events, pid, host) in enumerate(results):
        assert len(events) == 3
        assert {(e.rank, e.pid, e.host) for e in events} == {(rank, pid, host)}
    reference = [ev for events, _, _ in results for ev in events]
    # What nsys knows of those calls: the process and the time (devices deliberately swapped,
    # so a device-based assignment would give the wrong ranks).
    nsys = [CollectiveEvent(source="nsys", op=ev.op, pid=ev.pid, cuda_dev=1 - ev.rank,
                            t_start_ns=i, source_ref=f"r.sqlite#NVTX_EVENTS.{i}")
            for i, ev in enumerate(reference)]
    assert [(e.rank, e.op) for e in assign_ranks(nsys, reference)] == [
        (r, op) for r in (0, 1) for op in ("all_reduce", "broadcast", "all_reduce")]
