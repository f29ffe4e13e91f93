"""Validation of DMuon's hyper-parameters (pure, no collectives).

Why it is separate from the update: the Muon update runs only on a matrix's owner, so a value
checked there raises on the owners while a rank that owns nothing enters the next collective
and hangs until the process-group timeout. Everything here is checked
in ``DMuon.__init__`` and again at the start of every ``step()`` (a scheduler or the user may
change ``param_groups``), on every rank, before any collective.

The rules are ``torch.optim.Muon``'s and ``torch.optim.AdamW``'s (torch 2.13), plus the checks
torch only makes later inside ``step()`` (``ns_steps < 100``, a well-formed
``ns_coefficients``, a positive ``eps``), and finiteness everywhere: a NaN learning rate is
accepted by torch's ``0.0 <= lr`` test as False and raises there, but an ``inf`` one passes it.
Differences from torch: ``lr`` must be a Python number (torch also accepts a 1-element tensor,
which DMuon's per-matrix update does not take), and ``nesterov`` must be a bool.
"""

from __future__ import annotations

import math
import numbers

from dmuon.optim.muon_math import ADJUST_LR_FNS, _per_step_coefficients

#: ``torch.optim.Muon`` caps the Newton–Schulz steps below this ("for computational efficiency").
MAX_NS_STEPS = 100


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _at_least_zero(name: str, value, fix: str) -> None:
    if not _real(value) or value < 0:
        raise ValueError(f"Invalid {name}={value!r}. Must be a finite float >= 0 ({fix}).")


def validate_muon(group: dict, where: str = "") -> None:
    """Check the Muon hyper-parameters of ``group`` (keys as ``torch.optim.Muon``'s defaults).

    Args:
        group: a mapping with ``lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
            ns_steps, adjust_lr_fn``.
        where: prefix of the error message naming the object (e.g. ``"param_groups[0] "``).

    Raises:
        ValueError: ``Invalid {name}=... Must be ...`` for the first value that breaks a rule.
    """
    w = where
    _at_least_zero(f"{w}lr", group["lr"], "the Muon learning rate, default 1e-3")
    _at_least_zero(f"{w}weight_decay", group["weight_decay"], "decoupled, default 0.1")
    _at_least_zero(f"{w}momentum", group["momentum"], "torch.optim.Muon's rule; default 0.95")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"Invalid {w}nesterov={group['nesterov']!r}. Must be True or False.")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps < MAX_NS_STEPS:
        raise ValueError(
            f"Invalid {w}ns_steps={steps!r}. Must be an int in [0, {MAX_NS_STEPS}) "
            "(torch.optim.Muon's bound; default 5)."
        )
    eps = group["eps"]
    if not _real(eps) or eps <= 0:
        raise ValueError(
            f"Invalid {w}eps={eps!r}. Must be a finite float > 0 (the floor on the Frobenius "
            "norm before Newton–Schulz; default 1e-7)."
        )
    try:
        _per_step_coefficients(group["ns_coefficients"], int(steps))
    except ValueError as exc:
        raise ValueError(f"{w}{exc}") from None
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"Invalid {w}adjust_lr_fn={group['adjust_lr_fn']!r}. Must be one of {ADJUST_LR_FNS}."
        )


def validate_adamw(group: dict, where: str = "") -> None:
    """Check the AdamW hyper-parameters of ``group`` (``lr, betas, eps, weight_decay``).

    Raises:
        ValueError: as :func:`validate_muon`; names use the ``adamw_`` keyword of ``DMuon``.
    """
    w = where
    _at_least_zero(f"{w}adamw_lr", group["lr"], "default 1e-3")
    _at_least_zero(f"{w}adamw_eps", group["eps"], "default 1e-8")
    _at_least_zero(f"{w}adamw_weight_decay", group["weight_decay"], "decoupled, default 1e-2")
    betas = group["betas"]
    ok = (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(_real(b) and 0.0 <= b < 1.0 for b in betas)
    )
    if not ok:
        raise ValueError(
            f"Invalid {w}adamw_betas={betas!r}. Must be two floats in [0, 1) "
            "(torch.optim.AdamW's rule; default (0.9, 0.999))."
        )
