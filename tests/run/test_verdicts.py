"""Every check of a verify-traffic run names its cause (verify/report/checks.py): for each check,
a report where only that check fails; its last line, the terminal's ``checks:`` block, the
Failures sections of report.md and report.json's ``failures`` must all name it. The loss
check and a mode that raises are also run end to end (tests/run/test_launch.py).

Reports are built from tests/report_builders.py's example (W=4, gloo); no process is started.
"""

from __future__ import annotations

import json

import pytest

from tests.report_builders import example_report
from verify.report.checks import (
    CHECK_NAMES,
    failures_of_runs,
    final_line,
    label,
    run_checks,
    verdict_lines,
)
from verify.report.render import format_markdown, report_json
from verify.report.terminal import format_table


def _one_run(mode: str = "dmuon-z2") -> dict:
    """The example report cut to one passing run, with the runner's keys (loss gate, a
    profiler source) and its checks stored."""
    report = example_report()
    (run,) = [r for r in report["runs"] if r["mode"] == mode]
    run["loss_falls"] = True
    run["closed_form_matches"] = True
    run["sources"]["profiler"] = dict(run["sources"]["flight_recorder"], notes=[])
    report["runs"] = [run]
    return _settle(report)


def _settle(report: dict, errors: tuple[dict, ...] = ()) -> dict:
    """Store the checks of every run and the report's verdict, as the runner does."""
    for run in report["runs"]:
        run["checks"] = run_checks(run)
        run["pass"] = all(c["pass"] for c in run["checks"])
    report["failures"] = failures_of_runs(report["runs"]) + list(errors)
    report["pass"] = not report["failures"]
    return report


def _unexpected_barrier(run: dict) -> None:
    run["unexpected"] = [{"rank": 0, "phase": "backward", "op": "all_reduce",
                          "group_id": "0,1,2,3", "count": 1, "dtype": "float32", "root": None,
                          "module": None, "n": 1}]
    run["phases"]["backward"]["pass"] = False
    run["sources"]["interposer"].update({"pass": False, "unmatched": 1})


def _closed_form_off(run: dict) -> None:
    fwd = run["phases"]["forward"]
    fwd["closed_form_avg_elems"] += 1024
    fwd["closed_form_matches"] = fwd["pass"] = False
    run["closed_form_avg_elems"] += 1024
    run["closed_form_matches"] = False


def _ns_calls_off(run: dict) -> None:
    run["ns_calls_per_step"] += 1


def _loss_rises(run: dict) -> None:
    run["loss_last"] = run["loss_first"] + 1.0
    run["loss_falls"] = False


def _source_off(name: str):
    def mutate(run: dict) -> None:
        src = run["sources"][name]
        src.update({"matched": src["events"] - 1, "unmatched": 1, "pass": False})
        src["mismatches"] = [f"rank 1 pg 0,1,2,3 seq 7: {name} has no broadcast 4096 float32"]
    return mutate


#: check name -> (mutation that fails only it, words its detail must hold)
CASES = {
    "collectives": (_unexpected_barrier, "0 missing and 1 unexpected calls"),
    "closed_form": (_closed_form_off, "forward: measured 73,728 vs closed form 74,752 elem"),
    "ns_calls": (_ns_calls_off, "measured 9 vs expected 8 per step"),
    "loss": (_loss_rises, "10.8321 → 11.8321"),
    "source:flight_recorder": (_source_off("flight_recorder"), "seq 7: flight_recorder has no"),
    "source:profiler": (_source_off("profiler"), "seq 7: profiler has no"),
}


@pytest.mark.parametrize("check", list(CASES))
def test_each_check_fails_alone_and_is_named_everywhere(check):
    mutate, words = CASES[check]
    report = _one_run()
    mutate(report["runs"][0])
    _settle(report)
    run = report["runs"][0]
    assert [c["check"] for c in run["checks"] if not c["pass"]] == [check]
    failed = label(check, False)
    # the last line: CI reads only this
    assert final_line(report) == f"FAIL: {failed} (dmuon-z2)"
    # the terminal: the table's failure listing and one line per check
    text = format_table(report)
    listing = text.split("FAIL dmuon-z2 (W=4, N=4, R=1)")[1].split("\nchecks:\n")[0]
    assert f"- {failed}: " in listing and words in listing.replace("\n", " ")
    block = text.split("\nchecks:\n")[1].splitlines()
    assert f"  FAIL  {failed}: dmuon-z2" in block
    assert sum(line.startswith("  PASS  ") for line in block) == len(run["checks"]) - 1
    # report.md: the verdict under the title and the Failures section
    md = format_markdown(report)
    assert f"**FAIL: {failed} (dmuon-z2)**" in md
    section = md.split("## Failures")[1]
    assert "### dmuon-z2 (W=4, N=4, R=1)" in section and f"- {failed}: " in section
    # report.json
    doc = json.loads(report_json(report))
    assert doc["pass"] is False
    assert [(f["mode"], f["check"]) for f in doc["failures"]] == [("dmuon-z2", check)]
    assert words in doc["failures"][0]["detail"].replace("\n", " ")


