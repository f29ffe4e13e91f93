"""DMuon under expert parallelism matches single-process Muon.

On EP 2 x DP 2, EP 4 and HSDP 2 x EP 2 (W=4), in Z2 and Z3, after each of ``T.STEPS`` steps
(the second uses the momentum): every param every rank holds (an expert stack as its local
experts, which must be the oracle's slice for its EP index) lands within the bound of that
step's noise floor (``noise_floor``: the oracle against its nudged runs; Frobenius distance
relative to the oracle's displacement; a router without its mean over the experts, which no
routing sees: ``hf_tasks.routing_part``); Newton–Schulz runs once per expert and per dense
matrix per step across the mesh; ``opt.clip_grad_norm_`` returns the oracle's global grad norm
every step, within the bound of the norm's own floor. Controls: experts stepped with their
neighbours' updates land beyond the bound; expert grads averaged over their column instead of
W give a norm beyond the norm's bound.

Measured on a 2-core AMD EPYC: DMuon within 2e-7 of the oracle after step 1 in every layout,
0.8-1.2 % of the displacement after step 2, against floors of 1.4 % and 2.7 % (a one-ulp nudge
of the init); the rolled-experts control lands at 139 %, the column divisor's norm 7e-4 off
against a bound of 4e-6.
"""

import pytest
import torch

pytest.importorskip("transformers")

from examples.ep_moe import EXPERT_STACKS  # noqa: E402
from tests.distributed import noise_floor as NF  # noqa: E402
from tests.distributed.ep import dmuon_ep_tasks as T  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


def _floored(oracle_fn) -> dict:
    """``oracle_fn(nudge)``'s plain run with its per-step noise floors of the params
    (``floors``) and of the grad norm when it has one (``norm_floors``)."""
    ref = oracle_fn(None)
    nudged = {nudge: oracle_fn(nudge) for nudge in NF.NUDGES}
    ref["floors"] = NF.floors(ref, nudged, part=_router_part, norm="fro")
    if "grad_norms" in ref:
        ref["norm_floors"] = NF.scalar_floors(
            ref["grad_norms"], {k: run["grad_norms"] for k, run in nudged.items()})
    return ref


@pytest.fixture(scope="module")
def oracle4():
    return _floored(lambda nudge: T.oracle(4, nudge=nudge))


@pytest.fixture(scope="module")
def crafted4():
    return _floored(lambda nudge: T.crafted_oracle(4, nudge=nudge))


def _router_part(name: str, t):
    """What routing sees of a router (``hf_tasks.routing_part``): its mean over the experts
    removed; other params as they are."""
    return t - t.mean(dim=0, keepdim=True) if name.endswith(".mlp.router") else t


def _distances(results: list[dict], ref: dict, step: int) -> dict[str, float]:
    """Per (rank, param): the Frobenius distance after step ``step`` (0-based) of what the
    rank holds from the oracle's (its EP index's slice of an expert stack)."""
    out = {}
    for rank, res in enumerate(results):
        e, ep = res["ep_rank"], res["ep"]
        for name, got in res["steps"][step].items():
            want, init = ref["steps"][step][name], ref["init"][name]
            if name.rpartition(".")[2] in EXPERT_STACKS:
                k = want.shape[0] // ep
                want, init = want[e * k:(e + 1) * k], init[e * k:(e + 1) * k]
            assert got.shape == want.shape, (name, got.shape, want.shape)
            out[f"rank {rank}: {name}"] = NF.distance(*(_router_part(name, t) for t in (got, want, init)),
                                                      norm="fro")
    return out


def _assert_on_oracle(results: list[dict], ref: dict, what: str) -> None:
    for step, floor in enumerate(ref["floors"]):
        NF.assert_within(_distances(results, ref, step), floor, f"{what}, step {step + 1}")


#: Z2 on EP 4 and HSDP x EP is slow (``make test-all``): Z3 runs the same protocol on those
#: meshes and frees and re-broadcasts on top; Z2's path runs on EP 2 x DP 2 and the crafted layer.
_SLOW_Z2 = pytest.mark.slow


@pytest.mark.parametrize("mesh, z3", [
    ("shard2xep2", False), ("shard2xep2", True), ("ep4", True), ("hsdp2x1xep2", True),
    pytest.param("ep4", False, marks=_SLOW_Z2), pytest.param("hsdp2x1xep2", False, marks=_SLOW_Z2),
], ids=["shard2xep2-z2", "shard2xep2-z3", "ep4-z3", "hsdp2x1xep2-z3", "ep4-z2", "hsdp2x1xep2-z2"])
def test_dmuon_ep_matches_single_process_muon(pool4, oracle4, mesh, z3):
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, mesh, z3)
    _assert_on_oracle(results, oracle4, mesh)
    for res in results:  # the global grad norm of every step, the same on every rank
        for got, want, floor in zip(res["grad_norms"], oracle4["grad_norms"], oracle4["norm_floors"]):
            assert abs(got - want) <= floor.bound * want, (got, want, str(floor))
    experts = [n for n in results[0]["dedicated"] if n.rpartition(".")[2] in EXPERT_STACKS]
    assert len(experts) == 4, results[0]["dedicated"]  # 2 stacks x 2 layers, all dedicated
    assert sum(r["ns_calls"] for r in results) == T.STEPS * _ns_per_step(oracle4["muon"], results[0])


