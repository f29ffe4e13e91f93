"""The ownership plan as a table (moved out of ``dmuon/ownership/plan.py`` so that ``import dmuon``
loads no presentation library): per-owner load, then per-shard bytes and the max/mean ratios."""

from __future__ import annotations

from tabulate import tabulate

from dmuon.ownership.plan import OwnershipPlan


def format_plan_summary(plan: OwnershipPlan) -> str:
    """A short table of ``plan``'s per-owner load (params, NS cost, bytes), then the bytes per
    shard index and the max/mean ratios of both."""
    n = plan.mesh_shape[1]
    rows = [
        (g, g // n, g % n, len(plan.params_of(g)), plan.ns_load[g], plan.bytes_load[g])
        for g in range(plan.world_size)
    ]
    owners = tabulate(
        rows,
        headers=["owner g", "replicate r", "shard s", "params", "ns_cost", "param_bytes"],
        tablefmt="github",
    )
    return (
        f"OwnershipPlan mesh_shape={plan.mesh_shape} params={len(plan.specs)} "
        f"digest={plan.digest()[:12]}\n{owners}\n"
        f"bytes per shard s: {list(plan.bytes_load_per_shard)}\n"
        f"ns_cost max/mean over owners: {plan.ns_max_over_mean:.3f}; "
        f"bytes max/mean over shard indices: {plan.bytes_max_over_mean:.3f}"
    )