def test_passing_run_names_every_check():
    report = _one_run()
    assert final_line(report) == "PASS: all 6 checks held in 1 mode(s)"
    lines = verdict_lines(report)
    assert lines == [f"  PASS  {label(name, True)} (1 mode(s))" for name in CHECK_NAMES
                     if name in {c["check"] for c in report["runs"][0]["checks"]}]
    assert "## Failures" not in format_markdown(report)


def test_a_mode_that_raised_is_a_failed_check():
    error = {"mode": "dmuon-z3", "check": "error",
             "detail": "training raised on rank(s) [0, 1]: RuntimeError: boom "
                       "(traceback: dmuon-z3/error_rank0.txt)"}
    report = _settle(_one_run(), (error,))
    assert final_line(report) == "FAIL: mode raised an error (dmuon-z3)"
    text = format_table(report)
    assert "FAIL dmuon-z3\n  mode raised an error: training raised on rank(s) [0, 1]" in text
    assert "  FAIL  mode raised an error: dmuon-z3" in text.split("\nchecks:\n")[1]
    md = format_markdown(report).split("## Failures")[1]
    assert "### dmuon-z3" in md and "RuntimeError: boom" in md
    assert json.loads(report_json(report))["failures"] == [error]
    # every mode raised: no run at all is still a report
    report["runs"] = []
    report["failures"] = [error]
    assert json.loads(report_json(report))["runs"] == []
    assert final_line(report) == "FAIL: mode raised an error (dmuon-z3)"


def test_last_line_groups_modes_by_check_in_check_order():
    report = example_report()
    for run in report["runs"]:
        run["loss_falls"] = True
    by_mode = {r["mode"]: r for r in report["runs"]}
    _loss_rises(by_mode["dmuon-z2"])
    _ns_calls_off(by_mode["naive-fsdp2-z3"])
    _loss_rises(by_mode["dmuon-hsdp-z2"])
    _settle(report)
    assert final_line(report) == (
        "FAIL: collectives differ from the prediction (dmuon-z3); average differs from the "
        "closed form (dmuon-z3); NS calls differ from expected (naive-fsdp2-z3); loss did not "
        "fall (dmuon-z2, dmuon-hsdp-z2); flight_recorder trace does not match (dmuon-z3)")


def test_non_finite_loss_is_a_failed_loss_check():
    report = _one_run()
    run = report["runs"][0]
    run["loss_last"], run["loss_falls"] = None, False
    _settle(report)
    assert final_line(report) == "FAIL: loss did not fall (dmuon-z2)"
    assert "10.8321 → non-finite" in report["failures"][0]["detail"]
    assert "non-finite" in format_table(report)
    report_json(report)  # valid JSON (no NaN)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda r: r["runs"][0].update({"pass": False}), "pass=False while every check passed"),
    (lambda r: r["runs"][0]["checks"][2].update({"pass": False}), "pass=True while checks \\['ns_calls'\\]"),
    (lambda r: r["runs"][0]["checks"][0].update(check="speed"), "check='speed'"),
    (lambda r: r["failures"].append({"mode": "dmuon-z2", "check": "loss", "detail": "x"}),
     "Must list every failed check once"),
    (lambda r: r["failures"].append({"mode": "dmuon-z2", "check": "error", "detail": "x"}),
     "raised but has a run"),
    (lambda r: r["failures"].append({"mode": "dmuon-z3", "check": "error"}), "missing key 'detail'"),
    (lambda r: r.update(runs=[]), "Must hold at least one run"),
    (lambda r: r.update({"pass": False}), "Must be True exactly when no check failed"),
])
def test_inconsistent_verdicts_are_rejected(mutate, match):
    report = _one_run()
    mutate(report)
    with pytest.raises(ValueError, match=match):
        report_json(report)
