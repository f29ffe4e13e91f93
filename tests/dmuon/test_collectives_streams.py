"""DMuon's asynchronous launch (dmuon/runtime/collectives.py, "Asynchrony"). The CUDA branch cannot
run on the project's CPU machines: its order of stream operations is checked against a
stand-in accelerator module that logs every call (the same calls torch.cuda takes). The
gloo branch runs for real in the multi-process tests (tests/distributed/)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from dmuon.runtime.collectives import Launcher


class _Event:
    def __init__(self, log, stream):
        self.stream = stream
        log.append(("record_event", stream.name))


class _Stream:
    def __init__(self, log, name, priority=0):
        self.log, self.name, self.priority = log, name, priority

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        return _Event(self.log, self)

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream.name))


class _Accel:
    """What Launcher uses of torch.cuda: Stream, current_stream, stream(ctx)."""

    def __init__(self):
        self.log = []
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self.created = 0

    def Stream(self, device, priority):  # noqa: N802 - torch.cuda.Stream's name
        self.created += 1
        return _Stream(self.log, f"side{self.created}", priority)

    def current_stream(self, device):
        return self.current

    @contextmanager
    def stream(self, s):
        old, self.current = self.current, s
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self.current = old
            self.log.append(("exit", s.name))


def _call(accel):
    def call(async_op):
        accel.log.append(("collective", accel.current.name, async_op))
    return call


def test_cuda_branch_orders_side_stream_after_compute_and_waits_by_event():
    accel = _Accel()
    launcher = Launcher(torch.device("cuda", 0), accel=accel)
    buf = torch.zeros(4)
    pending = launcher.launch("broadcast", _call(accel), buf)
    assert accel.log == [
        ("wait_stream", "side1", "compute"),  # the data the call reads are written first
        ("enter", "side1"),
        ("collective", "side1", False),  # inside the side stream; the CPU does not wait
        ("record_event", "side1"),
        ("exit", "side1"),
    ]
    assert pending._keep == (buf,)  # alive until waited: no record_stream needed
    accel.log.clear()
    pending.wait()
    assert accel.log == [("wait_event", "compute", "side1")]  # the compute stream waits
    pending.wait()
    assert accel.log == [("wait_event", "compute", "side1")] and pending._keep == ()


def test_cuda_branch_one_high_priority_stream_per_channel():
    accel = _Accel()
    launcher = Launcher(torch.device("cuda", 0), accel=accel)
    for ch in ("broadcast", "reduce", "broadcast", "replicate", "reduce"):
        launcher.launch(ch, _call(accel))
    assert accel.created == 3
    assert launcher.stream("broadcast") is not launcher.stream("reduce")
    assert launcher.stream("replicate").priority == Launcher.STREAM_PRIORITY == -1


def test_gloo_branch_uses_async_work_handles():
    calls = []

    class Work:
        def wait(self):
            calls.append("wait")

    def call(async_op):
        calls.append(("collective", async_op))
        return Work()

    launcher = Launcher(torch.device("cpu"))
    assert launcher._accel is None  # async work handles, no side streams
    pending = launcher.launch("reduce", call)
    assert calls == [("collective", True)]
    pending.wait()
    pending.wait()
    assert calls == [("collective", True), "wait"]


def test_device_selects_the_branch():
    assert Launcher(torch.device("cuda", 0))._accel is not None  # side streams; constructing touches no GPU
    with pytest.raises(ValueError, match="Must be None for CPU tensors"):
        Launcher(torch.device("cpu"), accel=_Accel())


def test_synchronize_blocks_on_the_accelerator_only(monkeypatch):
    from dmuon.runtime import collectives

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    collectives.synchronize(torch.device("cpu"))
    collectives.synchronize(torch.device("meta"))
    collectives.synchronize(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]
