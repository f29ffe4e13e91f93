"""report.json's ``schema_version`` and its JSON Schema.

``verify/report/report.schema.json`` is generated from ``verify.report.schema``'s tables
(``verify.report.schema_json``); these tests keep the committed file equal to the generator,
validate written reports against it with the ``jsonschema`` package (a test extra), and check
that the JSON Schema and the Python checker refuse the same broken shapes. Reports of a real
run are validated in tests/distributed/phase_d/test_report_files.py.
"""

from __future__ import annotations

import copy
import json

import pytest

from tests.report_builders import example_report
from verify.report.render import read_report, report_json, write_report
from verify.report.schema import RUN_KEYS, SCHEMA_VERSION, TOP_KEYS, validate_report
from verify.report.schema_json import SCHEMA_PATH, main, schema_text

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test extra (pyproject.toml)")


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))  # the committed file
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _written(report: dict) -> dict:
    return json.loads(report_json(report))


def test_committed_schema_is_the_generated_one():
    """Fails when a key of verify.report.schema changes without regenerating the file."""
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text()
    assert main(["--check"]) == 0


def test_written_reports_carry_the_version_first_and_validate(validator, tmp_path):
    report = example_report()
    paths = write_report(report, tmp_path)
    doc = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert list(doc)[0] == "schema_version" and doc["schema_version"] == SCHEMA_VERSION
    validator.validate(doc)
    assert read_report(paths["json"])["schema_version"] == SCHEMA_VERSION


def test_failing_and_error_reports_validate(validator):
    """The example fails dmuon-z3; a mode that raised has no run and an ``error`` entry."""
    report = example_report()
    validator.validate(_written(report))
    report["runs"] = []
    report["failures"] = [{"mode": "dmuon-z3", "check": "error", "detail": "training raised"}]
    report["skipped"] = [{"mode": "naive-hsdp", "reason": "needs an even W >= 4"}]
    validator.validate(_written(report))


def test_other_schema_version_is_refused_by_both(validator, tmp_path):
    doc = _written(example_report())
    doc["schema_version"] = SCHEMA_VERSION + 1
    assert not validator.is_valid(doc)
    with pytest.raises(ValueError, match=r"schema_version.*Must be 1"):
        validate_report(doc)
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="schema_version"):
        read_report(bad)


def test_a_file_without_schema_version_fails_the_json_schema(validator):
    doc = _written(example_report())
    del doc["schema_version"]
    assert not validator.is_valid(doc)


@pytest.mark.parametrize("key", list(TOP_KEYS))
def test_missing_top_key_refused_by_both(validator, key):
    doc = _written(example_report())
    del doc[key]
    assert not validator.is_valid(doc)
    with pytest.raises(ValueError, match=key):
        validate_report(doc)


@pytest.mark.parametrize("key", list(RUN_KEYS))
def test_missing_or_mistyped_run_key_refused_by_both(validator, key):
    doc = _written(example_report())
    broken = copy.deepcopy(doc)
    del broken["runs"][0][key]
    assert not validator.is_valid(broken)
    with pytest.raises(ValueError, match=key):
        validate_report(broken)
    broken = copy.deepcopy(doc)
    broken["runs"][0][key] = True if key != "pass" else "yes"  # bool is no int, str no bool
    assert not validator.is_valid(broken)
    with pytest.raises(ValueError):
        validate_report(broken)


@pytest.mark.parametrize("path, value", [
    (("runs", 0, "mode"), "dmuon-z9"),
    (("backend",), "mpi"),
    (("runs", 0, "sources", "flight_recorder", "matched"), 1.5),
    (("runs", 0, "phases", "backward", "pass"), 1),
    (("runs", 0, "missing"), [{"rank": 0}]),
])
def test_bad_values_refused_by_both(validator, path, value):
    doc = _written(example_report())
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    errors = list(validator.iter_errors(doc))
    assert errors, f"the JSON Schema accepted {path}={value!r}"
    with pytest.raises(ValueError):
        validate_report(doc)
