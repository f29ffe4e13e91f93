"""Bad input gets a clear error on every rank (never a hang); edge cases work."""

import pytest
import torch

from tests.distributed.parity import dmuon_tasks as T

pytestmark = pytest.mark.distributed

CASES = {
    "non_2d_param": ("ValueError", "of shape (32,): Muon needs a matrix, a stack of matrices"),
    "param_not_in_model": ("ValueError", "not a parameter of the model"),
    "mesh_3d": ("ValueError", "ndim=3"),
    "mesh_axes_swapped": ("ValueError", "mesh_dim_names=('shard', 'replicate')"),
    "mesh_not_world": ("ValueError", "W = R * N = 2 must equal the world size 4"),
    "plan_mismatch": ("RuntimeError", "coalesce, rest or device type) differs across ranks"),
    "bucket_cap_mismatch": ("RuntimeError", "coalesce, rest or device type) differs across ranks"),
    "coalesce_mismatch": ("RuntimeError", "coalesce, rest or device type) differs across ranks"),
    "rest_mismatch": ("RuntimeError", "coalesce, rest or device type) differs across ranks"),
    "coalesce_invalid": ("ValueError", "Invalid coalesce='fastest'. Must be one of ('auto', 'block', 'all')"),
    "hierarchy_mismatch": ("RuntimeError", "setup (ownership plan and hierarchy,"),
    "hierarchy_invalid": ("ValueError", "Invalid hierarchy='2d'. Must be one of ('auto', 'hierarchical', 'flat')"),
    "link_invalid": ("ValueError", "Invalid link='infiniband'. Must be one of ('auto', 'nccl', 'gloo')"),
    "link_mismatch": ("RuntimeError", "coalesce, rest or device type) differs across ranks"),
    "already_ddp": ("ValueError", "already wrapped by DDP or FSDP2"),
    "optimizer_missing_params": ("ValueError", "are not among them"),
    "optimizer_param_groups": ("ValueError", "Invalid params[1]['amsgrad']=True. DMuon's AdamW is "
                               "torch.optim.AdamW with amsgrad=False only"),
    "optimizer_add_param_group": ("ValueError", "Invalid add_param_group(['params']): DMuon's param "
                                  "groups are fixed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_clear_error_on_every_rank(pool4, case):
    kind, text = CASES[case]
    for rank, message in enumerate(pool4.run_with_timeout(60, T.expect_error, case)):
        assert message.startswith(kind) and text in message, (rank, message)


def test_an_error_on_one_rank_raises_on_every_rank(pool4):
    """Rank 1 alone passes an invalid argument: it raises its ValueError after the setup
    agreement, which tells the others (they used to wait in it until the group's timeout)."""
    messages = pool4.run_with_timeout(30, T.expect_error, "one_rank_invalid")
    assert messages[1].startswith("ValueError: Invalid coalesce='fastest'"), messages[1]
    for rank in (0, 2, 3):
        assert messages[rank].startswith("RuntimeError: DMuon setup failed on ranks [1]"), messages[rank]


def test_fewer_matrices_than_ranks(pool4):
    results = pool4.run(T.fewer_matrices_than_ranks, 3)
    assert sorted(r["owned"] for r in results) == [0, 0, 1, 1]
    assert sum(r["ns_calls"] for r in results) == 3 * 2
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_param_unused_on_every_rank_gets_grad_none_and_no_update(pool4):
    results = pool4.run_with_timeout(60, T.unused_param)
    owner = [r for r in results if r["owns_b"]]
    assert len(owner) == 1
    assert owner[0]["b_grad"] is None and owner[0]["unchanged"]  # no weight decay applied
    assert owner[0]["second_grad"] and owner[0]["momentum"]  # used in step 2: updated
