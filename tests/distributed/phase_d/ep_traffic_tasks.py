"""Rank-side tasks for tests/distributed/phase_d/test_traffic_ep.py: a planted traffic bug in
the EP runtime that the independent predictor (verify/traffic/ep.py) must catch."""

from __future__ import annotations

from unittest import mock

from tests.distributed.phase_d.traffic_tasks import measure_mode


def measure_with_experts_on_dense_groups(mode: str, **config) -> dict:
    """``measure_mode`` with the expert stacks' buckets moved on the dense params' groups (the
    (R, N·E) mesh of all W ranks) instead of their EP column's: the same elements, another
    group, so every byte count per rank is unchanged and only the groups show it. Patches
    ``MeshLayout.extra_meshes`` where the runtime asks for the columns' groups; fails loudly if
    the runtime no longer has it or there is no column."""
    from dmuon.placement.layout import MeshLayout

    original = MeshLayout.extra_meshes

    def on_dense_groups(layout, groups):
        columns = original(layout, groups)
        assert columns, "no column of expert stacks to move onto the dense groups"
        return {key: (topology, plan, groups, divisor)
                for key, (topology, plan, _, divisor) in columns.items()}

    with mock.patch.object(MeshLayout, "extra_meshes", on_dense_groups):
        return measure_mode(mode, **config)
