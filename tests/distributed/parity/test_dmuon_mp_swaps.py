"""Mixed precision: where DMuon registers the bf16 compute params. A block swaps them in for
its forward (so that a compiled block traces the dedicated modules' casts into one graph,
test_compile.py); a dedicated module that runs without its block's hooks (here the
activation-checkpoint recompute of a block's body, ``checkpoint(block.forward)``) swaps them
in for its own forward. Without that fallback the recompute ran fc1 on the registered fp32
master against a bf16 input and raised; with checkpoint_wrapper the block's hooks run in the
recompute too."""

import pytest
import torch

from tests.distributed.parity import mp_swap_tasks as M

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120
STEPS = 3


def _merged(results) -> dict:
    return {n: t for r in results for n, t in r["params"].items()}


@pytest.mark.parametrize("mode, variants", [
    ("dmuon-z3", ("early-stop", "reentrant", "wrapper")),
    pytest.param("dmuon-z2", ("no-early-stop", "wrapper"), marks=pytest.mark.slow),
])
def test_mp_recompute_runs_in_bf16_and_params_equal_no_ac(pool2, mode, variants):
    reference = pool2.run_with_timeout(TIMEOUT_S, M.train_mp_ac, mode, None, STEPS)
    assert all(r["fc1_dtypes"] == ["torch.bfloat16"] * STEPS and r["registered"] for r in reference)
    ref = _merged(reference)
    for variant in variants:
        results = pool2.run_with_timeout(TIMEOUT_S, M.train_mp_ac, mode, variant, STEPS)
        for r in results:  # forward and recompute both on the bf16 copy; masters back after
            assert r["fc1_dtypes"] == ["torch.bfloat16"] * (2 * STEPS), (variant, r["fc1_dtypes"])
            assert r["registered"], variant
        got = _merged(results)
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[n], ref[n]) for n in ref), (variant, [n for n in ref if not torch.equal(got[n], ref[n])])


def test_mp_casts_pair_up_after_a_module_raised_inside_another(pool2):
    """A dedicated Linear raises inside its forward (so its post-hook never runs) and the
    enclosing block, which holds a dedicated matrix itself, catches it: the block still hands
    its output back in its fp32 input's dtype (DDP keeps the rest fp32) and no per-call entry
    stays in flight. Fails if a post-hook took the top entry as its own: the block got the
    inner call's bf16 and its own entry stayed behind."""
    for r in pool2.run_with_timeout(TIMEOUT_S, M.caught_inner_error):
        assert r == {"block_out": ["torch.float32"], "in_flight": 0}, r
