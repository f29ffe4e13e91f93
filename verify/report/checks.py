"""The checks a verify-traffic run is gated on, each a named verdict with its cause.

Per run (report.json ``runs[].checks``, in this order; a run passes when all of its checks do):

- ``collectives``: the measured multiset of ``(rank, phase, op, group, count, dtype, root)``
  equals the predicted list (``verify.compare``; the interposer's entry in ``sources`` is this
  check, so it is not repeated as a source check);
- ``closed_form``: the measured W-average equals the closed form of docs/spec.md §2, in every
  phase and in total;
- ``ns_calls``: Newton–Schulz calls per step equal the expected count;
- ``owners``: no dedicated matrix's owner, as the traffic shows it (the root of its broadcast,
  the dst of its reduce, its holder's part of an aligned call), differs from the harness's
  (``verify.traffic.owners``); DMuon modes;
- ``ns_balance``: on every rank, Newton–Schulz calls per step and the plan's NS cost stay
  within the bound the harness derives from the shapes (``verify.traffic.ns_bound``); modes
  where each matrix has one owner;
- ``memory``: on every rank, the peak bytes of DMuon's dedicated params in forward, in
  backward and between steps, and of its grad buffers, measured at the harness's hooks, stay
  within the bound predicted from the plan (``verify.traffic.memory``); DMuon modes where the
  run carries ``memory``;
- ``baseline``: the run's gated figures equal the baseline's (``verify.report.baseline``);
  only where a baseline was compared;
- ``loss``: the loss (mean over ranks) of the last step is below the first; only where the
  producer gates on it, i.e. the run carries ``loss_falls`` (verify-traffic does;
  ``verify.run.record.TrafficWindow`` does not);
- ``source:<name>``: each other trace source (``flight_recorder``, ``profiler``, ``nccl_log``,
  ``nsys``) matches the interposer one to one (the NCCL log: and the prediction), and every step
  it recorded before the window holds the whole prediction (``verify.sources.steps``).

Per report (``failures``): every failed check as ``{"mode", "check", "detail"}``, plus
``error`` entries: a mode that raised; it has no figures, so no entry in ``runs``.

The terminal and report.md print :func:`verdict_lines` (one line per check) and end with
:func:`final_line`, e.g. ``FAIL: loss did not fall (dmuon-z2); NS calls differ from expected
(naive-fsdp2-z3)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tracer.events import SOURCES

#: Measured and predicted figures are sums of integers divided by W: equal up to float rounding.
READING_REL_TOL = 1e-9

#: Check name -> (what holds when it passes, what the final line says when it fails).
_LABELS: dict[str, tuple[str, str]] = {
    "collectives": ("collectives equal the prediction", "collectives differ from the prediction"),
    "closed_form": ("averages equal the closed form", "average differs from the closed form"),
    "ns_calls": ("NS calls as expected", "NS calls differ from expected"),
    "owners": ("owners as the traffic shows them equal the plan's", "owner differs from the plan"),
    "ns_balance": ("NS calls and cost per rank within the shape bound",
                   "NS load of a rank above the shape bound"),
    "loss": ("loss falls", "loss did not fall"),
    **{f"source:{s}": (f"{s} matches one to one", f"{s} trace does not match")
       for s in SOURCES if s != "interposer"},
    "memory": ("DMuon's bytes per rank within the plan's bounds",
               "DMuon's memory outside the plan's bounds"),
    "numerics": ("losses and one step's updates equal the reference's within the noise floor",
                 "numerics differ from the reference"),
    "owner_grads": ("owners' grads and the clip norm equal the global mean's",
                    "owner's grad differs from the global mean"),
    "checkpoint": ("the step after a DCP save and load is bit-identical",
                   "the step after a checkpoint load differs"),
    "baseline": ("figures equal the baseline", "figures differ from the baseline"),
    "error": ("no mode raised", "mode raised an error"),
}
#: Every check name, in display order.
CHECK_NAMES: tuple[str, ...] = tuple(_LABELS)
#: Checks of a run (``error`` is a report-level failure only).
RUN_CHECK_NAMES: tuple[str, ...] = tuple(n for n in CHECK_NAMES if n != "error")


def label(name: str, passed: bool) -> str:
    """The words for check ``name``: what holds (``passed``) or what failed.

    Raises:
        ValueError: an unknown check name (must be one of :data:`CHECK_NAMES`).
    """
    if name not in _LABELS:
        raise ValueError(f"Invalid check={name!r}. Must be one of {list(CHECK_NAMES)}.")
    return _LABELS[name][0 if passed else 1]


def readings_equal(a: float | None, b: float | None) -> bool:
    """Whether two readings in elements are equal up to float rounding (None: never)."""
    return a is not None and b is not None and math.isclose(a, b, rel_tol=READING_REL_TOL,
                                                            abs_tol=1e-6)


def _elems(x: float) -> str:
    return f"{round(x):,}" if abs(x - round(x)) < 1e-9 else f"{x:,.2f}"


def _count(x: float) -> str:
    return f"{round(x)}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def _check(name: str, passed: bool, detail: str) -> dict:
    return {"check": name, "pass": bool(passed), "detail": detail}


def volume_text(run: Mapping) -> str:
    """How the measured volume and call count compare with the prediction, e.g. ``same
    bytes, 8× calls (128 vs 16 per step)`` or ``+12.5% bytes, 1.06× calls (17 vs 16 per
    step)``; ``""`` where the run has no call counts."""
    meas_calls, pred_calls = run.get("calls_measured_per_step"), run.get("calls_predicted_per_step")
    if meas_calls is None or pred_calls is None:
        return ""
    meas, pred = run["total_measured_avg_elems"], run["total_predicted_avg_elems"]
    if readings_equal(meas, pred):
        volume = "same bytes"
    elif pred:
        volume = f"{(meas - pred) / pred * 100:+.1f}% bytes"
    else:
        volume = f"{_elems(meas)} elem where none predicted"
    calls = f"{meas_calls / pred_calls:.3g}×" if pred_calls else "∞×"
    return f"{volume}, {calls} calls ({_count(meas_calls)} vs {_count(pred_calls)} per step)"


def _collectives(run: Mapping) -> dict:
    missing = sum(e["n"] for e in run["missing"])
    unexpected = sum(e["n"] for e in run["unexpected"])
    if not missing and not unexpected:
        per_step = sum(ph["collectives_predicted"] for ph in run["phases"].values())
        return _check("collectives", True, f"{_count(per_step)} calls per step, as predicted")
    phases = sorted({str(e["phase"]) for e in run["missing"] + run["unexpected"]})
    volume = volume_text(run)
    return _check("collectives", False, (f"{volume}; " if volume else "") +
                  f"{missing} missing and {unexpected} unexpected calls over the measured steps "
                  f"(phases: {', '.join(phases)})")


#: Owner findings named in a check's detail (the rest counted).
MAX_OWNERS_SHOWN = 4


def _owners(run: Mapping) -> dict:
    found = run["owners"]
    if not found:
        return _check("owners", True, "no owner differs from the plan in the traffic")
    shown = "; ".join(f"owner of {f['param']}: expected rank {f['expected_rank']}, traffic shows "
                      f"rank {f['traffic_rank']} ({f['phase']} {f['op']})"
                      for f in found[:MAX_OWNERS_SHOWN])
    more = len(found) - MAX_OWNERS_SHOWN
    return _check("owners", False, shown + (f"; and {more} more" if more > 0 else ""))


def _ns_balance(run: Mapping) -> dict:
    nb = run["ns_balance"]
    over = []
    calls = nb["calls_per_rank"]
    for r, c in enumerate(calls or ()):
        if c > nb["count_bound"]:
            over.append(f"rank {r} runs {_count(c)} NS calls per step > bound {nb['count_bound']}")
    for r, c in enumerate(nb["plan_cost_flops_per_rank"]):
        if c > nb["cost_bound_flops"]:
            over.append(f"rank {r}'s NS cost {c / nb['cost_bound_flops']:.2f}× the bound "
                        f"({c:.3g} > {nb['cost_bound_flops']:.3g} FLOPs per step)")
    if over:
        return _check("ns_balance", False, "; ".join(over) + " (bound from the shapes: T/W + "
                      "(1-1/W)·c_max; docs/traffic-model.md, 'Newton–Schulz balance')")
    shown = "/".join(_count(c) for c in calls) if calls is not None else "not measured"
    peak = max(nb["plan_cost_flops_per_rank"], default=0)
    return _check("ns_balance", True, f"NS calls per rank {shown} (bound {nb['count_bound']}), "
                                      f"busiest rank's cost {peak / nb['cost_bound_flops']:.2f}× the bound"
                  if nb["cost_bound_flops"] else "no Muon matrix")


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _memory(run: Mapping) -> dict:
    mem = run["memory"]
    over, worst = [], 0.0
    for r in mem["ranks"]:
        b, m = r["bound"], r["measured"]
        why = (f"Z3 window of {b['window_units']} unit{'s' if b['window_units'] != 1 else ''}"
               if mem["z3"] else "Z2: every copy resident")
        for phase, bound, cause in (("forward", b["peak_bytes"], why), ("backward", b["peak_bytes"], why),
                                    ("between steps", b["between_bytes"], "held buckets" if mem["z3"] else why),
                                    ("grads", b["grads_bytes"], "held buffers + 2 units")):
            got = m["between" if phase == "between steps" else phase]
            if bound:
                worst = max(worst, got / bound)
            if got > bound:
                what = "grad buffers" if phase == "grads" else f"peak {phase}"
                over.append(f"rank {r['rank']} {what} {_mb(got)} > bound {_mb(bound)} ({cause})")
        over += _memory_below(r, mem["z3"])
    if over:
        shown = "; ".join(over[:MAX_OWNERS_SHOWN])
        more = len(over) - MAX_OWNERS_SHOWN
        return _check("memory", False, shown + (f"; and {more} more" if more > 0 else "")
                      + " (docs/verify.md, 'Memory')")
    return _check("memory", True, f"every rank within the bound (at most {worst:.2f}× it) and at "
                                  f"least what the plan holds (exact where it says so; "
                                  f"prefetch_depth {mem['prefetch_depth']})")


def _memory_below(r: Mapping, z3: bool) -> list[str]:
    """One rank's findings below the plan: a meter that reads 0 where the plan holds bytes, a
    figure below the exact one or below the least the protocol needs (``MemoryBound``'s
    ``floor_*`` and ``between_exact``; bounds of older reports have none: no finding)."""
    b, m = r["bound"], r["measured"]
    if "floor_peak_bytes" not in b:
        return []
    out = []
    exact_between = b["between_exact"]
    rows = [("forward", b["floor_peak_bytes"], not z3 and exact_between),
            ("backward", b["floor_peak_bytes"], not z3 and exact_between),
            ("between", b["between_bytes"] if exact_between else 0, exact_between),
            ("grads", b["floor_grads_bytes"], False)]
    for phase, want, exact in rows:
        got = m[phase]
        what = "grad buffers" if phase == "grads" else ("between steps" if phase == "between" else phase)
        if want and got == 0:
            out.append(f"rank {r['rank']} meter reads 0 B {what} where the plan holds {_mb(want)}")
        elif exact and got < want:
            why = "Z3: its held buckets" if z3 else "Z2: every copy resident"
            out.append(f"rank {r['rank']} {what} {_mb(got)} < the plan's exact {_mb(want)} ({why}): "
                       "freed what it should keep")
        elif got < want:
            why = ("held buffers, or the largest bucket's" if phase == "grads"
                   else "held buckets + the largest unit, whole while it runs")
            out.append(f"rank {r['rank']} {what} {_mb(got)} < the least the plan needs {_mb(want)} ({why})")
    return out


def _g(x: float | None) -> str:
    return "non-finite" if x is None or not math.isfinite(x) else f"{x:.2e}"


def _share(x: float) -> str:
    """A relative distance: ``40.00%``, or ``7.6e-06`` below 0.1%."""
    return f"{x:.2%}" if x >= 1e-3 or not math.isfinite(x) else f"{x:.1e}"


def _loss_text(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.6f}"


def _numerics(run: Mapping) -> dict:
    num = run["numerics"]
    safety = num["safety"]
    bad, good = [], []
    losses = num.get("losses") or {}
    if losses.get("off"):
        ref = losses["reference"]
        bad += [f"loss at step {o['step']}: {_loss_text(o['loss'])} vs "
                f"{ref} {o['reference']:.6f} (|Δ| {_g(o['diff'])} > {_g(o['tol'])} = {losses['safety']:g} × "
                "the floor)" for o in losses["off"][:2]]
    elif "off" in losses:
        good.append(f"losses of {len(losses['floor'])} steps within {losses['safety']:g}× the floor of "
                    f"{losses['reference']}'s (max |Δ| {_g(losses['max_diff'])}, floor at the last step "
                    f"{_g(losses['floor'][-1])})")
    elif "skipped" in losses:
        good.append(f"losses not compared: {losses['skipped']}")
    worst = 0.0
    for u in num["updates"]:
        tol = u["floor"] * safety
        worst = max(worst, u["rel"] / tol if tol else math.inf)
        if not u["pass"]:
            if u["rel"] > tol:
                bad.append(f"step {num['step']} update of {u['param']} ({u['kind']}) off the oracle's by "
                           f"{_share(u['rel'])} of its norm (max |Δ| {_g(u['max_abs'])}; tol {_share(tol)} = "
                           f"{safety:g} × the floor)")
            if u["kind"] == "muon" and u["momentum_rel"] > u["momentum_floor"] * safety:
                bad.append(f"step {num['step']} momentum of {u['param']} off the oracle's by "
                           f"{_share(u['momentum_rel'])} of its norm (tol {_share(u['momentum_floor'] * safety)})")
    if bad:
        shown = "; ".join(bad[:MAX_OWNERS_SHOWN])
        more = len(bad) - MAX_OWNERS_SHOWN
        return _check("numerics", False, shown + (f"; and {more} more" if more > 0 else "")
                      + " (docs/verify.md, 'Numerics')")
    good.append(f"step {num['step']} updates of {len(num['updates'])} params on the oracle's "
                f"(worst {worst:.2f}× the tolerance)")
    return _check("numerics", True, "; ".join(good))


def _owner_grads(run: Mapping) -> dict:
    num = run["numerics"]
    safety = num["safety"]
    bad = []
    clip = num["clip_norm"]
    if not clip["pass"]:
        ratio = clip["measured"] / clip["oracle"] if clip["oracle"] else math.inf
        bad.append(f"clip_grad_norm_ {clip['measured']:.6g} vs the oracle's {clip['oracle']:.6g} "
                   f"({ratio:.3f}×)")
    for g in num["grads"]:
        if not g["pass"]:
            bad.append(f"grad of {g['param']} at its owner: "
                       f"{factor_text(g['ratio'], num['world'], num['mesh'])} (|Δ|/|mean| "
                       f"{_g(g['rel'])} > {safety:g} × floor {_g(g['floor'])})")
    if bad:
        shown = "; ".join(bad[:MAX_OWNERS_SHOWN])
        more = len(bad) - MAX_OWNERS_SHOWN
        return _check("owner_grads", False, shown + (f"; and {more} more" if more > 0 else ""))
    worst = max((g["rel"] / (safety * g["floor"]) for g in num["grads"]), default=0.0)
    return _check("owner_grads", True, f"{len(num['grads'])} owners' grads at step {num['step']} on the "
                                       f"global mean (worst {worst:.2f}× the tolerance); clip norm "
                                       f"{clip['measured']:.6g} vs {clip['oracle']:.6g}")


def factor_text(ratio: float, world: int, mesh: Sequence[int]) -> str:
    """How an owner's grad compares with the global mean, by the factor ``ratio`` (its
    projection on the mean over the mean's squared norm): ``2.000× the mean: divided by N=2,
    not W=4`` where ``W / ratio`` is an integer other than W (named after a mesh axis ``(R,
    N)`` of that size), else ``0.998× the mean``."""
    text = f"{ratio:.3f}× the mean"
    if ratio <= 0 or not math.isfinite(ratio):
        return text
    divisor = world / ratio
    if abs(divisor - round(divisor)) < 1e-3 * max(1.0, divisor) and round(divisor) != world:
        d = round(divisor)
        names = [f"{axis}={size}" for axis, size in zip(("R", "N"), mesh) if size == d] or [str(d)]
        text += f": divided by {names[-1]}, not W={world}"
    return text


def _checkpoint(run: Mapping) -> dict:
    ck = run["checkpoint"]
    if not ck["differ"]:
        return _check("checkpoint", True, f"step {ck['step']} after DCP save and load into a fresh model "
                                          f"and optimizer: {ck['compared']} tensors bit-identical "
                                          "(owners' momentum included)")
    parts = []
    for d in ck["differ"][:2]:
        names = d["names"]
        parts.append(f"rank {d['rank']}: {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    return _check("checkpoint", False, f"step {ck['step']} after DCP save and load into a fresh model and "
                                       f"optimizer is not bit-identical to the uninterrupted run's: "
                                       + "; ".join(parts))


def _closed_form(run: Mapping) -> dict:
    off = []
    for name, ph in run["phases"].items():
        cf = ph["closed_form_avg_elems"]
        ok = ph.get("closed_form_matches", cf is None or readings_equal(ph["measured_avg_elems"], cf))
        if not ok:
            off.append(f"{name}: measured {_elems(ph['measured_avg_elems'])} vs closed form "
                       f"{_elems(cf) if cf is not None else '–'} elem")
    total_ok = readings_equal(run["measured_avg_elems"], run["closed_form_avg_elems"])
    if not total_ok:
        off.append(f"total: measured {_elems(run['measured_avg_elems'])} vs closed form "
                   f"{_elems(run['closed_form_avg_elems'])} elem ({run['closed_form']})")
    passed = run.get("closed_form_matches", not off)
    if passed:
        return _check("closed_form", True, f"{run['closed_form']}, in every phase and in total")
    return _check("closed_form", False, "; ".join(off) or
                  f"measured {_elems(run['measured_avg_elems'])} vs closed form "
                  f"{_elems(run['closed_form_avg_elems'])} elem ({run['closed_form']})")


def _ns_calls(run: Mapping) -> dict:
    meas, exp = run["ns_calls_per_step"], run["ns_calls_expected"]
    return _check("ns_calls", meas == exp, f"measured {_count(meas)} vs expected {_count(exp)} "
                                           "per step (all ranks)")


def _loss(run: Mapping) -> dict:
    first, last = run["loss_first"], run["loss_last"]
    shown = " → ".join("non-finite" if x is None else f"{x:.4f}" for x in (first, last))
    return _check("loss", run["loss_falls"], f"{shown} (first → last step, mean over ranks)")


def _source(name: str, src: Mapping) -> dict:
    detail = f"matched {src['matched']}/{src['events']} events, {src['unmatched']} unmatched"
    if src.get("ops_missing"):
        detail += (f"; recorded no {', no '.join(src['ops_missing'])} where the prediction has "
                   "them (every op kind must appear in every source)")
    elif "op_counts" in src and src["pass"]:
        detail += f"; every predicted op kind recorded ({', '.join(sorted(src['op_counts']))})"
    steps = src.get("steps")  # the steps it recorded before the window (verify.sources.steps)
    if steps is not None:
        detail += (f"; steps before the window {steps['checked']}: "
                   + (f"{steps['incomplete']} gap(s)" if steps["incomplete"] else "complete")
                   + (f", not recorded {sorted(steps['not_recorded'], key=int)}" if steps["not_recorded"] else ""))
    if not src["pass"] and src["mismatches"]:
        detail += f"; first: {src['mismatches'][0]}"
    return _check(f"source:{name}", src["pass"], detail)


def run_checks(run: Mapping) -> list[dict]:
    """The checks of ``run`` (a ``runs[]`` entry) derived from its figures, in
    :data:`RUN_CHECK_NAMES` order: ``[{"check", "pass", "detail"}]`` (see module docstring;
    ``loss`` only where the run carries ``loss_falls``)."""
    out = [_collectives(run), _closed_form(run), _ns_calls(run)]
    if run.get("owners") is not None and run["mode"].startswith("dmuon-"):
        out.append(_owners(run))
    if run.get("ns_balance") is not None:
        out.append(_ns_balance(run))
    if run.get("memory") is not None:
        out.append(_memory(run))
    if run.get("numerics") is not None:
        out += [_numerics(run), _owner_grads(run)]
    if run.get("checkpoint") is not None:
        out.append(_checkpoint(run))
    if "loss_falls" in run:
        out.append(_loss(run))
    out += [_source(s, run["sources"][s]) for s in SOURCES
            if s != "interposer" and s in run["sources"]]
    return out


def checks_of(run: Mapping) -> list[dict]:
    """``run["checks"]`` where the producer stored them, else :func:`run_checks`."""
    return list(run["checks"]) if "checks" in run else run_checks(run)


def failures_of_runs(runs: Sequence[Mapping]) -> list[dict]:
    """report.json ``failures`` of ``runs``: ``{"mode", "check", "detail"}`` per failed check."""
    return [{"mode": run["mode"], "check": c["check"], "detail": c["detail"]}
            for run in runs for c in checks_of(run) if not c["pass"]]


def failures(report: Mapping) -> list[dict]:
    """``report["failures"]`` where stored (it holds the ``error`` entries), else the runs'."""
    return list(report["failures"]) if "failures" in report else failures_of_runs(report["runs"])


