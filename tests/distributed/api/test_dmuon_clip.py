"""DMuon.clip_grad_norm_: the global norm over the owners' grads and the rest, equal on every
rank and to one process's torch.nn.utils.clip_grad_norm_, so clipped training matches it
(torch's clipping over model.parameters() would see each dedicated grad on its owner only)."""

import math

import pytest

from tests.distributed.api import clip_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90


@pytest.mark.parametrize("wrap,norm_type", [("ddp", 2.0), ("fsdp", 2.0), ("ddp", math.inf)])
def test_clip_matches_single_process_torch(pool2, wrap, norm_type):
    ref = T.oracle(2, norm_type)
    results = pool2.run_with_timeout(TIMEOUT_S, T.train, wrap, norm_type)
    for r in results:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)  # and equal on both ranks
        assert all(n > T.MAX_NORM for n in r["norms"])  # clipping bit in every step
        for n, want in ref["params"].items():
            assert (r["params"][n] - want).abs().max().item() < 1e-6, (wrap, n)
    assert results[0]["norms"] == results[1]["norms"]


def test_clip_misuse_raises_on_every_rank(pool2):
    for errors in pool2.run_with_timeout(TIMEOUT_S, T.misuse):
        assert len(errors) == 4
        assert "called in state IDLE" in errors[0] and "after loss.backward()" in errors[0]
        assert "Invalid max_norm=0.0" in errors[1]
        assert "Invalid norm_type=-2.0" in errors[2]
        assert "Invalid max_norm=nan" in errors[3]
