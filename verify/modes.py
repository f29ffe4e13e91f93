"""How each mode of the harness wraps the model and builds its optimizer (one function each).

Every builder runs on every rank inside an initialised process group and returns a
:class:`Built`: the wrapped model, one optimizer object exposing ``step()``, ``zero_grad()``
and ``ns_calls``, and the :class:`verify.predict.RunLayout` the predictor needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.select import default_predicate
from dmuon.plan import specs_from_named_parameters

from .baselines import NaiveShardedMuon, ZeroOneMuon
from .predict import RunLayout

#: Hyper-parameters every mode uses (Muon's and AdamW's torch defaults except the lrs).
MUON_LR = 0.02
ADAMW_LR = 3e-3
DDP_BUCKET_CAP_MB = 25


@dataclass
class Built:
    """A mode ready to train on this rank."""

    model: nn.Module
    optimizer: object
    layout: RunLayout
    dedicated: dmuon.DedicatedParams | None = None


class _Pair:
    """Two optimizers stepped as one (a baseline's Muon + AdamW), counting NS calls."""

    def __init__(self, muon, adamw, ns_calls: Callable[[], int]) -> None:
        self.muon, self.adamw, self._ns_calls = muon, adamw, ns_calls

    @property
    def ns_calls(self) -> int:
        return self._ns_calls()

    def step(self) -> None:
        with dmuon.phase("optimizer"):
            self.muon.step()
            self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.adamw.zero_grad()


def muon_names(model: nn.Module) -> tuple[str, ...]:
    """Muon targets: DMuon's default predicate, applied the same way in every mode."""
    modules = dict(model.named_modules())
    return tuple(
        n for n, p in model.named_parameters() if default_predicate(n, p, modules[n.rpartition(".")[0]])
    )


def _mesh(mode: str, world: int, device: str):
    if "hsdp" in mode:
        if world % 2 or world < 4:
            raise ValueError(
                f"Invalid world_size={world} for {mode}: HSDP runs on a (2, W/2) mesh and "
                "needs an even W >= 4."
            )
        return init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,))


def _fsdp_wrap(model: nn.Module, mesh, reshard: bool, ignored: set, per_linear: list[str]) -> tuple[str, ...]:
    """fully_shard: optionally each Muon Linear, then each block, then the root; wrap order."""
    order = []
    modules = dict(model.named_modules())
    for name in per_linear:
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=reshard)
        order.append(name)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
        order.append(f"blocks.{i}")
    # The root without reshard_after_forward: FSDP2's "auto" keeps it unsharded after forward.
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    order.append("")
    return tuple(order)


def build(mode: str, make_model: Callable[[], nn.Module], device: str = "cpu") -> Built:
    """Build ``mode`` on this rank: wrap ``make_model()`` and create its optimizer.

    Raises:
        ValueError: unknown mode or a world size the mode cannot use.
    """
    world = dist.get_world_size()
    model = make_model().to(device)
    specs = tuple(specs_from_named_parameters(model.named_parameters()))
    targets = muon_names(model)
    mesh = _mesh(mode, world, device)
    r_size, n = (mesh.shape if mesh.ndim == 2 else (1, world))
    reshard = mode.endswith("z3") or mode == "naive-hsdp"

    def layout(fsdp_modules=(), reshard_flag=reshard) -> RunLayout:
        return RunLayout(
            mode=mode,
            replicate_size=r_size,
            shard_size=n,
            params=specs,
            muon_names=targets,
            fsdp_modules=fsdp_modules,
            reshard_after_forward=reshard_flag,
            ddp_bucket_cap_bytes=DDP_BUCKET_CAP_MB * 1024 * 1024,
        )

    if mode.startswith("dmuon-"):
        dm = dmuon.dedicate_params(model, mesh, params=list(targets), reshard_after_forward=reshard)
        if mode == "dmuon-ddp":
            model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
            fsdp_modules = ()
        else:
            fsdp_modules = _fsdp_wrap(model, mesh, reshard, set(dm), [])
        opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
        return Built(model, opt, layout(fsdp_modules), dm)

    if mode == "ddp-muon":
        named = dict(model.named_parameters())
        model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        muon = torch.optim.Muon([named[t] for t in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        counter = _count_torch_muon_ns(muon)
        return Built(model, _Pair(muon, adamw, counter), layout())

    if mode == "zero1-muon":
        named = dict(model.named_parameters())
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(targets))
        model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        muon = ZeroOneMuon([(t, named[t]) for t in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        return Built(model, _Pair(muon, adamw, lambda: muon.ns_calls), layout())

    if mode in ("naive-fsdp2-z2", "naive-fsdp2-z3", "naive-hsdp"):
        linear_modules = sorted({t.rpartition(".")[0] for t in targets}, key=[s.module for s in specs].index)
        fsdp_modules = _fsdp_wrap(model, mesh, reshard, set(), linear_modules)
        named = dict(model.named_parameters())
        muon = NaiveShardedMuon([named[t] for t in targets], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n_, p in named.items() if n_ not in targets], lr=ADAMW_LR)
        return Built(model, _Pair(muon, adamw, lambda: muon.ns_calls), layout(fsdp_modules))
    raise ValueError(f"Invalid mode={mode!r}.")


def _count_torch_muon_ns(opt: torch.optim.Muon) -> Callable[[], int]:
    """Count torch.optim.Muon's real NS calls: wrap its NS function during ``step()`` only."""
    import torch.optim._muon as muon_module

    calls = [0]
    original = muon_module._zeropower_via_newtonschulz

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    def pre(optimizer, args, kwargs):
        muon_module._zeropower_via_newtonschulz = counting

    def post(optimizer, args, kwargs):
        muon_module._zeropower_via_newtonschulz = original

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return lambda: calls[0]
