"""The reference EP MoE layer (``examples.ep_moe``) is exact: gloo ranks against one process.

At W=2 (EP 2) and W=4 (mesh ``("shard", "ep")`` 2x2, and EP 4), after one forward/backward:

- each rank's loss and output equal the single-process model's on that rank's batch;
- each rank's local expert grads, summed over its column (the ranks with its EP index), equal
  the matching slices of the single-process grad of the sum of all ranks' losses (the
  all_to_all's backward brings every EP peer's tokens routed to the rank's experts; the column
  adds the other EP groups' batches);
- every other (dense) grad, summed over all W ranks, equals the oracle's;
- every rank holds only its X/E experts (local stacks ``(X/E, ·, ·)``).

Two models: the crafted layer of ``ep_tasks`` (world rank 0 routes no token to any peer, the
last expert gets none at all: no hang, an all-zero grad slice), and a tiny Qwen3-MoE whose
sparse blocks are EPMoE carrying the Hugging Face blocks' weights, its oracle the Hugging Face
model itself (independent code: HF's per-expert loop, not EPMoE). Tolerance RTOL = 1e-5 of the
oracle's largest entry (fp32; the sums differ from the oracle's only in addition order).

The control plants an EP-only bug (received rows handed to the experts in arrival order, not
grouped by expert) and shows the output comparison fails by far more than RTOL.
"""

import pytest
import torch

# Imported here (at collection, before the pools fork) so the ranks inherit them: importing
# Qwen3-MoE's modeling module in each forked rank costs seconds.
pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

from examples.ep_moe import (  # noqa: E402
    EXPERT_STACKS, EPMoE, replace_qwen3_moe_blocks, tiny_qwen3_moe_ep)
from tests.distributed.ep import ep_tasks as E  # noqa: E402

pytestmark = pytest.mark.distributed

RTOL = 1e-5
TIMEOUT_S = 60
CASES = [("ep2", 2), ("shard2xep2", 4), ("ep4", 4)]


