"""Placements: one object per kind of dedicated param (``base.py``), read from its DTensor
layout by the one mesh layout (``layout.py``) against the mesh's declared data-parallel dims
(``dims.py``). :func:`layout_for` is the one place that looks at the mesh; everything after asks
the objects it returns.
"""

from __future__ import annotations

from dmuon.placement.base import Placement, StepContext
from dmuon.placement.dense import Dense
from dmuon.placement.layout import MeshLayout, already_wrapped, layout_for
from dmuon.placement.matrix import MatrixShard
from dmuon.placement.stack import StackShard

__all__ = ["Dense", "MatrixShard", "MeshLayout", "Placement", "StackShard", "StepContext",
           "already_wrapped", "layout_for"]
