"""The two objects a kind of dedicated param is made of (FSDP2's ``FSDPParam`` counterpart).

- A :class:`Placement` per dedicated param: where its values live on this rank (the local
  tensor DMuon's buckets hold and move), how a tensor of that local shape is shown as the param
  (a plain tensor, a ``DTensor``), whether this rank keeps its momentum and adds its grad to the
  global norm, and how its owners compute the Muon update (:meth:`Placement.step`).
- A :class:`MeshLayout` per ``dedicate_params`` call: which meshes it accepts, the checks on the
  model, this rank's data-parallel topology, the ownership plan, DMuon's process groups, and the
  :class:`Placement` of each dedicated param.

The runtime (``dmuon/runtime/``), the optimizer (``dmuon/optim/``) and ``dedicate_params`` ask
these objects; none of them branches on the kind. The kinds: ``dense.py`` (a plain matrix,
data parallel over the whole mesh) and ``tp.py`` (a tensor-parallel ``DTensor`` matrix). A new
kind is one subclass of each; ``docs/architecture.md``, "Placements", lists the methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    import torch.nn as nn

    from dmuon.ownership.plan import OwnershipPlan, ParamSpec
    from dmuon.ownership.topology import Topology
    from dmuon.runtime.collectives import DMuonGroups


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
    #: The data-parallel mesh its buckets move on: ``"dp"``, the layout's own topology and
    #: plan; any other key names one of ``MeshLayout.extra_meshes``.
    mesh_key: ClassVar[str] = "dp"

    def __init__(self, name: str) -> None:
        self.name = name

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
        of every matrix counted once over the W ranks)."""
        return True

    @classmethod
    def step(cls, opt, params: list[torch.Tensor], hparams: dict) -> int:
        """The Muon update of ``params`` (this kind's params of one param group that this rank
        owns and that have a grad; the same call on every rank, possibly empty), in place.

        ``opt`` is the :class:`~dmuon.optim.optimizer.DMuon`; its public helpers give the
        momentum (:meth:`~dmuon.optim.optimizer.DMuon.momentum_of`), the matrix view
        (``matrix_shape``) and a launcher per device (``launcher``). ``hparams``: the group's
        ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_steps``,
        ``eps``, ``adjust_lr_fn``. Returns the number of matrices orthogonalized on this rank.
        """
        raise NotImplementedError(f"{cls.__name__}.step")


class MeshLayout:
    """The kind of mesh one ``dedicate_params`` call runs on, and this rank's place in it.

    Class-level methods run before the layout exists (checks, every rank, before any
    collective); :meth:`build` makes this rank's instance (local: no collective).

    Attributes:
        index: this rank's index on the model-parallel axis (TP's ``t``, EP's ``e``), 0 without one.
        size: ranks per model-parallel group (TP's ``T``, EP's ``E``), 1 without one.
        plan: the data-parallel :class:`~dmuon.ownership.plan.OwnershipPlan` the runtime uses.
        agreed_plan: the plan the ranks' setup digest covers (the full plan under TP).
        placements: name -> :class:`Placement` of every dedicated param.
    """

    kind: ClassVar[str] = "base"
    #: The model-parallel mesh axis of this kind (``"tp"``, ``"ep"``), ``None`` without one.
    axis: ClassVar[str | None] = None
    #: Whether an HSDP mesh of this kind may be moved flat (``hierarchy="flat"``).
    allows_flat: ClassVar[bool] = True
    #: Whether a dedicated grad is shown as a DTensor on FSDP2's mesh between backward and
    #: ``step()`` (``dmuon/runtime/grad_view.py``), so torch's ``clip_grad_norm_`` is global.
    shows_grad_view: ClassVar[bool] = True
    #: Whether ``coalesce`` may join consecutive blocks into one unit. A kind whose params move
    #: on two data-parallel meshes keeps one unit per block, so both meshes' buckets of a block
    #: share its unit (its forward window, its free, its reduce trigger).
    joins_blocks: ClassVar[bool] = True

    def __init__(self, plan: OwnershipPlan, placements: dict[str, Placement], *,
                 index: int = 0, size: int = 1, agreed_plan: OwnershipPlan | None = None) -> None:
        self.plan = plan
        self.placements = placements
        self.index = index
        self.size = size
        self.agreed_plan = plan if agreed_plan is None else agreed_plan

    @classmethod
    def matches(cls, mesh) -> bool:
        """Whether ``mesh`` (a ``DeviceMesh``, a process group or ``None``) is of this kind."""
        raise NotImplementedError(f"{cls.__name__}.matches")

    @classmethod
    def check_options(cls, mesh, *, hierarchy: str, rest: str) -> None:
        """Refuse ``dedicate_params`` options this kind does not support (``ValueError``):
        ``hierarchy="flat"`` unless :attr:`allows_flat`."""
        if hierarchy == "flat" and not cls.allows_flat:
            raise ValueError(
                f"Invalid hierarchy='flat' on a mesh with the model-parallel axis {cls.axis!r}: "
                "DMuon moves its dedicated params over the shard and replicate axes of each "
                f"{cls.axis!r} column. Use hierarchy='auto' or 'hierarchical' there."
            )

    @classmethod
    def check_model(cls, model: nn.Module, mesh, dedicated: set[str]) -> None:
        """Check the model's params against the mesh (``ValueError`` naming the param)."""
        raise NotImplementedError(f"{cls.__name__}.check_model")

    @classmethod
    def topology(cls, mesh) -> Topology:
        """This rank's data-parallel topology (the shard and replicate axes DMuon moves on)."""
        raise NotImplementedError(f"{cls.__name__}.topology")

    @classmethod
    def build(cls, mesh, named: list[tuple[str, nn.Parameter, str]],
              specs: list[ParamSpec], topology: Topology) -> MeshLayout:
        """Plan the owners and place every dedicated param (local: the ranks agree on the plan
        afterwards, by the setup digest)."""
        raise NotImplementedError(f"{cls.__name__}.build")

    def extra_meshes(self, groups: DMuonGroups) -> dict[str, tuple]:
        """The data-parallel meshes other than the layout's own (``"dp"``) that some
        placements' buckets move on: ``mesh_key`` -> ``(topology, plan, groups, divisor)``
        (``divisor``: of the reduced grads). None by default."""
        return {}

    def make_groups(self, mesh, topology: Topology) -> DMuonGroups:
        """DMuon's process groups (a collective: every rank, the same order). ``topology``: the
        data-parallel topology the runtime moves on (an HSDP mesh moved flat: 1-D)."""
        raise NotImplementedError(f"{type(self).__name__}.make_groups")
