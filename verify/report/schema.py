"""The report.json data model, the one description of a verify-traffic report: which keys it
holds, their types and units (the tables below), and :func:`validate_report`.

The other texts about the report point here: ``verify/report/report.schema.json`` is generated
from these tables (``verify.report.schema_json``) for validators without Python; docs/verify.md
("Reading the report") tells a user how to read the files. The ``report`` dict (built by the
verify-traffic runner or ``TrafficWindow``) *is* the content of report.json: the renderers
(``verify.report.render``, ``terminal``, ``junit``) and the charts (``verify.report.plots``) are
pure functions of it. Keys marked optional below may be absent (reports of older versions);
when present they are type-checked like the others.

Units: all ``*_elems`` figures count elements of the dedicated (Muon-target) parameters per
rank per training step, as the **W-average** of ``f(n)·S`` over the calls each rank takes part
in (docs/spec.md §2; S is nccl-tests' "total array size", f = 2(n-1)/n for all_reduce and
(n-1)/n otherwise, from nccl-tests ``doc/PERFORMANCE.md``). ``max_rank_elems`` is the busiest
rank's figure in the same unit; it is always shown in its own column, never mixed with the
averages. ``*_bytes`` are bytes, ``*_ns`` nanoseconds, ``*_ms`` milliseconds.

Glossary: W = world size, N = shard-group size (``shard_size``), R = replicate-group size
(``replicate_size``), T = tensor-parallel degree (``tp_size``, 1 without TP), P_M = elements
of dedicated params (``p_m``), NS = Newton–Schulz.

Verdicts: a run's ``pass`` is the conjunction of its ``checks`` and ``failures`` lists every
failed check plus each mode that raised; which checks there are: ``verify.report.checks``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tracer.events import SOURCES

from verify.report.checks import CHECK_NAMES, READING_REL_TOL, RUN_CHECK_NAMES, checks_of, failures
from verify.modes.variants import RUN_MODES as MODES  # modes and their variants

__all__ = ["READING_REL_TOL", "SCHEMA_VERSION", "validate_report"]

#: report.json's ``schema_version``: raised whenever a key changes meaning, is removed or
#: becomes required (adding an optional key keeps it). ``verify/report/report.schema.json`` is
#: the JSON Schema of this version, generated from the tables below (``verify.report.schema_json``).
SCHEMA_VERSION = 1
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))

#: key -> allowed types, in report.json order.
TOP_KEYS: dict[str, tuple] = {
    "pass": (bool,),
    "created_utc": (str,),
    "torch_version": (str,),
    "backend": (str,),
    "world_size": (int,),
    "steps_warmup": (int,),
    "steps_measured": (int,),
    "run_id": (str,),
    "runs": (list,),
}
RUN_KEYS: dict[str, tuple] = {
    "mode": (str,),
    "world_size": (int,),
    "shard_size": (int,),
    "replicate_size": (int,),
    "p_m": (int,),
    "measured_avg_elems": _NUM,
    "predicted_avg_elems": _NUM,
    "closed_form": (str,),
    "closed_form_avg_elems": _NUM,
    "seed_avg_elems": _OPT_NUM,
    "ratio_to_p_m": _NUM,
    "ns_calls_per_step": _NUM,  # a mean over measured steps: may be fractional
    "ns_calls_expected": _NUM,
    "max_rank_elems": _NUM,
    "total_measured_avg_elems": _NUM,
    "total_predicted_avg_elems": _NUM,
    "loss_first": _OPT_NUM,  # None: the loss was not finite (JSON has no NaN)
    "loss_last": _OPT_NUM,
    "pass": (bool,),
    "phases": (dict,),
    "missing": (list,),
    "unexpected": (list,),
    "sources": (dict,),
    "replicate_overlap": (list,),
    "timeline": _OPT_STR,
}
PHASE_KEYS: dict[str, tuple] = {
    "measured_avg_elems": _NUM,
    "predicted_avg_elems": _NUM,
    "closed_form_avg_elems": _OPT_NUM,
    "seed_avg_elems": _OPT_NUM,
    "collectives_measured": _NUM,  # calls per step, all ranks (mean over measured steps)
    "collectives_predicted": _NUM,
    "pass": (bool,),
}
COLLECTIVE_KEYS: dict[str, tuple] = {  # None where the source could not tell
    "rank": _OPT_INT,
    "phase": _OPT_STR,
    "op": (str,),
    "group_id": _OPT_STR,
    "count": _OPT_INT,
    "dtype": _OPT_STR,
    "root": _OPT_INT,
    "module": _OPT_STR,
    "n": (int,),
}
#: Keys a missing / unexpected collective has since all_to_alls carry their totals (reports
#: written before lack them).
COLLECTIVE_OPTIONAL_KEYS: dict[str, tuple] = {"in_elems": _OPT_INT, "out_elems": _OPT_INT}
SOURCE_KEYS: dict[str, tuple] = {
    "events": (int,),
    "matched": (int,),
    "unmatched": (int,),
    "pass": (bool,),
    "mismatches": (list,),
}
OVERLAP_KEYS: dict[str, tuple] = {
    "module": (str,),
    "rank": (int,),
    "issued_ns": (int,),
    "waited_ns": (int,),
    "wait_dur_ns": (int,),
}
#: Optional top-level keys (absent in reports of older versions).
OPTIONAL_TOP_KEYS: dict[str, tuple] = {
    "schema_version": (int,),  # SCHEMA_VERSION; written first by every report.json (render.py)
    "model": (str,),  # --model: tinygpt, a preset, or pkg.module:factory
    "skipped": (list,),  # [{"mode", "reason"}]: modes this W cannot run
    "failures": (list,),  # [{"mode", "check", "detail"}]: every failed check (verify.report.checks)
    "params": (dict,),  # which params go to Muon / AdamW and why (PARAMS_KEYS)
}
#: ``report["params"]``: every param of the model, split by optimizer
#: (``verify.measure.figures.params_report``); each entry of the lists is PARAM_KEYS.
PARAMS_KEYS: dict[str, tuple] = {
    "muon_elems": (int,),
    "adamw_elems": (int,),
    "muon": (list,),
    "adamw": (list,),
}
PARAM_KEYS: dict[str, tuple] = {
    "name": (str,),
    "shape": (list,),
    "numel": (int,),
    "reason": (str,),
}
#: Optional per-run keys: ``tp_size`` (T of a tensor-parallel run, verify/traffic/tp.py),
#: ``ep_size`` (E of an expert-parallel run, verify/traffic/ep.py), ``pp_size``, ``microbatches``
#: and ``stage_p_m`` (S, M and each stage's P_s of a pipeline-parallel run, verify/traffic/pp.py),
#: ``cp_size`` and ``n_eff`` (C and N·C of a context-parallel run, verify/traffic/cp.py),
#: ``wire`` (verify.traffic.wire.wire_report), ``bytes``
#: (``{"measured_avg_bytes"|"predicted_avg_bytes": {phase|"total": {dtype: bytes}}}``),
#: ``timing`` (verify.measure.steptime.timing_report), ``checks`` (``[{"check", "pass", "detail"}]``,
#: verify.report.checks; derived from the figures where absent) and ``loss_falls`` (the run is
#: gated on its loss); ``memory`` (DMuon modes: measured peak bytes per rank against the
#: predicted bound, verify.traffic.memory.memory_report); ``qk_clip`` (``--qk-clip``: the phase's bytes in a DMuon run, or
#: ``{"applies": false, "reason"}`` in a baseline; verify.measure.qk_clip); ``losses`` (every
#: step's loss, mean over ranks, step P's included where it ran), ``numerics`` and
#: ``checkpoint`` (probed DMuon modes: the oracle's step P and the DCP round trip,
#: verify.measure.numerics, verify.measure.resume).
OPTIONAL_RUN_KEYS: dict[str, tuple] = {"tp_size": (int,), "ep_size": (int,), "pp_size": (int,),
                                       "microbatches": (int,), "stage_p_m": (list,),
                                       "cp_size": (int,), "n_eff": (int,), "wire": (dict,), "bytes": (dict,),
                                       "timing": (dict,), "checks": (list,), "loss_falls": (bool,),
                                       "hierarchy": (str,), "qk_clip": (dict,),
                                       "memory": (dict,), "losses": (list,), "numerics": (dict,),
                                       "checkpoint": (dict,)}
#: ``run["hierarchy"]``: how a DMuon run on a 2-D mesh moved its dedicated params
#: (``verify.traffic.predict.dmuon_hierarchy``; absent on 1-D meshes, other modes and older
#: reports, which all ran hierarchical; docs/traffic-model.md, "HSDP: flat or hierarchical").
HIERARCHIES = ("flat", "hierarchical")
CHECK_KEYS: dict[str, tuple] = {"check": (str,), "pass": (bool,), "detail": (str,)}
FAILURE_KEYS: dict[str, tuple] = {"mode": (str,), "check": (str,), "detail": (str,)}
WIRE_KEYS: dict[str, tuple] = {
    "per_rank": (list,),
    "busiest_rank": (int,),
    "max_recv_elems": _NUM,
    "max_sent_elems": _NUM,
    "max_recv_bytes": _NUM,
    "max_sent_bytes": _NUM,
    "mean_recv_elems": _NUM,
}
WIRE_RANK_KEYS: dict[str, tuple] = {
    "rank": (int,), "sent_elems": _NUM, "recv_elems": _NUM, "sent_bytes": _NUM, "recv_bytes": _NUM,
}
TIMING_KEYS: dict[str, tuple] = {
    "step_ms": _NUM,
    "step_ms_per_step": (list,),
    "exposed_comm_frac": _OPT_NUM,
    "exposed_comm_frac_max": _OPT_NUM,
    "exposed_comm_source": (str,),
    "exposed_comm_reason": _OPT_STR,
}
SKIPPED_KEYS: dict[str, tuple] = {"mode": (str,), "reason": (str,)}


def mode_label(run: Mapping) -> str:
    """A run's mode as the report's lines print it: ``"dmuon-hsdp-z2 (flat)"`` for a DMuon
    HSDP run that moved its dedicated params flat (``run["hierarchy"]``), else the mode; the
    hierarchical protocol is what an HSDP mode's name already says."""
    return run["mode"] + (" (flat)" if run.get("hierarchy") == "flat" else "")


