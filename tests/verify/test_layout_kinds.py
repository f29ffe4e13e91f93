"""Layout kinds (verify/traffic/layouts.py; docs/verify.md, "Layout kinds"): the harness asks
the layout, never branches on its kind, so a new kind is one subclass; ``layout.json`` names
its kind and a class refuses another kind's dict.

Before the refactor, ``verify.compare.compare_run``, ``verify.traffic.owners.owner_findings`` and
``verify.traffic.predict.dmuon_hierarchy`` branched on ``getattr(layout, "tp_size", 1) > 1`` and
called the dense or TP functions directly: the stand-in kind below (overriding every answer)
got the dense answers there, so ``test_compare_asks_the_layout`` and
``test_hierarchy_asks_flat_allowed`` failed; ``RunLayout.from_dict`` read a TP layout's dict
as a dense layout of a wrong world size, and ``TPRunLayout`` took ``tp_size=1``."""

from __future__ import annotations

import dataclasses

import pytest

from tests.builders import predicted_events, tinygpt_layout
from verify.compare import compare_run
from verify.traffic.layouts import LAYOUT_KINDS, layout_from_dict
from verify.traffic.owners import owner_findings
from verify.traffic.predict import (ClosedFormCheck, Expected, RunLayout, dmuon_coalesce_bytes,
                                    dmuon_hierarchy, ns_calls_per_step, predict_step)
from verify.traffic.tp import TPRunLayout

EXTRA = Expected(0, "optimizer", "all_reduce", "0,1", 2, 7, "float32", None, None, 0)


class ProbeLayout(RunLayout):
    """A stand-in third kind: the dense layout with every answer changed recognisably."""

    kind = "probe"
    flat_allowed = False

    def predict_calls(self) -> list[Expected]:
        return [*predict_step(self), EXTRA]

    def ns_calls_per_step(self) -> int:
        return ns_calls_per_step(self) + 1

    def closed_form_check(self) -> ClosedFormCheck:
        dense = super().closed_form_check()
        return dense._replace(p_m=dense.p_m + 1)

    def dmuon_view(self) -> None:
        return None

    def ns_plan(self) -> None:
        return None

    def report_fields(self) -> dict:
        return {"tp_size": 1, "probe_size": 3}


def _probe(layout: RunLayout) -> ProbeLayout:
    return ProbeLayout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(RunLayout)})


def _tp(layout: RunLayout) -> TPRunLayout:
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(RunLayout)}
    return TPRunLayout(**fields, tp_size=2, tp_dims=(("blocks.0.mlp.fc1.weight", 0),))


def test_compare_asks_the_layout():
    dense = tinygpt_layout("dmuon-z2", 2)
    ns = ns_calls_per_step(dense)
    plain = compare_run(dense, predicted_events(dense), steps=1, ns_calls=ns)
    assert plain["pass"] and plain["units"] and plain["ns_balance"] is not None
    probe = _probe(dense)
    run = compare_run(probe, predicted_events(dense), steps=1, ns_calls=ns)
    assert [(m["op"], m["count"]) for m in run["missing"]] == [("all_reduce", 7)]  # predict_calls
    assert run["ns_calls_expected"] == ns + 1  # ns_calls_per_step
    assert run["closed_form_p_m"] == plain["closed_form_p_m"] + 1  # closed_form_check
    assert run["units"] is None and run["owners"] == []  # dmuon_view
    assert run["ns_balance"] is None  # ns_plan
    assert run["probe_size"] == 3 and run["tp_size"] == 1  # report_fields
    assert not run["pass"]
    assert owner_findings(probe, predict_step(dense), {}, {}) == []


def test_hierarchy_asks_flat_allowed():
    """TinyGPT on a 2 x 2 HSDP mesh on gloo forms one unit: ``auto`` is flat for a dense
    layout, hierarchical for a kind that never moves flat."""
    dense = tinygpt_layout("dmuon-hsdp-z3", 4, dmuon_auto_flat=True, dmuon_reduce_by_gather=True,
                           dmuon_uneven_aligned=True,
                           dmuon_coalesce_bytes=dmuon_coalesce_bytes("auto", "gloo"))
    assert dmuon_hierarchy(dense) == "flat"
    assert dmuon_hierarchy(_probe(dense)) == "hierarchical"


def test_layout_json_names_its_kind_and_loads_by_it(monkeypatch):
    dense = tinygpt_layout("dmuon-z2", 2)
    tp = _tp(dense)
    assert dense.to_dict()["kind"] == "dense" and tp.to_dict()["kind"] == "tp"
    for layout in (dense, tp):
        assert layout_from_dict(layout.to_dict()) == layout
        legacy = {k: v for k, v in layout.to_dict().items() if k != "kind"}  # before "kind"
        assert layout_from_dict(legacy) == layout
    monkeypatch.setitem(LAYOUT_KINDS, "probe", ProbeLayout)  # a new kind: one entry
    probe = _probe(dense)
    back = layout_from_dict(probe.to_dict())
    assert type(back) is ProbeLayout and back == probe


def test_a_class_refuses_another_kinds_dict():
    dense = tinygpt_layout("dmuon-z2", 2)
    tp = _tp(dense)
    with pytest.raises(ValueError, match=r"RunLayout.from_dict: kind='tp'.*layout_from_dict"):
        RunLayout.from_dict(tp.to_dict())  # was a dense layout of W = 2, not 4
    with pytest.raises(ValueError, match=r"TPRunLayout.from_dict: kind='dense'"):
        TPRunLayout.from_dict(dense.to_dict())
    with pytest.raises(ValueError, match=r"Invalid layout kind='moe'. Must be one of \['cp', 'dense', 'ep', 'pp', 'tp', 'tpep'\]"):
        layout_from_dict({**dense.to_dict(), "kind": "moe"})
    with pytest.raises(ValueError, match=r"EPRunLayout.from_dict: missing ep_size"):
        layout_from_dict({**dense.to_dict(), "kind": "ep"})  # was a KeyError
    with pytest.raises(ValueError, match=r"PPRunLayout.from_dict: missing pp_size"):
        layout_from_dict({**dense.to_dict(), "kind": "pp"})
    with pytest.raises(ValueError, match=r"CPRunLayout.from_dict: missing cp_size"):
        layout_from_dict({**dense.to_dict(), "kind": "cp"})
    with pytest.raises(ValueError, match=r"TPEPRunLayout.from_dict: missing \['tp_size', 'ep_size'\]"):
        layout_from_dict({**dense.to_dict(), "kind": "tpep"})


@pytest.mark.parametrize("t", [1, 0, True, 2.0])
def test_tp_layout_needs_t_at_least_2(t):
    fields = {f.name: getattr(tinygpt_layout("dmuon-z2", 2), f.name) for f in dataclasses.fields(RunLayout)}
    with pytest.raises(ValueError, match=f"Invalid tp_size={t!r} for a TPRunLayout. Must be an int >= 2"):
        TPRunLayout(**fields, tp_size=t)
