"""The harness's own bound on each owner's Newton–Schulz load, from the Muon matrices' shapes.

Independent of DMuon's planner (nothing of ``dmuon.ownership.plan`` is used here: a planner
that piles every matrix on one rank must fail this check even where the predictor, which
shares that planner, agrees with the traffic). Derivation: docs/traffic-model.md,
"Newton–Schulz balance".

Cost of one matrix of shape ``(rows, cols)``, m = min, n = max: the floating-point operations
of torch.optim.Muon's quintic Newton–Schulz at ``NS_STEPS`` steps, counted from the iteration
(one multiply-add = 2 FLOPs): the prologue's Frobenius norm, clamp and division ``3·m·n + 1``;
per step ``A = X X^T`` 2·m²·n, ``B = b·A + c·A A`` 2·m³ + 3·m², ``X = a·X + B X`` 2·m²·n + 3·m·n.

Bound on any owner's load ``L_max`` for a plan made by greedy list scheduling (each matrix,
in any order, to an owner of least load; LPT is one such order) or anything better
(Graham, "Bounds for certain multiprocessing anomalies", Bell Syst. Tech. J. 45, 1966):
``L_max <= T/W + (1 - 1/W) · c_max`` (T total cost, c_max the largest), for a planner that
balances this cost (DMuon's default cost model counts the same FLOPs). Count bound: an owner under the cost bound holds
at most as many matrices as the cheapest ones that fit under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Newton–Schulz iterations (torch.optim.Muon's default ``ns_steps``).
NS_STEPS = 5
#: Relative float tolerance on the cost bound (costs are exact integers; T/W is not).
COST_BOUND_REL_TOL = 1e-12


def ns_cost(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of Newton–Schulz on one ``rows x cols`` matrix (module docstring).

    Raises:
        ValueError: a dim < 1 or ``steps`` < 0.
    """
    if rows < 1 or cols < 1 or steps < 0:
        raise ValueError(f"Invalid NS matrix {rows}x{cols} at steps={steps}. Must be dims >= 1, steps >= 0.")
    m, n = min(rows, cols), max(rows, cols)
    per_step = (2 * m * m * n) + (2 * m ** 3 + 3 * m * m) + (2 * m * m * n + 3 * m * n)
    return 3 * m * n + 1 + steps * per_step


@dataclass(frozen=True)
class NSBound:
    """Per-owner Newton–Schulz limits of one job (FLOPs per step and matrices per step).

    Attributes:
        world_size: W, the owners.
        total_cost: T, the sum of every matrix's :func:`ns_cost`.
        max_cost: c_max.
        cost_bound: ``T/W + (1 - 1/W)·c_max`` (plus :data:`COST_BOUND_REL_TOL`).
        count_bound: most matrices one owner can hold under ``cost_bound``.
    """

    world_size: int
    total_cost: int
    max_cost: int
    cost_bound: float
    count_bound: int


def ns_bound(matrix_shapes: Sequence[tuple[int, int]], world_size: int) -> NSBound:
    """:class:`NSBound` of the Muon matrices ``matrix_shapes`` (one entry per matrix: an
    expert stack of E matrices gives E entries) over ``world_size`` owners.

    Raises:
        ValueError: ``world_size`` < 1 or a bad shape (:func:`ns_cost`).
    """
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size}. Must be >= 1.")
    costs = sorted(ns_cost(r, c) for r, c in matrix_shapes)
    total = sum(costs)
    top = costs[-1] if costs else 0
    bound = (total / world_size + (1 - 1 / world_size) * top) * (1 + COST_BOUND_REL_TOL)
    count, acc = 0, 0
    for c in costs:
        if acc + c > bound:
            break
        acc, count = acc + c, count + 1
    return NSBound(world_size, total, top, bound, max(count, 1 if costs else 0))


def owner_loads(owner_of: dict[str, int], shapes: dict[str, list[tuple[int, int]]],
                world_size: int) -> tuple[list[int], list[int]]:
    """``(cost per owner, matrices per owner)`` over ``world_size`` owners from a param ->
    owner map and each param's matrix shapes (FLOPs per step, :func:`ns_cost`)."""
    cost, count = [0] * world_size, [0] * world_size
    for name, g in owner_of.items():
        for r, c in shapes[name]:
            cost[g] += ns_cost(r, c)
            count[g] += 1
    return cost, count