# ----------------------------------------------------------------------------- validation


def _check_keys(obj: object, spec: Mapping[str, tuple], where: str) -> None:
    if not isinstance(obj, Mapping):
        raise ValueError(f"Invalid {where}={obj!r}. Must be a dict with keys {list(spec)}.")
    for key, types in spec.items():
        if key not in obj:
            raise ValueError(
                f"Invalid {where}: missing key {key!r}. Must have keys {list(spec)} "
                "(report.json data model, verify/report/schema.py)."
            )
        value = obj[key]
        # bool is an int subclass: only accept it where bool is the declared type.
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            names = "/".join("None" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"Invalid {where}[{key!r}]={value!r}. Must be of type {names}.")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"Invalid {where}[{key!r}]={value!r}. Must be finite (JSON has no NaN/inf); "
                "fix the runner that computed it."
            )


def _check_optional(obj: Mapping, spec: Mapping[str, tuple], where: str) -> None:
    present = {k: v for k, v in spec.items() if k in obj}
    _check_keys({k: obj[k] for k in present}, present, where)


def _check_bytes(entry: Mapping, where: str) -> None:
    for kind in ("measured_avg_bytes", "predicted_avg_bytes"):
        table = entry.get(kind)
        if not isinstance(table, Mapping):
            raise ValueError(f"Invalid {where}[{kind!r}]={table!r:.80}. Must be a dict "
                             "{phase: {dtype: bytes}}.")
        for phase, by_dtype in table.items():
            ok = isinstance(by_dtype, Mapping) and all(
                isinstance(k, str) and isinstance(v, _NUM) and not isinstance(v, bool)
                and math.isfinite(v) for k, v in by_dtype.items())
            if not ok:
                raise ValueError(f"Invalid {where}[{kind!r}][{phase!r}]={by_dtype!r:.80}. "
                                 "Must map dtype names to finite byte counts.")


