"""dmuon.optim.muon_math against the oracle, torch 2.13's torch.optim.Muon (torch/optim/_muon.py)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.optim import _muon as torch_muon

from dmuon.optim.muon_math import (
    MUON_DEFAULTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_RAW_COEFFICIENTS,
    adjust_lr,
    muon_update_,
    ns_cost,
    ns_flops,
    polar_express_coefficients,
    zeropower_via_newtonschulz,
)

SHAPES = [(8, 8), (16, 48), (48, 16), (1, 7), (7, 1), (33, 65), (130, 20)]
DEFAULT_ABC = MUON_DEFAULTS["ns_coefficients"]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_defaults_match_installed_torch_signature():
    sig = inspect.signature(torch.optim.Muon.__init__)
    torch_defaults = {
        name: p.default for name, p in sig.parameters.items() if name not in ("self", "params")
    }
    assert torch_defaults == MUON_DEFAULTS


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_newtonschulz_bitwise_equal_to_torch(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    grad = torch.randn(shape, generator=g).to(dtype)
    ours = zeropower_via_newtonschulz(grad.clone(), DEFAULT_ABC, 5, 1e-7)
    ref = torch_muon._zeropower_via_newtonschulz(grad.clone(), DEFAULT_ABC, 5, 1e-7)
    assert ours.dtype == torch.bfloat16
    assert _bitwise_equal(ours, ref)


def test_newtonschulz_does_not_modify_bf16_input():
    # torch 2.13 divides a bf16 input in place (.bfloat16() is a no-op there); we copy.
    grad = torch.randn(12, 20).bfloat16()
    before = grad.clone()
    zeropower_via_newtonschulz(grad, DEFAULT_ABC, 5, 1e-7)
    assert torch.equal(grad, before)


def test_newtonschulz_zero_matrix_and_orthogonality():
    assert torch.count_nonzero(zeropower_via_newtonschulz(torch.zeros(4, 6), DEFAULT_ABC, 5, 1e-7)) == 0
    x = zeropower_via_newtonschulz(torch.randn(32, 64), DEFAULT_ABC, 5, 1e-7).float()
    sv = torch.linalg.svdvals(x)
    # Jordan's coefficients land singular values roughly in (0.5, 1.5), not exactly 1.
    assert sv.min() > 0.3 and sv.max() < 1.6


def test_per_step_coefficients_equal_to_repeated_single_triple():
    grad = torch.randn(24, 40)
    single = zeropower_via_newtonschulz(grad, DEFAULT_ABC, 5, 1e-7)
    per_step = zeropower_via_newtonschulz(grad, [DEFAULT_ABC] * 5, 5, 1e-7)
    assert _bitwise_equal(single, per_step)


def test_polar_express_table_and_convergence():
    assert len(POLAR_EXPRESS_RAW_COEFFICIENTS) == 8
    a0, b0, c0 = POLAR_EXPRESS_RAW_COEFFICIENTS[0]
    assert POLAR_EXPRESS_COEFFICIENTS[0] == (a0 / 1.01, b0 / 1.01**3, c0 / 1.01**5)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)  # no safety on the last
    # Each raw polynomial maps 1 close to 1 (a + b + c ~ 1 for the later ones).
    assert math.isclose(sum(POLAR_EXPRESS_RAW_COEFFICIENTS[-1]), 1.0)
    steps = polar_express_coefficients(10)
    assert steps[:8] == POLAR_EXPRESS_COEFFICIENTS and steps[8] == steps[9] == steps[7]
    # On a gradient-like matrix with spread singular values, Polar Express (8 steps) brings
    # the spectrum closer to 1 than Jordan's fixed triple does in the same 8 steps.
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(96, 64, generator=g))
    m = u @ torch.diag(torch.logspace(0, -3, 64)) @ v.T
    pe = zeropower_via_newtonschulz(m, polar_express_coefficients(8), 8, 1e-7).float()
    jordan = zeropower_via_newtonschulz(m, DEFAULT_ABC, 8, 1e-7).float()
    err_pe = (torch.linalg.svdvals(pe) - 1).abs().max().item()
    err_jordan = (torch.linalg.svdvals(jordan) - 1).abs().max().item()
    assert err_pe < err_jordan, (err_pe, err_jordan)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grad=torch.zeros(3)), "Must be a 2-D matrix"),
        (dict(grad=torch.zeros(2, 3, 4)), "Must be a 2-D matrix"),
        (dict(ns_steps=100), "ns_steps=100"),
        (dict(ns_steps=-1), "ns_steps=-1"),
        (dict(eps=0.0), "eps=0.0"),
        (dict(ns_coefficients=(1.0, 2.0)), "exactly 3"),
        (dict(ns_coefficients=(1.0, float("nan"), 2.0)), "3 finite floats"),
        (dict(ns_coefficients=[DEFAULT_ABC] * 4), "exactly ns_steps=5 triples"),
        (dict(ns_coefficients=[DEFAULT_ABC] * 4 + [(1.0, 2.0)]), r"ns_coefficients\[4\]"),
        (dict(ns_coefficients="abc"), "Invalid ns_coefficients"),
    ],
)
def test_newtonschulz_errors(kwargs, match):
    args = dict(grad=torch.zeros(4, 4), ns_coefficients=DEFAULT_ABC, ns_steps=5, eps=1e-7)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        zeropower_via_newtonschulz(**args)


@pytest.mark.parametrize("shape", [(4, 8), (8, 4), (5, 5)])
@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
def test_adjust_lr_matches_torch(shape, fn):
    assert adjust_lr(0.02, fn, shape) == torch_muon._adjust_lr(0.02, fn, torch.Size(shape))


def test_adjust_lr_errors():
    with pytest.raises(ValueError, match="adjust_lr_fn='rms'"):
        adjust_lr(0.1, "rms", (2, 2))
    with pytest.raises(ValueError, match="Must start with two positive dims"):
        adjust_lr(0.1, None, (0, 2))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_five_steps_bitwise_equal_to_torch_muon(nesterov, adjust_lr_fn):
    torch.manual_seed(0)
    shapes = [(16, 48), (48, 16), (32, 32)]
    ref_params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    our_params = [p.detach().clone() for p in ref_params]
    our_bufs = [torch.zeros_like(p) for p in our_params]
    hyper = dict(
        lr=0.02,
        weight_decay=0.05,
        momentum=0.9,
        nesterov=nesterov,
        ns_coefficients=DEFAULT_ABC,
        ns_steps=5,
        eps=1e-7,
        adjust_lr_fn=adjust_lr_fn,
    )
    opt = torch.optim.Muon(ref_params, **hyper)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        opt.step()
        for p, buf, g in zip(our_params, our_bufs, grads):
            muon_update_(p, g.clone(), buf, **hyper)
    for ref, ours, buf in zip(ref_params, our_params, our_bufs):
        assert _bitwise_equal(ref.detach(), ours)
        assert _bitwise_equal(opt.state[ref]["momentum_buffer"], buf)


def test_muon_update_errors():
    p, g, b = torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4)
    hyper = dict(MUON_DEFAULTS)
    with pytest.raises(ValueError, match="Must be 2-D"):
        muon_update_(torch.zeros(4), torch.zeros(4), torch.zeros(4), **hyper)
    with pytest.raises(ValueError, match=r"grad shape=\(4, 3\)"):
        muon_update_(p, torch.zeros(4, 3), b, **hyper)
    with pytest.raises(ValueError, match="momentum=-0.1"):
        muon_update_(p, g, b, **{**hyper, "momentum": -0.1})
    with pytest.raises(ValueError, match="adjust_lr_fn='x'"):
        muon_update_(p, g, b, **{**hyper, "adjust_lr_fn": "x"})


def test_ns_cost():
    # m*m*(2n + m): the square matrix costs 5.8x the wide one of the same numel
    assert ns_cost(4096, 4096) == 3 * 4096**3
    assert ns_cost(1024, 16384) == 33 * 1024**3
    assert ns_cost(3, 5) == ns_cost(5, 3) == 9 * 13
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="Must be a positive int"):
            ns_cost(bad, 3)


@pytest.mark.parametrize("shape, steps", [((24, 40), 5), ((40, 24), 5), ((17, 17), 3), ((5, 64), 1)])
def test_ns_flops_matmul_part_matches_torch_flop_counter(shape, steps):
    # torch's FlopCounterMode counts the matrix products (2 FLOPs per multiply-add) of the
    # real call; ns_flops adds the elementwise terms derived in its docstring.
    from torch.utils.flop_counter import FlopCounterMode

    m, n = min(shape), max(shape)
    grad = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(grad, MUON_DEFAULTS["ns_coefficients"], steps, 1e-7)
    elementwise = 3 * m * n + 1 + steps * (3 * m * m + 3 * m * n)
    assert counter.get_total_flops() == 2 * steps * ns_cost(*shape)
    assert ns_flops(*shape, steps) == counter.get_total_flops() + elementwise
    assert ns_flops(*shape, 0) == 3 * m * n + 1
    with pytest.raises(ValueError, match="ns_steps"):
        ns_flops(*shape, 100)


def test_bf16_params_nesterov_bitwise_equal_to_torch_muon():
    torch.manual_seed(1)
    ref = torch.nn.Parameter(torch.randn(24, 40).bfloat16())
    ours, buf = ref.detach().clone(), torch.zeros(24, 40, dtype=torch.bfloat16)
    opt = torch.optim.Muon([ref], lr=0.02, nesterov=True)
    for _ in range(3):
        g = torch.randn(24, 40).bfloat16()
        ref.grad = g.clone()
        opt.step()
        muon_update_(ours, g.clone(), buf, **{**MUON_DEFAULTS, "lr": 0.02})
    assert _bitwise_equal(ref.detach(), ours)
    assert _bitwise_equal(opt.state[ref]["momentum_buffer"], buf)


def test_bf16_nesterov_false_keeps_momentum_buffer_unnormalised():
    # torch 2.13 with bf16 params and nesterov=False passes the momentum buffer itself to NS,
    # whose `.bfloat16()` is then a no-op, so `div_` rescales the buffer to unit Frobenius
    # norm. We orthogonalize a copy: the buffer stays (1 - momentum) * grad after one step.
    g = torch.randn(8, 12).bfloat16()
    p, buf = torch.randn(8, 12).bfloat16(), torch.zeros(8, 12, dtype=torch.bfloat16)
    muon_update_(p, g, buf, **{**MUON_DEFAULTS, "nesterov": False})
    assert torch.equal(buf, torch.zeros_like(buf).lerp_(g, 1 - MUON_DEFAULTS["momentum"]))
