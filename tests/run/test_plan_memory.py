"""dmuon-plan's memory per rank (verify.plan.memory): a tiny model computed by hand, holders
by shard index and momentum by owner under HSDP, FSDP2's chunks of the rest against
``torch.chunk``, the median, the table and the JSON."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter

import pytest
import torch

from dmuon.ownership.plan import ParamSpec, plan_ownership
from verify.plan.cli import ModelLayout, main
from verify.plan.memory import _median, adamw_rest_bytes, rank_memory
from verify.traffic.predict import RunLayout
from verify.workload.presets import resolve_model

FOUR = "tests.plan_factories:four_blocks"
# fp32, one unit per block (--intra-alpha-us 0: coalesce target 0)
ARGS = ["--model", FOUR, "--dtype", "fp32", "--intra-alpha-us", "0", "--json"]


def _memory(capsys, mesh: str) -> dict:
    assert main([*ARGS, "--mesh", mesh]) == 0
    rep = json.loads(capsys.readouterr().out)["reports"][0]
    return {m["mode"]: m["memory"] for m in rep["modes"] if "memory" in m}


def test_four_blocks_at_w2_by_hand(capsys):
    """Four blocks of one (8, 8) fp32 Linear (256 B), owners 0, 1, 0, 1; an Embedding (3, 8)
    for AdamW. Each rank holds two matrices: 512 B, momentum 512 B. Z3 window at depth 1:
    unit i with bucket i + 1 (or i - 1): one of them non-held, 256 B over 2 units; Z2 and
    DDP: both non-held, 512 B over 4 units. Grad buffers: (64 + 1 usage) · 4 = 260 B a
    bucket, two held (520), and two adjacent units of which one non-held (260). AdamW of the
    embedding: 2 states · rows · 8 · 4 B; FSDP2 over W = 2 chunks 3 rows as 2 + 1 (128 B,
    64 B, median 96), DDP whole (192 B)."""
    ml = ModelLayout(resolve_model(FOUR)(), FOUR, "float32")
    assert plan_ownership(ml.muon_specs, (1, 2)).owner == {
        "blocks.0.0.weight": 0, "blocks.1.0.weight": 1, "blocks.2.0.weight": 0,
        "blocks.3.0.weight": 1}  # the hand computation's input
    mem = _memory(capsys, "2")
    assert list(mem) == ["dmuon-ddp", "dmuon-z2", "dmuon-z3"]
    common = {"params_held_bytes": 512, "grads_held_bytes": 520, "grads_in_flight_bytes": 260,
              "momentum_bytes": 512}
    for mode, window, units, adamw in (("dmuon-ddp", 512, 4, (192, 192, 192)),
                                       ("dmuon-z2", 512, 4, (64, 96, 128)),
                                       ("dmuon-z3", 256, 2, (64, 96, 128))):
        m = mem[mode]
        assert m["z3"] == (mode == "dmuon-z3") and m["prefetch_depth"] == 1
        for stat, rest in zip(("min", "median", "max"), adamw):
            want = {**common, "window_bytes": window, "adamw_rest_bytes": rest}
            assert m[stat] == {**want, "sum_bytes": sum(want.values())}, (mode, stat)
        # rank 0 has the embedding's 2 rows: the busiest
        assert m["busiest"] == {"rank": 0, **common, "window_bytes": window, "window_units": units,
                                "adamw_rest_bytes": adamw[2],
                                "sum_bytes": sum(common.values()) + window + adamw[2]}


def test_hsdp_holds_by_shard_index_and_keeps_momentum_on_the_owner():
    """2x2 HSDP, owners 0..3: shard index s holds blocks s and s + 2 (512 B, like its
    replica), but each rank owns (momentum) one matrix (256 B); AdamW by shard index."""
    ml = ModelLayout(resolve_model(FOUR)(), FOUR, "float32")
    plan = plan_ownership(ml.muon_specs, (2, 2))
    assert sorted(plan.owner.values()) == [0, 1, 2, 3]
    rows = rank_memory(ml.layout("dmuon-hsdp-z3", 2, 2), plan)
    assert [(r["rank"], r["params_held_bytes"], r["momentum_bytes"], r["window_bytes"],
             r["adamw_rest_bytes"]) for r in rows] == [
        (0, 512, 256, 256, 128), (1, 512, 256, 256, 64), (2, 512, 256, 256, 128),
        (3, 512, 256, 256, 64)]
    with pytest.raises(ValueError, match="Must be a DMuon mode"):
        rank_memory(ml.layout("naive-hsdp", 2, 2), plan)
    with pytest.raises(ValueError, match="W=4 ranks"):
        rank_memory(ml.layout("dmuon-hsdp-z3", 2, 2), plan_ownership(ml.muon_specs, (1, 2)))


def test_adamw_rest_is_fsdp2s_torch_chunk_of_dim0():
    """Per shard, the rest's bytes equal ``torch.chunk``'s parts (FSDP2's dim-0 shards: rows
    fewer than shards, uneven remainders, empty dims), frozen and dedicated params left out."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        params = tuple(ParamSpec(f"p{i}", tuple(rng.randint(0, 12) for _ in range(rng.randint(1, 3))),
                                 "float32", "") for i in range(rng.randint(2, 5)))
        layout = RunLayout(mode="dmuon-z3", replicate_size=1, shard_size=n, params=params,
                           muon_names=(params[0].name,), frozen_names=(params[1].name,),
                           fsdp_modules=("",))
        want = [2 * 4 * sum(torch.chunk(torch.empty(p.shape), n)[s].numel()
                            if p.shape[0] and s < len(torch.chunk(torch.empty(p.shape), n)) else 0
                            for p in params[2:]) for s in range(n)]
        assert adamw_rest_bytes(layout) == want


def test_median_of_counts():
    rng = random.Random(1)
    for _ in range(500):
        values = [rng.randint(0, 5) for _ in range(rng.randint(1, 9))]
        assert _median(Counter(values)) == statistics.median(values)


def test_table_shows_memory_per_dmuon_mode_and_sweep_has_none(capsys, monkeypatch):
    assert main(["--model", FOUR, "--mesh", "2x2"]) == 0
    out = capsys.readouterr().out
    assert "Memory per rank, GiB" in out and "busiest: rank 0" in out
    assert "| dmuon-hsdp-z3 | min " in out and "| naive-hsdp " in out
    monkeypatch.setattr("verify.plan.cli.SWEEP_WORLDS", (8,))
    assert main(["--model", FOUR, "--sweep", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all("memory" not in m for rep in doc["reports"] for m in rep["modes"])
