"""DMuon with torch-style param groups against one process running
torch.optim.Muon and torch.optim.AdamW with the same groups and the same per-group LambdaLR.

Before this change ``DMuon(list_of_dicts, ...)`` raised ``ValueError`` ("DMuon takes a flat
iterable"), so every test here failed. The bound is the parity tests' (``noise_floor``): after
STEPS steps DMuon lands within FACTOR times the oracle's measured noise floor (the oracle
against its nudged runs and against itself fed the global batch as 2 accumulated
micro-batches; Frobenius). A group whose hyper-parameter did not reach its params (the
no-decay group's ``weight_decay=0.0``, the MLP group's Muon ``lr`` or ``momentum``, a part
scheduled as another user group) moves a param by a large fraction of its displacement: beyond
that bound (checked: ``test_a_wrong_group_is_outside_the_bound``).
"""

import pytest
import torch

from tests.distributed.parity import dmuon_tasks as T
from tests.distributed.parity import group_tasks as G
from tests.distributed import noise_floor as NF

pytestmark = pytest.mark.distributed

STEPS = 3
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def oracle():
    init = T.make_model().state_dict()
    return NF.floored(lambda nudge: NF.final_only(init, G.oracle(STEPS, nudge=nudge)),
                      {"2 micro-batches": lambda: NF.final_only(init, G.oracle(STEPS, micro_batches=2))},
                      norm="fro")


def _distances(ref: dict, params: dict) -> dict[str, float]:
    return NF.distances(params, ref["final"], ref["init"], norm="fro")


def test_a_wrong_group_is_outside_the_bound(oracle):
    """The bound separates: the same run without the scheduler (every part's lr off from
    step 1 on) lands beyond it."""
    dist = _distances(oracle, G.oracle(STEPS, schedule=False))
    NF.assert_beyond({"worst param": max(dist.values())}, oracle["floors"][0], "no scheduler")


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3"])
def test_groups_and_scheduler_match_the_oracle(pool2, oracle, mode):
    results = pool2.run_with_timeout(TIMEOUT_S, G.train, mode, STEPS)
    NF.assert_within(_distances(oracle, T.merge_owned(results)), oracle["floors"][0], mode)
    groups = results[0]["groups"]
    assert groups == results[1]["groups"]  # identical on every rank
    # Muon then AdamW per user group, empty parts left out; the scheduler acted per part.
    assert [(g["group"], g["algorithm"], g["n"]) for g in groups] == [
        (0, "muon", 2), (0, "adamw", 3), (1, "adamw", 4), (2, "muon", 2), (2, "adamw", 2)]
    decayed = 0.8 ** STEPS
    assert [g["lr"] for g in groups] == pytest.approx(
        [T.MUON_LR * decayed, T.ADAMW_LR * decayed, 6e-3, 0.01 * decayed, 1e-3 * decayed])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0, 0.05, 0.05]
    mlp_muon, mlp_adamw = groups[3], groups[4]
    assert (mlp_muon["momentum"], mlp_muon["nesterov"], mlp_muon["adjust_lr_fn"], mlp_muon["eps"]) == (
        0.9, False, "match_rms_adamw", 1e-6)
    assert (mlp_adamw["betas"], mlp_adamw["eps"]) == ((0.8, 0.99), 1e-6)


def test_state_dict_round_trip_keeps_the_groups(pool2):
    for r in pool2.run_with_timeout(TIMEOUT_S, G.state_dict_round_trip):
        assert r["loaded"] == r["saved"]  # lr after scheduling, every group's own values
        assert r["saved"][0]["lr"] == pytest.approx(T.MUON_LR * 0.8 ** 2)
        assert r["states_equal"]
        assert len(r["errors"]) == 2
        assert "param groups of sizes [2, 3, 4, 2, 2]. Must match this DMuon's [4, 9]" in r["errors"][0]
        assert "param groups of algorithms ['muon', 'adamw']" in r["errors"][1]
        assert "Must match this DMuon's ['adamw', 'muon']" in r["errors"][1]


def test_dcp_resume_at_another_world_size_keeps_the_groups(pool2, pool4, tmp_path):
    saved = pool4.run_with_timeout(TIMEOUT_S, G.dcp_save, "z3", str(tmp_path))
    loaded = pool2.run_with_timeout(TIMEOUT_S, G.dcp_load, "z2", str(tmp_path))
    for r in loaded:
        assert r["groups"] == saved[0]["groups"]
    for key in ("owned", "momentum"):
        before = {n: t for r in saved for n, t in r["view"][key].items()}
        after = {n: t for r in loaded for n, t in r["view"][key].items()}
        assert before.keys() == after.keys() and len(after) == 4, key
        assert all(torch.equal(before[n], after[n]) for n in before), key
    for r in loaded:
        adamw = r["view"]["adamw"]
        assert adamw.keys() == saved[0]["view"]["adamw"].keys()
        assert all(torch.equal(adamw[k], saved[0]["view"]["adamw"][k]) for k in adamw)
