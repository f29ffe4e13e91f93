"""The rest, replicated by DMuon: ``dedicate_params(rest="replicate")``.

"The rest" is every param of the model that is not dedicated (norms, biases, embeddings,
heads: what AdamW steps). By default (``rest="wrapper"``) DDP or FSDP2 handles it. With
``rest="replicate"`` DMuon does, the way DDP would, and nothing wraps the model:

- every rank keeps the whole rest (params, grads and AdamW state are replicated, as under
  DDP), and every rank runs the same AdamW update on it;
- **first forward** (DMuon's ``world`` group, phase ``setup``, span ``dmuon.rest_broadcast``):
  group rank 0 broadcasts every param of the rest, trainable or frozen, one call per dtype
  (model order of first appearance), each of ``sum(numel)`` elements, so ranks that
  initialised differently start equal (DDP broadcasts at construction; DMuon waits for the
  first forward so that a model built on the meta device and initialised after
  ``dedicate_params`` is covered);
- **end of each backward outside** ``no_sync()`` (DMuon's ``world`` group, on the ``reduce``
  channel's stream under CUDA, phase ``backward``, span ``dmuon.rest_all_reduce``): one ``all_reduce`` (sum) per dtype of the trainable rest
  (model order of first appearance) over all W ranks, issued after the step's last shard
  reduce and waited with the reduces; it carries ``sum(numel) + len(params)`` elements: the
  grads (zeros where this rank has none), then one usage element per param (1 where this
  rank has a grad), as the dedicated reduces do (``docs/protocol.md`` step 4). Each param's grad
  becomes the sum / W, or stays ``None`` where no rank had one.

Per step that is one call where FSDP2 would make two (an all_gather in forward and a
reduce_scatter in backward) and DDP one per 25 MiB bucket: for a rest small enough that its
calls are latency-bound (docs/user-guide.md, "Who handles the rest"). Its memory is not
sharded: ``param + grad + 2 AdamW moments`` of the rest on every rank.

Mixed precision: the rest computes in its own dtype, as under DDP (DMuon's policy applies to
dedicated params only; the dedicated modules hand their outputs back in the dtype their inputs
arrived in, ``precision.py``). Buffers are not synchronised (as under FSDP2).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dmuon import annotate
from dmuon.runtime import collectives, usage

#: ``dedicate_params``' ``rest`` values.
REST_MODES = ("wrapper", "replicate")


def check_rest(rest) -> None:
    """Validate ``rest`` (local, before any collective; what a mesh kind refuses is its
    ``MeshLayout.check_options``, ``dmuon/placement/``).

    Raises:
        ValueError: ``rest`` is not one of :data:`REST_MODES`.
    """
    if not isinstance(rest, str) or rest not in REST_MODES:
        raise ValueError(
            f"Invalid rest={rest!r}. Must be 'wrapper' (the default: DDP or FSDP2 handles the "
            "params DMuon does not dedicate) or 'replicate' (DMuon keeps them replicated and "
            "averages their grads with one all_reduce per step; wrap nothing)."
        )


def rest_of(model: nn.Module, dedicated: set[str]) -> list[tuple[str, nn.Parameter]]:
    """The rest: ``(name, param)`` of every param of ``model`` not in ``dedicated``, model
    order (``named_parameters``: a tied param once)."""
    return [(n, p) for n, p in model.named_parameters() if n not in dedicated]


def ddp_group_size(model: nn.Module) -> int | None:
    """The size of the process group of the DDP whose forward this forward of ``model`` runs
    inside (torch 2.13 sets ``DistributedDataParallel._active_ddp_module`` for the duration of
    DDP's forward: ``torch/nn/parallel/distributed.py``, ``_inside_ddp_forward``), else ``None``
    (also where torch lacks it)."""
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or not any(m is model for m in ddp.module.modules()):
        return None
    return ddp.process_group.size()


def wrapper_defers_sync(model: nn.Module) -> bool:
    """Whether the wrapper of ``model`` skips its grad reduction in the backward of the forward
    that is starting, so DMuon accumulates its dedicated grads locally too (as in ``dm.no_sync()``).

    True when this forward runs inside a ``DistributedDataParallel`` over ``model`` whose
    ``require_backward_grad_sync`` is ``False`` (DDP's ``no_sync()`` sets it, and scripts set it
    by hand: ``ddp.require_backward_grad_sync = micro_step == last``; DDP reads it in the same
    forward), or when the outermost FSDP2 module in ``model`` that manages params was told
    ``set_requires_gradient_sync(False)`` (its param group's ``reduce_grads``, torch 2.13).
    Read at the start of every forward, before the wrapper's own hooks; local, no collective.
    """
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is not None and any(m is model for m in ddp.module.modules()):
        return not ddp.require_backward_grad_sync
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                return not group.reduce_grads
    return False


def warn_if_not_averaged(rest: list[tuple[str, nn.Parameter]], ddp_seen: int | bool, dp_size: int,
                         is_shard=None) -> bool:
    """``rest="wrapper"`` at a ``step()``: something must average the rest's grads over the
    data-parallel ranks, or each rank's AdamW steps on its own micro-batch and the ranks drift
    apart. Averaged: a forward ran inside DDP over all ``dp_size`` data-parallel ranks
    (``ddp_seen``: that DDP's group size, ``False`` if none ran), or every trainable param of the
    rest with a grad is an FSDP2 shard (``is_shard(p)``: the mesh layout's
    ``MeshLayout.is_data_sharded``, a DTensor split over data-parallel ranks; default: any
    DTensor). Otherwise a ``UserWarning`` names a
    param and the fixes (a warning, not an error: the user may average those grads by hand).
    Local, the same on every rank.

    Returns:
        Whether the check is done (False: the rest has trainable params but none has a grad
        yet; ask again at the next step).

    Raises:
        RuntimeError: the DDP's group is not the data-parallel ranks (e.g. ``mesh["shard"]`` of
            an EP or HSDP mesh): it averages the rest over ``ddp_seen`` ranks, the dedicated
            grads over ``dp_size``, so the ranks drift apart silently.
    """
    if ddp_seen and ddp_seen != dp_size:
        raise RuntimeError(
            f"Invalid DistributedDataParallel process group of {ddp_seen} ranks: DMuon's "
            f"data-parallel size here is {dp_size} (dedicated grads are averaged over it), so the "
            "rest's grads must be averaged over the same ranks. Build "
            "DistributedDataParallel(model) on the default group (or a group of all "
            f"{dp_size} data-parallel ranks), or pass rest='replicate' to dedicate_params."
        )
    trainable = [(n, p) for n, p in rest if p.requires_grad]
    if dp_size < 2 or ddp_seen or not trainable:
        return True
    with_grad = [(n, p) for n, p in trainable if p.grad is not None]
    is_shard = is_shard or (lambda p: isinstance(p, DTensor))
    bare = [n for n, p in with_grad if not is_shard(p)]
    if bare:
        warnings.warn(
            f"DMuon: rest='wrapper' but nothing averages the grads of {bare[0]} (and "
            f"{len(bare) - 1} other params DMuon does not dedicate) over the {dp_size} "
            "data-parallel ranks: no forward ran inside DistributedDataParallel and they are not "
            "FSDP2 shards, so each rank steps them on its own batch and the ranks drift apart. "
            "Wrap the model (DistributedDataParallel(model) or fully_shard(..., "
            "ignored_params=set(dm))) after dmuon.dedicate_params, pass rest='replicate', or "
            "average these grads yourself before step().",
            stacklevel=5,
        )
    return bool(with_grad)


def check_dtypes(model: nn.Module, dedicated: set[str], param_dtype: torch.dtype) -> None:
    """``rest="replicate"`` with a ``param_dtype``: no module may hold both a dedicated param
    (cast to ``param_dtype`` for its forward) and a floating-point param of the rest in another
    dtype (kept in it), or that forward mixes dtypes (a Linear's bf16 weight and fp32 bias).

    Raises:
        ValueError: naming the module and both params.
    """
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        mine = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
        cast = [n for n, _ in mine if n in dedicated]
        kept = [(n, p.dtype) for n, p in mine
                if n not in dedicated and p.is_floating_point() and p.dtype != param_dtype]
        if cast and kept:
            raise ValueError(
                f"Invalid mp_policy with rest='replicate': module {name or '<root>'!r} holds the "
                f"dedicated {cast[0]!r} (cast to {param_dtype} for its forward) and the rest's "
                f"{kept[0][0]!r}, which rest='replicate' keeps in {kept[0][1]}, so its forward "
                "would mix dtypes. Use rest='wrapper' (fully_shard casts the rest too), or no "
                "param_dtype."
            )


class ReplicatedRest:
    """The rest of one model, replicated (module docstring).

    Params are looked up by name at each use, so a param the user replaces (``to_empty``,
    ``m.weight = nn.Parameter(...)``) is followed; one that a wrapper replaced by a DTensor
    raises.

    Args:
        model: the bare model given to ``dedicate_params``.
        names: the rest's names (:func:`rest_of`).
        group: DMuon's ``world`` group (all W ranks).
    """

    def __init__(self, model: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
        modules = dict(model.named_modules())
        self.names = list(names)
        self._slots = [(modules[n.rpartition(".")[0]], n.rpartition(".")[2]) for n in self.names]
        # the rest's holders and their ancestors: none may become an FSDP2 module
        prefixes = {".".join(n.split(".")[:i]) for n in self.names for i in range(n.count(".") + 1)}
        self._holders = [(name, modules[name]) for name in sorted(prefixes)]
        self._group = group
        self._broadcast_done = False
        # (work, buffer, params, this rank's usage flags) per dtype
        self._pending: list[tuple[collectives.Pending, torch.Tensor, list[nn.Parameter], list[bool]]] = []

    def close(self) -> None:
        """Drop the ``world`` group (``DedicatedParams.close()`` destroys it)."""
        self._group = None

    def params(self) -> list[nn.Parameter]:
        """The rest's current params (model order).

        Raises:
            ValueError: one was replaced by a DTensor or a module holding one was wrapped by
                ``fully_shard`` (which shards them and swaps them in only for its forward).
        """
        wrapped = next((name for name, m in self._holders if isinstance(m, FSDPModule)), None)
        if wrapped is not None:
            _refuse(f"module {wrapped or '<root>'!r} was wrapped by fully_shard, but "
                    f"dedicate_params(rest='replicate') handles the params it holds (e.g. "
                    f"{self.names[0]!r})")
        out = []
        for name, (module, attr) in zip(self.names, self._slots):
            p = getattr(module, attr, None)
            if p is None or isinstance(p, DTensor):
                _refuse(f"the param {name!r} is {'gone' if p is None else 'a DTensor'}, but "
                        "dedicate_params(rest='replicate') handles it")
            out.append(p)
        return out

    # ------------------------------------------------------------------ first forward
    def begin_forward(self) -> None:
        """Each forward: check the rest is still ours (:meth:`params`); the first forward
        also broadcasts group rank 0's values of the whole rest to every rank (synchronous,
        one broadcast per dtype)."""
        params = self.params()
        if self._broadcast_done:
            return
        self._broadcast_done = True
        with torch.no_grad(), annotate.phase("setup"), annotate.span("dmuon.rest_broadcast"):
            for group in _by_dtype(params):
                flat = torch.cat([p.detach().reshape(-1) for p in group])
                collectives.broadcast_(flat, 0, self._group)
                for p, part in zip(group, torch.split(flat, [p.numel() for p in group])):
                    p.copy_(part.view_as(p))

    # ------------------------------------------------------------------ backward
    def issue(self, launcher_of) -> None:
        """End of a backward outside ``no_sync``: pack and issue one async ``all_reduce`` per
        dtype (``launcher_of(tensor)`` gives the device's launcher)."""
        trainable = [p for p in self.params() if p.requires_grad]
        for params in _by_dtype(trainable):
            n = sum(p.numel() for p in params)
            buf = torch.empty(n + len(params), dtype=params[0].dtype, device=params[0].device)
            flags = [p.grad is not None for p in params]
            with torch.no_grad():
                for p, view in zip(params, torch.split(buf[:n], [p.numel() for p in params])):
                    view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            usage.fill_flags_(buf[n:], flags)  # no host-to-device copy (usage.py)
            with annotate.phase("backward"), annotate.span("dmuon.rest_all_reduce"):
                work = launcher_of(buf).all_reduce(buf, self._group, channel="reduce")
            self._pending.append((work, buf, params, flags))

    def finish(self, world_size: int) -> None:
        """Wait for the all_reduces; each param's grad becomes the average (in place into a
        kept grad tensor), or stays ``None`` where no rank produced one."""
        pending, self._pending = self._pending, []
        for work, buf, params, flags in pending:
            work.wait()
            n = sum(p.numel() for p in params)
            # read back only where this rank had no grad (usage.py: no sync otherwise)
            anywhere = usage.used_anywhere(flags, lambda: buf[n:])
            with torch.no_grad():
                buf[:n].div_(world_size)
                for p, view, used in zip(params, torch.split(buf[:n], [p.numel() for p in params]), anywhere):
                    if p.grad is not None:
                        p.grad.copy_(view.view_as(p.grad))
                    elif used:  # a fresh grad laid out like p (as autograd would make it)
                        p.grad = torch.empty_like(p).copy_(view.view_as(p))

    def abort(self, drop_grads: bool) -> None:
        """After an exception: wait for what is in flight; an aborted backward drops the
        rest's grads (a step must not use one rank's partial grads)."""
        for work, *_ in self._pending:
            work.wait()
        self._pending = []
        if drop_grads:
            for p in self.params():
                p.grad = None


def _refuse(what: str) -> None:
    raise ValueError(
        f"Invalid model: {what}. With rest='replicate' DMuon replicates every param it does not "
        "dedicate, so the model must not be wrapped by fully_shard or DistributedDataParallel. "
        "Drop the wrapper, or use rest='wrapper'."
    )


def _by_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())
