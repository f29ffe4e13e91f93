"""Checkpointing with the standard calls: resume is bit-identical.

Every check compares with ``torch.equal`` (bit-identity, no tolerance): a checkpoint moves
values without arithmetic, and a resumed run repeats the uninterrupted run's reductions in the
same order, so any difference is a bug (e.g. a stale non-owner copy saved, lost momentum).
A resume at another world size compares the loaded state with the saved state (training after
it sums gradients over a different number of ranks, so it is not compared with the W=4 run).
"""

import pytest
import torch

from tests.distributed.api import checkpoint_tasks as C

pytestmark = pytest.mark.distributed

#: Per-task timeout (s): a few seconds of work on an idle 2-core machine, generous for a loaded one.
TASK_TIMEOUT_S = 120


@pytest.mark.parametrize(
    ("mode", "world", "kind"),
    # z2 and flat hsdp-z3 slow: z3 saves and loads through the same state_dict hooks with its
    # copies freed, and flat HSDP is the 1-D protocol over W
    [("ddp", 2, "gpt"), pytest.param("z2", 4, "gpt", marks=pytest.mark.slow), ("z3", 4, "gpt"),
     pytest.param("hsdp-z3", 4, "gpt", marks=pytest.mark.slow),
     ("hsdp-z3/hierarchical", 4, "gpt"),
     pytest.param("hsdp-z2", 4, "gpt", marks=pytest.mark.slow),
     ("z3", 2, "experts"),  # 3-D expert stacks and plain 2-D routers
     pytest.param("hsdp-z3", 4, "experts", marks=pytest.mark.slow)],
)
def test_dcp_resume_is_bit_identical(pool2, pool4, tmp_path, mode, world, kind):
    pool = pool2 if world == 2 else pool4
    results = pool.run_with_timeout(TASK_TIMEOUT_S, C.dcp_resume, mode, str(tmp_path), kind)
    for rank, r in enumerate(results):
        diffs = {k: v for k, v in r.items() if k.startswith(("saving_run", "resume_"))}
        assert diffs.keys() == {"saving_run", "resume_after_step", "resume_mid", "resume_twice_2"}
        assert diffs == {k: [] for k in diffs}, (mode, rank)
        # Right after step() every copy is stale: one broadcast of every dedicated element
        # (phase "checkpoint"); the second of two saves in a row issues no DMuon collective.
        assert r["sync_elements"]["after_step"] == r["dedicated_elements"], (mode, rank)
        assert r["sync_elements"]["twice_1"] == r["dedicated_elements"], (mode, rank)
        assert r["sync_elements"]["twice_2"] == 0, (mode, rank)


def test_torch_save_of_state_dicts_on_every_rank_resumes_z3(pool4, tmp_path):
    results = pool4.run_with_timeout(TASK_TIMEOUT_S, C.plain_resume, "z3", str(tmp_path))
    assert all(r["diff"] == [] for r in results)
    # After state_dict() every rank reads the owner's values (non-holders included): equal norms.
    assert all(r["norms"] == results[0]["norms"] for r in results)
    # Before it, p.norm() on a Z3 non-holder raises a clear error (never SIGSEGV); holders
    # (owners on a 1-D mesh) read the new values.
    for name, norm in results[0]["norms"].items():
        before = [r["norm_before_sync"][name] for r in results]
        assert sum(b == norm for b in before) == 1, (name, before)
        assert all(b == norm or "dm.sync_params()" in b for b in before), (name, before)
    # A submodule's own state_dict() / load_state_dict() right after step() (non-holders freed).
    for r in results:
        assert r["sub_state"].keys() == {"fc1.weight", "fc2.weight"}
        assert all(torch.equal(r["sub_state"][k], results[0]["sub_state"][k]) for k in r["sub_state"])
        assert r["sub_loaded_diff"] == []


