"""Rank-side tasks for the NCCL-path tests: the link policy from the backend, no
host–device sync in a step, one issue order across DMuon's channels, no deprecated call."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.runtime import collectives

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D, bias=False)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Chain(nn.Module):
    """Four blocks in model order; ``skip`` (a block index) is left out of the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.norm(x)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, D, generator=g)


def policy_on_meta(backend: str) -> dict:
    """A model built on ``meta`` (the documented meta-init flow), with the default group's
    backend name reported as ``backend`` to the link policy only (DMuon's groups stay gloo):
    what ``dedicate_params`` resolved."""
    saved = collectives.default_backend
    collectives.default_backend = lambda: backend
    try:
        with torch.device("meta"):
            model = Chain()
        dm = dmuon.dedicate_params(model, init_device_mesh("cpu", (dist.get_world_size(),)))
        try:
            return {"coalesce_bytes": dm.coalesce_bytes, "reduce_by_gather": dm.reduce_by_gather}
        finally:
            dm.close()
    finally:
        collectives.default_backend = saved


class HostReads:
    """Stand-in for ``torch.cuda.set_sync_debug_mode("error")`` on a CPU machine: while
    active, records every Python-level read of a tensor's values into the host
    (``.tolist()``, ``.item()``, ``bool()`` / ``int()`` / ``float()`` / ``index()``,
    ``.numpy()``, ``.nonzero()``) and every tensor made from host data (``torch.tensor``: on
    CUDA a pageable host-to-device copy), on any thread (autograd's hooks included: the
    methods are patched on ``torch.Tensor``, which a ``TorchFunctionMode`` would not see
    there). On CUDA each of these blocks the CPU until the GPU catches up. It cannot see a
    sync made inside C++ (a blocking copy's wait): the GPU check's sync debug mode does."""

    METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero")

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._saved: dict[str, object] = {}

    def _recording(self, name: str, original):
        def recorded(*args, **kwargs):
            self.seen.append(name)
            return original(*args, **kwargs)
        return recorded

    def __enter__(self) -> "HostReads":
        for name in self.METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._recording(name, getattr(torch.Tensor, name)))
        self._saved["tensor"] = torch.tensor
        torch.tensor = self._recording("tensor", torch.tensor)
        return self

    def __exit__(self, *exc) -> None:
        torch.tensor = self._saved.pop("tensor")
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()


def host_reads_in_a_step(z3: bool, rest: str) -> list[str]:
    """Two warm-up steps, then the host reads of one forward and backward (DMuon's hooks,
    every reduce and its wait included; every param used on every rank)."""
    model = Chain()
    dm = dmuon.dedicate_params(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                               reshard_after_forward=z3, coalesce="block", rest=rest)
    wrapped = model if rest == "replicate" else nn.parallel.DistributedDataParallel(model)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    for step in range(2):
        wrapped(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    x = _batch(2)
    with HostReads() as reads:
        wrapped(x).square().mean().backward()
    opt.step()
    dm.close()
    return reads.seen


def channel_order(z3: bool, skip_rank: int | None) -> dict:
    """The order in which DMuon issues its asynchronous calls (channel of each) in one step
    after a warm-up step, Z3 or Z2, one unit per block; ``skip_rank``: on that rank block 2
    does not run in that step (a module that runs on some ranks only). Also the params after
    the step (the deferral changes no value)."""
    model = Chain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ranks' block records may differ: model order kept
        dm = dmuon.dedicate_params(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                                   reshard_after_forward=z3, coalesce="block", rest="replicate")
        opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
        model(_batch(0)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        issued: list[str] = []
        launch = collectives.Launcher.launch

        def logged(self, channel, call, *tensors):
            issued.append(channel)
            return launch(self, channel, call, *tensors)

        collectives.Launcher.launch = logged
        try:
            model.skip = 2 if dist.get_rank() == skip_rank else None
            model(_batch(1)).square().mean().backward()
        finally:
            collectives.Launcher.launch = launch
        opt.step()
        dm.sync_params()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        dm.close()
    return {"issued": issued, "params": params}


def deprecation_warnings() -> list[str]:
    """DMuon's all_gather and reduce_scatter seams (the aligned groups' calls) on a live
    group, with every warning recorded."""
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.empty(3 * world)
        collectives.all_gather_(out, torch.ones(3), group)
        collectives.reduce_scatter_sum_(torch.empty(3), torch.ones(3 * world), group)
        collectives.check_plan_agreement("ab" * 32, "test")
    dist.destroy_process_group(group)
    return [f"{w.category.__name__}: {w.message}" for w in caught]
