"""dmuon-plan --ep E --tp T (verify/plan/ep.py, "TP × EP"): the mesh R x N x E x T; every
rank's dedicated elements and calls against a call-by-call sum of the documented protocol
(docs/protocol.md, "Tensor parallelism", "Expert parallelism", "Other meshes"), the W-average
against the closed forms, E = 1 against the TP section's model, NS counts; the CLI's text,
JSON and bounds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dmuon.ownership.buckets import block_of
from verify.plan.cli import ModelLayout, main
from verify.plan.ep import ep_report, part_traffic, plan_ep, rank_traffic, split_specs, tp_column
from verify.plan.tp import tp_dims, tp_report
from verify.traffic.predict import RunLayout
from verify.traffic.tpep import TPEPRunLayout, tpep_closed_form

from tests.run.test_plan_cli_ep import BF16, _buckets, tiny_moe

MOE = "tests.run.test_plan_cli_ep:tiny_moe"

#: (R, N, E, T): TP 2 on EP 2 x DP 2, one data-parallel rank per column, HSDP, 3 shards (owners
#: uneven), and T = 3, which divides some dense matrices' dims only (the rest replicated over TP).
MESHES = [(1, 2, 2, 2), (1, 1, 2, 2), (2, 1, 2, 2), (2, 2, 2, 2), (1, 3, 2, 2), (1, 2, 2, 3)]


@pytest.fixture(scope="module")
def ml():
    with torch.device("meta"):
        return ModelLayout(tiny_moe(), "tiny-moe")


def _tp_dim(sp, t):
    """The documented rule: a 2-D matrix is TP-sharded on its output dim if T divides it, else
    on its input dim if T divides that, else replicated over TP (None); the MoE router
    (``mlp.router`` in tiny_moe) is replicated."""
    if len(sp.shape) != 2 or sp.module.endswith(".mlp.router"):
        return None
    return 0 if sp.shape[0] % t == 0 else 1 if sp.shape[1] % t == 0 else None


def brute_force(ml, mesh, mode, with_tp_step=True):
    """Per world rank ((r·N + s)·E + e)·T + t: (dedicated elements f(n)·S, calls) of one
    step, call by call. In each TP column k: the dense buckets (local shards: n/T of a TP
    matrix) over the replica's N·E shard group of column k, owner column index g // T of the
    W-slot plan (HSDP: then the replicate pair); the expert buckets per (e, k) over the
    column's N shard group, owner the column index of the stack's (R, N·T) slot. Then per TP group, per (NS rank, dtype) of the TP matrices its
    column index owns: a gather and a scatter of the local counts c, (T-1)/T·c each on every
    member. Z3 re-broadcasts every bucket in backward but those of each part's last block."""
    r, n, e, t = mesh
    w, ne = r * n * e * t, n * e
    dense_specs, local = split_specs(ml.muon_specs, e)
    plan = plan_ep(dense_specs, local, (r, n, e), t)
    stacks = [sp for sp in ml.muon_specs if len(sp.shape) == 3]
    blocks = list(dict.fromkeys(block_of(sp.module) for sp in ml.params))
    elems, calls = [0.0] * w, [0] * w
    z3 = mode.endswith("z3")

    def take(members, size, numel, times):
        for m in members:
            elems[m] += times * (size - 1) / size * numel
            calls[m] += times

    col_owner = {name: g // t for name, g in plan.dense.owner.items()}
    buckets, kept = {}, None
    for sp in dense_specs:
        key = (block_of(sp.module), col_owner[sp.name])
        buckets[key] = buckets.get(key, 0) + sp.numel // (1 if _tp_dim(sp, t) is None else t)
        kept = max(kept or key[0], key[0], key=blocks.index)
    for (blk, cg), numel in buckets.items():
        for k in range(t):
            for ri in range(r):
                take([(ri * ne + j) * t + k for j in range(ne)], ne, numel, 2 + (z3 and blk != kept))
            if r > 1:
                take([(ri * ne + cg % ne) * t + k for ri in range(r)], r, numel, 2)
    # a stack's slot (r·N + s)·T + m: column owner r·N + s, stepped in every column (e, t)
    buckets, kept = _buckets(stacks, {k: j // t for k, j in plan.expert.owner.items()}, blocks, e)
    for (blk, c), numel in buckets.items():
        for k in range(t):
            for ek in range(e):
                for ri in range(r):
                    take([((ri * n + si) * e + ek) * t + k for si in range(n)], n, numel,
                         2 + (z3 and blk != kept))
                if r > 1:
                    take([((ri * n + c % n) * e + ek) * t + k for ri in range(r)], r, numel, 2)
    if with_tp_step:
        counts = {}
        for sp in dense_specs:
            if _tp_dim(sp, t) is not None:
                g = plan.dense.owner[sp.name]
                counts[(g // t, g % t, sp.dtype)] = counts.get((g // t, g % t, sp.dtype), 0) + sp.numel // t
        for (cg, _, _), c in counts.items():
            take([cg * t + k for k in range(t)], t, c, 2)
    return elems, calls


def _closed(mode, mesh, p_d_loc, p_x_loc, p_tp, kept_d, kept_x):
    """docs/traffic-model.md's TP × EP forms: the EP forms at P_D,loc plus 2(T-1)/(T·W)·P_TP."""
    r, n, e, t = mesh
    w, ne, rn = r * n * e * t, n * e, r * n
    step = 2 * (t - 1) / (t * w) * p_tp
    if mode == "dmuon-z2":
        return 2 * (ne - 1) / ne * p_d_loc + 2 * (n - 1) / n * p_x_loc + step
    if mode == "dmuon-z3":
        return (3 * (ne - 1) / ne * p_d_loc - (ne - 1) / ne * kept_d
                + 3 * (n - 1) / n * p_x_loc - (n - 1) / n * kept_x + step)
    if mode == "dmuon-hsdp-z2":
        return 2 * (r * ne - 1) / (r * ne) * p_d_loc + 2 * (rn - 1) / rn * p_x_loc + step
    return ((2 * (r * ne - 1) / (r * ne) + (ne - 1) / ne) * p_d_loc - (ne - 1) / ne * kept_d
            + (2 * (rn - 1) / rn + (n - 1) / n) * p_x_loc - (n - 1) / n * kept_x + step)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_tp_ep_figures_equal_the_brute_force_per_rank_sum(ml, mesh):
    r, n, e, t = mesh
    rep = ep_report(ml, (r, n), e, coalesce_bytes=0, tp=t)
    w = r * n * e * t
    assert rep["world_size"] == w and rep["mesh"] == {"replicate": r, "shard": n, "ep": e, "tp": t}
    dense = [sp for sp in ml.muon_specs if len(sp.shape) != 3]
    p_tp = sum(sp.numel for sp in dense if _tp_dim(sp, t) is not None)
    assert rep["p_tp"] == p_tp and rep["p_d_local"] == p_tp // t + rep["p_d"] - p_tp
    dense_specs, local = split_specs(ml.muon_specs, e)
    column, dense_col, step = tp_column(plan_ep(dense_specs, local, (r, n, e), t), dense_specs,
                                        tp_dims(ml.muon_specs, t))
    for row in rep["modes"]:
        elems, calls = brute_force(ml, mesh, row["mode"])
        st = part_traffic(ml, column, row["mode"], 0, dense_col, local)[2:]
        per_rank = rank_traffic(*st, column.mesh, t)  # rank by rank: one TP column, then the step
        assert [a + b for a, b in zip(per_rank["calls"], step.per_rank["calls"])] == calls
        assert [a + b for a, b in zip(per_rank["ded_avg_elems"], step.per_rank["ded_avg_elems"])] == \
            pytest.approx(elems, rel=1e-12)
        assert row["ded_avg_elems"] == pytest.approx(sum(elems) / w, rel=1e-12)
        assert row["ded_avg_bytes"] == pytest.approx(sum(elems) / w * BF16, rel=1e-12)
        assert row["ded_max_bytes"] == pytest.approx(max(elems) * BF16, rel=1e-12)
        assert row["calls_max"] == max(calls) and row["calls_avg"] == pytest.approx(sum(calls) / w)
        closed = _closed(row["mode"], mesh, rep["p_d_local"], rep["p_x_local"], p_tp,
                         row["p_d_kept_elems"], row["p_x_kept_elems"])
        assert row["closed_form_elems"] == pytest.approx(closed, rel=1e-12)
        assert sum(elems) / w == pytest.approx(closed, rel=1e-12)
        assert row["tp_gather_elems"] == row["tp_scatter_elems"] == pytest.approx((t - 1) / (t * w) * p_tp)
        assert row["memory"] is None
        # the control: without the TP step the sum is another figure
        without, _ = brute_force(ml, mesh, row["mode"], with_tp_step=False)
        assert sum(without) / w < row["ded_avg_elems"] - 1e-9


def test_with_e_1_tp_ep_is_the_tp_model(ml):
    """E = 1: every expert stack is a TP-replicated matrix over (R, N), the TP section's
    layout; Z2's W-average and the NS count agree with verify/plan/tp.py's closed form."""
    for r, n, t in [(1, 2, 2), (2, 2, 2), (1, 2, 3)]:
        ep = ep_report(ml, (r, n), 1, coalesce_bytes=0, tp=t)
        tp = tp_report(ml, (r, n), t, coalesce_bytes=0)
        assert ep["ns_calls"] == tp["modes"][0]["ns_calls"]
        assert ep["p_tp"] == tp["p_tp"]
        assert ep["modes"][0]["ded_avg_elems"] == pytest.approx(tp["modes"][0]["ded_avg_elems"], rel=1e-12)


@pytest.mark.parametrize("mesh", [(1, 2, 2, 2), (1, 2, 2, 3), (2, 3, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_ns_counts_and_the_plan(ml, mesh):
    """NS once per TP matrix; in every TP column for a replicated matrix and for each expert.
    The plan (docs/protocol.md, "Other meshes"): the stacks over the (R, N·T) slots; the dense
    params, greedy by (cost, bytes, name) onto the least (load, bytes, slot), over the W slots
    from the load the stacks leave on the world ranks of their slot's TP index (every e)."""
    r, n, e, t = mesh
    w = r * n * e * t
    rep = ep_report(ml, (r, n), e, coalesce_bytes=0, tp=t)
    dense, local = split_specs(ml.muon_specs, e)
    stacks = [sp for sp in ml.muon_specs if len(sp.shape) == 3]
    assert rep["ns_calls"] == (sum(sp.matrices * (1 if _tp_dim(sp, t) is not None else t) for sp in dense)
                               + t * sum(sp.shape[0] for sp in stacks))
    if t == 3:  # some dense matrices are replicated over TP at T = 3 (d_model 16)
        assert any(_tp_dim(sp, t) is None for sp in dense)
    plan = plan_ep(dense, local, (r, n, e), t)
    assert plan.expert.mesh_shape == (r, n * t) and plan.dense.mesh_shape == (r, n * e * t)
    load, held = [0.0] * w, [0] * w  # held: the dense bytes placed so far
    for sp in local:
        j = plan.expert.owner[sp.name]
        for k in range(e):
            load[(j // t * e + k) * t + j % t] += sp.ns_cost
    owner = {}
    for sp in sorted(dense, key=lambda sp: (-sp.ns_cost, -sp.nbytes, sp.name)):
        g = min(range(w), key=lambda g: (load[g], held[g], g))
        owner[sp.name] = g
        load[g] += sp.ns_cost
        held[g] += sp.nbytes
    assert plan.dense.owner == owner
    # the NS work: every stack in every (e, t) column of its owner, a replicated dense matrix on
    # each rank of its owner's TP group, a TP matrix on its NS rank
    work = [0.0] * w
    for sp in local:
        c = plan.expert.owner[sp.name] // t
        for k in range(e * t):
            work[c * e * t + k] += sp.ns_cost
    for sp in dense:
        g = plan.dense.owner[sp.name]
        for k in (range(t) if _tp_dim(sp, t) is None else [g % t]):
            work[g - g % t + k] += sp.ns_cost
    assert rep["ns_max_over_mean"] == pytest.approx(max(work) / (sum(work) / w))
    assert rep["ns_idle_ranks"] == sum(1 for x in work if x == 0)


@pytest.mark.parametrize("mesh", [(1, 2, 2), (2, 2, 2), (3, 2, 2), (2, 2, 4), (1, 4, 2)],
                         ids=lambda m: "x".join(map(str, m)))
def test_plan_and_closed_form_agree_with_the_traffic_harness(ml, mesh):
    """The harness's TP × EP layout (verify.traffic.tpep, R = 1) on the same model: the same
    expert and dense owners and NS ranks, the same closed form per mode."""
    n, e, t = mesh
    dense, local = split_specs(ml.muon_specs, e)
    plan = plan_ep(dense, local, (1, n, e), t)
    rep = ep_report(ml, (1, n), e, coalesce_bytes=0, tp=t)
    for row in rep["modes"]:
        fields = {f.name: getattr(ml.layout(row["mode"], 1, n), f.name) for f in dataclasses.fields(RunLayout)}
        lay = TPEPRunLayout(**{**fields, "dmuon_rest": "wrapper"}, tp_size=t, ep_size=e,
                            tp_dims=tuple(tp_dims(ml.muon_specs, t).items()),
                            expert_names=tuple(sp.name for sp in ml.muon_specs if len(sp.shape) == 3))
        expert_owner, dense_owner, ns_rank = lay.plans()
        assert {k: j // t for k, j in plan.expert.owner.items()} == expert_owner
        assert {k: g // t for k, g in plan.dense.owner.items()} == dense_owner
        assert {k: plan.dense.owner[k] % t for k in ns_rank} == ns_rank
        assert row["closed_form_elems"] == pytest.approx(tpep_closed_form(lay).total * lay.p_m(), rel=1e-12)


def test_cli_prints_the_tp_ep_section_and_json(capsys):
    assert main(["--model", MOE, "--mesh", "2", "--ep", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4 (W = 4)" in out  # the table: the same W without EP or TP
    assert "tensor parallel: mesh 1x4x2" in out  # TP without EP at the same W
    assert "expert parallel: mesh 1x2x2x2 (R x N x E x T, W = 8)" in out
    assert "+ 2(T-1)/(T·W)·P_TP" in out and "not sized with --tp" in out
    assert main(["--model", MOE, "--mesh", "2x1", "--ep", "2", "--tp", "2", "--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["reports"][0]["ep"]
    assert ep["mesh"] == {"replicate": 2, "shard": 1, "ep": 2, "tp": 2} and ep["world_size"] == 8
    assert "p_tp" in ep["units"] and ep["activations"] is None


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "1024x512", "--ep", "2", "--tp", "2"], ["Invalid --ep 2 on mesh 1024x512 --tp 2", "W = R·N·E·T = 2,097,152"]),
    (["--sweep", "--ep", "2", "--tp", "2"], ["Invalid --ep 2 with --sweep"]),
    (["--mesh", "2", "--ep", "3", "--tp", "2"], ["divisible by E = 3"]),
])
def test_cli_bad_tp_ep_exits_2_with_one_line(capsys, argv, words):
    assert main(["--model", MOE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(x in err for x in words), err
