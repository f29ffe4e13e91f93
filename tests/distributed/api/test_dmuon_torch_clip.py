"""torch's clipping functions in a DMuon script.

Where every grad is a plain tensor (DDP, ``rest="replicate"``) ``torch.nn.utils.clip_grad_norm_``
over ``model.parameters()`` sees each dedicated grad on its owner only, so each rank clips by
its own norm and replicated params drift apart. Before the grad guard
(``dmuon/optim/grad_guard.py``) ``step()`` ran silently after it, so
``test_step_after_torch_clip_grad_norm_raises_on_every_rank`` failed (no error, every param
changed). Where FSDP2 handles the rest the dedicated grads are shown as DTensors between
backward and step (``dmuon/optim/grad_view.py``) and torch's function gives the global norm:
before that it raised torch's own "mixed torch.Tensor and DTensor" error, so
``test_torch_clip_grad_norm_matches_the_oracle_under_fsdp2`` failed. ``clip_grad_value_`` is
elementwise: on the grads where DMuon reads them it is the single-process clip.
"""

import pytest

from tests.distributed.api import torch_clip_tasks as C
from tests.distributed.parity import dmuon_tasks as T
from tests.distributed import noise_floor as NF

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90
CASES = [("ddp", {}), ("z2", {"rest": "replicate"})]  # every grad a plain tensor: torch's clip runs


@pytest.mark.parametrize("mode,kw", CASES)
@pytest.mark.parametrize("how", ["norm", "norm_not_biting", "total_norm"])
def test_step_after_torch_clip_grad_norm_raises_on_every_rank(pool2, mode, kw, how):
    for rank, r in enumerate(pool2.run_with_timeout(TIMEOUT_S, C.step_after, mode, how, **kw)):
        assert "as torch.nn.utils.clip_grad_norm_ does" in r["error"], (rank, r["error"])
        assert "Call opt.clip_grad_norm_(max_norm" in r["error"], (rank, r["error"])
        assert r["changed"] == [], (rank, r["changed"])  # before any param changed
        assert r["again"] == r["error"]  # and again on a retry


@pytest.mark.parametrize("how", ["none", "dmuon", "value", "dmuon_then_value"])
def test_dmuon_clip_and_elementwise_clip_step(pool2, how):
    for rank, r in enumerate(pool2.run_with_timeout(TIMEOUT_S, C.step_after, "ddp", how)):
        assert r["error"] == "", (rank, r["error"])
        assert len(r["changed"]) > 0


FSDP2 = [("z2", {}), ("z3", {}), ("hsdp-z3", {})]


STEPS = 3


@pytest.fixture(scope="module")
def oracles() -> dict:
    """Per clip (``"value"``, ``"norm"``): the oracle over STEPS steps (its ``clamped`` and
    ``norms``) with its noise floor after the last step (``noise_floor``: its nudged runs and
    itself fed the batch as 2 micro-batches; Frobenius)."""
    init = T.make_model().state_dict()
    out = {}
    for how in ("value", "norm"):
        def run(nudge=None, micro_batches=1, how=how):
            ref = C.oracle(STEPS, how, micro_batches, nudge)
            return {**NF.final_only(init, ref["params"]), "clamped": ref["clamped"],
                    "norms": ref["norms"]}
        out[how] = NF.floored(run, {"2 micro-batches": lambda run=run: run(micro_batches=2)},
                              norm="fro")
    return out


def _matches_oracle(pool, oracles: dict, how: str, mode: str, kw: dict) -> list[dict]:
    ref = oracles[how]
    if how == "value":
        assert all(0.05 < f < 0.95 for f in ref["clamped"])  # the clip bites on part of the grads
    else:
        assert all(n > 4 * C.MAX_NORM for n in ref["norms"])  # and here on every step
    results = pool.run_with_timeout(TIMEOUT_S, C.train, mode, STEPS, how, **kw)
    NF.assert_within(NF.distances(T.merge_owned(results), ref["final"], ref["init"], norm="fro"),
                     ref["floors"][0], f"{how} {mode} {kw}")
    return results


@pytest.mark.parametrize("mode,kw", CASES + FSDP2 + [("z3", {"via_opt": True})])
def test_clip_grad_value_matches_the_oracle(pool2, oracles, mode, kw):
    """torch's clip_grad_value_ in every mode (under FSDP2 on the shown DTensor grads), and
    opt.clip_grad_value_."""
    _matches_oracle(pool2, oracles, "value", mode, kw)


@pytest.mark.parametrize("mode,kw", FSDP2 + [("z2", {"via_opt": True})])
def test_torch_clip_grad_norm_matches_the_oracle_under_fsdp2(pool2, oracles, mode, kw):
    """torch's clip_grad_norm_ over model.parameters() returns the global norm on every rank
    (the same float) and trains as the single-process clip does; opt.clip_grad_norm_ too."""
    ref = oracles["norm"]
    results = _matches_oracle(pool2, oracles, "norm", mode, kw)
    assert results[0]["norms"] == results[1]["norms"]
    assert results[0]["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-6)


def test_the_comparison_sees_which_clip_ran(oracles):
    """The control: the oracle that clipped by norm lands beyond the bound of the one that
    clipped by value, and the other way round."""
    for how, other in (("value", "norm"), ("norm", "value")):
        ref = oracles[how]
        dist = NF.distances(oracles[other]["final"], ref["final"], ref["init"], norm="fro")
        NF.assert_beyond({"worst param": max(dist.values())}, ref["floors"][0], f"{other} for {how}")
