"""verify.sources.nvlink: modelled wire bytes and the report entry; the runner's real no-NVML path."""

from __future__ import annotations

import pytest

from tracer.events import CollectiveEvent
from tracer.nvml import NvlinkReading, NvlinkSampler
from verify.sources.nvlink import modelled_wire_bytes, nvlink_report


def _ev(op, count, n, dtype="float32"):
    return CollectiveEvent(source="interposer", op=op, count=count, dtype=dtype, group_size=n)


def test_modelled_wire_bytes_is_the_bus_traffic_of_every_member():
    # all_gather, 4 ranks, 1000 fp32 each: every member receives (n-1)/n * S = 3000 elements
    four_views = [_ev("all_gather", 1000, 4)] * 4
    assert modelled_wire_bytes(four_views) == 4 * 3000 * 4
    # all_reduce, 2 ranks, 10 bf16: 2(n-1)/n * S = 10 elements per member
    assert modelled_wire_bytes([_ev("all_reduce", 10, 2, "bfloat16")] * 2) == 2 * 10 * 2
    with pytest.raises(ValueError, match="count, group_size and dtype_bytes must be known"):
        modelled_wire_bytes([CollectiveEvent(source="nsys", op="broadcast", msg_bytes=8)])


def test_report_available_sums_nodes():
    reading = NvlinkReading(True, None, {0: 100, 1: 300}, {0: 50, 1: 50}, links={0: 4, 1: 4})
    out = nvlink_report([reading, reading], [_ev("all_gather", 1000, 4)] * 4)
    assert out == {"available": True, "tx_bytes": 800, "rx_bytes": 200,
                   "modelled_wire_bytes": 48000, "tx_to_model": 800 / 48000, "links": 16}


def test_report_unavailable_names_the_reason():
    bad = NvlinkReading(False, "no active NVLink on devices [0]")
    good = NvlinkReading(True, None, {0: 1}, {0: 1}, links={0: 1})
    assert nvlink_report([good, bad], []) == {"available": False,
                                              "reason": "no active NVLink on devices [0]"}
    assert nvlink_report([], [])["reason"] == "no node sampled NVLink counters"


def test_this_machine_reports_why_not():
    sampler = NvlinkSampler()
    sampler.start()
    out = nvlink_report([sampler.stop()], [])
    if out["available"]:
        pytest.skip("this machine has NVLink counters")
    assert out["reason"]  # e.g. "NVML unavailable: nvmlInit failed with NVMLError_LibraryNotFound: ..."


def test_report_renders_nvlink_one_line_or_table():
    from tests.report_builders import example_report
    from verify.report.render import format_markdown
    from verify.report.terminal import format_table

    report = example_report()
    for run in report["runs"]:
        run["nvlink"] = {"available": False, "reason": "NVML unavailable: no driver"}
    assert "NVLink counters (NVML, coarse cross-check): unavailable: NVML unavailable: no driver" in format_table(report)
    report["runs"][0]["nvlink"] = {"available": True, "tx_bytes": 1200, "rx_bytes": 1200,
                                   "modelled_wire_bytes": 1000, "tx_to_model": 1.2, "links": 8}
    text, md = format_table(report), format_markdown(report)
    assert "1,200" in text and "1,000" in text and "unavailable" in text
    assert "## NVLink counters" in md and "TX / model" in md