def _order(name: str) -> int:
    return CHECK_NAMES.index(name) if name in CHECK_NAMES else len(CHECK_NAMES)


def final_line(report: Mapping) -> str:
    """The last line of verify-traffic: ``PASS: ...`` or ``FAIL: <check> (<modes>); ...``, the
    failed checks in :data:`CHECK_NAMES` order, each with the modes it failed in."""
    failed = failures(report)
    if not failed:
        n = sum(len(checks_of(run)) for run in report["runs"])
        return f"PASS: all {n} checks held in {len(report['runs'])} mode(s)"
    modes: dict[str, list[str]] = {}
    for f in sorted(failed, key=lambda f: _order(f["check"])):
        modes.setdefault(f["check"], [])
        if f["mode"] not in modes[f["check"]]:
            modes[f["check"]].append(f["mode"])
    return "FAIL: " + "; ".join(f"{label(name, False)} ({', '.join(ms)})"
                                for name, ms in modes.items())


def verdict_lines(report: Mapping) -> list[str]:
    """One line per check that ran (``PASS``/``FAIL``, what holds, the modes), and below a
    failed one each failing mode with the cause; a mode that raised gets an ``error`` line."""
    by_name: dict[str, list[tuple[str, dict]]] = {}
    for run in report["runs"]:
        for c in checks_of(run):
            by_name.setdefault(c["check"], []).append((run["mode"], c))
    for f in failures(report):
        if f["check"] == "error":
            by_name.setdefault("error", []).append((f["mode"], {"pass": False, "detail": f["detail"]}))
    lines = []
    for name in sorted(by_name, key=_order):
        entries = by_name[name]
        bad = [(mode, c) for mode, c in entries if not c["pass"]]
        if not bad:
            lines.append(f"  PASS  {label(name, True)} ({len(entries)} mode(s))")
            continue
        lines.append(f"  FAIL  {label(name, False)}: {', '.join(m for m, _ in bad)}")
        lines += [f"          {mode}: {c['detail']}" for mode, c in bad]
    return lines