@pytest.mark.parametrize(
    ("load_mode", "flatten", "kind", "dedicated"),
    [("z3", False, "gpt", 4), ("ddp", True, "gpt", 4), ("z3", False, "experts", 7),
     ("hsdp-z3/hierarchical", False, "gpt", 4)],
    ids=["z3_default_options", "ddp_flat_optimizer_state", "z3_expert_stacks",
         "hierarchical_hsdp_2x1"],
)
def test_resume_at_another_world_size_moves_momentum_to_new_owners(pool4, pool2, tmp_path, load_mode,
                                                                   flatten, kind, dedicated):
    """Saved by Z3 at W=4; loaded at W=2 by Z3 (FSDP2 reshards 4 -> 2), by DDP (the FSDP2
    shards become plain tensors) or by hierarchical HSDP (2 x 1: the owner's replicate
    broadcast reaches the other holder), with default options or torchtitan's flat optimizer state;
    the MoE's 3-D expert stacks move whole, with their (E, rows, cols) momentum."""
    saved = pool4.run_with_timeout(TASK_TIMEOUT_S, C.save_for_resize, "z3", str(tmp_path), flatten, kind)
    loaded = pool2.run_with_timeout(TASK_TIMEOUT_S, C.load_resized, load_mode, str(tmp_path), flatten, kind)
    for key in ("owned", "momentum"):
        before = {n: t for r in saved for n, t in r[key].items()}
        after = {n: t for r in loaded for n, t in r[key].items()}
        assert before.keys() == after.keys() and len(after) == dedicated, key  # one owner each
        assert all(torch.equal(before[n], after[n]) for n in before), key
    # The saving ranks 2 and 3 owned matrices: their momentum now lives on rank 0 or 1.
    assert any(saved[2]["momentum"]) or any(saved[3]["momentum"])
    for r in loaded:  # AdamW params and moments
        assert r["adamw"].keys() == saved[0]["adamw"].keys()
        assert all(torch.equal(r["adamw"][k], saved[0]["adamw"][k]) for k in r["adamw"])
        assert r["after_step_finite"]


@pytest.mark.parametrize("mode", ["z3", "hsdp-z3"])
def test_get_state_dict_on_a_fresh_optimizer_does_not_step_it(pool4, mode):
    results = pool4.run_with_timeout(TASK_TIMEOUT_S, C.fresh_get_state_dict, mode)
    owners = {}
    for rank, r in enumerate(results):
        assert r["ns_calls"] == 0 and r["diff"] == [], rank
        for name, keys in r["entries"].items():  # every rank lists every dedicated param
            assert keys == (["momentum_buffer"] if name in r["owned"] else []), (rank, name)
            if keys:
                owners.setdefault(name, []).append(rank)
    assert all(len(ranks) == 1 for ranks in owners.values()) and len(owners) == 4


@pytest.mark.parametrize(
    ("case", "start"),
    [("assign", "ValueError: Invalid load_state_dict(assign=True)"),
     ("swap_tensors", "ValueError: Invalid torch.__future__.set_swap_module_params_on_conversion(True)")],
    ids=["assign", "swap_tensors"],
)
def test_loads_that_would_replace_params_raise(pool2, tmp_path, case, start):
    for message in pool2.run_with_timeout(TASK_TIMEOUT_S, C.load_errors, case, str(tmp_path)):
        assert message.startswith(start) and "holds DMuon-dedicated params" in message, message


def test_optimizer_state_dict_of_another_rank_raises(pool2, tmp_path):
    results = pool2.run_with_timeout(TASK_TIMEOUT_S, C.load_errors, "other_ranks_optimizer", str(tmp_path))
    for message in results:
        assert message.startswith("ValueError: Invalid state_dict: momentum_buffer of dedicated param"), message
        assert "is none" in message and "use DCP" in message


def test_readme_checkpointing_snippet_runs(pool2, tmp_path):
    assert "dcp.save" in C.readme_checkpoint_code()
    assert pool2.run_with_timeout(TASK_TIMEOUT_S, C.readme_snippet, "z3", str(tmp_path)) == [[], []]


@pytest.mark.slow  # waits out a 3 s group timeout in a fresh pool (8 s)
def test_sync_params_on_one_rank_names_the_cause():
    """dm.sync_params() on rank 0 only after a step: its broadcast times out (on gloo; NCCL's
    watchdog aborts) and the error says it is a collective of every rank."""
    from tests.distributed.harness import DistributedPool

    timeout_s = 3
    with DistributedPool(2, timeout_s=timeout_s) as pool:
        message = pool.run_with_timeout(60, C.sync_params_on_rank0_only, timeout_s)[0]
    assert message.startswith("DMuon: sync_params() failed in its broadcasts"), message
    assert "call those on every rank" in message, message
