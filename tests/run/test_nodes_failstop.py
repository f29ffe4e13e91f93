"""Unit tests of more than one node (verify.run.nodes, verify.run.collect, the launcher's
rendezvous flags) and of the failure board (verify.run.failstop) on an in-memory store."""

import json

import pytest
import torch.distributed as dist

from tracer.events import CollectiveEvent
from verify.run import failstop
from verify.run.collect import limit_problem, needs_gloo_group, own_files
from verify.run.launch import launch_command, rendezvous_args
from verify.run.nodes import cross_share, node_map, node_traffic


def _ev(rank, op, group, count=100, root=None, dtype="float32"):
    members = [int(r) for r in group.split(",")]
    return CollectiveEvent(source="interposer", op=op, rank=rank, group_id=group,
                           group_size=len(members), group_rank=members.index(rank), count=count,
                           dtype=dtype, root=root)


def test_rendezvous_is_standalone_on_one_node_and_c10d_on_more():
    assert rendezvous_args(1, None, "x") == ["--standalone"]
    assert rendezvous_args(2, "10.0.0.1:29400", "job") == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "job"]
    cmd = launch_command(2, "out", [], rendezvous_args(2, "h:1", "j"))
    assert "--standalone" not in cmd and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    for bad in ((2, None), (2, "nohost"), (0, "h:1")):
        with pytest.raises(ValueError, match="Invalid --"):
            rendezvous_args(*bad, "j")


