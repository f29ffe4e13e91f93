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
from tests.distributed.parity.test_dmuon_parity import FLOOR_FACTOR, _rel_err

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


def _matches_oracle(pool, how: str, mode: str, kw: dict, steps: int = 4) -> list[dict]:
    init = T.make_model().state_dict()
    ref = C.oracle(steps, how)
    if how == "value":
        assert all(0.05 < f < 0.95 for f in ref["clamped"])  # the clip bites on part of the grads
    else:
        assert all(n > 4 * C.MAX_NORM for n in ref["norms"])  # and here on every step
    floor = _rel_err(C.oracle(steps, how, micro_batches=2)["params"], init, ref["params"])
    results = pool.run_with_timeout(TIMEOUT_S, C.train, mode, steps, how, **kw)
    assert _rel_err(T.merge_owned(results), init, ref["params"]) <= FLOOR_FACTOR * floor
    return results


@pytest.mark.parametrize("mode,kw", CASES + FSDP2 + [("z3", {"via_opt": True})])
def test_clip_grad_value_matches_the_oracle(pool2, mode, kw):
    """torch's clip_grad_value_ in every mode (under FSDP2 on the shown DTensor grads), and
    opt.clip_grad_value_."""
    _matches_oracle(pool2, "value", mode, kw)


@pytest.mark.parametrize("mode,kw", FSDP2 + [("z2", {"via_opt": True})])
def test_torch_clip_grad_norm_matches_the_oracle_under_fsdp2(pool2, mode, kw):
    """torch's clip_grad_norm_ over model.parameters() returns the global norm on every rank
    (the same float) and trains as the single-process clip does; opt.clip_grad_norm_ too."""
    ref = C.oracle(4, "norm")
    results = _matches_oracle(pool2, "norm", mode, kw)
    assert results[0]["norms"] == results[1]["norms"]
    assert results[0]["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-6)
