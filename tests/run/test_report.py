"""Tests of the verify-traffic report renderers (verify/report/render.py, verify/report/plots.py).

The example report follows the traffic model of docs/spec.md §2 for a small GPT (2 blocks,
d=64: per block qkv 64×192, proj 64×64, fc1 64×256, fc2 256×64, so P_M = 98,304) at W=4 on
gloo, all 9 modes, with dmuon-z3 failing: the backward re-broadcast of blocks.1.mlp is missing
on every rank and a 1-element all_reduce (a barrier) is unexpected. No trace fixture is read
here.
"""

from __future__ import annotations

import copy
import json
import random

import matplotlib.image
import pytest

from dmuon.annotate import Span
from tests.report_builders import FR_MISMATCHES, P_M, example_report
from tracer.events import CollectiveEvent
from verify.measure.compute_spans import BACKWARD, FORWARD
from verify.report.plots import _pieces, plot_timeline, plot_traffic, timeline_bars, traffic_series
from verify.report.render import (
    MODES,
    fmt_elems,
    format_markdown,
    read_report,
    report_json,
    table_rows,
    write_report,
)
from verify.report.schema import SCHEMA_VERSION
from verify.report.terminal import format_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: A chart with axes, bars and text is tens of kB; a blank or failed canvas is far smaller.
MIN_PNG_BYTES = 10_000


@pytest.fixture
def report() -> dict:
    return example_report()


# ----------------------------------------------------------------------------- table


def _data_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in MODES]


def test_table_has_every_mode_and_phase_row(report):
    text = format_table(report)
    first_table = text.split("\n\n")[0]
    rows = {tuple(line.split()[:2]) for line in _data_lines(first_table)}
    expected = {(run["mode"], ph) for run in report["runs"] for ph in run["phases"]}
    expected |= {(m, "total") for m in MODES}
    assert rows == expected
    assert len(_data_lines(first_table)) == len(expected)


def test_table_numbers_and_columns(report):
    headers, rows = table_rows(report)
    col = {h: i for i, h in enumerate(headers)}
    assert "fr [matched/events]" in col and "interposer [matched/events]" in col
    assert "nccl [matched/events]" not in col  # gloo run: only sources that ran
    by_key = {(r[0], r[1]): r for r in rows}
    total = by_key[("dmuon-z2", "total")]
    assert total[col["measured avg [elem]"]] == "147,456"
    assert total[col["ratio to P_M"]] == "1.5000"
    assert total[col["formula"]] == "2(N-1)/N"
    assert total[col["NS calls/step meas/exp"]] == "8/8"
    assert by_key[("ddp-muon", "total")][col["NS calls/step meas/exp"]] == "32/32"
    assert total[col["result"]] == "PASS"
    bwd = by_key[("dmuon-z3", "backward")]
    assert bwd[col["measured avg [elem]"]] == "122,880"
    assert bwd[col["predicted avg [elem]"]] == "147,456"
    assert bwd[col["ratio to P_M"]] == "1.2500"
    assert bwd[col["result"]] == "FAIL"
    assert by_key[("dmuon-z3", "total")][col["fr [matched/events]"]].endswith(" FAIL")
    hsdp = by_key[("dmuon-hsdp-z2", "replicate")]
    assert hsdp[col["seed avg [elem]"]] == "98,304"
    assert hsdp[col["closed form avg [elem]"]] == "49,152"
    assert by_key[("dmuon-z2", "forward")][col["seed avg [elem]"]] == "–"


def test_average_and_max_never_share_a_column(report):
    headers, rows = table_rows(report)
    i_max = headers.index("busiest recv [elem]")
    i_avg = [i for i, h in enumerate(headers) if "avg" in h]
    assert i_max not in i_avg
    for row in rows:
        if row[1] != "total":
            assert row[i_max] == ""  # per-rank max is a run figure, never beside phase averages
    z2 = next(r for r in rows if r[:2] == ["dmuon-z2", "total"])
    assert z2[i_max] == "184,320.50"
    assert "184,320.50" not in [z2[i] for i in i_avg]