@pytest.fixture(scope="module")
def oracle2():
    """The oracle of the TP x EP test: 2 data-parallel batches, one step (below), with its
    noise floors."""
    return _floored(lambda nudge: T.oracle(2, 1, nudge=nudge, frozen_qk_norms=True))


#: The attention projections the TP x EP mesh shards on "tp" (``T.parallelize_attention``).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("plant", [None, "roll-experts"], ids=["dmuon", "control-rolled-experts"])
def test_tp_x_ep_on_torchtitan_dims_matches_single_process_muon(pool4, oracle2, plant):
    """The usual MoE layout on ``("dp_shard", "ep", "tp")`` (1 x 2 x 2, the data-parallel dims
    declared ``shard_dims=("dp_shard", "ep")``): attention tensor parallel on "tp", experts on
    "ep", in one model; the rest under FSDP2 (q / k norms frozen on both sides:
    ``T.freeze_qk_norms``). After one step every param (attention matrices gathered whole,
    expert stacks per EP index) lands within the oracle's noise-floor bound
    (``noise_floor.py``) of the single-process oracle of the 2 data-parallel batches, and the
    step's global grad norm within its own (the grads' scale, which Muon's update is blind
    to); the control (each expert handed its neighbour's update) lands beyond it on every
    expert stack. One step: by step 3 the tensor-parallel matmuls' other summation order has
    grown, through Newton–Schulz in bfloat16 and the top-k routing, to 1-11 % of the
    displacement on this machine, as the nudged oracle does. Each attention matrix runs Newton–Schulz once
    per step (on one "tp" rank), each other dense matrix and each expert once per "tp" column
    (both are replicated over "tp")."""
    steps = 1
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, "dp_shard1xep2xtp2", True, steps, plant)
    if plant is not None:
        experts = {k: d for k, d in _distances(results, oracle2, 0).items()
                   if k.rpartition(".")[2] in EXPERT_STACKS}
        NF.assert_beyond(experts, oracle2["floors"][0], "rolled experts, dp_shard x ep x tp")
        return
    _assert_on_oracle(results, oracle2, "dp_shard x ep x tp")
    for res in results:
        for got, want, floor in zip(res["grad_norms"], oracle2["grad_norms"], oracle2["norm_floors"]):
            assert abs(got - want) <= floor.bound * want, (got, want, str(floor))
    muon = list(oracle2["muon"])
    attention = [n for n in muon if n.rpartition(".")[0].rpartition(".")[2] in ATTENTION]
    assert len(attention) == 4 * 2, muon  # q, k, v, o of 2 layers: all dedicated
    experts = {n: v for n, v in results[0]["held"].items() if n.rpartition(".")[2] in EXPERT_STACKS}
    other = [n for n in muon if n not in experts and n not in attention]
    tp = 2  # every expert of a stack: its local experts on each of the 2 EP ranks, in each tp column
    per_step = len(attention) + tp * len(other) + tp * sum(v.shape[0] * 2 for v in experts.values())
    assert sum(r["ns_calls"] for r in results) == steps * per_step


def _ns_per_step(muon_names: list[str], res: dict) -> int:
    """Newton–Schulz calls per step across the mesh if each expert and dense matrix is
    orthogonalized once: the dense matrices plus every expert of every stack."""
    experts = {n: v for n, v in res["held"].items() if n.rpartition(".")[2] in EXPERT_STACKS}
    dense = [n for n in muon_names if n not in experts]
    return len(dense) + sum(v.shape[0] * res["ep"] for v in experts.values())


def test_control_rolled_experts_land_far(pool4, oracle4):
    """The comparison can fail: each expert stepped with its neighbour's update lands beyond
    the first step's bound, on every expert stack of every rank."""
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, "shard2xep2", False, 1, "roll-experts")
    experts = {k: d for k, d in _distances(results, oracle4, 0).items()
               if k.rpartition(".")[2] in EXPERT_STACKS}
    NF.assert_beyond(experts, oracle4["floors"][0], "rolled experts")


