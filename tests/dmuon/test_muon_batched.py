"""Batched Newton–Schulz / Muon update (owner-side compute) against the per-matrix
path, for wide, tall and square matrices, with and without Nesterov. The stated tolerance:
each bfloat16 element of the orthogonalized update equals the loop's or differs by one ulp
(relative 2**-7); on this CPU build 1 batch in ~20 of small matrices has such an element
(bmm and mm take different CPU GEMM paths). Bad batches raise."""

import pytest
import torch

from dmuon.optim.muon_math import (
    MUON_DEFAULTS,
    muon_update_,
    muon_update_matrices_,
    zeropower_via_newtonschulz,
    zeropower_via_newtonschulz_batched,
)

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_coefficients=MUON_DEFAULTS["ns_coefficients"],
          ns_steps=5, eps=1e-7, adjust_lr_fn=None)


@pytest.mark.parametrize("shape", [(32, 32), (96, 32), (32, 128)])
def test_batched_newton_schulz_matches_the_loop_within_one_bf16_ulp(shape):
    gen = torch.Generator().manual_seed(0)
    differing = total = 0
    for _ in range(6):
        g = torch.randn(4, *shape, generator=gen)
        g[1] *= 1e-3  # per-matrix norms, not one norm of the batch
        loop = torch.stack([zeropower_via_newtonschulz(x, HP["ns_coefficients"], 5, 1e-7) for x in g])
        got = zeropower_via_newtonschulz_batched(g, HP["ns_coefficients"], 5, 1e-7)
        assert got.dtype == torch.bfloat16 and got.shape == g.shape
        torch.testing.assert_close(got.float(), loop.float(), rtol=2**-7, atol=0)
        differing += int((got != loop).sum())
        total += got.numel()
    assert differing <= total // 1000, (differing, total)  # nearly all bits equal


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_update_matches_the_loop(nesterov):
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    grads = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    bufs = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    ref = [[t.clone() for t in ts] for ts in (params, grads, bufs)]
    for p, g, m in zip(*ref):
        muon_update_(p, g, m, nesterov=nesterov, **HP)
    muon_update_matrices_(params, grads, bufs, matrix_shape=(48, 16), nesterov=nesterov, **HP)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref[2]))  # momentum: same ops, same bits
    step_ulp = HP["lr"] * 3**0.5 * 2**-7 * 1.25  # adjusted lr x one ulp of an update <= 1.25
    for a, b in zip(params, ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=step_ulp)


def test_bad_batches_raise():
    a, b = torch.zeros(4, 4), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="whole number of"):
        muon_update_matrices_([a, b], [a, b], [a, b], matrix_shape=(4, 3), nesterov=True, **HP)
    with pytest.raises(ValueError, match="Invalid lengths"):
        muon_update_matrices_([], [], [], matrix_shape=(4, 4), nesterov=True, **HP)
    with pytest.raises(ValueError, match="Must be 3-D"):
        zeropower_via_newtonschulz_batched(a, HP["ns_coefficients"], 5, 1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
def test_stack_and_conv_updates_equal_torch_muon_over_each_matrix(nesterov):
    """A (3, 8, 12) stack and a (6, 2, 3, 3) conv weight stepped by muon_update_matrices_
    against torch.optim.Muon given each slice / the flattened view as its own 2-D param."""

    torch.manual_seed(0)
    stack, conv = torch.randn(3, 8, 12), torch.randn(6, 2, 3, 3)
    ref_stack, ref_conv = stack.clone(), conv.clone()
    views = [torch.nn.Parameter(ref_stack[i]) for i in range(3)] + [
        torch.nn.Parameter(ref_conv.view(6, 18))]
    torch_muon = torch.optim.Muon(views, lr=0.02, nesterov=nesterov, adjust_lr_fn="original")
    hp = {k: torch_muon.defaults[k] for k in ("lr", "weight_decay", "momentum", "nesterov",
                                               "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn")}
    bufs = [torch.zeros_like(stack), torch.zeros_like(conv)]
    for step in range(3):
        g_stack, g_conv = torch.randn(3, 8, 12), torch.randn(6, 2, 3, 3)
        for i in range(3):
            views[i].grad = g_stack[i].clone()
        views[3].grad = g_conv.view(6, 18).clone()
        torch_muon.step()
        muon_update_matrices_([stack], [g_stack], [bufs[0]], matrix_shape=(8, 12), **hp)
        muon_update_matrices_([conv], [g_conv], [bufs[1]], matrix_shape=(6, 18), **hp)
    # the conv weight is one matrix: torch's own arithmetic, bit for bit
    assert torch.equal(conv, ref_conv)
    # the stack's slices run in one bmm chain: within one bf16 ulp of the lr-scaled update
    lr = 0.02 * max(1, 8 / 12) ** 0.5
    assert (stack - ref_stack).abs().max() <= 3 * lr * 2**-7


def test_matrices_update_rejects_a_partial_matrix():

    p = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="whole number of"):
        muon_update_matrices_([p], [p.clone()], [p.clone()], matrix_shape=(3, 3), lr=0.1,
                              weight_decay=0.0, momentum=0.9, nesterov=True,
                              ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                              adjust_lr_fn=None)
