"""Activation checkpointing under DMuon: recompute neither frees nor
broadcasts again, the collective list equals verify.traffic.predict's, and the params are
bit-identical to the same run without AC."""

import pytest
import torch

from tests.distributed.runtime import runtime_tasks as T
from verify.compare import compare_run

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120
STEPS = 3
VARIANTS = ("reentrant", "early-stop", "no-early-stop", "wrapper")


def _run(pool, mode, variant):
    results = pool.run_with_timeout(TIMEOUT_S, T.train_ac, mode, variant, STEPS)
    events = [ev for r in results for ev in r["events"]]
    ns = sum(r["ns_calls"] for r in results) * (STEPS - 1) // STEPS
    run = compare_run(results[0]["layout"], events, steps=STEPS - 1, ns_calls=ns)
    params = {}
    for r in results:
        params.update(r["params"])
    assert all(r["fc1_calls"] == STEPS * (1 if variant is None else 2) for r in results), variant
    return run, params


@pytest.mark.parametrize("mode", ["dmuon-z3", "dmuon-z2"])
def test_ac_traffic_equals_prediction_and_params_equal_no_ac(pool2, mode):
    _, reference = _run(pool2, mode, None)
    for variant in VARIANTS if mode == "dmuon-z3" else ("early-stop", "reentrant"):
        run, params = _run(pool2, mode, variant)
        assert run["missing"] == [] and run["unexpected"] == [], (variant, run["missing"][:3], run["unexpected"][:3])
        assert params.keys() == reference.keys()
        assert all(torch.equal(params[n], reference[n]) for n in reference), variant
