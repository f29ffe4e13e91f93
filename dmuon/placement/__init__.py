"""Placements: one object per kind of dedicated param, and one per kind of mesh (``base.py``).

:func:`layout_class` is the one place that looks at the mesh to pick a kind; everything after
asks the objects it returns.
"""

from __future__ import annotations

from dmuon.placement.base import MeshLayout, Placement
from dmuon.placement.dense import DataParallelMesh, Dense
from dmuon.placement.ep import EPMesh, EPShard
from dmuon.placement.tp import TPMesh, TPShard

#: Mesh kinds, asked in this order (the first whose ``matches`` holds); the last is the fallback.
LAYOUTS: tuple[type[MeshLayout], ...] = (TPMesh, EPMesh, DataParallelMesh)


def layout_class(mesh) -> type[MeshLayout]:
    """The :class:`MeshLayout` kind of ``mesh`` (a ``DeviceMesh``, a process group or ``None``)."""
    return next(cls for cls in LAYOUTS if cls.matches(mesh))


__all__ = ["LAYOUTS", "DataParallelMesh", "Dense", "EPMesh", "EPShard", "MeshLayout", "Placement",
           "TPMesh", "TPShard", "layout_class"]
