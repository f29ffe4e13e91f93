"""What a kind of dedicated param implements (FSDP2's ``FSDPParam`` counterpart).

A :class:`Placement` per dedicated param says where its values live on this rank (the local
tensor DMuon's buckets hold and move), how a tensor of that local shape is shown as the param
(a plain tensor, a ``DTensor``), which data-parallel column its buckets move over
(``mesh_key``), whether this rank keeps its momentum and adds its grad to the global norm, and
how its owners compute the Muon update (:meth:`Placement.step`, given a :class:`StepContext`).

The one mesh layout (``layout.py``) reads each param's kind from its DTensor placements and the
mesh dims they name; the runtime (``dmuon/runtime/``), the optimizer (``dmuon/optim/``) and
``dedicate_params`` ask these objects and never branch on the kind. The kinds: ``dense.py`` (a
plain matrix), ``matrix.py`` (a matrix sharded on a model-parallel dim: tensor parallel),
``stack.py`` (a stack sharded on dim 0: experts). A new kind is one subclass;
``docs/architecture.md``, "Placements", lists the methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepContext:
    """What :meth:`Placement.step` may use: the params' state and views, the hyper-parameters
    and DMuon's groups of the model-parallel dims (not the optimizer).

    Attributes:
        hparams: the param group's ``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
            ``ns_coefficients``, ``ns_steps``, ``eps``, ``adjust_lr_fn``.
        momentum_of: ``p`` -> its momentum buffer (created where missing).
        matrix_shape: ``p`` -> Muon's ``(rows, cols)`` view of one of its matrices.
        placement_of: ``p`` -> its :class:`Placement`.
        launcher: device -> the :class:`~dmuon.runtime.collectives.Launcher` a step's
            collectives go through (work handles on gloo, a side stream on CUDA).
        groups: model-parallel dim -> this rank's DMuon group along it (``Placement.group_key``).
        label: ``p`` -> ``(unit, block, owner)`` for the spans.
    """

    hparams: dict
    momentum_of: Callable[[torch.Tensor], torch.Tensor]
    matrix_shape: Callable[[torch.Tensor], tuple[int, int]]
    placement_of: Callable[[torch.Tensor], "Placement"]
    launcher: Callable[[torch.device], object]
    groups: Mapping[str, dist.ProcessGroup]
    label: Callable[[torch.Tensor], tuple[str, str, int]]


class Placement:
    """Where one dedicated param lives on this rank and how its owners step it.

    The defaults are a plain tensor held whole on every rank. Subclasses override what differs.

    Attributes:
        name: the param's fully qualified name.
        step_order: the order in which :meth:`step` runs per param group, kinds sorted by it
            (the same on every rank: a kind whose step issues collectives must meet its peers).
        mesh_key: which data-parallel mesh its buckets move on (class attribute).
    """

    kind: ClassVar[str] = "base"
    step_order: ClassVar[int] = 0
    #: The data-parallel column its buckets move on: ``"dp"`` (every data-parallel dim), or
    #: one of ``MeshLayout.extra_meshes`` (the params sharded on some data-parallel dims).
    mesh_key: str = "dp"

    def __init__(self, name: str, *, counted: bool = True, mesh_key: str = "dp") -> None:
        self.name = name
        self._counted = counted
        self.mesh_key = mesh_key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ----------------------------------------------------------------- values
    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor of ``t`` (the param, its compute copy or its grad) that this rank holds:
        what a bucket's flat buffer views and its collectives move. Shape: the local shape."""
        return t

    def like(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor of ``p``'s local shape) as a tensor like ``p``: what ``.grad`` and a
        compute copy are set to. Shares ``t``'s memory."""
        return t

    def placed_like(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A grad ``g`` of ``p`` in ``p``'s own layout (what autograd produced may differ)."""
        return g

    def guarded(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors that carry the freed guard while ``p``'s storage is freed: every object
        through which a user can read its values."""
        return (p,)

    # ----------------------------------------------------------------- optimizer
    def keeps_momentum(self) -> bool:
        """Whether this rank, when it owns the param, keeps its momentum (and runs its
        Newton–Schulz)."""
        return True

    def new_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """A fresh momentum buffer: zeros of ``p``'s shape, dtype and device, as
        ``torch.optim.Muon`` creates at a param's first step."""
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def counts_in_norm(self) -> bool:
        """Whether this rank's owned grad of the param enters the global grad norm (each element
        of every matrix counted once over the W ranks: ``False`` in every model-parallel column
        the param is replicated over but the first)."""
        return self._counted

    @classmethod
    def step(cls, ctx: StepContext, params: list[torch.Tensor]) -> int:
        """The Muon update of ``params`` (this kind's params of one param group that this rank
        owns and that have a grad; the same call on every rank, possibly empty), in place, with
        ``ctx``'s hyper-parameters, momenta and groups. Returns the number of matrices
        orthogonalized on this rank."""
        raise NotImplementedError(f"{cls.__name__}.step")
