"""DMuon with context parallelism: ``examples/cp_attention.py``'s decoder on a ``("dp_shard",
"cp")`` 2 x 2 mesh (each rank its rows and its half of every sequence; attention all-gathers K / V
over "cp"), both dims declared shard dims, so the owners span dp_shard x cp (N_eff = N·C = 4) and
the grads are averaged over all 4 ranks; against single-process Muon + AdamW on the whole
sequences (``cp_tasks.py``). The control leaves "cp" undeclared (model parallel): the dedicated
grads are then averaged over dp_shard only, each CP column stepping on half the sequence."""

import pytest

from tests.distributed.parity import cp_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120
STEPS = 3
#: Of the oracle's displacement (max |got - ref| / max |ref - init| over each param's elements),
#: after STEPS steps. CP sums each grad in another order (the attention over two parts, the
#: all_reduce of K / V grads, DMuon's reduce over 4 ranks); Newton–Schulz in bfloat16 turns
#: those fp32 ulps into whole bfloat16 flips: measured here 0 on every Muon matrix but one
#: (1.6e-2) after one step, at most 2.1e-2 after three, 2e-4 on the AdamW params. The control
#: (cp undeclared: each CP column steps on half of every sequence) measured 0.5-1.1 on every
#: Muon matrix. REL_TOL sits between, 5x the first and a tenth of the second.
REL_TOL = 1e-1


@pytest.fixture(scope="module")
def oracle():
    return T.make_model().state_dict(), T.oracle(STEPS)


def _rel_err(got: dict, init: dict, ref: dict) -> float:
    worst = 0.0
    for n, r in ref.items():
        disp = (r - init[n]).abs().max().item()
        worst = max(worst, (got[n] - r).abs().max().item() / max(disp, 1e-12))
    return worst


@pytest.mark.parametrize("z3", [pytest.param(False, marks=pytest.mark.slow), True], ids=["z2", "z3"])
def test_cp_trains_like_single_process_muon_on_whole_sequences(pool4, oracle, z3):
    init, ref = oracle
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, STEPS, z3)
    for r in results[1:]:
        assert all(r["params"][n].equal(results[0]["params"][n]) for n in ref)
    assert _rel_err(results[0]["params"], init, ref) <= REL_TOL
    dedicated = results[0]["dedicated"]
    assert len(dedicated) == 4 * 2  # qkv, proj, fc1, fc2 of 2 blocks
    assert sum(r["ns_calls"] for r in results) == STEPS * len(dedicated)  # once per matrix


def test_control_cp_left_undeclared_misses_the_oracle(pool4, oracle):
    init, ref = oracle
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, STEPS, True, ("dp_shard",))
    assert _rel_err(results[0]["params"], init, ref) > 3 * REL_TOL


def _union(results: list[dict], key: str) -> dict:
    """Every owner's momentum from the ranks' ``key`` states (each matrix on one owner)."""
    out = {}
    for r in results:
        for n, t in r[key]["momentum"].items():
            assert n not in out, n
            out[n] = t
    return out


@pytest.mark.parametrize("saved, loaded", [("dp2xcp2", "dp4"),
                                           pytest.param("dp4", "dp2xcp2", marks=pytest.mark.slow)])
def test_dcp_resumes_across_a_change_of_layout(pool4, tmp_path, saved, loaded):
    """DCP saved on one layout (dp_shard x cp, or a 1-D mesh of 4 data-parallel ranks) loads on
    the other: every param and every owner's momentum equals what was saved, bit for bit (the
    owners differ: momentum moves to the new ones), and the next step lands on the oracle's
    third step (the bound above)."""
    path = str(tmp_path / "ckpt")
    before = pool4.run_with_timeout(TIMEOUT_S, T.checkpoint_run, saved, path, range(2), False)
    after = pool4.run_with_timeout(TIMEOUT_S, T.checkpoint_run, loaded, path, range(2, 3), True)
    for r in after:
        for n, t in before[0]["saved"]["params"].items():
            assert r["loaded"]["params"][n].equal(t), n
    saved_m, loaded_m = _union(before, "saved"), _union(after, "loaded")
    assert saved_m.keys() == loaded_m.keys() and len(saved_m) == 8
    assert all(loaded_m[n].equal(t) for n, t in saved_m.items())
    init, ref = T.make_model().state_dict(), T.oracle(3)
    assert _rel_err(after[0]["final"], init, ref) <= REL_TOL
