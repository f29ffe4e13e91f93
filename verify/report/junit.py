"""junit.xml of a verify-traffic report: one test case per mode × check, for CI test reporters.

Written by :func:`verify.report.render.write_report` beside report.json, from the same checks
the report is gated on (``verify.report.checks.checks_of``), so the XML can never pass what the
report fails:

- ``<testcase classname="verify-traffic.<mode>" name="<check>">`` per check of each run (the
  mode as the report prints it, ``dmuon-hsdp-z2 (flat)`` included); a failed check holds
  ``<failure type="<check>" message="<what failed>: <cause>">`` with the check's detail;
- a mode that raised (``failures`` entry ``error``): one test case ``error`` holding
  ``<error>`` with the message and the traceback file it names;
- a mode this world size cannot run (``skipped``): one test case ``run`` holding ``<skipped>``
  with the reason.

The ``testsuite`` carries the run id, the UTC time and, as properties, the backend, W, torch
and ``schema_version``. Characters XML 1.0 cannot hold (control characters from an exception
message) are replaced by ``?``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from verify.report.checks import checks_of, failures, label
from verify.report.schema import SCHEMA_VERSION, mode_label

#: Characters outside XML 1.0's Char production.
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
SUITE = "verify-traffic"


def _text(value: object) -> str:
    return _NOT_XML.sub("?", str(value))


def _case(suite: ET.Element, mode: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=_text(f"{SUITE}.{mode}"), name=name,
                         time="0")


def junit_xml(report: Mapping) -> str:
    """The junit.xml text of ``report`` (a report dict as ``verify.report.schema`` models it;
    validate it first: this function reads, it does not check). See the module docstring."""
    suite = ET.Element("testsuite", name=_text(f"{SUITE} {report.get('run_id', '')}".strip()))
    if report.get("created_utc"):
        suite.set("timestamp", _text(report["created_utc"]))
    props = ET.SubElement(suite, "properties")
    for key in ("backend", "world_size", "torch_version", "model"):
        if key in report:
            ET.SubElement(props, "property", name=key, value=_text(report[key]))
    ET.SubElement(props, "property", name="schema_version", value=str(SCHEMA_VERSION))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for run in report["runs"]:
        for check in checks_of(run):
            case = _case(suite, mode_label(run), check["check"])
            counts["tests"] += 1
            if not check["pass"]:
                counts["failures"] += 1
                message = f"{label(check['check'], False)}: {check['detail']}"
                failure = ET.SubElement(case, "failure", type=check["check"], message=_text(message))
                failure.text = _text(message)
    for entry in failures(report):
        if entry["check"] == "error":
            case = _case(suite, entry["mode"], "error")
            counts["tests"] += 1
            counts["errors"] += 1
            error = ET.SubElement(case, "error", type="error", message=_text(entry["detail"]))
            error.text = _text(entry["detail"])
    for entry in report.get("skipped", []):
        case = _case(suite, entry["mode"], "run")
        counts["tests"] += 1
        counts["skipped"] += 1
        ET.SubElement(case, "skipped", message=_text(entry["reason"]))
    for key, n in counts.items():
        suite.set(key, str(n))
    root = ET.Element("testsuites", name=SUITE, **{k: str(v) for k, v in counts.items()})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
