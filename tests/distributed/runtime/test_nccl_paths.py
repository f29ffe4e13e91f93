"""DMuon's NCCL paths, checked on gloo with stand-ins (the paths in ``dmuon/``). What
only a GPU shows (a real NCCL group, ``torch.cuda.set_sync_debug_mode``, a kernel queue
deadlock under ``CUDA_DEVICE_MAX_CONNECTIONS=1``) is left to ``make gpu-check``; each test
says which stand-in it uses and why it fails without its fix."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.runtime import nccl_path_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90


@pytest.mark.parametrize("backend,by_gather,target", [
    ("nccl", False, 3_600_000), ("cpu:gloo,cuda:nccl", False, 3_600_000), ("gloo", True, 2_000_000)])
def test_a_meta_built_model_gets_the_policy_of_the_groups_backend(pool2, backend, by_gather, target):
    """Stand-in: the default group's backend name, as the link policy reads it
    (``collectives.default_backend``), reported as ``backend``; DMuon's groups stay gloo.
    Without the fix the policy followed the params' device: ``meta`` got gloo's (reduce by
    gather, 2 MB units) on NCCL, so the "nccl" rows failed. A mixed group's meta params take
    the accelerator's entry (``collectives.link_backend``)."""
    for got in pool2.run_with_timeout(TIMEOUT_S, T.policy_on_meta, backend):
        assert got == {"coalesce_bytes": target, "reduce_by_gather": by_gather}


@pytest.mark.parametrize("z3,rest", [(False, "wrapper"), (True, "replicate")])
def test_a_step_reads_nothing_back_from_the_device(pool2, z3, rest):
    """Stand-in for ``torch.cuda.set_sync_debug_mode``: ``HostReads`` records every
    ``.tolist()`` / ``.item()`` / ``bool(tensor)`` / ``torch.tensor(...)`` during a forward and
    backward (DMuon's hooks, the reduces and their waits, the replicated rest's all_reduce).
    Without the fix it saw ``tolist`` (the reduced usage, ``schedule.finish_reduces`` and
    ``rest.finish``) and ``tensor`` (the rest's usage flags, ``rest.issue``) every backward."""
    for seen in pool2.run_with_timeout(TIMEOUT_S, T.host_reads_in_a_step, z3, rest):
        assert seen == []


def test_the_stand_in_sees_a_host_read():
    """``HostReads`` is not blind: it records the reads the fix removed."""
    with T.HostReads() as reads:
        t = torch.ones(3)
        t.sum().item()
        t.tolist()
        bool(t[0])
        torch.tensor([True, False])
    assert reads.seen == ["item", "tolist", "__bool__", "tensor"]


@pytest.mark.parametrize("z3", [True, False])
def test_every_rank_issues_the_channels_in_one_order(pool2, z3):
    """Block 2 runs on rank 1 only (one unit per block, Z3): its grads never arrive on rank
    0. If its reduce waited for the end of backward there while the re-broadcasts went on,
    rank 0 would issue [..., broadcast, reduce] where rank 1 issues [..., reduce, broadcast]
    (on NCCL two kernels of two communicators in opposite orders: a deadlock when they
    cannot run at once). Issuing every re-broadcast before any reduce would avoid that but
    hold every grad buffer to the end of backward; instead both channels follow one order
    (``Schedule._pump``) and rank 0 sends block 2's zeros where rank 1 sends its grads, so
    reduces go between the re-broadcasts (that assertion fails on the
    re-broadcasts-first rule). The step's results stay equal on both ranks."""
    ranks = pool2.run_with_timeout(TIMEOUT_S, T.channel_order, z3, 0)
    assert ranks[0]["issued"] == ranks[1]["issued"]
    issued = ranks[0]["issued"]
    assert issued.count("reduce") >= 4  # 4 bucket reduces (+ the rest's all_reduce)
    after = issued[issued.index("reduce"):]
    if z3:  # the reduces go as their grads arrive, between the re-broadcasts
        assert "broadcast" in after, issued
    else:
        assert "broadcast" not in after  # Z2: forward broadcasts only
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name


def test_dmuon_calls_no_deprecated_collective(pool2):
    """torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a
    FutureWarning per rank and call site): DMuon's seams (the aligned groups' all_gather and
    reduce_scatter, the setup agreement) use ``all_gather_single`` / ``reduce_scatter_single``
    where torch has them, the old names on torch 2.11. Without the fix each rank warned
    twice here (the agreement's ``all_gather_single`` was also missing on torch 2.11)."""
    for caught in pool2.run_with_timeout(TIMEOUT_S, T.deprecation_warnings):
        assert [w for w in caught if "deprecated" in w] == []
