"""dmuon-plan --ep E (verify/plan/ep.py): the closed forms of docs/traffic-model.md, "Expert
parallelism", against a brute-force per-rank sum of the protocol's calls; NS once per
expert; memory per rank; the CLI's output and its errors on a bad --ep."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from dmuon.ownership.buckets import block_of
from verify.plan.cli import ModelLayout, main
from verify.plan.ep import ep_report, part_traffic, plan_ep, rank_traffic, split_specs
from verify.workload.presets import Decoder, DecoderConfig, MoEConfig

#: (R, N, E) meshes the EP support is documented for, and around them: EP 2 x DP 2, EP 4, R = 2, W = 8;
#: at 2x4x2 the 6 local stacks leave column shard indices 2 and 3 one replicate pair fewer.
MESHES = [(1, 2, 2), (1, 1, 4), (2, 1, 2), (2, 2, 2), (1, 3, 2), (2, 4, 2)]

#: Element bytes of the layouts below (--dtype bfloat16).
BF16 = 2


def tiny_moe():
    """3 layers, the first dense; two MoE layers of 4 experts as 3-D stacks, a router and a
    shared expert (the CLI tests' --model)."""
    return Decoder(DecoderConfig(
        vocab_size=50, d_model=16, n_layers=3, n_heads=2, n_kv_heads=2, ffn_dim=24,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=8, n_shared_experts=1,
                      first_dense_layers=1, stacked=True)))


def dense_tiny():
    """A model without expert stacks."""
    return Decoder(DecoderConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2,
                                 ffn_dim=24))


@pytest.fixture(scope="module")
def ml():
    with torch.device("meta"):
        return ModelLayout(tiny_moe(), "tiny-moe")


def _buckets(specs, owner, blocks, e=1):
    """(block, owner) -> elements (a 3-D stack: its E-shard's): one bucket per owner per block
    (coalesce="block")."""
    out = defaultdict(int)
    for sp in specs:
        out[(block_of(sp.module), owner[sp.name])] += sp.numel // (e if len(sp.shape) == 3 else 1)
    return out, max((b for b, _ in out), key=blocks.index)  # the kept unit: the last block


def brute_force(ml, mesh, mode):
    """Per world rank: (dedicated elements f(n)·S summed, calls) of one step, written from the
    protocol call by call: dense buckets over each replica's N·E shard group (then, HSDP, a
    reduce and a broadcast over the owner's replicate group (*, s, e)); expert buckets over
    each column's shard group (r, *, e) from owner (r_o, s_o, e) in every column e, then over
    (*, s_o, e); Z3 re-broadcasts every bucket in backward but those of the last block."""
    r, n, e = mesh
    w, ne = r * n * e, n * e
    plan = plan_ep(*split_specs(ml.muon_specs, e), mesh)  # the owners; sizes from the model
    dense = [sp for sp in ml.muon_specs if len(sp.shape) != 3]
    stacks = [sp for sp in ml.muon_specs if len(sp.shape) == 3]
    blocks = list(dict.fromkeys(block_of(sp.module) for sp in ml.params))
    elems, calls = [0.0] * w, [0] * w
    z3 = mode.endswith("z3")

    def take(members, size, numel, times):
        for m in members:
            elems[m] += times * (size - 1) / size * numel
            calls[m] += times

    buckets, kept = _buckets(dense, plan.dense.owner, blocks)
    for (blk, g), numel in buckets.items():
        for ri in range(r):
            take(range(ri * ne, (ri + 1) * ne), ne, numel, 2 + (z3 and blk != kept))
        if r > 1:
            take([ri * ne + g % ne for ri in range(r)], r, numel, 2)
    buckets, kept = _buckets(stacks, plan.expert.owner, blocks, e)
    for (blk, c), numel in buckets.items():
        for k in range(e):
            for ri in range(r):
                take([(ri * n + si) * e + k for si in range(n)], n, numel, 2 + (z3 and blk != kept))
            if r > 1:
                take([(ri * n + c % n) * e + k for ri in range(r)], r, numel, 2)
    return elems, calls


