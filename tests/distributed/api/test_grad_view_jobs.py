"""torch's ``clip_grad_norm_(..., norm_type=inf)`` on the dedicated grads shown as DTensors
under FSDP2 (``dmuon/runtime/grad_view.py``; docs/user-guide.md, "Gradient clipping", says
torch's clipping functions work as in an FSDP2 script).

Found by helper h18: every non-owner shows an empty ``(0, cols)`` local tensor, and torch's
``_foreach_norm`` refuses the infinity norm of an empty tensor ("cannot compute the infinity
norm on an empty tensor because the operation does not have an identity"). So torch's
function raises on every rank that does not own some dedicated param, before its all_reduce;
a rank that owns every dedicated param (one matrix, or a plan that puts all on one rank)
enters the all_reduce alone and hangs until the process-group timeout. The same script
under plain FSDP2 (no DMuon) returns the norm. The 2-norm and p-norms with p < inf are right
(an empty tensor adds 0).

Both tests are marked ``xfail(strict=True)``: they fail today (the error / TimeoutError) and
turn into a strict XPASS failure once fixed, which is the signal to drop the marker. A fix
checked by monkeypatch in the trial (not committed: grad_view.py was being edited by another
helper): show a non-owner's grad as one fresh zero row ``(1, *shape[1:])`` instead of an
empty tensor; the inf norm then equals DMuon's ``opt.clip_grad_norm_(norm_type=inf)`` on both
ranks, and 2-norm runs stay bit-identical (zeros add nothing to a sum nor to a max of |x|).
"""

import pytest

from tests.distributed.api import grad_view_jobs_tasks as G
from tests.distributed.harness import RankError  # noqa: F401  (raised by the second test)

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60
HANG_TIMEOUT_S = 8  # the single-owner case hangs today: fail fast instead of the pool's default


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="grad_view: non-owners' empty locals make torch's inf-norm raise")
def test_torch_inf_norm_clip_is_the_global_max(pool2):
    results = pool2.run_with_timeout(TIMEOUT_S, G.inf_norm_clip, "z2", one_matrix=False)
    for rank, r in enumerate(results):
        assert r["error"] == "", (rank, r["error"])
        assert r["total"] == pytest.approx(r["ref"], rel=1e-6), (rank, r)
    assert results[0]["total"] == results[1]["total"]


@pytest.mark.xfail(strict=True, raises=(RankError, TimeoutError, AssertionError),
                   reason="grad_view: the rank owning every dedicated param hangs in torch's inf-norm")
def test_torch_inf_norm_clip_with_one_owner_does_not_hang(pool2):
    results = pool2.run_with_timeout(HANG_TIMEOUT_S, G.inf_norm_clip, "z3", one_matrix=True)
    for rank, r in enumerate(results):
        assert r["error"] == "", (rank, r["error"])
        assert r["total"] == pytest.approx(r["ref"], rel=1e-6), (rank, r)