def test_node_map_from_group_rank_else_hosts():
    infos = [{"rank": r, "node": r // 2, "host": "h", "local_rank": r % 2} for r in range(4)]
    assert node_map(infos) == {"count": 2, "source": "GROUP_RANK (torchrun's node rank)",
                               "of_rank": [0, 0, 1, 1], "hosts": ["h", "h"]}
    by_host = [{"rank": r, "node": None, "host": "ab"[r % 2], "local_rank": 0} for r in range(4)]
    assert node_map(by_host)["of_rank"] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="Must be 0..W-1"):
        node_map(infos[::-1])


def test_replicate_groups_across_nodes_carry_every_byte_shard_groups_none():
    """2 x 2 HSDP, nodes {0,1} {2,3}: the replicate groups 0,2 / 1,3 span the nodes, the shard
    groups 0,1 / 2,3 do not; an all_reduce over 0,2 sends 2(n-1)/n·S = S elements each way."""
    node_of = [0, 0, 1, 1]
    assert cross_share(_ev(0, "all_reduce", "0,2"), node_of) == (1.0, 1.0)
    assert cross_share(_ev(0, "all_gather", "0,1"), node_of) == (0.0, 0.0)
    # ring over the world: 0 -> 1 stays, 1 -> 2 crosses, 3 -> 0 crosses
    assert cross_share(_ev(1, "all_gather", "0,1,2,3"), node_of) == (1.0, 0.0)
    assert cross_share(_ev(0, "all_to_all", "0,1,2,3"), node_of) == (2 / 3, 2 / 3)
    assert cross_share(_ev(0, "broadcast", "0,2", root=0), node_of) == (1.0, 1.0)
    events = [_ev(r, "all_reduce", g) for g in ("0,2", "1,3", "0,1", "2,3") for r in map(int, g.split(","))]
    out = node_traffic(events, node_of, steps=1, hosts=["a", "b"])
    assert out["spanning_groups"] == {"0,2": 800.0, "1,3": 800.0}  # 2 members x 100 elem x 4 B
    assert out["inter_node_share"] == 0.5 and out["unplaced_events"] == 0
    assert [n["inter_node_sent_bytes"] for n in out["per_node"]] == [800.0, 800.0]
    assert [n["sent_bytes"] for n in out["per_node"]] == [1600.0, 1600.0]


def test_an_event_whose_rank_is_not_its_group_member_is_unplaced():
    bad = CollectiveEvent(source="interposer", op="all_reduce", rank=1, group_id="0,2",
                          group_size=2, group_rank=0, count=4, dtype="float32")
    assert cross_share(bad, [0, 0, 1, 1]) is None
    assert node_traffic([bad], [0, 0, 1, 1], steps=1)["unplaced_events"] == 1


def test_own_files_are_this_ranks_and_its_nccl_log(tmp_path):
    for rel in ("m/events_rank1.parquet", "m/events_rank11.parquet", "m/fr_before/fr_rank1.json",
                "m/error_rank1.txt", "m/layout.json", "nccl/nccl.host.42.log", "nccl/nccl.host.7.log"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert own_files(tmp_path, 1, pid=42) == ["m/error_rank1.txt", "m/events_rank1.parquet",
                                              "m/fr_before/fr_rank1.json", "nccl/nccl.host.42.log"]


def test_collection_past_the_limit_is_refused_naming_the_flag():
    manifests = [{"rank": 0, "files": []}, {"rank": 2, "files": [("a", 3 << 20)]}]
    assert limit_problem(manifests, 4 << 20) is None
    assert "ranks [2] hold 3.0 MiB" in limit_problem(manifests, 1 << 20)
    assert "--collect-max-mb" in limit_problem(manifests, 1 << 20)


def _boards(world):
    store = dist.HashStore()
    return [failstop.Board(store, rank=r, world=world) for r in range(world)]


def test_a_mode_that_raised_everywhere_is_settled_and_the_run_goes_on():
    b0, b1 = _boards(2)
    b0.post("m", {"error": "E", "file": "f"})
    assert b1.settle("m", {"error": "E", "file": "f"}, settle_s=5) is None
    assert b1.left() == {}


def test_a_rank_that_raised_alone_leaves_and_the_report_names_it():
    """Rank 1 raised; rank 0 never posts (blocked in a collective with it): after the settle
    time rank 1 posts ``left``, and the description names rank 1's error first, rank 0's
    broken connection as a consequence. Fails if settle gathered (returned None) instead."""
    b0, b1 = _boards(2)
    broken = b1.settle("m", {"error": "RuntimeError: planted", "file": "m/error_rank1.txt"}, settle_s=0.3)
    assert broken is not None and list(b0.left()) == [1]
    assert b0.settle("m", {"ok": True}) is not None  # a peer left: nothing to gather
    b0.post("m", {"error": "RuntimeError: Connection closed by peer [x]", "file": "g"})  # the gather's
    text = failstop.describe(b0.broken("m"), 2)
    assert text.index("rank 1 raised: RuntimeError: planted") < text.index("rank(s) [0] failed as a consequence")
    failures = failstop.stopped_failures(b0.broken("m"), ["m2", "m3"], 2)
    assert [(f["mode"], f["check"]) for f in failures] == [("m", "error"), ("m2", "error"), ("m3", "error")]
    assert "not run" in failures[1]["detail"]


def test_a_rank_that_posted_nothing_is_named_as_ended_without_exception():
    b0, _ = _boards(2)
    b0.post("m", {"error": "RuntimeError: Connection reset by peer", "file": "x"})
    broken = b0.broken("m", collect_s=0.2)
    assert broken.missing == [1]
    assert "rank 1 posted no status: its process ended without a Python exception" in failstop.describe(broken, 2)
    assert json.dumps(failstop.stopped_report(broken, ["m2"]))  # report.json-ready


def test_files_move_on_the_default_group_where_it_has_gloo_for_cpu():
    # torch's default group on a GPU node is "cpu:gloo,cuda:nccl": its gloo half carries the
    # host tensors. The string comparison `!= "gloo"` that was in collect_to_rank0 made every
    # rank create an extra gloo group there (this test fails against it).
    assert not needs_gloo_group("cpu:gloo,cuda:nccl")
    assert not needs_gloo_group("gloo") and not needs_gloo_group("GLOO")
    assert needs_gloo_group("nccl") and needs_gloo_group("cpu:mpi,cuda:nccl")
    with pytest.raises(ValueError, match="Invalid backend"):
        needs_gloo_group("")