def _closed(mode, mesh, p_d, p_x_loc, kept_d, kept_x):
    """docs/traffic-model.md's EP forms, written out."""
    r, n, e = mesh
    w, ne, rn = r * n * e, n * e, r * n
    if mode == "dmuon-z2":
        return 2 * (ne - 1) / ne * p_d + 2 * (n - 1) / n * p_x_loc
    if mode == "dmuon-z3":
        return (3 * (ne - 1) / ne * p_d - (ne - 1) / ne * kept_d
                + 3 * (n - 1) / n * p_x_loc - (n - 1) / n * kept_x)
    if mode == "dmuon-hsdp-z2":
        return 2 * (w - 1) / w * p_d + 2 * (rn - 1) / rn * p_x_loc
    return ((2 * (w - 1) / w + (ne - 1) / ne) * p_d - (ne - 1) / ne * kept_d
            + (2 * (rn - 1) / rn + (n - 1) / n) * p_x_loc - (n - 1) / n * kept_x)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_closed_forms_equal_the_brute_force_per_rank_sum(ml, mesh):
    r, n, e = mesh
    rep = ep_report(ml, (r, n), e, coalesce_bytes=0)
    plan = plan_ep(*split_specs(ml.muon_specs, e), mesh)
    assert rep["world_size"] == r * n * e and rep["p_x_local"] * e == rep["p_x"]
    assert [m["mode"] for m in rep["modes"]] == (
        ["dmuon-z2", "dmuon-z3"] if r == 1 else ["dmuon-hsdp-z2", "dmuon-hsdp-z3"])
    for row in rep["modes"]:
        elems, calls = brute_force(ml, mesh, row["mode"])
        w = len(elems)
        st = part_traffic(ml, plan, row["mode"], 0, *split_specs(ml.muon_specs, e))[2:]
        per_rank = rank_traffic(*st, mesh)  # rank by rank, not only the extremes
        assert per_rank["calls"] == calls
        assert per_rank["ded_avg_elems"] == pytest.approx(elems, rel=1e-12)
        assert row["ded_avg_elems"] == pytest.approx(sum(elems) / w, rel=1e-12)
        assert row["ded_max_bytes"] == pytest.approx(max(elems) * BF16, rel=1e-12)
        assert row["calls_max"] == max(calls) and row["calls_avg"] == pytest.approx(sum(calls) / w)
        closed = _closed(row["mode"], mesh, rep["p_d"], rep["p_x_local"],
                         row["p_d_kept_elems"], row["p_x_kept_elems"])
        assert row["closed_form_elems"] == pytest.approx(closed, rel=1e-12)
        assert sum(elems) / w == pytest.approx(closed, rel=1e-12)
    if r * n == 1:  # a column of one rank: the expert stacks never move
        assert all(row["expert_elems"] == 0 for row in rep["modes"])