def test_seed_column_only_with_hsdp(report):
    report["runs"] = [r for r in report["runs"] if "hsdp" not in r["mode"]]
    headers, _ = table_rows(report)
    assert not any("seed" in h for h in headers)
    assert "HSDP replicate term" not in format_markdown(report)


def test_failure_listing(report):
    text = format_table(report)
    fail_part = text.split("FAIL dmuon-z3 (W=4, N=4, R=1)")[1]
    assert "missing collectives (4 entries, 4 calls)" in fail_part
    assert "unexpected collectives (4 entries, 4 calls)" in fail_part
    lines = fail_part.splitlines()
    missing = [l for l in lines if "blocks.1.mlp" in l and "×1" in l]
    assert len(missing) == 4
    cells = missing[0].split()
    assert all(s in cells for s in ("backward", "0,1,2,3", "32,768", "float32", "3", "×1"))
    barrier = [l for l in lines if "all_reduce" in l and "×1" in l]
    assert len(barrier) == 4 and all("–" in l for l in barrier)  # no root, no module
    assert "backward: measured 122,880 vs predicted 147,456 elem" in fail_part
    assert "flight_recorder mismatches (7; matched" in fail_part
    for m in FR_MISMATCHES[:5]:
        assert m in fail_part
    assert FR_MISMATCHES[5] not in fail_part
    assert "… and 2 more" in fail_part
    assert text.count("\nFAIL ") == 1  # only the failing run gets a listing


def test_long_missing_list_is_truncated(report):
    run = report["runs"][MODES.index("dmuon-z3")]
    run["missing"] = run["missing"] * 10
    text = format_table(report)
    assert "missing collectives (40 entries, 40 calls)" in text
    assert "… and 20 more entries" in text


def test_fmt_elems():
    assert fmt_elems(98_304.0) == "98,304"
    assert fmt_elems(65_536 * 2 / 3) == "43,690.67"
    assert fmt_elems(None) == "–"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r["runs"][0].pop("p_m"), "missing key 'p_m'"),
        (lambda r: r["runs"][0].update(mode="fsdp-muon"), "mode='fsdp-muon'"),
        (lambda r: r["runs"][1].update(measured_avg_elems=float("nan")), "Must be finite"),
        (lambda r: r["runs"][1].update(ns_calls_per_step=True), "ns_calls_per_step"),
        (lambda r: r["runs"][1].update(ratio_to_p_m=2.0), "ratio_to_p_m=2.0. Must equal"),
        (lambda r: r.update(backend="mpi"), "\\['backend'\\]='mpi'"),
        (lambda r: r["runs"][2]["phases"].update({None: r["runs"][2]["phases"]["forward"]}),
         "phase=None"),
        (lambda r: r["runs"][2]["sources"].update(perfetto={}), "source='perfetto'"),
        (lambda r: r["runs"][MODES.index("dmuon-z3")]["missing"][0].pop("dtype"), "missing\\[0\\]: missing key 'dtype'"),
        (lambda r: r.update(runs=[]), "Must hold at least one run"),
        (lambda r: r["runs"][MODES.index("dmuon-hsdp-z2")]["replicate_overlap"][0].update(waited_ns=0),
         "waited_ns=0 < issued_ns=9000000"),
        (lambda r: r.update({"pass": True}), "runs \\['dmuon-z3'\\] failed"),
    ],
)
def test_bad_report_is_rejected(report, mutate, match):
    mutate(report)
    with pytest.raises(ValueError, match=match):
        format_table(report)


