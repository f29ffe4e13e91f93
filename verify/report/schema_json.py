"""The JSON Schema of report.json, generated from the data model of ``verify.report.schema``.

``verify/report/report.schema.json`` (shipped as package data) is this module's output,
committed so that CI jobs and other languages can validate a report without DMuon; the tables
of ``verify.report.schema`` stay the one source of truth, and a test fails when the committed
file differs from :func:`report_json_schema` (regenerate with
``python -m verify.report.schema_json``).

What it checks: every key of the data model with its JSON type (integers, numbers, strings,
booleans, null where the model allows ``None``), the required keys, mode / backend / check /
source / hierarchy names, and ``schema_version`` = :data:`verify.report.schema.SCHEMA_VERSION`
(required in a file: ``verify.report.render.report_json`` writes it). Keys outside the model
are allowed, as the Python checker allows them. The relations between values (``pass`` the
conjunction of the checks, ``failures`` listing exactly the failed ones, ``ratio_to_p_m`` =
measured / P_M, finite floats) are :func:`verify.report.schema.validate_report`'s only: JSON
Schema cannot state them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

from tracer.events import SOURCES

from verify.report import schema as S
from verify.report.checks import CHECK_NAMES, RUN_CHECK_NAMES
from verify.modes.variants import RUN_MODES as MODES  # modes and their variants

#: The committed schema file (package data of ``verify``).
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
SCHEMA_ID = f"urn:dmuon:verify-traffic:report:{S.SCHEMA_VERSION}"

_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
              dict: "object", type(None): "null"}


def _type(types: tuple) -> dict:
    """``{"type": ...}`` of a data-model type tuple (int and float together: ``number``)."""
    names = [_JSON_TYPE[t] for t in types]
    if "number" in names and "integer" in names:
        names.remove("integer")
    return {"type": names[0] if len(names) == 1 else names}


def _object(required: Mapping[str, tuple], optional: Mapping[str, tuple] = {},
            refine: Mapping[str, dict] = {}) -> dict:
    """An object schema: ``required`` keys must be present, ``optional`` ones may be; each key
    typed from its tuple and then narrowed by ``refine[key]`` (items, enums, nested objects)."""
    props = {k: {**_type(t), **refine.get(k, {})} for k, t in {**required, **optional}.items()}
    return {"type": "object", "required": list(required), "properties": props}


def _array_of(item: dict) -> dict:
    return {"items": item}


def _enum(values) -> dict:
    return {"enum": list(values)}


def _run_schema() -> dict:
    collective = _object(S.COLLECTIVE_KEYS, S.COLLECTIVE_OPTIONAL_KEYS)
    number_map = {"type": "object", "additionalProperties": {"type": "number"}}
    by_phase = {"type": "object", "additionalProperties": number_map}
    return _object(S.RUN_KEYS, S.OPTIONAL_RUN_KEYS, {
        "mode": _enum(MODES),
        "phases": {"additionalProperties": _object(S.PHASE_KEYS)},
        "missing": _array_of(collective),
        "unexpected": _array_of(collective),
        "sources": {"propertyNames": _enum(SOURCES),
                    "additionalProperties": _object(S.SOURCE_KEYS,
                                                    refine={"mismatches": _array_of({"type": "string"})})},
        "replicate_overlap": _array_of(_object(S.OVERLAP_KEYS)),
        "hierarchy": _enum(S.HIERARCHIES),
        "wire": _object(S.WIRE_KEYS, refine={"per_rank": _array_of(_object(S.WIRE_RANK_KEYS))}),
        "bytes": {"required": ["measured_avg_bytes", "predicted_avg_bytes"],
                  "properties": {"measured_avg_bytes": by_phase, "predicted_avg_bytes": by_phase}},
        "timing": _object(S.TIMING_KEYS, refine={"step_ms_per_step": _array_of({"type": "number"})}),
        "checks": _array_of(_object(S.CHECK_KEYS, refine={"check": _enum(RUN_CHECK_NAMES)})),
    })


def report_json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of report.json version :data:`~verify.report.schema.SCHEMA_VERSION`."""
    param = _object(S.PARAM_KEYS, refine={"shape": _array_of({"type": "integer"})})
    top = _object({"schema_version": (int,), **S.TOP_KEYS},
                  {k: v for k, v in S.OPTIONAL_TOP_KEYS.items() if k != "schema_version"}, {
        "schema_version": {"const": S.SCHEMA_VERSION},
        "backend": _enum(("gloo", "nccl")),
        "runs": _array_of({"$ref": "#/$defs/run"}),
        "skipped": _array_of(_object(S.SKIPPED_KEYS, refine={"mode": _enum(MODES)})),
        "failures": _array_of(_object(S.FAILURE_KEYS, refine={"mode": _enum(MODES),
                                                              "check": _enum(CHECK_NAMES)})),
        "params": _object(S.PARAMS_KEYS, refine={"muon": _array_of(param),
                                                 "adamw": _array_of(param)}),
    })
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"DMuon verify-traffic report.json, schema_version {S.SCHEMA_VERSION}",
        "description": "Generated by verify/report/schema_json.py from verify/report/schema.py; "
                       "docs/verify.md, 'report.json'. Relations between values are checked by "
                       "verify.report.schema.validate_report only.",
        **top,
        "$defs": {"run": _run_schema()},
    }


def schema_text() -> str:
    """:func:`report_json_schema` as the committed file holds it (indent 2, newline at the end)."""
    return json.dumps(report_json_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m verify.report.schema_json [--check]``: write :data:`SCHEMA_PATH`, or with
    ``--check`` exit 1 when the committed file differs from the generated schema."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        same = SCHEMA_PATH.is_file() and SCHEMA_PATH.read_text(encoding="utf-8") == schema_text()
        if not same:
            print(f"{SCHEMA_PATH} differs from verify.report.schema's tables; regenerate with "
                  "`python -m verify.report.schema_json`", file=sys.stderr)
        return 0 if same else 1
    if argv:
        print("usage: python -m verify.report.schema_json [--check]", file=sys.stderr)
        return 2
    SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
