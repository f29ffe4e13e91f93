"""Muon's per-matrix math, with no collectives: Newton–Schulz, lr adjustment, one update step.

The reference oracle is torch 2.13's ``torch.optim.Muon`` (``torch/optim/_muon.py``). With one
``(a, b, c)`` coefficient triple, :func:`zeropower_via_newtonschulz` performs the same
operations in the same order as ``torch.optim._muon._zeropower_via_newtonschulz`` and
:func:`muon_update_` the same as ``_single_tensor_muon`` for one parameter, so results are
bitwise equal (tested). DMuon's owner rank calls :func:`muon_update_` once per owned matrix.

Glossary:

- *NS*: the Newton–Schulz iteration ``X <- a X + (b A + c A A) X`` with ``A = X X^T``, run in
  bfloat16 on the "wide" orientation of the matrix (rows <= cols), after scaling ``X`` by its
  Frobenius norm so that its spectral norm is at most 1.
- *per-step coefficients*: one ``(a, b, c)`` per iteration instead of one for all (Polar
  Express, Amsel et al. 2025, arXiv:2505.16932).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "MUON_DEFAULTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_RAW_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "ADJUST_LR_FNS",
    "adjust_lr",
    "muon_update_",
    "muon_update_matrices_",
    "ns_cost",
    "ns_flops",
    "polar_express_coefficients",
    "zeropower_via_newtonschulz",
]

#: ``torch.optim.Muon``'s defaults in torch 2.13 (its ``__init__`` signature; the NS triple is
#: Keller Jordan's, https://kellerjordan.github.io/posts/muon/). Same keys as its ``defaults``.
MUON_DEFAULTS: dict = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}

#: Accepted ``adjust_lr_fn`` values (torch 2.13 ``Muon.__init__``): ``None`` means "original".
ADJUST_LR_FNS: tuple = (None, "original", "match_rms_adamw")

#: Polar Express degree-5 polynomials p_t(x) = a x + b x^3 + c x^5 for the paper's default
#: setting (lower bound l = 1e-3, upper bound u = 1), as published in Algorithm 1 of Amsel,
#: Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their Application
#: to the Muon Algorithm", arXiv:2505.16932 (2025). The 8th polynomial is the limit: the paper
#: notes that all later ones equal it numerically. These are the coefficients *before* the
#: safety factor of Section 4.4.
POLAR_EXPRESS_RAW_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

#: Section 4.4's safety factor: each polynomial p(x) is replaced by p(x / 1.01), i.e.
#: (a, b, c) -> (a / 1.01, b / 1.01**3, c / 1.01**5), except the last one (which would
#: otherwise make singular values converge to ~0.999998 instead of 1).
POLAR_EXPRESS_SAFETY: float = 1.01


def _with_safety(coeffs, safety):
    scaled = [(a / safety, b / safety**3, c / safety**5) for a, b, c in coeffs[:-1]]
    return tuple(scaled) + (tuple(coeffs[-1]),)


#: The coefficients DMuon uses for Polar Express: :data:`POLAR_EXPRESS_RAW_COEFFICIENTS` with
#: :data:`POLAR_EXPRESS_SAFETY` folded into all but the last triple (as in Algorithm 1).
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = _with_safety(
    POLAR_EXPRESS_RAW_COEFFICIENTS, POLAR_EXPRESS_SAFETY
)


def polar_express_coefficients(ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """The first ``ns_steps`` triples of :data:`POLAR_EXPRESS_COEFFICIENTS`.

    Beyond the 8 published triples the last one, (1.875, -1.25, 0.375), repeats (the paper:
    "subsequent coeffs equal this numerically"). Pass the result as ``ns_coefficients`` with
    the same ``ns_steps``.

    Normalisation: DMuon keeps torch's ``X / max(||X||_F, eps)`` for every coefficient choice,
    so the only difference between the classic and the Polar Express iteration is the
    polynomial. The paper's Algorithm 1 divides by ``1.01 * ||X||_F + 1e-7`` instead; its
    Section 4.4 protects against round-off above the upper bound through the safety factor,
    which is already folded into these coefficients.

    Raises:
        ValueError: ``ns_steps`` not an int in [1, 100).
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ValueError(f"Invalid {ns_steps=}. Must be an int in [1, 100).")
    table = POLAR_EXPRESS_COEFFICIENTS
    return tuple(table[min(i, len(table) - 1)] for i in range(ns_steps))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _per_step_coefficients(ns_coefficients, ns_steps: int) -> list[tuple[float, float, float]]:
    """Normalise ``ns_coefficients`` to one finite ``(a, b, c)`` per step, or raise."""
    if isinstance(ns_coefficients, (str, bytes)) or not isinstance(ns_coefficients, Sequence):
        raise ValueError(
            f"Invalid {ns_coefficients=}. Must be one (a, b, c) tuple of 3 floats, or a "
            f"sequence of {ns_steps} such tuples (one per Newton-Schulz step)."
        )
    if len(ns_coefficients) == 3 and all(_is_real(x) for x in ns_coefficients):
        return [tuple(ns_coefficients)] * ns_steps
    if all(isinstance(t, Sequence) and not isinstance(t, (str, bytes)) for t in ns_coefficients):
        if len(ns_coefficients) != ns_steps:
            raise ValueError(
                f"Invalid {ns_coefficients=} with {len(ns_coefficients)} triples. Must have "
                f"exactly {ns_steps=} triples, one per step (e.g. "
                f"polar_express_coefficients({ns_steps}))."
            )
        steps = []
        for i, t in enumerate(ns_coefficients):
            if len(t) != 3 or not all(_is_real(x) for x in t):
                raise ValueError(
                    f"Invalid ns_coefficients[{i}]={t!r}. Must be a tuple of exactly 3 finite "
                    "floats (a, b, c)."
                )
            steps.append(tuple(t))
        return steps
    raise ValueError(
        f"Invalid {ns_coefficients=}. Must be a tuple of exactly 3 finite floats (a, b, c), "
        f"or a sequence of {ns_steps} such tuples."
    )


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_coefficients: Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``grad = U S V^T`` by Newton–Schulz.

    Arithmetic, in order (identical to torch 2.13 ``_zeropower_via_newtonschulz``):
    ``X = bf16(grad)``, transposed if rows > cols; ``X /= max(||X||_F, eps)``; then per step
    ``A = X X^T``; ``B = b A + c A A`` (one ``addmm``); ``X = a X + B X`` (one ``addmm``);
    transposed back.

    Args:
        grad: ``(rows, cols)`` tensor, any floating dtype; not modified (torch 2.13 divides a
            bfloat16 input in place, because ``.bfloat16()`` returns the input itself; this
            function always works on a copy; the returned values are the same).
        ns_coefficients: one ``(a, b, c)`` triple used at every step, or ``ns_steps`` triples
            (per-step coefficients, e.g. :func:`polar_express_coefficients`).
        ns_steps: number of iterations, an int in [0, 100) (torch's bound).
        eps: positive floor on the Frobenius norm (a zero ``grad`` returns zeros).

    Returns:
        ``(rows, cols)`` bfloat16 tensor on ``grad``'s device.

    Raises:
        ValueError: ``grad`` not 2-D, ``ns_steps`` outside [0, 100), ``eps`` not a positive
            finite number, malformed ``ns_coefficients``.
    """
    if not isinstance(grad, Tensor) or grad.ndim != 2:
        shape = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
        raise ValueError(
            f"Invalid grad shape={shape}. Must be a 2-D matrix (rows, cols); Muon only "
            "orthogonalizes 2-D weights, optimize other params with AdamW."
        )
    steps = _checked_steps(ns_coefficients, ns_steps, eps)
    tall = grad.size(0) > grad.size(1)
    ortho = grad.to(dtype=torch.bfloat16, copy=True)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    ortho = _ns_iterations(ortho, steps)
    if tall:
        ortho = ortho.T
    return ortho


def zeropower_via_newtonschulz_batched(
    grads: Tensor,
    ns_coefficients: Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` of ``k`` same-shape matrices at once (one ``bmm``
    chain: ``baddbmm`` where the 2-D form uses ``addmm``, a per-matrix Frobenius norm).

    Same arithmetic per matrix, with the 2-D form's norm reduction. Tolerance against the
    per-matrix loop: each bfloat16 element equal or one ulp apart (relative 2**-7); on CPU
    torch 2.13 about 1 batch in 20 of small matrices has such an element, because ``bmm``
    and ``mm`` take different GEMM paths (``tests/dmuon/test_muon_batched.py``).

    Args:
        grads: ``(k, rows, cols)`` tensor, any floating dtype; not modified.
        ns_coefficients, ns_steps, eps: as :func:`zeropower_via_newtonschulz`.

    Returns:
        ``(k, rows, cols)`` bfloat16 tensor on ``grads``' device.

    Raises:
        ValueError: ``grads`` not 3-D, and what :func:`zeropower_via_newtonschulz` rejects.
    """
    if not isinstance(grads, Tensor) or grads.ndim != 3:
        shape = tuple(grads.shape) if isinstance(grads, Tensor) else type(grads).__name__
        raise ValueError(
            f"Invalid grads shape={shape}. Must be 3-D (k, rows, cols): k same-shape matrices."
        )
    steps = _checked_steps(ns_coefficients, ns_steps, eps)
    tall = grads.size(1) > grads.size(2)
    ortho = grads.to(dtype=torch.bfloat16, copy=True)
    if tall:
        ortho = ortho.mT
    norms = torch.stack([x.norm() for x in ortho]).view(-1, 1, 1)  # the 2-D form's reduction
    ortho.div_(norms.clamp(min=eps))
    ortho = _ns_iterations(ortho, steps)
    if tall:
        ortho = ortho.mT
    return ortho


def _checked_steps(ns_coefficients, ns_steps, eps) -> list[tuple[float, float, float]]:
    """Validate ``ns_steps`` and ``eps``; the per-step ``(a, b, c)`` triples."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(
            f"Invalid {ns_steps=}. Must be an int in [0, 100) (fewer than 100 steps for "
            "computational efficiency, as torch.optim.Muon requires)."
        )
    if not _is_real(eps) or eps <= 0:
        raise ValueError(f"Invalid {eps=}. Must be a positive finite float (default 1e-7).")
    return _per_step_coefficients(ns_coefficients, ns_steps)


def _ns_iterations(ortho: Tensor, steps) -> Tensor:
    """The Newton–Schulz iterations on a normalized wide ``(r, c)`` or ``(k, r, c)`` tensor."""
    mm = torch.addmm if ortho.ndim == 2 else torch.baddbmm
    for a, b, c in steps:
        gram = ortho @ ortho.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        ortho = mm(ortho, poly, ortho, beta=a)  # a X + (b A + c A A) X
    return ortho


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Scale ``lr`` for a ``(A, B)`` matrix as torch 2.13 ``torch.optim._muon._adjust_lr``.

    - ``None`` / ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``.
    - ``"match_rms_adamw"`` (Moonshot, arXiv:2502.16982): ``lr * 0.2 * sqrt(max(A, B))``.

    Raises:
        ValueError: ``adjust_lr_fn`` not in :data:`ADJUST_LR_FNS`, ``shape`` with fewer than 2
            dims or a non-positive dim.
    """
    if len(shape) < 2 or any(int(d) < 1 for d in shape[:2]):
        raise ValueError(f"Invalid {shape=}. Must start with two positive dims (A, B).")
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"Invalid {adjust_lr_fn=}. Must be one of {ADJUST_LR_FNS}.")
    return lr * ratio


