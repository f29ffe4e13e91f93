"""``dedicate_params``' knobs as one value: :class:`DedicateOptions` (the values given,
validated once, on every rank, before any collective) and :class:`ResolvedOptions` (what they
mean on this mesh, backend and model: the ``"auto"`` choices made). ``dedicate_params`` builds
both; the runtime (``DedicatedParams``, ``Runtime``, ``Schedule``, each ``Bucket``) reads the
one :class:`ResolvedOptions` it is handed, and nothing stores a knob under another name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.ownership.buckets import (DEFAULT_BUCKET_CAP_MB, Coalescing, bucket_layout,
                                     check_hierarchy, check_link, resolve_coalesce,
                                     resolve_hierarchy)
from dmuon.ownership.plan import OwnershipPlan, ParamSpec
from dmuon.runtime.rest import check_rest


@dataclass(frozen=True)
class DedicateOptions:
    """The knobs of :func:`dmuon.dedicate_params`, as given (its docstring says what each does).

    Built once by ``dedicate_params``; ``__post_init__`` validates every field, locally (no
    collective), so a bad value raises on every rank before DMuon creates a group.

    Attributes:
        reshard_after_forward: ``True`` = Z3, ``False`` = Z2.
        mp_policy: a ``MixedPrecisionPolicy`` (or an object with its attribute names), or
            ``None``.
        bucket_cap_mb: cap of one bucket in MiB (> 0, finite).
        prefetch_depth: buckets issued ahead (int >= 0).
        coalesce: ``"auto"``, ``"block"``, ``"all"`` or a byte count (int >= 0).
        rest: ``"wrapper"`` or ``"replicate"``.
        hierarchy: ``"auto"``, ``"hierarchical"`` or ``"flat"``.
        link: ``"auto"``, ``"nccl"`` or ``"gloo"``.

    Raises:
        ValueError: a field out of its domain; the message names the argument, its value, the
            values allowed and what to pass.
    """

    reshard_after_forward: bool = True
    mp_policy: Any = None
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    prefetch_depth: int = 1
    coalesce: str | int = "auto"
    rest: str = "wrapper"
    hierarchy: str = "auto"
    link: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"Invalid reshard_after_forward={self.reshard_after_forward!r}. Must be True (Z3: "
                "non-holders free after forward) or False (Z2: keep until the next step)."
            )
        _check_policy(self.mp_policy)
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(
                f"Invalid bucket_cap_mb={cap!r}. Must be a positive number of MiB (a "
                f"block's params per owner share one collective up to this size; default "
                f"{DEFAULT_BUCKET_CAP_MB})."
            )
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(
                f"Invalid prefetch_depth={depth!r}. Must be an int >= 0 (buckets whose "
                "broadcast is issued ahead of the module that needs them; 1 is the default)."
            )
        resolve_coalesce(self.coalesce, "gloo")  # raises for a value that is no coalesce mode
        check_rest(self.rest)
        check_hierarchy(self.hierarchy)
        check_link(self.link)

    @property
    def bucket_cap_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes (at least 1)."""
        return max(1, int(self.bucket_cap_mb * 1024 * 1024))

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The compute dtype of the dedicated params (``None``: their own)."""
        return getattr(self.mp_policy, "param_dtype", None)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype of the reduces (``None``: the grads' own); FSDP2's default:
        ``param_dtype``."""
        return getattr(self.mp_policy, "reduce_dtype", None) or self.param_dtype

    def resolve(self, *, backend: str | None, joins_blocks: bool, hsdp: bool, allows_flat: bool,
                specs: Sequence[ParamSpec], plan: OwnershipPlan,
                rest_names: Sequence[str] = ()) -> ResolvedOptions:
        """What these options mean here (pure; the same on every rank given the same inputs).

        Args:
            backend: the backend DMuon's groups run on (``collectives.link_backend``); read
                only when ``link="auto"`` (``None`` otherwise).
            joins_blocks: the mesh kind lets ``coalesce`` join blocks into units
                (``MeshLayout.joins_blocks``; else one unit per block).
            hsdp: the data-parallel mesh has a replicate axis of more than one rank.
            allows_flat: the mesh kind may move an HSDP mesh flat (``MeshLayout.allows_flat``).
            specs, plan: the dedicated params and their plan (``hierarchy="auto"`` asks
                whether they form one unit).
            rest_names: the params DMuon does not dedicate, in model order (kept under
                ``rest="replicate"``).
        """
        policy = backend if self.link == "auto" else self.link
        coalescing = resolve_coalesce(self.coalesce, policy)
        if not joins_blocks:
            coalescing = dataclasses.replace(coalescing, target_bytes=0)
        flat = hsdp and allows_flat and resolve_hierarchy(
            self.hierarchy, coalescing,
            lambda: bucket_layout(specs, plan, self.bucket_cap_bytes, coalescing.target_bytes,
                                  coalescing.reduce_by_gather))
        return ResolvedOptions(self, policy, coalescing, flat,
                               tuple(rest_names) if self.rest == "replicate" else ())


@dataclass(frozen=True)
class ResolvedOptions:
    """:class:`DedicateOptions` with the choices ``"auto"`` left open made for this mesh,
    backend and model (:meth:`DedicateOptions.resolve`); what the runtime reads.

    Attributes:
        given: the options as given.
        link_policy: whose link policy the collectives follow (``buckets.LINK_COSTS`` key:
            ``link``, or the groups' backend for ``"auto"``).
        coalescing: ``coalesce`` resolved (:class:`~dmuon.ownership.buckets.Coalescing`:
            the unit target in bytes, reductions by gather).
        flat: an HSDP mesh moves the dedicated params flat (``hierarchy`` resolved; False on
            a 1-D mesh).
        rest_names: the params DMuon replicates (``rest="replicate"``), model order; else ().
    """

    given: DedicateOptions
    link_policy: str
    coalescing: Coalescing
    flat: bool
    rest_names: tuple[str, ...] = ()

    # the given knobs the runtime reads, by their own names
    @property
    def reshard_after_forward(self) -> bool:
        return self.given.reshard_after_forward

    @property
    def mp_policy(self):
        return self.given.mp_policy

    @property
    def prefetch_depth(self) -> int:
        return self.given.prefetch_depth

    @property
    def bucket_cap_bytes(self) -> int:
        return self.given.bucket_cap_bytes

    @property
    def rest(self) -> str:
        return self.given.rest

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.given.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.given.reduce_dtype

    @property
    def reduce_by_gather(self) -> bool:
        return self.coalescing.reduce_by_gather


def _check_policy(policy) -> None:
    """``mp_policy`` is ``None`` or has FSDP2's ``MixedPrecisionPolicy`` attributes, each
    dtype ``None`` or a floating ``torch.dtype``.

    Raises:
        ValueError: e.g. a bare ``torch.bfloat16`` (read as "no policy" before: every call ran
            in the params' dtype, silently).
    """
    if policy is None:
        return
    fix = ("Pass torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) "
           "(the object fully_shard takes), or None.")
    if not hasattr(policy, "param_dtype"):
        raise ValueError(f"Invalid mp_policy={policy!r}: not a mixed-precision policy (it has no "
                         f"param_dtype). {fix}")
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, key, None)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(f"Invalid mp_policy.{key}={value!r}: must be None or a floating "
                             f"torch.dtype. {fix}")
