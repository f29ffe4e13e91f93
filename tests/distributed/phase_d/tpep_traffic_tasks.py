"""Rank-side tasks for tests/distributed/phase_d/test_traffic_tpep.py: a planted traffic bug in
the runtime on the TP × EP mesh that the independent predictor (verify/traffic/tpep.py) must
catch."""

from __future__ import annotations

import dataclasses
from unittest import mock

from tests.distributed.phase_d.traffic_tasks import measure_mode


def measure_with_dense_owners_rotated(mode: str, **config) -> dict:
    """``measure_mode`` with the runtime's plan of the dense column (TP shards and routers)
    rotated by one column rank (owner c -> c + 1 mod N·E), alike on every rank, so the run
    agrees with itself and trains, but its buckets and step-6 gathers sit on other owners than
    the documented plan's. Patches ``plan_layout`` where ``MeshLayout.build`` calls it; fails
    loudly if the runtime no longer has it or has no dense column."""
    import dmuon.placement.layout as layout

    original = layout.plan_layout

    def rotated(dims, layouts, specs):
        result = original(dims, layouts, specs)
        plan = result.plans[layout.DP_KEY]
        n = plan.mesh_shape[0] * plan.mesh_shape[1]
        assert n > 1 and plan.owner, "no dense column to rotate"
        moved = dataclasses.replace(plan, owner={k: (g + 1) % n for k, g in plan.owner.items()})
        return dataclasses.replace(result, plans={**result.plans, layout.DP_KEY: moved})

    with mock.patch.object(layout, "plan_layout", rotated):
        return measure_mode(mode, **config)