@torch.no_grad()
def muon_update_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """One in-place Muon step for one 2-D parameter, as ``torch.optim.Muon.step()`` does it.

    In order (torch 2.13 ``_single_tensor_muon``)::

        momentum_buffer.lerp_(grad, 1 - momentum)         # B = m B + (1 - m) g
        update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
        update = zeropower_via_newtonschulz(update, ...)  # bfloat16
        param.mul_(1 - lr * weight_decay)                  # decoupled weight decay, raw lr
        param.add_(update, alpha=-adjust_lr(lr, adjust_lr_fn, param.shape))

    Args:
        param: ``(rows, cols)`` parameter, updated in place.
        grad: gradient, same shape as ``param`` (the *averaged* gradient: under DMuon the
            owner's reduced sum divided by the data-parallel world size).
        momentum_buffer: same shape, updated in place (zeros before the first step, as
            torch's lazily created state).
        lr, weight_decay, momentum: non-negative finite floats.
        nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: as ``torch.optim.Muon``.

    Raises:
        ValueError: non-2-D or mismatched shapes, negative or non-finite hyperparameters, and
            anything :func:`zeropower_via_newtonschulz` / :func:`adjust_lr` reject.
    """
    if param.ndim != 2:
        raise ValueError(
            f"Invalid param shape={tuple(param.shape)}. Must be 2-D; Muon only supports 2-D "
            "params (use AdamW for embeddings, norms, biases)."
        )
    muon_update_matrices_(
        [param], [grad], [momentum_buffer], matrix_shape=tuple(param.shape), lr=lr,
        weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn,
    )


