"""torch's clipping functions in a DMuon script (issue 34, item 2).

``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()`` sees each dedicated grad on its
owner only, so each rank clips by its own norm and DDP-replicated params drift apart. Before
the grad guard (``dmuon/optim/grad_guard.py``) ``step()`` ran silently after it, so
``test_step_after_torch_clip_grad_norm_raises_on_every_rank`` failed (no error, every param
changed). ``clip_grad_value_`` is elementwise: on the grads where DMuon reads them it is the
single-process clip, so it must keep working and match the oracle.
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


@pytest.mark.parametrize("mode,kw", CASES + [("z3", {"via_opt": True})])
def test_clip_grad_value_matches_the_oracle(pool2, mode, kw):
    """torch's clip_grad_value_ (DDP, rest="replicate"); under FSDP2 opt.clip_grad_value_
    (torch's foreach refuses FSDP2's DTensor grads beside DMuon's plain ones)."""
    steps = 4
    init = T.make_model().state_dict()
    ref = C.oracle_value(steps)
    assert all(0.05 < f < 0.95 for f in ref["clamped"])  # the clip bites on part of the grads
    floor = _rel_err(C.oracle_value(steps, micro_batches=2)["params"], init, ref["params"])
    merged = T.merge_owned(pool2.run_with_timeout(TIMEOUT_S, C.train_value, mode, steps, **kw))
    assert _rel_err(merged, init, ref["params"]) <= FLOOR_FACTOR * floor