def test_runner_style_values_render(report, tmp_path):
    """What the runner may emit: per-step means as floats, an untagged phase, a missing call
    whose source could not tell phase or dtype, and extra keys; all render and round-trip."""
    run = report["runs"][MODES.index("dmuon-z3")]
    run["phases"]["backward"]["collectives_measured"] = 12.5
    run["ns_calls_per_step"] = 8.0
    run["phases"]["None"] = dict(run["phases"]["forward"], collectives_measured=4.0)
    run["missing"].append(dict(run["missing"][0], phase=None, dtype=None, count=None))
    run["closed_form_matches"] = False
    run["replicate_overlap"] = [{"module": "blocks.0.attn", "rank": 0, "issued_ns": 5,
                                 "waited_ns": 9, "gap_ns": 4, "wait_dur_ns": 1}]
    report["config"] = {"modes": list(MODES)}
    headers, rows = table_rows(report)
    phases = [r[1] for r in rows if r[0] == "dmuon-z3"]
    assert phases == ["forward", "backward", "optimizer", "None", "total"]
    bwd = next(r for r in rows if r[:2] == ["dmuon-z3", "backward"])
    assert bwd[headers.index("collectives meas/pred")] == "12.50/16"
    total = next(r for r in rows if r[:2] == ["dmuon-z3", "total"])
    assert total[headers.index("NS calls/step meas/exp")] == "8/8"
    assert "missing collectives (5 entries, 5 calls)" in format_table(report)
    paths = write_report(report, tmp_path)
    assert read_report(paths["json"]) == {"schema_version": SCHEMA_VERSION, **report}
    assert list(json.loads(paths["json"].read_text()))[-1] == "config"  # extras after the model


# ----------------------------------------------------------------------------- markdown


def test_markdown_structure(report):
    md = format_markdown(report)
    assert md.startswith("# verify-traffic report `r1-gloo-w4`: FAIL")
    assert "| `r1-gloo-w4` | 2025-06-01T12:00:00Z | 2.13.0+cpu | gloo | 4 | 2 | 3 |" in md
    for phrase in ("2(n-1)/n", "(n-1)/n", "total array size", "mean over all W ranks"):
        assert phrase in md
    for run in report["runs"]:
        for ph in list(run["phases"]) + ["total"]:
            assert f"| {run['mode']} " in md and f"| {ph} " in md
    assert "### dmuon-z3 (W=4, N=4, R=1)" in md
    assert "**missing collectives (4 entries, 4 calls)**" in md
    assert "![ratio to P_M per mode](traffic.png)" in md
    assert "[`traces/r1/dmuon-hsdp-z2/timeline.json`]" in md
    # every markdown table line has the column count of its header
    block: list[str] = []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            assert len({l.count("|") for l in block}) == 1, block[0]
            block = []


def _md_rows(section: str) -> list[list[str]]:
    """Cells of the markdown table rows in ``section`` (header and rule lines dropped)."""
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in section.splitlines() if line.startswith("|")]
    return [r for r in rows[1:] if not set("".join(r)) <= set("-:")]


def _hsdp_section(md: str) -> str:
    return md.split("## HSDP replicate term: which reading holds")[1].split("\n## ")[0]


def test_markdown_hsdp_readings(report):
    rows = {(r[0], r[1]): r[2:] for r in _md_rows(_hsdp_section(format_markdown(report)))}
    # replicate + total for z2 and z3; no seed reading for the naive-hsdp baseline
    assert set(rows) == {(m, t) for m in ("dmuon-hsdp-z2", "dmuon-hsdp-z3")
                         for t in ("replicate", "total")}
    assert rows[("dmuon-hsdp-z2", "replicate")] == [
        "49,152", "49,152", "98,304", "0.5000", "W-average"]
    assert rows[("dmuon-hsdp-z3", "total")] == [
        "196,608", "196,608", "245,760", "0.8000", "W-average"]


def test_markdown_hsdp_backward_replicate_reduce(report):
    """Where the runner tags the replicate-axis reduce as backward (its seed reading then
    differs from the W-average one in backward too), backward is compared as well."""
    run = report["runs"][MODES.index("dmuon-hsdp-z2")]
    bwd, rep = run["phases"]["backward"], run["phases"]["replicate"]
    for key in ("measured_avg_elems", "predicted_avg_elems", "closed_form_avg_elems"):
        bwd[key] += 0.25 * P_M
        rep[key] -= 0.25 * P_M
    bwd["seed_avg_elems"], rep["seed_avg_elems"] = 1.0 * P_M, 0.5 * P_M
    rows = {(r[0], r[1]): r[2:] for r in _md_rows(_hsdp_section(format_markdown(report)))}
    assert rows[("dmuon-hsdp-z2", "backward")] == [
        "73,728", "73,728", "98,304", "0.7500", "W-average"]
    assert rows[("dmuon-hsdp-z2", "replicate")] == [
        "24,576", "24,576", "49,152", "0.5000", "W-average"]
    assert ("dmuon-hsdp-z2", "forward") not in rows  # seed and W-average agree there


