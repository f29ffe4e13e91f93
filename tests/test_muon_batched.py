"""Batched Newton–Schulz / Muon update (issue 9, owner-side compute) against the per-matrix
path, for wide, tall and square matrices, with and without Nesterov. The stated tolerance:
each bfloat16 element of the orthogonalized update equals the loop's or differs by one ulp
(relative 2**-7); on this CPU build 1 batch in ~20 of small matrices has such an element
(bmm and mm take different CPU GEMM paths). Bad batches raise."""

import pytest
import torch

from dmuon.optim.muon_math import (
    MUON_DEFAULTS,
    muon_update_,
    muon_update_batched_,
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
    muon_update_batched_(params, grads, bufs, nesterov=nesterov, **HP)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref[2]))  # momentum: same ops, same bits
    step_ulp = HP["lr"] * 3**0.5 * 2**-7 * 1.25  # adjusted lr x one ulp of an update <= 1.25
    for a, b in zip(params, ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=step_ulp)


def test_bad_batches_raise():
    a, b = torch.zeros(4, 4), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="Must all be equal"):
        muon_update_batched_([a, b], [a, b], [a, b], nesterov=True, **HP)
    with pytest.raises(ValueError, match="Invalid lengths"):
        muon_update_batched_([], [], [], nesterov=True, **HP)
    with pytest.raises(ValueError, match="Must be 3-D"):
        zeropower_via_newtonschulz_batched(a, HP["ns_coefficients"], 5, 1e-7)