def _rel_err(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _check(ref: dict, results: list[dict], ep: int) -> None:
    world = len(results)
    for r, res in enumerate(results):
        assert res["ep_rank"] == r % ep  # the EP axis is last: world rank = s·E + e
        assert _rel_err(res["loss"], ref["losses"][r]) <= RTOL, (r, res["loss"], ref["losses"][r])
        assert _rel_err(res["out"], ref["outs"][r]) <= RTOL, r
    for name in results[0]["grads"]:
        want = ref["grads"][E.hf_name(name)]
        if name.rpartition(".")[2] in EXPERT_STACKS:
            local = want.shape[0] // ep
            for e in range(ep):
                got = sum(results[r]["grads"][name] for r in range(e, world, ep))
                assert got.shape == (local, *want.shape[1:]), (name, got.shape)
                err = _rel_err(got, want[e * local:(e + 1) * local])
                assert err <= RTOL, (name, e, err)
        else:
            err = _rel_err(sum(res["grads"][name] for res in results), want)
            assert err <= RTOL, (name, err)


def _pool(request, world: int):
    return request.getfixturevalue(f"pool{world}")


def _routes(layer: EPMoE, rank: int) -> torch.Tensor:
    """The experts rank ``rank``'s tokens pick in the oracle layer, (T, K)."""
    x, _ = E.layer_batch(rank)
    return torch.softmax(x @ layer.router.detach().T, dim=-1).topk(E.K, dim=-1).indices


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize("layout,world", CASES)
def test_crafted_layer_with_zero_token_peers_is_exact(request, layout, world):
    ep = E.ep_size(layout)
    norm = layout != "ep4"  # both of Qwen3-MoE's gate conventions
    ref = E.oracle("layer", layout, world, norm)
    # The case is what it claims: rank 0 sends nothing to its peers, the last expert is idle.
    assert int(_routes(ref["model"], 0).max()) < E.X // ep
    assert all(int((_routes(ref["model"], r) == E.X - 1).sum()) == 0 for r in range(world))
    assert torch.equal(ref["grads"]["gate_up_proj"][-1], torch.zeros(2 * E.F_FF, E.D))
    results = _pool(request, world).run_with_timeout(TIMEOUT_S, E.run_layer, layout, norm)
    _check(ref, results, ep)
    for res in results[ep - 1::ep]:  # the idle expert's owners: a zero slice, not a missing one
        assert torch.equal(res["grads"]["down_proj"][-1], torch.zeros(E.D, E.F_FF))


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize("layout,world", CASES)
def test_qwen3_moe_with_ep_experts_matches_hugging_face(request, layout, world):
    ref = E.oracle("hf", layout, world)
    results = _pool(request, world).run_with_timeout(TIMEOUT_S, E.run_hf, layout)
    _check(ref, results, E.ep_size(layout))


@pytest.mark.timeout(TIMEOUT_S * 2)
def test_user_guide_snippet_is_exact(pool4):
    """The user guide's EP snippet, run as written on a 2 x 2 mesh, gives the oracle's losses,
    outputs and grads (summed as the guide says)."""
    ref = E.oracle("hf", "shard2xep2", 4)
    _check(ref, pool4.run_with_timeout(TIMEOUT_S, E.run_guide_snippet), 2)


@pytest.mark.timeout(TIMEOUT_S * 2)
def test_control_experts_fed_in_arrival_order_fail_the_comparison(pool2):
    ref = E.oracle("layer", "ep2", 2, True)
    results = pool2.run_with_timeout(TIMEOUT_S, E.run_layer, "ep2", True, control=True)
    # Rank 0's experts get rows from both ranks, so arrival order is not expert order there.
    assert _rel_err(results[0]["out"], ref["outs"][0]) > 1e3 * RTOL
    with pytest.raises(AssertionError):
        _check(ref, results, 2)


@pytest.mark.timeout(TIMEOUT_S * 2)
def test_shard_experts_refuses_on_every_rank(pool2):
    msgs = pool2.run_with_timeout(TIMEOUT_S, E.shard_errors)
    for rank_msgs in msgs:
        assert len(rank_msgs) == 2
        assert "n_experts=3" in rank_msgs[0] and "multiple of the EP size 2" in rank_msgs[0]
        assert "Must be 1-D: pass mesh['ep']" in rank_msgs[1]


def test_unsharded_layer_equals_the_hugging_face_block():
    """One process, no mesh: EPMoE's math (routing, SwiGLU, gates) against HF's own block."""
    hf = E.tiny_qwen3_moe()
    ours = tiny_qwen3_moe_ep()
    ids = E.hf_batch(0)
    a, b = hf(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert _rel_err(b.logits, a.logits) <= RTOL
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel_err(p.grad, hf_params[E.hf_name(name)].grad) <= RTOL, name


def test_layer_refuses_bad_sizes_and_inputs():
    with pytest.raises(ValueError, match=r"top_k=3\. Must be in \[1, n_experts=2\]"):
        EPMoE(4, 4, 2, 3)
    with pytest.raises(ValueError, match="d_ff=0. Must be >= 1"):
        EPMoE(4, 0, 2, 1)
    with pytest.raises(ValueError, match=r"last dim must be d_model=4"):
        EPMoE(4, 4, 2, 1)(torch.zeros(3, 5))


def test_from_hf_keeps_the_blocks_dtype():
    """A bf16 Hugging Face model stays bf16 after the replacement (EPMoE's params were fp32
    before ``from_hf`` took the block's dtype) and computes the same logits (one bf16 ulp)."""
    hf = E.tiny_qwen3_moe().to(torch.bfloat16)
    ours = replace_qwen3_moe_blocks(E.tiny_qwen3_moe().to(torch.bfloat16))
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = E.hf_batch(1)
    want = hf(input_ids=ids).logits.float()
    assert _rel_err(ours(input_ids=ids).logits.float(), want) <= 2**-8
