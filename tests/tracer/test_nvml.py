"""tracer.nvml: the real no-driver path of this machine, and the arithmetic with a fake pynvml."""

from __future__ import annotations

import types

import pytest

from tracer import nvml as tnvml
from tracer.nvml import FIELD_NVLINK_RX_KIB, FIELD_NVLINK_TX_KIB, NvlinkSampler


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    """Tests set CUDA_VISIBLE_DEVICES themselves (a GPU node's value would change which
    devices the sampler reads)."""
    monkeypatch.delenv(tnvml.VISIBLE_ENV, raising=False)


def _has_nvml_driver() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_has_nvml_driver(), reason="an NVML driver is present on this machine")
def test_real_pynvml_without_driver_reports_unavailable():
    sampler = NvlinkSampler()
    sampler.start()
    reading = sampler.stop()
    assert reading.available is False
    assert reading.reason.startswith("NVML unavailable: nvmlInit failed with NVMLError")
    assert reading.tx_bytes == {} and reading.total_tx_bytes == 0


def test_stop_without_start():
    reading = NvlinkSampler().stop()
    assert (reading.available, reading.reason) == (False, "start() was not called")


def test_invalid_devices():
    with pytest.raises(ValueError, match=r"devices=\[-1\]"):
        NvlinkSampler(devices=[-1])


class _Value:
    def __init__(self, field_id, scope, kib, ret=0):
        self.fieldId, self.scopeId, self.nvmlReturn = field_id, scope, ret
        self.value = types.SimpleNamespace(ullVal=kib)


def _fake_pynvml(counters, active_links, fail_init=False):
    """counters: {device: {link: [tx_kib, rx_kib]}} mutated by the test between reads."""
    calls = {"shutdown": 0}

    class NVMLError_LibraryNotFound(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def state(handle, link):
        if link >= 4:
            raise NVMLError_LibraryNotFound("invalid argument")  # any NVMLError past the end
        return 1 if link in active_links[handle] else 0

    def field_values(handle, ids):
        out = []
        for field_id, link in ids:
            tx, rx = counters[handle][link]
            out.append(_Value(field_id, link, tx if field_id == FIELD_NVLINK_TX_KIB else rx))
        return out

    def shutdown():
        calls["shutdown"] += 1

    mod = types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=shutdown, nvmlDeviceGetCount=lambda: len(counters),
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:x}{h:x}a1b2c3-0000-4000-8000-00000000000{h}".encode(),
        nvmlDeviceGetFieldValues=field_values, NVML_NVLINK_MAX_LINKS=18)
    return mod, calls


def test_fake_pynvml_deltas_per_link_and_device(monkeypatch):
    counters = {0: {0: [100, 200], 1: [5, 5], 2: [0, 0]}, 1: {0: [0, 0], 1: [7, 9]}}
    mod, calls = _fake_pynvml(counters, active_links={0: {0, 1}, 1: {1}})
    monkeypatch.setattr(tnvml, "_load_pynvml", lambda: mod)
    sampler = NvlinkSampler()
    sampler.start()
    counters[0][0] = [100 + 3, 200 + 1]   # KiB
    counters[0][1] = [5 + 2, 5 + 4]
    counters[0][2] = [999, 999]           # inactive link: not summed
    counters[1][1] = [7 + 10, 9 + 20]
    r = sampler.stop()
    assert r.available and r.reason is None
    assert r.tx_bytes == {0: 5 * 1024, 1: 10 * 1024}
    assert r.rx_bytes == {0: 5 * 1024, 1: 20 * 1024}
    assert r.per_link_tx_bytes == {0: {0: 3 * 1024, 1: 2 * 1024}, 1: {1: 10 * 1024}}
    assert r.links == {0: 2, 1: 1}
    assert (r.total_tx_bytes, r.total_rx_bytes) == (15 * 1024, 25 * 1024)
    assert calls["shutdown"] == 1
    assert FIELD_NVLINK_RX_KIB == 139


