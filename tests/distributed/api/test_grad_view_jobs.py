"""torch's ``clip_grad_norm_(..., norm_type=inf)`` on the dedicated grads shown as DTensors
under FSDP2 (``dmuon/runtime/grad_view.py``; docs/user-guide.md, "Gradient clipping", says
torch's clipping functions work as in an FSDP2 script).

Found by helper h18: every non-owner showed an empty ``(0, cols)`` local tensor, and torch's
``_foreach_norm`` refuses the infinity norm of an empty tensor ("cannot compute the infinity
norm on an empty tensor because the operation does not have an identity"). So torch's
function raised on every rank that does not own some dedicated param, before its all_reduce;
a rank that owns every dedicated param (one matrix, or a plan that puts all on one rank)
enters the all_reduce alone and hangs until the process-group timeout. The same script
under plain FSDP2 (no DMuon) returns the norm. The 2-norm and p-norms with p < inf are right
(an empty tensor adds 0).

Both failed before the fix (the error; ``TimeoutError``): a non-owner now shows one fresh
row of zeros, which adds nothing to a sum nor to a max of |x| (2-norm runs bit-identical).
"""

import pytest

from tests.distributed.api import grad_view_jobs_tasks as G

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60
HANG_TIMEOUT_S = 8  # the single-owner case hung before the fix: fail fast, not at the pool's default


def test_torch_inf_norm_clip_is_the_global_max(pool2):
    results = pool2.run_with_timeout(TIMEOUT_S, G.inf_norm_clip, "z2", one_matrix=False)
    for rank, r in enumerate(results):
        assert r["error"] == "", (rank, r["error"])
        assert r["total"] == pytest.approx(r["ref"], rel=1e-6), (rank, r)
    assert results[0]["total"] == results[1]["total"]


def test_torch_inf_norm_clip_with_one_owner_does_not_hang(pool2):
    results = pool2.run_with_timeout(HANG_TIMEOUT_S, G.inf_norm_clip, "z3", one_matrix=True)
    for rank, r in enumerate(results):
        assert r["error"] == "", (rank, r["error"])
        assert r["total"] == pytest.approx(r["ref"], rel=1e-6), (rank, r)