def _check_run_optional(run: Mapping, where: str) -> None:
    _check_optional(run, OPTIONAL_RUN_KEYS, where)
    if run.get("hierarchy", HIERARCHIES[0]) not in HIERARCHIES:
        raise ValueError(f"Invalid {where} hierarchy={run['hierarchy']!r}. Must be one of {HIERARCHIES} "
                         "(verify.traffic.predict.dmuon_hierarchy).")
    if "wire" in run:
        _check_keys(run["wire"], WIRE_KEYS, f"{where} wire")
        for j, entry in enumerate(run["wire"]["per_rank"]):
            _check_keys(entry, WIRE_RANK_KEYS, f"{where} wire per_rank[{j}]")
    if "bytes" in run:
        _check_bytes(run["bytes"], f"{where} bytes")
    if "timing" in run:
        _check_keys(run["timing"], TIMING_KEYS, f"{where} timing")


def _check_run_verdict(run: Mapping, where: str) -> None:
    """``run["checks"]`` entries are well-formed, and ``run["pass"]`` is their conjunction."""
    for j, entry in enumerate(run.get("checks", [])):
        _check_keys(entry, CHECK_KEYS, f"{where} checks[{j}]")
        if entry["check"] not in RUN_CHECK_NAMES:
            raise ValueError(f"Invalid {where} checks[{j}] check={entry['check']!r}. Must be one "
                             f"of {list(RUN_CHECK_NAMES)}.")
    failed = [c["check"] for c in checks_of(run) if not c["pass"]]
    if run["pass"] and failed:
        raise ValueError(f"Invalid {where} pass=True while checks {failed} failed. Must be "
                         "False when any check fails.")
    if not run["pass"] and not failed:
        raise ValueError(f"Invalid {where} pass=False while every check passed. Must name the "
                         "failed check (verify.report.checks).")