def test_markdown_hsdp_seed_reading_confirmed(report):
    run = report["runs"][MODES.index("dmuon-hsdp-z2")]
    rep = run["phases"]["replicate"]
    rep["measured_avg_elems"] = rep["seed_avg_elems"]
    rep["pass"] = run["pass"] = False  # the W-average closed form then fails the run
    rows = {(r[0], r[1]): r[2:] for r in _md_rows(_hsdp_section(format_markdown(report)))}
    assert rows[("dmuon-hsdp-z2", "replicate")][-1] == "seed"
    assert rows[("dmuon-hsdp-z2", "total")][-1] == "W-average"  # the total was not edited


def test_markdown_overlap_summary(report):
    md = format_markdown(report)
    section = md.split("## HSDP replicate broadcast overlap")[1].split("\n## ")[0]
    cells = next(r for r in _md_rows(section) if r[0] == "dmuon-hsdp-z2")
    # 4 modules × 4 ranks; issue→wait 2,200 µs + 390 µs·module + 1 µs·rank (median of the
    # 8th and 9th: 2,593 and 2,980); wait 3.0..4.5 µs; total per rank 3+3.5+4+4.5 = 15 µs
    assert cells[1:] == ["16", "2,786.5", "3.8", "4.5", "15.0"]


# ----------------------------------------------------------------------------- files


def test_write_report_round_trip(report, tmp_path):
    paths = write_report(report, tmp_path / "out")
    assert set(paths) == {"json", "markdown", "junit", "traffic_png"}
    assert read_report(paths["json"]) == {"schema_version": SCHEMA_VERSION, **report}
    assert paths["markdown"].read_text(encoding="utf-8") == format_markdown(report)
    data = paths["traffic_png"].read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > MIN_PNG_BYTES
    keys = list(json.loads(paths["json"].read_text())["runs"][0])
    assert keys[:3] == ["mode", "world_size", "shard_size"] and keys[-1] == "timeline"


