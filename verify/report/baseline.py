"""A verify-traffic baseline: the gated figures of a known-good run, compared on every run.

``make verify-traffic`` compares its default run (W = 4, gloo, the built-in model, every mode
and variant, default knobs) with the committed ``verify/baselines/default-w4-gloo.json``, and
each run of ``make verify-traffic-full`` with the committed file written from that run
(:func:`committed_baseline`);
``--baseline FILE`` compares any run with ``FILE`` and ``--write-baseline FILE`` writes one
(docs/verify.md, "Baseline"). Per mode it records (all per measured step, W-averages where
a phase's figure is one):

- ``calls_per_step`` and ``calls_per_phase``: collectives, all params;
- ``elems_per_phase`` / ``bytes_per_phase``: the dedicated params' measured f(n)·S, elements
  and bytes by dtype;
- ``busiest_rank``, ``busiest_recv_elems``: the rank receiving most under NCCL's algorithms
  and what it receives (``wire``);
- ``ns_calls_per_rank``: Newton–Schulz calls on each rank;
- ``hierarchy`` (DMuon HSDP: flat / hierarchical) and ``units`` (DMuon's units).

Any difference fails the run's ``baseline`` check, naming the figure, e.g. ``calls_per_step:
56 vs baseline 16``, and what it means in the protocol's words where a rule applies
(:func:`causes`: "a unit is broadcast again in backward", "copies freed between steps"). Step time (median ms of the slowest rank) is compared with a noise band
and reported only: timings on shared CPUs vary by several times.

A baseline applies to the run it was written from: same W, backend, model, torch minor
version and knobs (:func:`baseline_key`). The default baseline is skipped (and says why) on
any other run; a ``--baseline FILE`` whose key differs fails every run, naming the keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from verify.report.checks import failures_of_runs, readings_equal

#: Bumped when the file's layout changes.
BASELINE_VERSION = 1
#: The committed baselines: the default run's, and one per run of ``make verify-traffic-full``.
BASELINES_DIR = Path(__file__).resolve().parents[1] / "baselines"
#: The committed baseline of the default run.
DEFAULT_BASELINE = BASELINES_DIR / "default-w4-gloo.json"
#: Report ``config`` entries that do not change a step's figures.
_NOT_KEYED = ("out_dir", "profiler", "steps_warmup", "steps_measured", "device", "numerics")
#: Step time: a ratio to the baseline outside [1/NOISE, NOISE] is reported as outside the band.
STEP_TIME_NOISE = 3.0


#: Knobs added after baselines were written, with the default that means "as before" (a run at
#: it keys as ``None``, as the older baseline files read).
_PREDATED = {"ep": 1, "pp": 1, "microbatches": 4, "cp": 1}


def baseline_key(report: Mapping) -> dict:
    """What a baseline must share with a run to apply: W, backend, model, torch major.minor
    and the report's ``config`` without the entries that do not change a step's figures, as
    JSON reads them back (a run's ``modes`` tuple and a baseline file's list compare equal).
    A knob a baseline predates (``qk_clip_tau``, ``ep``, ``pp``, ``microbatches``, ``cp``) reads as ``None`` there: a run with its
    default (:data:`_PREDATED`, or ``None``) matches, any other value is another run (its
    reason names the knob)."""
    config = {k: (None if _PREDATED.get(k, object()) == v else v)
              for k, v in report["config"].items() if k not in _NOT_KEYED}
    torch_minor = ".".join(str(report["torch_version"]).split(".")[:2])
    return json.loads(json.dumps({"world_size": report["world_size"], "backend": report["backend"],
                                  "model": report["model"], "torch": torch_minor, **config}))


def figures(run: Mapping) -> dict:
    """The gated figures of one ``runs[]`` entry (module docstring)."""
    wire = run.get("wire") or {}
    nb = run.get("ns_balance") or {}
    return {
        "calls_per_step": run.get("calls_measured_per_step"),
        "calls_per_phase": {ph: v["collectives_measured"] for ph, v in sorted(run["phases"].items())},
        "elems_per_phase": {ph: v["measured_avg_elems"] for ph, v in sorted(run["phases"].items())},
        "bytes_per_phase": (run.get("bytes") or {}).get("measured_avg_bytes"),
        "busiest_rank": wire.get("busiest_rank"),
        "busiest_recv_elems": wire.get("max_recv_elems"),
        "ns_calls_per_rank": nb.get("calls_per_rank"),
        "hierarchy": run.get("hierarchy"),
        "units": run.get("units"),
    }


def committed_baseline(report: Mapping) -> Path:
    """The committed baseline written from the same run as ``report`` (its key equal to
    :func:`baseline_key`), else :data:`DEFAULT_BASELINE` (which then says why it is skipped).

    Raises:
        ValueError: a committed file is not a baseline (:func:`read_baseline`).
    """
    key = baseline_key(report)
    for path in sorted(BASELINES_DIR.glob("*.json")):
        if not key_differences(key, read_baseline(path)["key"]):
            return path
    return DEFAULT_BASELINE


def key_differences(key: Mapping, want: Mapping) -> list[str]:
    """``"name=run's (baseline baseline's)"`` for each entry where run ``key`` and baseline key
    ``want`` differ; an entry one side lacks reads as ``None`` (a knob the baseline predates,
    :func:`baseline_key`). ``[]``: the baseline applies."""
    return [f"{k}={key.get(k)!r} (baseline {want.get(k)!r})" for k in sorted(set(key) | set(want))
            if key.get(k) != want.get(k)]


def make_baseline(report: Mapping) -> dict:
    """The baseline of ``report`` (a passing run's; JSON-able)."""
    return {
        "baseline_version": BASELINE_VERSION,
        "key": baseline_key(report),
        "modes": {run["mode"]: {"figures": figures(run),
                                "step_ms": (run.get("timing") or {}).get("step_ms")}
                  for run in report["runs"]},
    }


def write_baseline(report: Mapping, path: str | Path) -> Path:
    """Write :func:`make_baseline` of ``report`` to ``path``.

    Raises:
        ValueError: the report did not pass (a baseline records a known-good run).
    """
    if not report["pass"]:
        raise ValueError(f"Invalid report for --write-baseline {path}: the run failed. Must "
                         "pass: a baseline records a known-good run.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(make_baseline(report), indent=1, sort_keys=True) + "\n")
    return path


def read_baseline(path: str | Path) -> dict:
    """A baseline file.

    Raises:
        ValueError: unreadable, not JSON, or not a baseline of :data:`BASELINE_VERSION`.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Invalid baseline file {path}: {exc}. Must be a file written by "
                         "--write-baseline.") from exc
    if not isinstance(data, dict) or data.get("baseline_version") != BASELINE_VERSION \
            or not isinstance(data.get("modes"), dict) or not isinstance(data.get("key"), dict):
        raise ValueError(f"Invalid baseline file {path}: baseline_version "
                         f"{data.get('baseline_version') if isinstance(data, dict) else None!r}. "
                         f"Must be a version-{BASELINE_VERSION} file written by --write-baseline.")
    return data


def _same(a, b) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return readings_equal(float(a), float(b)) or a == b
    return a == b


def _show(x) -> str:
    if isinstance(x, float) and x == int(x):
        return str(int(x))
    return json.dumps(x, sort_keys=True) if isinstance(x, (dict, list)) else str(x)


def differences(run_figures: Mapping, base_figures: Mapping) -> list[str]:
    """``"<figure>: <this run> vs baseline <baseline>"`` for every figure that differs."""
    return [f"{name}: {_show(run_figures.get(name))} vs baseline {_show(base_figures.get(name))}"
            for name in sorted(set(run_figures) | set(base_figures))
            if not _same(run_figures.get(name), base_figures.get(name))]


def _calls(fig: Mapping, phase: str) -> float:
    return float((fig.get("calls_per_phase") or {}).get(phase) or 0)


def causes(mode: str, run_figures: Mapping, base_figures: Mapping) -> list[str]:
    """What the figures that differ mean in the protocol's words (docs/protocol.md), one
    sentence each, for the failure's text beside the figures; empty where no rule applies.

    Read from the mode's name (``z2``/``z3``, ``hsdp``, DMuon or a baseline) and the figures
    only: more backward calls under Z3 (a unit broadcast again in backward: the kept last unit,
    step 2, or a re-sent unit), more forward calls under Z2 (copies freed between steps and
    broadcast again: Z2 keeps them resident), calls in the ``optimizer`` phase, another unit
    count (the coalescing target), another HSDP protocol, Newton–Schulz on other ranks (the
    ownership plan), another dtype on the wire, and equal calls of other sizes."""
    out = []
    dmuon = mode.startswith("dmuon")
    z3 = "z3" in mode.split("[")[0]
    for phase in sorted(set(run_figures.get("calls_per_phase") or {}) | set(base_figures.get("calls_per_phase") or {})):
        now, then = _calls(run_figures, phase), _calls(base_figures, phase)
        if now == then:
            continue
        more = "more" if now > then else "fewer"
        if dmuon and phase == "backward" and z3 and now > then:
            out.append(f"{now - then:g} more backward calls per step under Z3: a unit is broadcast "
                       "again in backward (the kept last unit re-broadcast, docs/protocol.md step 2, or a "
                       "unit re-sent for a block that runs again)")
        elif dmuon and phase == "forward" and not z3 and "ddp" not in mode and now > then:
            out.append(f"{now - then:g} more forward calls per step under Z2: copies freed between "
                       "steps are broadcast again in forward (Z2 keeps every copy resident, "
                       "docs/protocol.md 'Residency')")
        elif phase == "optimizer":
            out.append(f"{more} calls in the optimizer phase ({then:g} -> {now:g}): a collective "
                       "added to or removed from step()")
        else:
            out.append(f"{more} {phase} calls per step ({then:g} -> {now:g})")
    if run_figures.get("units") != base_figures.get("units"):
        out.append(f"DMuon's units changed ({base_figures.get('units')} -> {run_figures.get('units')}): "
                   "the coalescing target or the blocks' sizes differ (docs/traffic-model.md, 'Coalescing')")
    if run_figures.get("hierarchy") != base_figures.get("hierarchy"):
        out.append(f"the HSDP protocol changed ({base_figures.get('hierarchy')} -> "
                   f"{run_figures.get('hierarchy')}; docs/traffic-model.md, 'HSDP: flat or hierarchical')")
    if run_figures.get("ns_calls_per_rank") != base_figures.get("ns_calls_per_rank"):
        out.append("Newton–Schulz runs on other ranks or more often: the ownership plan or the "
                   "owner's step changed (docs/protocol.md step 6)")
    dtypes = lambda f: {d for v in (f.get("bytes_per_phase") or {}).values() for d in v}
    if dtypes(run_figures) != dtypes(base_figures):
        out.append(f"another dtype on the wire ({sorted(dtypes(base_figures))} -> {sorted(dtypes(run_figures))}): "
                   "mixed precision or a reduce dtype changed")
    elif (run_figures.get("calls_per_phase") == base_figures.get("calls_per_phase")
          and not _same(run_figures.get("elems_per_phase"), base_figures.get("elems_per_phase"))):
        out.append("the same calls move other sizes: a bucket's params or padding changed")
    return out


def _step_time(run: Mapping, base: Mapping | None) -> dict | None:
    now, then = (run.get("timing") or {}).get("step_ms"), (base or {}).get("step_ms")
    if not now or not then:
        return None
    ratio = now / then
    return {"mode": run["mode"], "step_ms": now, "baseline_step_ms": then, "ratio": ratio,
            "within_noise_band": 1 / STEP_TIME_NOISE <= ratio <= STEP_TIME_NOISE}


def apply_baseline(report: dict, baseline: Mapping, source: str, explicit: bool) -> dict:
    """Compare ``report`` with ``baseline`` in place: a ``baseline`` check on every run,
    ``failures`` and ``pass`` recomputed (``error`` entries kept), and ``report["baseline"]``
    = ``{"file", "compared", "reason", "step_time", "not_run"}``. Returns ``report``.

    A key that differs (:func:`baseline_key`): skipped with the reason for the default
    baseline (``explicit=False``), a failed ``baseline`` check on every run for ``--baseline``.
    """
    off = key_differences(baseline_key(report), baseline["key"])
    summary = {"file": source, "compared": not off, "reason": None, "step_time": [], "not_run": []}
    if off and not explicit:
        summary["reason"] = "not the run the baseline was written from: " + "; ".join(off)
        report["baseline"] = summary
        return report
    modes = baseline["modes"]
    for run in report["runs"]:
        if off:
            ok, detail = False, "baseline written for another run: " + "; ".join(off)
        elif run["mode"] not in modes:
            ok, detail = False, f"mode {run['mode']} is not in the baseline {source}"
        else:
            now, then = figures(run), modes[run["mode"]]["figures"]
            diff = differences(now, then)
            why = causes(run["mode"], now, then) if diff else []
            ok = not diff
            detail = ("; ".join(diff) + (" — " + "; ".join(why) if why else "")) if diff \
                else f"every gated figure equals {source}"
            st = _step_time(run, modes[run["mode"]])
            if st is not None:
                summary["step_time"].append(st)
        run["checks"] = [c for c in run["checks"] if c["check"] != "baseline"] + [
            {"check": "baseline", "pass": ok, "detail": detail}]
        run["pass"] = all(c["pass"] for c in run["checks"])
    ran = {run["mode"] for run in report["runs"]}
    summary["not_run"] = sorted(m for m in modes if m not in ran)
    errors = [f for f in report.get("failures", []) if f["check"] == "error"]
    report["failures"] = failures_of_runs(report["runs"]) + errors
    report["pass"] = not report["failures"]
    report["baseline"] = summary
    return report


def summary_lines(report: Mapping) -> list[str]:
    """What the terminal prints about the baseline: compared or why not, and step times
    against the baseline's (reported, not gated)."""
    summary = report.get("baseline")
    if summary is None:
        return []
    if not summary["compared"] and summary["reason"]:
        return [f"baseline {summary['file']}: not compared ({summary['reason']})"]
    lines = [f"baseline {summary['file']}: compared ({len(report['runs'])} mode(s))"
             + (f"; not run here: {', '.join(summary['not_run'])}" if summary["not_run"] else "")]
    outside = [s for s in summary["step_time"] if not s["within_noise_band"]]
    if summary["step_time"]:
        ratios = sorted(s["ratio"] for s in summary["step_time"])
        lines.append(f"  step time vs baseline (not gated): {ratios[0]:.2f}x to {ratios[-1]:.2f}x; "
                     f"outside the {1 / STEP_TIME_NOISE:.2f}x-{STEP_TIME_NOISE:.0f}x noise band: "
                     + (", ".join(f"{s['mode']} {s['ratio']:.2f}x" for s in outside) or "none"))
    return lines