def test_control_column_divisor_changes_the_norm(pool4, oracle4):
    """The norm check can fail: expert grads averaged over their column (2 ranks) instead of
    W = 4 give a global norm beyond the norm's bound (measured 7e-4 relative: the experts'
    share of the norm is small; the update itself is blind to the scale, as Newton–Schulz
    normalizes)."""
    results = pool4.run_with_timeout(TIMEOUT_S, T.train, "shard2xep2", False, 1, "column-divisor")
    got, want, floor = results[0]["grad_norms"][0], oracle4["grad_norms"][0], oracle4["norm_floors"][0]
    assert abs(got - want) > floor.bound * want, (got, want, str(floor))


def _full(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Each param's full value from what the ranks report under ``key`` (expert stacks joined
    from their EP indices); asserts that every rank reporting a part reports the same."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for res in results:
        for name, t in res[key].items():
            e = res["ep_rank"] if name.rpartition(".")[2] in EXPERT_STACKS else 0
            seen = parts.setdefault(name, {})
            if e in seen:
                assert torch.equal(seen[e], t), (name, e)
            seen[e] = t
    return {n: torch.cat([p[e] for e in sorted(p)]) if len(p) > 1 else p[0] for n, p in parts.items()}


@pytest.mark.parametrize("saved, loaded", [("shard2xep2", "ep4"), ("ep4", "hsdp2x1xep2")])
def test_dcp_resumes_at_another_ep_degree_and_dp_size(pool4, oracle4, tmp_path, saved, loaded):
    """DCP saved at one EP layout after step 1 loads at another (EP 2 -> 4 with DP 2 -> 1, EP 4
    -> 2 with a replicate axis): every param and every owner's momentum (expert stacks resharded
    to the new EP indices and owners) equals what was saved, bit for bit; the next step, which
    uses the loaded momentum, lands on the single-process oracle's second step."""
    path = str(tmp_path / "ckpt")
    before = pool4.run_with_timeout(TIMEOUT_S, T.checkpoint_run, saved, path, range(1), False)
    after = pool4.run_with_timeout(TIMEOUT_S, T.checkpoint_run, loaded, path, range(1, 2), True)
    saved_params, loaded_params = _full(before, "saved"), _full(after, "loaded")
    assert saved_params.keys() == loaded_params.keys()
    for name, t in saved_params.items():
        assert torch.equal(loaded_params[name], t), name
    saved_m, loaded_m = _full(before, "momentum"), _full(after, "momentum")
    assert saved_m.keys() == loaded_m.keys() and saved_m, sorted(saved_m)
    for name, t in saved_m.items():
        assert torch.equal(loaded_m[name], t), name
    resumed = [{**r, "steps": [None, r["final"]]} for r in after]
    NF.assert_within(_distances(resumed, oracle4, 1), oracle4["floors"][1], f"{saved} -> {loaded}")


@pytest.mark.parametrize("case, text", [
    ("flat", "Invalid hierarchy='flat' on a mesh with the model-parallel axis 'ep'"),
    ("stack_2d", "DMuon's expert stacks must be 3-D"),
    ("other_mesh", "Under EP every DTensor param must be an expert stack sharded Shard(0) on mesh['ep']"),
])
def test_unsupported_ep_setups_raise_on_every_rank(pool4, case, text):
    for rank, message in enumerate(pool4.run_with_timeout(TIMEOUT_S, T.expect_error, case)):
        assert message.startswith("ValueError") and text in message, (rank, message)


@pytest.mark.parametrize("ep_mesh", [True, False], ids=["ep", "hsdp"])
def test_ddp_over_a_subgroup_is_refused_at_step_on_every_rank(pool4, ep_mesh):
    for rank, message in enumerate(pool4.run_with_timeout(TIMEOUT_S, T.ddp_on_a_subgroup, ep_mesh)):
        assert message.startswith("RuntimeError: Invalid DistributedDataParallel process group "
                                  "of 2 ranks"), (rank, message)


@pytest.mark.parametrize("z3", [False, True], ids=["z2", "z3"])
def test_an_expert_no_token_reaches_and_a_rank_routing_nothing_to_peers(pool4, crafted4, z3):
    """The crafted layer (``ep_tasks.crafted_layer``): world rank 0 routes every token to its own
    experts and no token of any rank reaches the last expert. No hang; the idle expert's grads
    are exactly zero on its owner; every param, the idle expert's slices included, lands on
    per-expert single-process Muon (which, like DMuon, steps a zero-grad expert with its
    momentum and weight decay only)."""
    ref = crafted4
    results = pool4.run_with_timeout(TIMEOUT_S, T.train_crafted, z3)
    _assert_on_oracle(results, ref, "crafted layer")
    owners = [r["idle_grads"] for r in results if r["idle_grads"]]
    assert owners and all(g == 0.0 for grads in owners for g in grads), owners
    for res in results:
        if res["ep_rank"] == 1:
            for name in ("gate_up_proj", "down_proj"):
                got, want = res["held"][name][-1], ref["final"][name][-1]
                assert torch.allclose(got, want, rtol=0, atol=1e-6), name