def test_z3_keeps_the_last_block_of_each_part(ml):
    """The kept units are the last block's buckets of each part (coalesce="block"): layer 2's
    dense matrices and its local stacks."""
    rep = ep_report(ml, (1, 2), 2, coalesce_bytes=0)
    z3 = rep["modes"][1]
    last = [sp for sp in ml.muon_specs if block_of(sp.module) == "layers.2"]
    stacks = {sp.name for sp in last if len(sp.shape) == 3}
    assert z3["p_x_kept_elems"] == sum(sp.numel // 2 for sp in last if sp.name in stacks)
    assert z3["p_d_kept_elems"] == sum(sp.numel for sp in last if sp.name not in stacks)
    assert rep["modes"][0]["p_d_kept_elems"] == rep["modes"][0]["p_x_kept_elems"] == 0


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_ns_once_per_expert_and_the_two_level_plan(ml, mesh):
    r, n, e = mesh
    dense, local = split_specs(ml.muon_specs, e)
    plan = plan_ep(dense, local, mesh)
    w = r * n * e
    runs = [0] * w  # NS calls per world rank, from the owners
    for sp in local:  # column owner (r_o, s_o) runs its local stack in every column
        c = plan.expert.owner[sp.name]
        for k in range(e):
            runs[c * e + k] += sp.matrices
    for sp in dense:
        runs[plan.dense.owner[sp.name]] += sp.matrices
    stacks = [sp for sp in ml.muon_specs if len(sp.shape) == 3]
    # every expert once across the mesh, every dense matrix once
    assert sum(runs) == sum(sp.shape[0] for sp in stacks) + sum(sp.matrices for sp in dense)
    rep = ep_report(ml, (r, n), e, coalesce_bytes=0)
    assert rep["ns_calls"] == sum(runs)
    # list scheduling from initial loads: the last item went to a least-loaded rank, so
    # max <= max(busiest initial load, final mean + largest dense cost)
    load = plan.ns_load()
    initial = max(plan.expert.ns_load)
    assert max(load) <= max(initial, sum(load) / w + max(sp.ns_cost for sp in dense)) + 1e-6
    assert max(load) / (sum(load) / w) == pytest.approx(rep["ns_max_over_mean"])


def test_dense_goes_to_the_ranks_the_experts_left_light():
    """Two columns owners' loads differ (3 local stacks on 2 owners): the dense matrix lands
    on a rank of the lighter owner, not on world rank 0 as a plan without initial loads would."""
    from dmuon.ownership.plan import ParamSpec

    local = [ParamSpec(f"layers.{i}.mlp.experts.w", (2, 8, 8), "float32", f"layers.{i}.mlp.experts")
             for i in range(3)]
    dense = [ParamSpec("layers.0.attn.w", (8, 8), "float32", "layers.0.attn")]
    plan = plan_ep(dense, local, (1, 2, 2))
    heavy = max(range(2), key=lambda c: plan.expert.ns_load[c])
    assert plan.dense.owner["layers.0.attn.w"] // 2 != heavy
    assert max(plan.ns_load()) == max(plan.expert.ns_load)


@pytest.mark.parametrize("mesh", [(1, 2, 2), (1, 1, 4)], ids=lambda m: "x".join(map(str, m)))
def test_memory_per_rank(ml, mesh):
    """Z2: every rank holds all dense params and its E-shard of every stack; Z3: the owned
    share (dense it owns plus the local stacks its column owner index owns) plus a window;
    momentum: what it owns."""
    r, n, e = mesh
    dense, local = split_specs(ml.muon_specs, e)
    plan = plan_ep(dense, local, mesh)
    rep = ep_report(ml, (r, n), e, coalesce_bytes=0)
    z2, z3 = (row["memory"] for row in rep["modes"])
    resident = (sum(sp.numel for sp in dense) + sum(sp.numel for sp in local)) * BF16
    # held + resident window is the same on every rank: the extremes pair up
    assert z2["min"]["params_held_bytes"] + z2["max"]["window_bytes"] == resident
    assert z2["max"]["params_held_bytes"] + z2["min"]["window_bytes"] == resident
    assert z2["busiest"]["params_held_bytes"] + z2["busiest"]["window_bytes"] == resident
    owned = [0] * (r * n * e)
    for sp in dense:
        owned[plan.dense.owner[sp.name]] += sp.numel * BF16
    for sp in local:
        for k in range(e):
            owned[plan.expert.owner[sp.name] * e + k] += sp.numel * BF16
    assert z3["max"]["params_held_bytes"] == max(owned) and z3["min"]["params_held_bytes"] == min(owned)
    assert z3["max"]["momentum_bytes"] == max(owned)
    big = z3["busiest"]
    assert big["params_held_bytes"] == owned[big["rank"]]
    assert 0 < z3["max"]["window_bytes"] < resident  # Z3 holds less than everything


def test_cli_prints_the_ep_section_and_json(capsys):
    model = "tests.run.test_plan_cli_ep:tiny_moe"
    assert main(["--model", model, "--mesh", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4 (W = 4)" in out  # the table: the same W without EP
    assert "expert parallel: mesh 1x2x2 (R x N x E, W = 4)" in out
    assert "2(NE-1)/(NE)·P_D + 2(N-1)/N·P_X/E" in out and "activations" in out
    assert main(["--model", model, "--mesh", "2x1", "--ep", "2", "--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["reports"][0]["ep"]
    assert ep["mesh"] == {"replicate": 2, "shard": 1, "ep": 2} and "p_x_local" in ep["units"]
    assert {m["mode"] for m in ep["modes"]} == {"dmuon-hsdp-z2", "dmuon-hsdp-z3"}
    act = ep["activations"]  # 2 MoE layers, top-2, D = 16, bf16, E = 2
    assert act["moe_layers"] == 2 and act["calls_per_step"] == 10
    assert act["bytes_per_token"] == 2 * 4 * 2 * 16 * BF16 * (2 - 1) / 2


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "2", "--ep", "3"], ["X = 4", "divisible by E = 3"]),
    (["--mesh", "1", "--ep", "8"], ["X = 4", "divisible by E = 8"]),
    (["--mesh", "2", "--ep", "0"], ["--ep"]),
    (["--sweep", "--ep", "2"], ["Invalid --ep 2 with --sweep"]),
    (["--mesh", "1024x1024", "--ep", "2"], ["W = R·N·E", "at most"]),
])
def test_cli_bad_ep_exits_2_with_one_line(capsys, argv, words):
    assert main(["--model", "tests.run.test_plan_cli_ep:tiny_moe", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_cli_ep_on_a_model_without_expert_stacks_exits_2(capsys):
    assert main(["--model", "tests.run.test_plan_cli_ep:dense_tiny", "--mesh", "2", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "no expert stacks" in err and "deepseek-v3-like-stacked" in err


def test_stacked_experts_compute_what_separate_experts_compute():
    """The stacked preset layout is the same function: copy each SwiGLU expert's weights into
    the stacks' slices and compare outputs (fails if a slice is transposed or the SwiGLU
    order differs)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=24)
    moe = dict(n_experts=4, top_k=2, expert_ffn_dim=8, first_dense_layers=1)
    sep = Decoder(DecoderConfig(**cfg, moe=MoEConfig(**moe)))
    stk = Decoder(DecoderConfig(**cfg, moe=MoEConfig(**moe, stacked=True)))
    sd = {k: v for k, v in sep.state_dict().items() if ".experts." not in k}
    stk.load_state_dict(sd, strict=False)
    experts = stk.layers[1].mlp.experts
    with torch.no_grad():
        for j, ex in enumerate(sep.layers[1].mlp.experts):
            experts.gate_proj[j].copy_(ex.gate_proj.weight)
            experts.up_proj[j].copy_(ex.up_proj.weight)
            experts.down_proj[j].copy_(ex.down_proj.weight)
    idx = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(stk(idx), sep(idx))
    assert sum(p.numel() for p in stk.parameters()) == sum(p.numel() for p in sep.parameters())


def z2_bytes(ep: dict) -> float:
    return ep["modes"][0]["ded_avg_bytes"]


@pytest.mark.slow
def test_deepseek_v3_stacked_at_w1024(capsys):
    """docs/scaling.md's run: W = 1,024 = 16 x 64 with EP 64 (about 10-25 s here)."""
    assert main(["--model", "deepseek-v3-like-stacked", "--mesh", "16", "--ep", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rep, ep = doc["reports"][0], doc["reports"][0]["ep"]
    assert rep["world_size"] == ep["world_size"] == 1024
    assert ep["expert_stacks"] == 58 * 3 and ep["experts"] == [256]
    plain = {m["mode"]: m for m in rep["modes"]}["dmuon-z2"]
    assert ep["ns_calls"] == plain["ns_calls"] == 45_090  # once per matrix, EP or not
    assert z2_bytes(ep) < plain["ded_avg_bytes"] / 25  # the stacks no longer move whole
    z2 = ep["modes"][0]
    assert ep["ns_bound_ratio"] == pytest.approx(1.0) and ep["ns_idle_ranks"] == 0
    assert z2["expert_elems"] == pytest.approx(2 * 15 / 16 * ep["p_x_local"])
    assert z2["dense_elems"] == pytest.approx(2 * 1023 / 1024 * ep["p_d"])
    resident = (ep["p_d"] + ep["p_x_local"]) * BF16
    big = z2["memory"]["busiest"]
    assert big["params_held_bytes"] + big["window_bytes"] == resident