@torch.no_grad()
def muon_update_matrices_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    matrix_shape: Sequence[int],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """``torch.optim.Muon`` applied to every ``(rows, cols)`` matrix of ``params``, each param
    seen as ``param.view(-1, rows, cols)``: a 2-D weight (one matrix), a 3-D expert stack
    ``(E, rows, cols)`` (E matrices) or a conv weight flattened to ``(out, in·k…)``.

    Per matrix it is :func:`muon_update_` of that matrix as its own parameter: momentum and
    Nesterov are element-wise (the same on the whole tensor), Newton–Schulz normalises and
    orthogonalises each matrix on its own, weight decay uses the raw ``lr`` and the update
    ``adjust_lr(lr, adjust_lr_fn, (rows, cols))``: the matrix's shape, never the param's.
    One matrix in all takes :func:`muon_update_`'s path (bitwise torch's); more run one
    :func:`zeropower_via_newtonschulz_batched` over all of them (that function's tolerance).

    Args:
        params, grads, momentum_buffers: ``k >= 1`` contiguous tensors each, ``grads[i]`` and
            ``momentum_buffers[i]`` of ``params[i]``'s shape; every numel a multiple of
            ``rows * cols``.
        matrix_shape: ``(rows, cols)`` of one matrix.
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn:
            as :func:`muon_update_`.

    Raises:
        ValueError: the lists differ in length or are empty, a shape mismatch, a numel that
            is not a whole number of matrices, and what :func:`muon_update_` rejects.
    """
    if not params or not len(params) == len(grads) == len(momentum_buffers):
        raise ValueError(
            f"Invalid lengths {len(params)=}, {len(grads)=}, {len(momentum_buffers)=}. Must "
            "be equal and >= 1 (one grad and momentum buffer per param)."
        )
    if len(matrix_shape) != 2:
        raise ValueError(f"Invalid {matrix_shape=}. Must be (rows, cols).")
    rows, cols = _check_dims(*matrix_shape)
    for p, g, m in zip(params, grads, momentum_buffers):
        if p.ndim < 2 or p.numel() % (rows * cols):
            raise ValueError(
                f"Invalid param shape={tuple(p.shape)} for matrix_shape={(rows, cols)}. Must "
                "have at least 2 dims and a whole number of (rows, cols) matrices."
            )
        _check_like_param(p, g, m)
    _check_hparams(lr, weight_decay, momentum, adjust_lr_fn)
    updates = [_momentum_update(g, m, momentum, nesterov) for g, m in zip(grads, momentum_buffers)]
    if sum(p.numel() for p in params) == rows * cols:  # one matrix: torch's own arithmetic
        ortho = [zeropower_via_newtonschulz(updates[0].reshape(rows, cols), ns_coefficients,
                                            ns_steps, eps)]
    else:
        stacked = torch.cat([u.reshape(-1, rows, cols) for u in updates])
        ortho = zeropower_via_newtonschulz_batched(stacked, ns_coefficients, ns_steps, eps)
        ortho = ortho.split([p.numel() // (rows * cols) for p in params])
    alpha = -adjust_lr(lr, adjust_lr_fn, (rows, cols))
    for p, u in zip(params, ortho):
        p.mul_(1 - lr * weight_decay)
        p.add_(u.reshape(p.shape), alpha=alpha)


def _check_like_param(param, grad, momentum_buffer) -> None:
    """Raise ``ValueError`` unless the grad and the momentum buffer have the param's shape."""
    for name, t in (("grad", grad), ("momentum_buffer", momentum_buffer)):
        if t.shape != param.shape:
            raise ValueError(
                f"Invalid {name} shape={tuple(t.shape)}. Must equal the param's shape "
                f"{tuple(param.shape)}."
            )


def _check_hparams(lr, weight_decay, momentum, adjust_lr_fn) -> None:
    """Raise ``ValueError`` for a negative or non-finite lr, weight_decay or momentum, or an
    unknown ``adjust_lr_fn``."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
        if not _is_real(value) or value < 0:
            raise ValueError(f"Invalid {name}={value!r}. Must be a finite float >= 0.")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Invalid {adjust_lr_fn=}. Must be one of {ADJUST_LR_FNS}.")


def _momentum_update(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``B = m B + (1 - m) g`` in place; the update (Nesterov: ``g`` lerped towards ``B``)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def _check_dims(rows, cols) -> tuple[int, int]:
    for name, dim in (("rows", rows), ("cols", cols)):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
            raise ValueError(f"Invalid {name}={dim!r}. Must be a positive int.")
    return int(rows), int(cols)


def ns_cost(rows: int, cols: int) -> int:
    """Multiply-adds of the matrix products of one NS iteration on a ``(rows, cols)`` matrix.

    With ``m = min(rows, cols)``, ``n = max(rows, cols)`` (the iteration works on the wide
    orientation, see :func:`zeropower_via_newtonschulz`), one iteration multiplies
    ``X X^T`` ((m, n) @ (n, m): m*m*n), ``A A`` (m*m*m) and ``B X`` ((m, m) @ (m, n): m*m*n):
    ``m*m*(2n + m)``. A (4096, 4096) matrix costs 3 * 4096**3, a (1024, 16384) one of the same
    numel 33 * 1024**3, 5.8x less: NS cost grows with the smaller dimension squared.

    Raises:
        ValueError: a dim that is not a positive int.
    """
    rows, cols = _check_dims(rows, cols)
    m, n = min(rows, cols), max(rows, cols)
    return m * m * (2 * n + m)


def ns_flops(rows: int, cols: int, ns_steps: int = 5) -> int:
    """Floating-point operations of one :func:`zeropower_via_newtonschulz` call, exactly.

    Counted from the arithmetic of that function (m = min(rows, cols), n = max(rows, cols);
    one multiply-add = 2 FLOPs; the bfloat16 cast and transposes are copies, not FLOPs):

    - prologue: Frobenius norm (m*n squares + m*n - 1 adds + 1 square root), the clamp (1),
      the division (m*n): ``3*m*n + 1``;
    - per iteration (all iterations are quintic: 3 coefficients, whether one triple is reused
      or ``ns_steps`` per-step triples are given, so the cost does not depend on which):
      ``X X^T`` 2*m*m*n; ``addmm(A, A, A, beta=b, alpha=c)`` 2*m**3 for the product plus
      3*m*m for ``c*(AA) + b*A``; ``addmm(X, B, X, beta=a)`` 2*m*m*n plus 3*m*n for
      ``a*X + 1*(BX)`` (torch's addmm scales by alpha even when it is 1; counted);
      i.e. ``2*ns_cost(rows, cols) + 3*m*m + 3*m*n``.

    The planner balances this figure (per matrix) unless a measured per-shape table is given.

    Raises:
        ValueError: a dim that is not a positive int, ``ns_steps`` not an int in [0, 100).
    """
    rows, cols = _check_dims(rows, cols)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"Invalid {ns_steps=}. Must be an int in [0, 100).")
    m, n = min(rows, cols), max(rows, cols)
    per_step = 2 * ns_cost(rows, cols) + 3 * m * m + 3 * m * n
    return 3 * m * n + 1 + ns_steps * per_step