def _check_failures(report: Mapping) -> None:
    """``report["failures"]`` entries are well-formed and agree with the runs' checks; an
    ``error`` entry names a mode that has no run."""
    if "failures" not in report:
        return
    modes = {run["mode"] for run in report["runs"]}
    listed = set()
    for j, entry in enumerate(report["failures"]):
        where = f"report['failures'][{j}]"
        _check_keys(entry, FAILURE_KEYS, where)
        if entry["check"] not in CHECK_NAMES:
            raise ValueError(f"Invalid {where} check={entry['check']!r}. Must be one of "
                             f"{list(CHECK_NAMES)}.")
        if entry["mode"] not in MODES:
            raise ValueError(f"Invalid {where} mode={entry['mode']!r}. Must be one of {MODES}.")
        if entry["check"] == "error" and entry["mode"] in modes:
            raise ValueError(f"Invalid {where}: mode {entry['mode']!r} raised but has a run. "
                             "Must have no runs[] entry (a mode that raised has no figures).")
        if entry["check"] != "error":
            listed.add((entry["mode"], entry["check"]))
    failed = {(run["mode"], c["check"]) for run in report["runs"] for c in checks_of(run)
              if not c["pass"]}
    if listed != failed:
        raise ValueError(f"Invalid report['failures']: lists {sorted(listed)} while the runs' "
                         f"failed checks are {sorted(failed)}. Must list every failed check once.")


