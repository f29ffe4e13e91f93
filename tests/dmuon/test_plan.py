"""dmuon.ownership.plan: the ownership planner (pure; no processes except one hash-seed check)."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dmuon.optim.muon_math import ns_cost, ns_flops
from dmuon.ownership.plan import (
    _lpt,
    OwnershipPlan,
    ParamSpec,
    makespan_lower_bound,
    plan_ownership,
    specs_from_named_parameters,
)
from tests.builders import llama_specs

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Balance bars for the transformer-like sets below (measured values are printed with -s).
#: LPT's worst case is 4/3; these sets measure <= 1.07 (NS) and <= 1.23 (bytes, the secondary
#: key: GQA's k/v matrices carry 4x the bytes per unit of NS cost of the square ones).
NS_MAX_OVER_MEAN_BAR = 1.10
BYTES_MAX_OVER_MEAN_BAR = 1.25


def gpt_specs(n_layers: int = 12, d: int = 768, dtype: str = "float32") -> list[ParamSpec]:
    """The Muon targets of a GPT-2-small-like stack (torch Linear weights are (out, in))."""
    shapes = {"attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.fc1": (4 * d, d), "mlp.fc2": (d, 4 * d)}
    return [
        ParamSpec(f"blocks.{i}.{m}.weight", shape, dtype, f"blocks.{i}.{m}")
        for i in range(n_layers)
        for m, shape in shapes.items()
    ]


def test_deterministic_and_independent_of_input_order():
    specs = gpt_specs(n_layers=6)
    plan = plan_ownership(specs, (1, 4))
    for seed in range(5):
        shuffled = specs[:]
        random.Random(seed).shuffle(shuffled)
        other = plan_ownership(shuffled, (1, 4))
        assert other == plan
        assert other.digest() == plan.digest()
        assert dict(other.owner) == dict(plan.owner)
    assert [sp.name for sp in plan.specs] == sorted(sp.name for sp in specs)


TRANSFORMER_SETS = {
    "gpt_12x768": lambda: gpt_specs(n_layers=12, d=768),
    "llama_8x1024_gqa": lambda: llama_specs(n_layers=8),
    "llama_5x1024_gqa": lambda: llama_specs(n_layers=5),
}


@pytest.mark.parametrize("set_name", sorted(TRANSFORMER_SETS))
@pytest.mark.parametrize("mesh_shape", [(1, 2), (1, 3), (1, 4), (1, 8), (2, 2), (2, 3), (2, 4)])
def test_balance_on_transformer_like_sets(set_name, mesh_shape):
    plan = plan_ownership(TRANSFORMER_SETS[set_name](), mesh_shape)
    print(
        f"\n{set_name} mesh={mesh_shape}: ns max/mean={plan.ns_max_over_mean:.4f} "
        f"bytes/shard max/mean={plan.bytes_max_over_mean:.4f}"
    )
    assert all(load > 0 for load in plan.ns_load)
    assert plan.ns_max_over_mean <= NS_MAX_OVER_MEAN_BAR
    assert plan.bytes_max_over_mean <= BYTES_MAX_OVER_MEAN_BAR
    assert sum(plan.ns_load) == sum(sp.ns_cost for sp in plan.specs)
    assert sum(plan.bytes_load_per_shard) == sum(sp.nbytes for sp in plan.specs)


def _optimal_makespan(costs: list[int], world: int) -> int:
    best = sum(costs)
    for assignment in itertools.product(range(world), repeat=len(costs)):
        load = [0] * world
        for c, o in zip(costs, assignment):
            load[o] += c
        best = min(best, max(load))
    return best


def test_lpt_guarantee_against_brute_force_optimum():
    # Graham 1969: LPT makespan <= (4/3 - 1/(3W)) * optimal makespan. Brute force small cases.
    rng = random.Random(0)
    worst = 0.0
    for case in range(40):
        world = rng.choice([2, 3])
        specs = [
            ParamSpec(f"p{i}", (1, rng.randint(1, 30)), "float32", "m")
            for i in range(rng.randint(world, 9))
        ]
        plan = plan_ownership(specs, (1, world))  # FLOPs of (1, c): 38c + 26, all distinct
        opt = _optimal_makespan([sp.ns_cost for sp in specs], world)
        ratio = max(plan.ns_load) / opt
        worst = max(worst, ratio)
        assert ratio <= 4 / 3 - 1 / (3 * world) + 1e-12, (case, specs, plan.owner)
    print(f"\nworst LPT / optimal makespan over 40 random cases: {worst:.4f}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_lpt_bound_is_reached_on_grahams_tight_instance_and_multifit_repairs_it(world):
    # Costs 2W-1, 2W-1, 2W-2, 2W-2, ..., W+1, W+1, W, W, W: LPT gives 4W-1, the optimum 3W.
    costs = [c for c in range(2 * world - 1, world, -1) for _ in range(2)] + [world] * 3
    specs = [ParamSpec(f"p{i:02d}", (1, c), "float32", "m") for i, c in enumerate(costs)]
    table = {(1, c): c for c in costs}
    ordered = sorted(specs, key=lambda sp: (-sp.shape[1], sp.name))
    _, lpt_max = _lpt(ordered, {sp.name: sp.shape[1] for sp in specs}, {sp.name: sp.nbytes for sp in specs}, world)
    assert lpt_max == 4 * world - 1
    plan = plan_ownership(specs, (1, world), cost_table=table)  # 4W-1 > 1.05 x bound: MULTIFIT
    assert max(plan.ns_load) == _optimal_makespan(costs, world) == 3 * world


def test_hsdp_2x2_uses_all_four_owners_and_coordinates():
    specs = gpt_specs(n_layers=2, d=64)
    # the per-iteration products only (a "measured" table), to keep the numbers readable
    plan = plan_ownership(specs, (2, 2), cost_table={sp.shape: ns_cost(*sp.shape) for sp in specs})
    assert plan.world_size == 4
    assert sorted({plan.owner[sp.name] for sp in specs}) == [0, 1, 2, 3]
    for sp in specs:
        g = plan.owner[sp.name]
        assert (plan.replicate_owner(sp.name), plan.shard_owner(sp.name)) == (g // 2, g % 2)
    assert sorted(n for g in range(4) for n in plan.params_of(g)) == sorted(sp.name for sp in specs)
    # m*m*(2n + m) in units of 64**3: qkv 7, proj 3, fc1 9, fc2 9 per layer; 56 over 4 owners.
    # No 4-way split reaches 14 (each owner needs one of the four 9s, and two of them a 7),
    # so 16 is optimal: LPT finds it ({9, 7}, {9, 7}, {9, 3}, {9, 3}).
    assert max(plan.ns_load) == 16 * 64**3
    assert plan.ns_max_over_mean == pytest.approx(16 / 14)
    # Shard index 0 holds owners 0 and 2, shard 1 owners 1 and 3: 12 units of bytes each.
    assert plan.bytes_max_over_mean == 1.0
    assert len(plan.bytes_load_per_shard) == 2


def test_one_d_mesh_owner_is_shard_index():
    plan = plan_ownership(gpt_specs(n_layers=2, d=32), (1, 3))
    for sp in plan.specs:
        assert plan.shard_owner(sp.name) == plan.owner[sp.name]
        assert plan.replicate_owner(sp.name) == 0


def test_fewer_matrices_than_owners_leaves_owners_idle():
    specs = [ParamSpec("a.weight", (8, 8), "float32", "a"), ParamSpec("b.weight", (4, 8), "float32", "b")]
    plan = plan_ownership(specs, (2, 4))
    assert plan.owner == {"a.weight": 0, "b.weight": 1}  # biggest first, lowest free index
    assert [len(plan.params_of(g)) for g in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert plan.ns_load[2:] == (0,) * 6
    assert plan.idle_owners == 6
    cost_a, cost_b = specs[0].ns_cost, specs[1].ns_cost
    assert plan.ns_max_over_mean == pytest.approx(8 * cost_a / (cost_a + cost_b))


def test_empty_plan():
    plan = plan_ownership([], (2, 2))
    assert plan.specs == () and dict(plan.owner) == {}
    assert plan.ns_load == (0, 0, 0, 0) and plan.bytes_load_per_shard == (0, 0)
    assert plan.ns_max_over_mean == 1.0 and plan.bytes_max_over_mean == 1.0
    assert len(plan.digest()) == 64


def test_digest_stable_across_processes_and_hash_seeds():
    specs = llama_specs(n_layers=3)
    local = plan_ownership(specs, (2, 2)).digest()
    script = textwrap.dedent(
        """
        import random, sys
        sys.path.insert(0, sys.argv[1])
        from tests.builders import llama_specs
        from dmuon.ownership.plan import plan_ownership
        specs = llama_specs(n_layers=3)
        random.Random(int(sys.argv[2])).shuffle(specs)
        print(plan_ownership(specs, (2, 2)).digest())
        """
    )
    # One child (a torch import costs seconds) with a fixed hash seed and another input order;
    # this process runs under a different (random or caller-chosen) seed.
    child_seed = "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"
    out = subprocess.run(
        [sys.executable, "-c", script, str(REPO_ROOT), child_seed],
        env={**os.environ, "PYTHONHASHSEED": child_seed},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == local


def test_digest_changes_with_plan_inputs():
    specs = gpt_specs(n_layers=2, d=32)
    base = plan_ownership(specs, (1, 2)).digest()
    assert plan_ownership(specs, (2, 1)).digest() != base
    assert plan_ownership(specs[:-1], (1, 2)).digest() != base
    bf16 = [ParamSpec(sp.name, sp.shape, "bfloat16", sp.module) for sp in specs]
    assert plan_ownership(bf16, (1, 2)).digest() != base


def test_specs_from_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
    specs = specs_from_named_parameters(model.named_parameters())
    assert specs == [
        ParamSpec("0.weight", (8, 4), "float32", "0"),
        ParamSpec("1.weight", (2, 8), "float32", "1"),
    ]
    assert specs[0].nbytes == 8 * 4 * 4


@pytest.mark.parametrize(
    "specs, mesh_shape, match",
    [
        ([ParamSpec("w", (4,), "float32", "m")], (1, 2), r"Invalid shape=\(4,\) for param 'w'"),
        ([ParamSpec("w", (2, 3, 4), "float32", "m", (3, 8))], (1, 2), r"Must be None, \(3, 4\)"),
        ([ParamSpec("w", (0, 4), "float32", "m")], (1, 2), "positive ints"),
        (
            [ParamSpec("w", (2, 2), "float32", "m"), ParamSpec("w", (3, 3), "float32", "m")],
            (1, 2),
            "duplicate name='w'",
        ),
        ([ParamSpec("w", (2, 2), "float31", "m")], (1, 2), "dtype='float31'"),
        ([], (0, 2), r"mesh_shape=\(0, 2\)"),
        ([], (2, -1), r"mesh_shape=\(2, -1\)"),
        ([], (4,), r"mesh_shape=\(4,\)"),
        ([], (1.0, 2), "two positive ints"),
    ],
)
def test_errors(specs, mesh_shape, match):
    with pytest.raises(ValueError, match=match):
        plan_ownership(specs, mesh_shape)


def test_helper_errors_and_direct_construction_checks():
    plan = plan_ownership(gpt_specs(n_layers=1, d=8), (1, 2))
    with pytest.raises(ValueError, match="Invalid name='nope'"):
        plan.shard_owner("nope")
    with pytest.raises(ValueError, match=r"Invalid g=2. Must be an int in \[0, 2\)"):
        plan.params_of(2)
    with pytest.raises(ValueError, match=r"Invalid owner\['blocks.0.attn.qkv.weight'\]=5"):
        OwnershipPlan((1, 2), plan.specs, {**plan.owner, "blocks.0.attn.qkv.weight": 5})
    with pytest.raises(ValueError, match="missing="):
        OwnershipPlan((1, 2), plan.specs, {})


def _scan_lpt(specs: list[ParamSpec], world: int) -> dict[str, int]:
    """Reference LPT: a linear scan for the owner with the least (load, bytes, g), O(M * W)."""
    ordered = sorted(specs, key=lambda sp: (-sp.ns_cost, -sp.nbytes, sp.name))
    load, nbytes, owner = [0] * world, [0] * world, {}
    for sp in ordered:
        g = min(range(world), key=lambda o: (load[o], nbytes[o], o))
        owner[sp.name] = g
        load[g] += sp.ns_cost
        nbytes[g] += sp.nbytes
    return owner


@pytest.mark.parametrize("mesh_shape", [(1, 1), (1, 3), (2, 4), (4, 5), (1, 64)])
def test_heap_lpt_equals_linear_scan_lpt(mesh_shape):
    rng = random.Random(sum(mesh_shape))
    shapes = [(rng.randint(1, 9) * 16, rng.randint(1, 9) * 16) for _ in range(6)]
    specs = [
        ParamSpec(f"m{i:03d}.weight", rng.choice(shapes), rng.choice(["float32", "bfloat16"]), f"m{i:03d}")
        for i in range(150)
    ]
    plan = plan_ownership(specs, mesh_shape)
    assert dict(plan.owner) == _scan_lpt(specs, mesh_shape[0] * mesh_shape[1])


def test_ns_steps_and_cost_table_enter_the_plan():
    specs = llama_specs(n_layers=2)
    flops = plan_ownership(specs, (1, 3))
    assert flops.ns_cost["layers.0.mlp.up.weight"] == ns_flops(2816, 1024, 5)
    assert plan_ownership(specs, (1, 3), ns_steps=2).ns_cost["layers.0.mlp.up.weight"] == ns_flops(2816, 1024, 2)
    # a measured table that makes the square matrices the expensive ones changes the owners
    table = {sp.shape: (10.0 if sp.shape[0] == sp.shape[1] else 1.0) for sp in specs}
    measured = plan_ownership(specs, (1, 3), cost_table=table)
    assert set(measured.ns_cost.values()) == {10.0, 1.0}
    assert measured.digest() != flops.digest()
    assert sum(measured.ns_load) == pytest.approx(sum(table[sp.shape] for sp in specs))


@pytest.mark.parametrize(
    "table, match",
    [
        ({}, r"Invalid cost_table\[\(256, 1024\)\]=None for param 'layers.0.attn.k.weight'"),
        ({(256, 1024): -1.0}, "positive finite"),
        ({(256, 1024): float("nan")}, "positive finite"),
    ],
)
def test_cost_table_errors(table, match):
    specs = [sp for sp in llama_specs(n_layers=1) if sp.shape == (256, 1024)]
    with pytest.raises(ValueError, match=match):
        plan_ownership(specs, (1, 2), cost_table=table)


def test_makespan_lower_bound_never_exceeds_the_brute_force_optimum():
    rng = random.Random(1)
    stronger = 0
    for _ in range(150):
        world = rng.choice([2, 3, 4])
        costs = [rng.choice([3, 5, 7, 11, 13, 20]) for _ in range(rng.randint(1, 8))]
        bound = makespan_lower_bound(costs, world)
        assert max(max(costs), sum(costs) / world) <= bound <= _optimal_makespan(costs, world)
        stronger += bound > max(max(costs), sum(costs) / world) + 1e-9
    assert stronger > 10  # the L2 test does more than the trivial bound on these sets
    with pytest.raises(ValueError, match="world=0"):
        makespan_lower_bound([1], 0)
    assert makespan_lower_bound([], 4) == 0.0


def test_makespan_lower_bound_when_large_matrices_must_sit_alone():
    # Llama-3-70B at W=256 in units of 8192**2 * 1024 per iteration: 240 MLP matrices of 64,
    # 80 of 28 (qkv), 80 of 24 (o). Trivial bound 76.25; every MLP owner is full above 52,
    # so 160 matrices of 24..28 need the other 16 owners or share with MLP owners (>= 88).
    costs = [64] * 240 + [28] * 80 + [24] * 80
    assert makespan_lower_bound(costs, 256) > 1.15 * 76.25
    plan_load = max(plan_ownership(
        [ParamSpec(f"p{i:03d}", (1, c), "float32", "m") for i, c in enumerate(costs)],
        (1, 256),
        cost_table={(1, c): c for c in set(costs)},
    ).ns_load)
    assert plan_load <= 1.05 * makespan_lower_bound(costs, 256)


def test_multifit_step_fixes_lpt_where_grouping_equal_sizes_wins():
    # GPT-2 small's matrices at W=16 in units of 768**3 per iteration: 24 x 9 (fc1, fc2),
    # 12 x 7 (qkv), 12 x 3 (proj); total 336 = 16 x 21. LPT reaches 23; {9, 9, 3} x 12 and
    # {7, 7, 7} x 4 reach 21, which MULTIFIT's first-fit decreasing finds.
    specs = gpt_specs(n_layers=12, d=768)
    table = {sp.shape: ns_cost(*sp.shape) // 768**3 for sp in specs}
    assert sorted(set(table.values())) == [3, 7, 9]
    plan = plan_ownership(specs, (1, 16), cost_table=table)
    assert max(plan.ns_load) == 21 == makespan_lower_bound(list(plan.ns_cost.values()), 16)
    assert sorted(plan.ns_load) == [21] * 16


def test_a_stack_costs_e_slices_and_a_conv_its_flattened_matrix():
    from dmuon.optim.muon_math import ns_flops

    stack = ParamSpec("experts.w", (8, 24, 40), "float32", "experts")
    conv = ParamSpec("conv.weight", (16, 3, 5, 5), "float32", "conv", (16, 75))
    assert (stack.matrix_shape, stack.matrices) == ((24, 40), 8)
    assert (conv.matrix_shape, conv.matrices) == ((16, 75), 1)
    plan = plan_ownership([stack, conv], (1, 2))
    assert plan.ns_cost["experts.w"] == 8 * ns_flops(24, 40, 5)
    assert plan.ns_cost["conv.weight"] == ns_flops(16, 75, 5)
    # a measured table is keyed by the matrix shape and scaled by the matrices
    table = plan_ownership([stack, conv], (1, 2), cost_table={(24, 40): 2.0, (16, 75): 3.0})
    assert dict(table.ns_cost) == {"conv.weight": 3.0, "experts.w": 16.0}


def test_the_matrix_view_is_in_the_digest():
    as_stack = ParamSpec("w", (4, 6, 6), "float32", "m")
    as_conv = ParamSpec("w", (4, 6, 6), "float32", "m", (4, 36))
    assert plan_ownership([as_stack], (1, 2)).digest() != plan_ownership([as_conv], (1, 2)).digest()
    # the stack layout given explicitly is the default (None), as specs_from_named_parameters stores it
    import torch

    specs = specs_from_named_parameters([("w", torch.zeros(4, 6, 6)), ("c", torch.zeros(4, 6, 6))],
                                        {"w": (6, 6), "c": (4, 36)})
    assert [sp.matrix for sp in specs] == [None, (4, 36)]
