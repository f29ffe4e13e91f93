"""A ``register_step_post_hook`` hook edits the stepped weights before DMuon refreshes the
compute copies and HSDP replicas from them.

Before: ``step()`` refreshed (bf16 compute copies cast from the masters, the HSDP replicate
broadcast started) inside its body, before torch ran the post-hooks, so a hook's clamp reached
no compute copy (DDP + bf16: every use stale) and, under hierarchical HSDP-Z3, raced the
broadcast. This test failed then with ``stale > 0``.
"""

import pytest

from tests.distributed.parity import post_hook_tasks as P

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


@pytest.mark.parametrize("mode,pool", [("ddp", "pool2"), ("z3", "pool2"), ("hsdp-z3", "pool4")])
def test_post_hook_edit_reaches_every_compute_copy(request, mode, pool):
    results = request.getfixturevalue(pool).run_with_timeout(TIMEOUT_S, P.clamp_in_post_hook, mode)
    for rank, r in enumerate(results):
        assert r["seen"] > 0 and r["stale"] == 0, (mode, rank, r)
