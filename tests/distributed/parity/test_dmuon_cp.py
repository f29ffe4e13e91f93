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


@pytest.mark.parametrize("z3", [False, True], ids=["z2", "z3"])
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
