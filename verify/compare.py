"""Compare measured collectives with the prediction: exact multisets, then the W-averages.

A measured event and a predicted call are the same when their key
``(rank, phase, op, group_id, count, dtype, root, in_elems, out_elems)`` is equal (the totals
of an all_to_all, :func:`tracer.events.all_to_all_elems`; ``None`` for every other op). The comparison is a multiset
difference per run: anything predicted but not measured is *missing*, anything measured but
not predicted is *unexpected*; either fails the run.

Traffic figures follow ``verify.traffic.formulas``: the W-average of f(n)·S. The Muon-param share of
a measured event (``dedicated`` figures) is the share of its matched prediction: a DDP
bucket or an FSDP2 group may fuse Muon and AdamW params in one call, and only the plan knows
the split; the existence and size of every call is measured. An unmatched event (a call the
prediction does not have: a bucket cut differently, a wrong root) gets the share of the
predicted calls of its ``(rank, phase, op, group)``, else of its ``(phase, op, group)``, else of
its module's calls in its phase, so bytes that moved are not read as 0 (:func:`unmatched_share`). Likewise an all_to_all's own
chunk (which it neither sends nor receives): no source records it, so a measured all_to_all
is charged the elements its matched prediction sends, ``in_elems - self_elems``
(:func:`verify.traffic.formulas.avg_elems`; an uneven one has no single count). Unmatched
events fail the run anyway; an unmatched all_to_all without a count is charged (n-1)/n of its
input, the even case's.

Per run it also reports (``verify.report.checks``): the owners the traffic shows against the
harness's buckets (``owners``, :mod:`verify.traffic.owners`) and, for modes where each matrix
has one owner, Newton–Schulz calls per rank and the plan's NS cost per rank against the
harness's own bound from the shapes (``ns_balance``, :mod:`verify.traffic.ns_bound`).

The closed form gates every run, in every phase and in total: the measured W-average must equal
docs/spec.md §2's formula at P_M (DMuon and DDP modes, any shapes: they move whole matrices) or at
P_M^pad, the Muon params padded on dim 0 to a multiple of N (the naive FSDP2 / HSDP
baselines, ``verify.traffic.formulas.PADDED_MODES``; derivation in docs/traffic-model.md),
plus, when a unit runs more than once per forward (weight sharing), the form's term in P_M^r
(``verify.traffic.predict.reused_elems``), 0 otherwise, and under DMuon's Z3 the term in P_M^L,
the unit kept allocated from its forward into the backward (``verify.traffic.predict.kept_elems``).
A DMuon HSDP run that moved its dedicated params flat is checked against the 1-D form at N = W
(``verify.traffic.predict.run_closed_form``; docs/traffic-model.md, "HSDP: flat or
hierarchical"), and its entry says so (``hierarchy``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from dmuon.annotate import PHASES
from tracer.events import CollectiveEvent, all_to_all_elems

from verify.traffic.predict import Expected, RunLayout, dmuon_block, dmuon_hierarchy, layout_buckets
from verify.traffic.formulas import PADDED_MODES, avg_elems
from verify.traffic.ns_bound import ns_bound, owner_loads
from verify.traffic.owners import owner_findings


def event_key(ev: CollectiveEvent) -> tuple:
    """The comparison key of a measured event (see module docstring); the same tuple as
    :meth:`verify.traffic.predict.Expected.key`."""
    return (ev.rank, ev.phase, ev.op, ev.group_id, ev.count, ev.dtype, ev.root,
            *all_to_all_elems(ev.op, ev.count, ev.group_size, ev.in_elems, ev.out_elems))


def measured_avg_elems(ev: CollectiveEvent, self_elems: int | None) -> float:
    """A measured event's f(n)·S (:func:`verify.traffic.formulas.avg_elems`), an all_to_all's
    own chunk ``self_elems`` taken from its matched prediction (module docstring)."""
    n = ev.group_size or 1
    if ev.op == "all_to_all" and ev.in_elems is not None:
        if self_elems is not None:
            return avg_elems(ev.op, ev.count, n, in_elems=ev.in_elems, self_elems=self_elems)
        if ev.count is None:  # unmatched and uneven: the even case's share of its input
            return (n - 1) / n * ev.in_elems
    return avg_elems(ev.op, ev.count or 0, n)


#: Measured and closed-form averages are sums of integers times rationals: equal up to rounding.
CLOSED_FORM_REL_TOL = 1e-9


def _close(measured: float, expected: float, scale: int) -> bool:
    return abs(measured - expected) <= CLOSED_FORM_REL_TOL * max(scale, 1)


def _class_of(key: tuple, wide: bool) -> tuple:
    rank, phase, op, group_id = key[:4]
    return (phase, op, group_id) if wide else (rank, phase, op, group_id)


def class_shares(predicted: Sequence[Expected]) -> tuple[dict, dict, dict]:
    """The Muon-target share of the predicted calls (sum of dedicated f(n)·S over sum of
    f(n)·S, calls that move nothing left out) per ``(rank, phase, op, group)``, per
    ``(phase, op, group)`` and per ``(phase, module)``: what a measured call the prediction
    does not have is charged (:func:`unmatched_share`, module docstring)."""
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in predicted:
        total, ded = e.avg_elems(), e.dedicated_avg_elems()
        for kind, cls in ((0, _class_of(e.key(), False)), (1, _class_of(e.key(), True)),
                          (2, (e.phase, e.module))):
            sums[(kind, cls)][0] += ded
            sums[(kind, cls)][1] += total
    tables: tuple[dict, dict, dict] = ({}, {}, {})
    for (kind, cls), (d, t) in sums.items():
        if t:
            tables[kind][cls] = d / t
    return tables


def unmatched_share(ev: CollectiveEvent, key: tuple, tables: tuple[dict, dict, dict],
                    unit_of: dict[str, str] | None = None) -> float:
    """The Muon-target share of a measured call the prediction does not have: that of the
    predicted calls of its ``(rank, phase, op, group)``, else of its ``(phase, op, group)``,
    else of the calls its module (the DMuon unit or FSDP2 module in whose span it ran; a DMuon
    block is mapped to its predicted unit by ``unit_of``) was predicted to make in its phase
    (a bucket moved by another op, or a unit split differently), else 0."""
    narrow, broad, by_module = tables
    module = (unit_of or {}).get(dmuon_block(ev.module), ev.module) if ev.module else ev.module
    for table, cls in ((narrow, _class_of(key, False)), (broad, _class_of(key, True)),
                       (by_module, (ev.phase, module))):
        if cls in table:
            return table[cls]
    return 0.0


#: Modes whose NS work sits on one owner per matrix (``ns_balance`` applies to these modes).
OWNER_MODES = ("zero1-muon", "dmuon-ddp", "dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")


def ns_balance(layout: RunLayout, ns_calls_per_rank: Sequence[float] | None) -> dict | None:
    """report.json ``ns_balance`` of an owner mode (:data:`OWNER_MODES`) whose layout has one
    NS owner per matrix (``layout.ns_plan()``; not TP): the harness's bound
    (:func:`verify.traffic.ns_bound.ns_bound` over the Muon matrices' shapes), Newton–Schulz
    calls per rank per step as measured, and the NS cost (FLOPs per step) per rank of the plan
    the run used (a planner bug shows there as well as in the measured counts). ``None``
    otherwise."""
    plan = layout.ns_plan() if layout.mode in OWNER_MODES else None
    if plan is None:
        return None
    specs = layout.muon_specs()
    shapes = {s.name: [s.matrix_shape] * s.matrices for s in specs}
    bound = ns_bound([m for s in specs for m in shapes[s.name]], layout.world_size)
    cost, count = owner_loads(dict(plan.owner), shapes, layout.world_size)
    return {"cost_bound_flops": bound.cost_bound, "count_bound": bound.count_bound,
            "total_cost_flops": bound.total_cost, "max_matrix_cost_flops": bound.max_cost,
            "plan_cost_flops_per_rank": cost, "plan_calls_per_rank": count,
            "calls_per_rank": None if ns_calls_per_rank is None else list(ns_calls_per_rank)}


def _call_dict(key: tuple, n: int, module: str | None) -> dict:
    rank, phase, op, group_id, count, dtype, root, in_elems, out_elems = key
    return dict(rank=rank, phase=phase, op=op, group_id=group_id, count=count, dtype=dtype,
                root=root, module=module, n=n, in_elems=in_elems, out_elems=out_elems)


def compare_run(
    layout: RunLayout,
    events: Sequence[CollectiveEvent],
    *,
    steps: int,
    ns_calls: int,
    ns_calls_per_rank: Sequence[int] | None = None,
) -> dict:
    """The report entry of one run (keys of report.json's ``runs[]``, see verify/report/render.py).

    Args:
        layout: what was run.
        events: every rank's interposer events over ``steps`` measured steps.
        steps: number of measured steps (> 0).
        ns_calls: measured Newton–Schulz calls over those steps, summed over ranks.
        ns_calls_per_rank: the same per rank (rank order), for ``ns_balance``; ``None``:
            only the plan's figures are gated there.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"Invalid steps={steps}. Must be >= 1.")
    w = layout.world_size
    predicted: list[Expected] = layout.predict_calls()  # the layout's kind: dense, TP, EP
    window = layout.window_calls(steps)  # calls that differ per step (EP's token all_to_all)
    pred_counter = Counter()
    share: dict[tuple, float] = {}
    self_of: dict[tuple, int | None] = {}
    module_of: dict[tuple, str | None] = {}
    for e, times in [(e, steps) for e in predicted] + [(e, 1) for e in window]:
        pred_counter[e.key()] += times
        share[e.key()] = e.dedicated_share()
        self_of[e.key()] = e.self_elems
        module_of[e.key()] = e.module
    meas_counter = Counter(event_key(ev) for ev in events)
    missing = pred_counter - meas_counter
    unexpected = meas_counter - pred_counter
    tables = class_shares(predicted + window)
    view = layout.dmuon_view()  # None: no single DMuon layout (not DMuon, or TP)
    buckets = None if view is None else layout_buckets(view)
    unit_of = {} if buckets is None else {blk: b.module for b in buckets for blk in b.blocks}

    phases: dict[str, dict] = {}
    p_m = layout.p_m()
    form, cf_p_m, p_m_r, p_m_k = layout.closed_form_check()  # flat DMuon HSDP: the 1-D form at N = W
    padded = layout.mode in PADDED_MODES and cf_p_m != p_m
    all_forms = layout.all_closed_forms()
    per_rank = defaultdict(float)
    total_measured = 0.0
    meas_phase = defaultdict(float)
    meas_phase_n = Counter()
    meas_all = defaultdict(float)  # every param's and activation's elements, per phase
    for ev in events:
        key = event_key(ev)
        elems = measured_avg_elems(ev, self_of.get(key))
        total_measured += elems
        meas_all[ev.phase] += elems
        if key in share:
            ded = elems * share[key]
        else:  # not predicted: its class's share (module docstring), never 0 for moved bytes
            ded = elems * unmatched_share(ev, key, tables, unit_of)
        meas_phase[ev.phase] += ded
        meas_phase_n[ev.phase] += 1
        per_rank[ev.rank] += ded
    pred_phase = defaultdict(float)
    pred_phase_n = Counter()
    pred_all = defaultdict(float)
    total_predicted = 0.0
    for e, per_step in [(e, 1.0) for e in predicted] + [(e, 1 / steps) for e in window]:
        total_predicted += e.avg_elems() * per_step
        pred_all[e.phase] += e.avg_elems() * per_step
        pred_phase[e.phase] += e.dedicated_avg_elems() * per_step
        pred_phase_n[e.phase] += per_step
    for ph in [p for p in PHASES if p in pred_phase or p in meas_phase] + sorted(
        p for p in set(meas_phase) | set(pred_phase) | set(all_forms) if p not in PHASES
    ):
        ph_missing = sum(n for k, n in missing.items() if k[1] == ph)
        ph_unexpected = sum(n for k, n in unexpected.items() if k[1] == ph)
        cf = form.at(ph, cf_p_m, p_m_r, p_m_k)
        seed = form.seed_phases.get(ph) if form.seed_phases else None
        measured_ph = meas_phase[ph] / (w * steps)
        cf_ok = _close(measured_ph, cf, cf_p_m)
        all_cf = all_forms.get(ph)  # every element's closed form (PP's P2P), where priced
        if all_cf is not None:
            cf_ok = cf_ok and _close(meas_all[ph] / (w * steps), all_cf, max(round(all_cf), 1))
        phases[str(ph)] = {
            "measured_avg_elems": measured_ph,
            "predicted_avg_elems": pred_phase[ph] / w,
            "closed_form_avg_elems": cf,
            "seed_avg_elems": None if seed is None else seed * p_m,
            "collectives_measured": meas_phase_n[ph] / steps,
            "collectives_predicted": pred_phase_n[ph],
            # all params' (and activations': EP's token all_to_all) elements, W-average
            "all_measured_avg_elems": meas_all[ph] / (w * steps),
            "all_predicted_avg_elems": pred_all[ph] / w,
            "all_closed_form_avg_elems": all_cf,
            "closed_form_matches": cf_ok,
            "pass": ph_missing == 0 and ph_unexpected == 0 and cf_ok,
        }
    measured_avg = sum(meas_phase.values()) / (w * steps)
    predicted_avg = sum(pred_phase.values()) / w
    ns_per_step = ns_calls / steps
    ns_expected = layout.ns_calls_per_step()
    closed_ok = _close(measured_avg, form.total_at(cf_p_m, p_m_r, p_m_k), cf_p_m) and all(
        ph["closed_form_matches"] for ph in phases.values()
    )
    ok = not missing and not unexpected and ns_per_step == ns_expected and closed_ok
    run = dict(
        mode=layout.run_name,  # a variant's label (verify.modes.variants)
        world_size=w,
        shard_size=layout.shard_size,
        replicate_size=layout.replicate_size,
        **layout.report_fields(),  # tp_size
        p_m=p_m,
        measured_avg_elems=measured_avg,
        predicted_avg_elems=predicted_avg,
        closed_form=form.text + (" at P_M^pad" if padded else "") + form.terms_text(p_m_r, p_m_k),
        closed_form_avg_elems=form.total_at(cf_p_m, p_m_r, p_m_k),
        closed_form_p_m=cf_p_m,
        p_m_reused=p_m_r,
        p_m_kept=p_m_k,
        closed_form_padded=padded,
        seed_avg_elems=None if form.seed_total is None else form.seed_total * p_m,
        ratio_to_p_m=measured_avg / p_m if p_m else 0.0,
        ns_calls_per_step=int(ns_per_step) if ns_per_step == int(ns_per_step) else ns_per_step,
        ns_calls_expected=ns_expected,
        max_rank_elems=max(per_rank.values(), default=0.0) / steps,
        total_measured_avg_elems=total_measured / (w * steps),
        total_predicted_avg_elems=total_predicted / w,
        phases=phases,
        units=None if buckets is None else len({b.module for b in buckets}),  # DMuon's units (coalescing)
        calls_measured_per_step=len(events) / steps,
        calls_predicted_per_step=len(predicted) + len(window) / steps,
        owners=owner_findings(layout, predicted, missing, unexpected),
        ns_balance=ns_balance(layout, None if ns_calls_per_rank is None
                              else [c / steps for c in ns_calls_per_rank]),
        missing=[_call_dict(k, n, module_of.get(k)) for k, n in sorted(missing.items(), key=str)],
        unexpected=[_call_dict(k, n, None) for k, n in sorted(unexpected.items(), key=str)],
        closed_form_matches=closed_ok,
        # every op kind the prediction has, with its calls per step (all ranks): each trace
        # source must record every one (verify.run.runner._sources)
        predicted_ops=dict(sorted(Counter(e.op for e in predicted).items())),
    )
    hierarchy = dmuon_hierarchy(layout)
    if hierarchy is not None:  # DMuon on a 2-D mesh: flat or hierarchical
        run["hierarchy"] = hierarchy
    run["pass"] = ok
    return run