def validate_report(report: Mapping) -> None:
    """Check ``report`` against the report.json data model.

    Raises:
        ValueError: a key is missing or has the wrong type, a float is NaN/inf, a mode or
            source name is unknown, a phase name is not a str, ``ratio_to_p_m`` is not
            ``measured_avg_elems / p_m``, a replicate broadcast is waited before it is
            issued, a run's ``pass`` is not the conjunction of its checks, ``failures`` does not
            list exactly the failed checks (plus modes that raised), ``report["pass"]`` is
            not "no check failed", or ``schema_version`` is present and not
            :data:`SCHEMA_VERSION` (absent: a report dict before it is written, or an older file).
    """
    _check_keys(report, TOP_KEYS, "report")
    _check_optional(report, OPTIONAL_TOP_KEYS, "report")
    if report.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ValueError(f"Invalid report['schema_version']={report['schema_version']!r}. Must be "
                         f"{SCHEMA_VERSION}, the version this DMuon reads and writes (a report of "
                         "another version: read it with the DMuon that wrote it).")
    for j, entry in enumerate(report.get("skipped", [])):
        _check_keys(entry, SKIPPED_KEYS, f"report['skipped'][{j}]")
    if "params" in report:
        _check_keys(report["params"], PARAMS_KEYS, "report['params']")
        for kind in ("muon", "adamw"):
            for j, entry in enumerate(report["params"][kind]):
                _check_keys(entry, PARAM_KEYS, f"report['params'][{kind!r}][{j}]")
    if report["backend"] not in ("gloo", "nccl"):
        raise ValueError(
            f"Invalid report['backend']={report['backend']!r}. Must be 'gloo' or 'nccl'."
        )
    if not report["runs"] and not any(isinstance(f, Mapping) and f.get("check") == "error"
                                     for f in report.get("failures", [])):
        raise ValueError("Invalid report['runs']=[]. Must hold at least one run (or a failure "
                         "entry of a mode that raised).")
    for i, run in enumerate(report["runs"]):
        where = f"report['runs'][{i}]"
        _check_keys(run, RUN_KEYS, where)
        where = f"run {run['mode']!r}"
        if run["mode"] not in MODES:
            raise ValueError(f"Invalid {where} mode={run['mode']!r}. Must be one of {MODES}.")
        if run["p_m"] <= 0:
            raise ValueError(
                f"Invalid {where} p_m={run['p_m']}. Must be > 0 (elements of dedicated params)."
            )
        ratio = run["measured_avg_elems"] / run["p_m"]
        if not math.isclose(run["ratio_to_p_m"], ratio, rel_tol=READING_REL_TOL, abs_tol=1e-12):
            raise ValueError(
                f"Invalid {where} ratio_to_p_m={run['ratio_to_p_m']}. Must equal "
                f"measured_avg_elems / p_m = {run['measured_avg_elems']} / {run['p_m']} = {ratio}."
            )
        for name, ph in run["phases"].items():
            if not isinstance(name, str):
                raise ValueError(f"Invalid {where} phase={name!r}. Must be a str (phase name).")
            _check_keys(ph, PHASE_KEYS, f"{where} phases[{name!r}]")
        for kind in ("missing", "unexpected"):
            for j, entry in enumerate(run[kind]):
                _check_keys(entry, COLLECTIVE_KEYS, f"{where} {kind}[{j}]")
                _check_optional(entry, COLLECTIVE_OPTIONAL_KEYS, f"{where} {kind}[{j}]")
        for name, src in run["sources"].items():
            if name not in SOURCES:
                raise ValueError(f"Invalid {where} source={name!r}. Must be one of {SOURCES}.")
            _check_keys(src, SOURCE_KEYS, f"{where} sources[{name!r}]")
        _check_run_optional(run, where)
        _check_run_verdict(run, where)
        for j, entry in enumerate(run["replicate_overlap"]):
            _check_keys(entry, OVERLAP_KEYS, f"{where} replicate_overlap[{j}]")
            if entry["waited_ns"] < entry["issued_ns"]:
                raise ValueError(
                    f"Invalid {where} replicate_overlap[{j}] waited_ns={entry['waited_ns']} < "
                    f"issued_ns={entry['issued_ns']}. Must be measured from the same step start "
                    "(the step that issued the broadcast), so that the wait comes after the issue."
                )
    _check_failures(report)
    failed = [run["mode"] for run in report["runs"] if not run["pass"]]
    if report["pass"] and failed:
        raise ValueError(
            f"Invalid report['pass']=True while runs {failed} failed. Must be False when any "
            "run fails (it is the CI gate)."
        )
    if report["pass"] == bool(failures(report)):
        raise ValueError(
            f"Invalid report['pass']={report['pass']} with {len(failures(report))} failed "
            "check(s). Must be True exactly when no check failed (it is the CI gate)."
        )