def test_fake_pynvml_no_active_links_and_init_failure(monkeypatch):
    mod, _ = _fake_pynvml({0: {0: [0, 0]}}, active_links={0: set()})
    monkeypatch.setattr(tnvml, "_load_pynvml", lambda: mod)
    s = NvlinkSampler()
    s.start()
    assert s.stop().reason == "no active NVLink on devices [0]"
    mod, _ = _fake_pynvml({0: {0: [0, 0]}}, active_links={0: {0}}, fail_init=True)
    monkeypatch.setattr(tnvml, "_load_pynvml", lambda: mod)
    s = NvlinkSampler()
    s.start()
    assert "NVMLError_LibraryNotFound" in s.stop().reason


def test_fake_pynvml_field_error_is_reported(monkeypatch):
    mod, _ = _fake_pynvml({0: {0: [0, 0]}}, active_links={0: {0}})
    mod.nvmlDeviceGetFieldValues = lambda h, ids: [_Value(f, lk, 0, ret=3) for f, lk in ids]
    monkeypatch.setattr(tnvml, "_load_pynvml", lambda: mod)
    s = NvlinkSampler()
    s.start()
    r = s.stop()
    assert not r.available and "returned NVML error 3" in r.reason


def _eight_gpus(monkeypatch):
    counters = {d: {0: [0, 0]} for d in range(8)}
    mod, _ = _fake_pynvml(counters, active_links={d: {0} for d in range(8)})
    monkeypatch.setattr(tnvml, "_load_pynvml", lambda: mod)
    return counters, mod


@pytest.mark.parametrize("visible, devices", [
    ("2,5", [2, 5]),
    (" 5 , 2 ", [5, 2]),
    ("GPU-33a1b2c3-0000-4000-8000-000000000003,6", [3, 6]),
    ("GPU-77a1", [7]),                 # a unique UUID prefix, as CUDA accepts
    ("44a1b2c3", [4]),                 # a UUID without its GPU- prefix
    ("1,-1,3", [1]),                   # CUDA stops at the first invalid entry
    ("0,9,3", [0]),
])
def test_sampler_reads_only_cuda_visible_devices(monkeypatch, visible, devices):
    """NVML numbers every GPU of the node; a job given GPUs 2 and 5 sampled all 8 and summed
    the other jobs' traffic into its own (before the fix ``devices=None`` meant every GPU)."""
    counters, _ = _eight_gpus(monkeypatch)
    monkeypatch.setenv(tnvml.VISIBLE_ENV, visible)
    s = NvlinkSampler()
    s.start()
    for d in counters:
        counters[d][0] = [d + 1, 0]    # every GPU moves d+1 KiB: the sum says which were read
    r = s.stop()
    assert r.available, r.reason
    assert sorted(r.tx_bytes) == sorted(devices)
    assert r.total_tx_bytes == sum((d + 1) * 1024 for d in devices)


@pytest.mark.parametrize("visible, message", [
    ("MIG-GPU-11a1b2c3/1/0", "is a MIG instance"),
    ("GPU-", "is a prefix of 8 GPUs"),
    ("2,2", "GPU 2 is named twice"),
    ("-1", "names none of the 8 GPUs"),
    ("GPU-ffff", "names none of the 8 GPUs"),
])
def test_bad_visible_devices_make_the_reading_unavailable_with_the_reason(monkeypatch, visible, message):
    _eight_gpus(monkeypatch)
    monkeypatch.setenv(tnvml.VISIBLE_ENV, visible)
    s = NvlinkSampler()
    s.start()
    r = s.stop()
    assert not r.available and message in r.reason and repr(visible) in r.reason


def test_unset_means_every_gpu_and_explicit_devices_win(monkeypatch):
    _eight_gpus(monkeypatch)
    s = NvlinkSampler()
    s.start()
    assert sorted(s.stop().links) == list(range(8))
    monkeypatch.setenv(tnvml.VISIBLE_ENV, "1")
    s = NvlinkSampler(devices=[3, 4])
    s.start()
    assert sorted(s.stop().links) == [3, 4]


def test_missing_pynvml_degrades_with_a_message(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(tnvml, "_load_pynvml", missing)
    s = NvlinkSampler()
    s.start()
    r = s.stop()
    assert not r.available and "pynvml not importable" in r.reason and "nvidia-ml-py" in r.reason