def test_json_key_order_is_stable(report):
    shuffled = copy.deepcopy(report)
    rng = random.Random(0)

    def shuffle(d: dict) -> dict:
        items = list(d.items())
        rng.shuffle(items)
        return {k: (shuffle(v) if isinstance(v, dict) else
                    [shuffle(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list)
                    else v) for k, v in items}

    assert report_json(shuffle(shuffled)) == report_json(report)
    assert list(json.loads(report_json(report))) == [
        "schema_version", "pass", "created_utc", "torch_version", "backend", "world_size", "steps_warmup",
        "steps_measured", "run_id", "runs"]


def test_read_report_rejects_non_json(tmp_path):
    bad = tmp_path / "report.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_report(bad)


def test_invalid_report_writes_nothing(report, tmp_path):
    report["runs"][0]["ratio_to_p_m"] = float("inf")
    with pytest.raises(ValueError, match="ratio_to_p_m"):
        write_report(report, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- plots


def test_traffic_series(report):
    series = {s["mode"]: s for s in traffic_series(report)}
    assert list(series) == list(MODES)
    assert series["naive-fsdp2-z3"]["ratios"]["closed_form"] == pytest.approx(3.0)
    assert series["dmuon-z3"]["ratios"]["measured"] == pytest.approx(2.0)
    assert series["dmuon-z3"]["ratios"]["predicted"] == pytest.approx(2.25)
    assert series["dmuon-hsdp-z2"]["ratios"]["seed"] == pytest.approx(2.0)
    assert series["dmuon-z2"]["ratios"]["seed"] is None
    assert series["dmuon-z3"]["pass"] is False


def _png_ok(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > MIN_PNG_BYTES
    return matplotlib.image.imread(path).shape[:2]


def test_plot_traffic_png(report, tmp_path):
    h, w = _png_ok(plot_traffic(report, tmp_path / "traffic.png"))
    assert w > h > 300


def _ev(rank, op, phase, t0, t1, **kw):
    kw = {"group_id": "0,1,2,3", "group_size": 4, **kw}
    return CollectiveEvent(source="interposer", op=op, rank=rank, count=16_384, dtype="float32",
                           phase=phase, t_start_ns=t0, t_end_ns=t1, source_ref="test", **kw)


def _hsdp_step(rank: int) -> tuple[list[CollectiveEvent], list[Span]]:
    """One HSDP step on ``rank``: forward broadcasts, a replicate broadcast issued at the end
    of the previous step (t < 0) that is still in flight during forward, backward reduces."""
    us = 1_000
    events = [
        _ev(rank, "broadcast", "replicate", -50 * us, 400 * us, root=0),  # async, spans forward
        _ev(rank, "broadcast", "forward", 10 * us, 60 * us, root=1),
        _ev(rank, "broadcast", "forward", 200 * us, 260 * us, root=2),
        _ev(rank, "reduce", "backward", 600 * us, 700 * us, root=1),
        _ev(rank, "reduce", "backward", 750 * us, 850 * us, root=2),
        _ev(rank, "all_reduce", "backward", None, None),  # no times from this source
    ]
    spans = [
        Span("dmuon.forward_pre_hook", "blocks.0.attn", 1, "forward", 5 * us, 70 * us, 1),
        Span("dmuon.broadcast", "blocks.0.attn", 1, "forward", 10 * us, 60 * us, 1),
        Span("dmuon.replicate_wait", "blocks.1.mlp", 0, "forward", 380 * us, 400 * us, 1),
        Span("dmuon.newton_schulz", "blocks.1.mlp", rank, "optimizer", 900 * us, 990 * us, 1),
    ]
    return events, spans


def test_timeline_layout():
    per_rank = {r: _hsdp_step(r) for r in range(4)}
    bars, t0, t1, untimed = timeline_bars(per_rank, t0_ns=0, t1_ns=1_000_000)
    assert (t0, t1, untimed) == (0, 1_000_000, 4)
    rank0 = [b for b in bars if b.rank == 0]
    coll = [b for b in rank0 if b.kind == "collective"]
    # the in-flight replicate broadcast is clipped to the window and gets its own lane
    rep = next(b for b in coll if b.label == "replicate")
    assert (rep.t_start_ns, rep.lane) == (0, 0)
    assert {b.lane for b in coll if b.label == "forward"} == {1}
    assert {b.lane for b in coll if b.label == "backward"} == {0}
    # spans that issue a collective are drawn by its row; the others keep theirs
    spans = {b.key: b.lane for b in rank0 if b.kind == "span"}
    assert spans == {"dmuon.replicate_wait": 0, "dmuon.newton_schulz": 0}
    # a narrower window drops what lies outside it
    bars, *_ = timeline_bars(per_rank, t0_ns=550_000, t1_ns=1_000_000)
    assert {b.label for b in bars if b.kind == "collective"} == {"backward"}


def test_timeline_rejects_bad_input():
    with pytest.raises(ValueError, match="per_rank"):
        timeline_bars({})
    with pytest.raises(ValueError, match="per_rank\\[0\\]"):
        timeline_bars({0: [[]]})
    with pytest.raises(ValueError, match="no span or collective"):
        timeline_bars({0: _hsdp_step(0)}, t0_ns=10**12, t1_ns=10**12 + 1)
    with pytest.raises(ValueError, match="t1_ns > t0_ns"):
        timeline_bars({0: ([], [])})


def _overlap_step(rank: int) -> tuple[list[CollectiveEvent], list[Span]]:
    """One DMuon forward on ``rank``: block 1's broadcast issued at 10 µs and waited on at
    80..90 µs while block 0 computes (20..70 µs), a second one on another group overlapping
    it, and a synchronous reduce."""
    us = 1_000
    events = [
        _ev(rank, "broadcast", "forward", 10 * us, 12 * us, module="blocks.1",
            t_wait_start_ns=80 * us, t_waited_ns=90 * us),
        _ev(rank, "broadcast", "forward", 14 * us, 15 * us, module="blocks.1",
            t_wait_start_ns=85 * us, t_waited_ns=86 * us),
        _ev(rank, "broadcast", "forward", 95 * us, 97 * us, group_id="0,1", group_size=2),
        _ev(rank, "reduce", "backward", 100 * us, 110 * us),
    ]
    spans = [Span(FORWARD, "blocks.0", None, "forward", 20 * us, 70 * us, 1),
             Span(FORWARD, "blocks.1", None, "forward", 91 * us, 99 * us, 1),
             Span(BACKWARD, "blocks.1", None, "backward", 99 * us, 100 * us, 1),
             Span("dmuon.broadcast", "blocks.1", 1, "forward", 9 * us, 13 * us, 1)]
    return events, spans


def test_timeline_in_flight_bars_beside_compute():
    us = 1_000
    bars, *_ = timeline_bars({0: _overlap_step(0)}, t0_ns=0, t1_ns=200 * us)
    rows = {}
    for b in bars:
        rows.setdefault(b.row, []).append(b)
    # dmuon.broadcast issued a collective: its row shows it, no DMuon spans row is left
    assert list(rows) == ["compute", "broadcast [0,1,2,3]", "broadcast [0,1]", "reduce"]
    first, second = rows["broadcast [0,1,2,3]"]
    assert (first.in_flight, first.t_start_ns, first.t_issued_ns, first.t_wait_start_ns,
            first.t_end_ns, first.lane, first.label) == (True, 10 * us, 12 * us, 80 * us,
                                                          90 * us, 0, "blocks.1")
    assert (second.t_end_ns, second.lane) == (86 * us, 1)  # in flight beside the first
    block0 = next(b for b in rows["compute"] if b.label == "blocks.0")
    assert first.t_issued_ns <= block0.t_start_ns < block0.t_end_ns <= first.t_wait_start_ns
    [sync] = rows["reduce"]
    assert (sync.in_flight, sync.t_end_ns, sync.lane) == (False, 110 * us, 0)
    assert _pieces(first) == [(10 * us, 12 * us, 1.0), (12 * us, 80 * us, 0.3),
                              (80 * us, 90 * us, 1.0)]
    assert _pieces(sync) == [(100 * us, 110 * us, 1.0)]
    # clipped to a window that starts while the first broadcast is in flight
    bars, *_ = timeline_bars({0: _overlap_step(0)}, t0_ns=50 * us, t1_ns=200 * us)
    clipped = next(b for b in bars if b.row.startswith("broadcast") and b.lane == 0)
    assert (clipped.t_start_ns, clipped.t_issued_ns, clipped.t_wait_start_ns) == (
        50 * us, 50 * us, 80 * us)


def test_plot_timeline_png_with_in_flight_bars(tmp_path):
    h, w = _png_ok(plot_timeline(tmp_path / "o.png", {r: _overlap_step(r) for r in range(2)},
                                 title="dmuon-z3 forward"))
    assert w > 1000 and h > 300


def test_plot_timeline_png(tmp_path):
    per_rank = {r: _hsdp_step(r) for r in range(4)}
    path = plot_timeline(tmp_path / "t" / "timeline.png", per_rank,
                         title="dmuon-hsdp-z2 step 3", t0_ns=-100_000)
    h, w = _png_ok(path)
    assert w > 1000 and h > 300


def test_user_facing_texts_cite_the_spec_file(report):
    """The specification is docs/spec.md (there is no file named SPEC)."""
    from verify.report.plots import _SERIES

    for text in (format_markdown(report), format_table(report), format_table(report, wide=True),
                 " ".join(label for _, label, _, _ in _SERIES)):
        assert "docs/spec.md §2" in text and "SPEC" not in text
