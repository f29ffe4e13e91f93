"""junit.xml beside report.json: one test case per mode × check, from the checks the report is
gated on (verify/report/junit.py). Parsed back with the standard library."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tests.report_builders import example_report
from verify.report.checks import checks_of, run_checks
from verify.report.junit import junit_xml
from verify.report.render import write_report


def _cases(xml_text: str) -> dict[tuple[str, str], ET.Element]:
    root = ET.fromstring(xml_text)
    assert root.tag == "testsuites"
    (suite,) = root
    return {(c.get("classname"), c.get("name")): c for c in suite.iter("testcase")}


def test_one_case_per_mode_and_check_and_counts(tmp_path):
    report = example_report()
    paths = write_report(report, tmp_path)
    assert paths["junit"] == tmp_path / "junit.xml"
    text = paths["junit"].read_text(encoding="utf-8")
    cases = _cases(text)
    want = {(f"verify-traffic.{run['mode']}", c["check"]) for run in report["runs"]
            for c in checks_of(run)}
    assert set(cases) == want
    suite = ET.fromstring(text)[0]
    failed = [k for k, c in cases.items() if c.find("failure") is not None]
    assert int(suite.get("tests")) == len(want) and int(suite.get("failures")) == len(failed)
    assert suite.get("name") == "verify-traffic r1-gloo-w4"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["backend"] == "gloo" and props["world_size"] == "4" and props["schema_version"] == "1"


def test_a_failing_check_is_a_failure_naming_its_cause():
    """The example's dmuon-z3 misses its backward re-broadcast of blocks.1.mlp; its FR trace
    does not match. Every other case passes."""
    report = example_report()
    cases = _cases(junit_xml(report))
    failures = {k: c.find("failure") for k, c in cases.items() if c.find("failure") is not None}
    z3 = next(r for r in report["runs"] if r["mode"] == "dmuon-z3")
    failed_checks = {c["check"] for c in run_checks(z3) if not c["pass"]}
    assert set(failures) == {("verify-traffic.dmuon-z3", name) for name in failed_checks}
    coll = failures[("verify-traffic.dmuon-z3", "collectives")]
    assert coll.get("type") == "collectives"
    assert coll.get("message").startswith("collectives differ from the prediction: 4 missing")
    assert "phases: backward" in coll.text
    fr = failures[("verify-traffic.dmuon-z3", "source:flight_recorder")]
    assert "predicted broadcast 32768 float32 root 3" in fr.get("message")


def test_a_mode_that_raised_is_an_error_and_skipped_modes_are_skipped():
    report = example_report()
    report["runs"] = [r for r in report["runs"] if r["mode"] == "dmuon-z2"]
    report["failures"] = [{"mode": "dmuon-z3", "check": "error",
                           "detail": "training raised on rank(s) [1]: RuntimeError: boom\x00\x1b[0m "
                                     "(traceback: dmuon-z3/error_rank1.txt)"}]
    report["skipped"] = [{"mode": "naive-hsdp", "reason": "needs an even W >= 4"}]
    text = junit_xml(report)
    cases = _cases(text)  # control characters of the message do not break the XML
    error = cases[("verify-traffic.dmuon-z3", "error")].find("error")
    assert "RuntimeError: boom?" in error.get("message") and "error_rank1.txt" in error.text
    skipped = cases[("verify-traffic.naive-hsdp", "run")].find("skipped")
    assert skipped.get("message") == "needs an even W >= 4"
    suite = ET.fromstring(text)[0]
    assert (suite.get("errors"), suite.get("skipped"), suite.get("failures")) == ("1", "1", "0")


def test_flat_runs_are_named_as_the_report_prints_them():
    report = example_report()
    run = next(r for r in report["runs"] if r["mode"] == "dmuon-hsdp-z2")
    run["hierarchy"] = "flat"
    assert ("verify-traffic.dmuon-hsdp-z2 (flat)", "collectives") in _cases(junit_xml(report))
