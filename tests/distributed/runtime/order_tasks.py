"""Rank-side tasks for the execution-order tests: a model whose forward runs its blocks in
another order than it registers them (buckets in execution order)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tracer.interposer import Interposer

#: The order the forward runs ``blocks`` in (registered 0, 1, 2, 3).
RUN_ORDER = (2, 0, 3, 1)
D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D, bias=False)
        self.fc2 = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Permuted(nn.Module):
    """Four blocks of two bias-free Linears (every param dedicated), run in ``RUN_ORDER``;
    ``skip`` (a block index) is left out of the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in RUN_ORDER:
            if i != self.skip:
                x = self.blocks[i](x)
        return x


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, D, generator=g)


def _build(z3: bool, hsdp: bool = False):
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    model = Permuted()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=z3, coalesce="block")  # per-block order
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    return model, dm, opt


def _step(model, opt, step: int) -> None:
    with dmuon.phase("forward"):
        loss = model(_batch(step)).square().mean()
    with dmuon.phase("backward"):
        loss.backward()
    opt.step()
    opt.zero_grad()


def _params(model, dm) -> dict[str, torch.Tensor]:
    dm.sync_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reordered_step(z3: bool, model_order: bool = False, hsdp: bool = False) -> dict:
    """Step 1 (records and agrees), step 2 under the interposer with a forward hook per block,
    step 3; returns the block order, the positions in step 2's ordered events, the layout the
    harness derives (its own recording) and the params after step 3. ``model_order``: the
    runtime's order rule is replaced by model order (the reference without reordering);
    ``hsdp``: a (2, W/2) mesh."""
    from dmuon.runtime import order
    from dmuon.ownership.plan import specs_from_named_parameters
    from verify.measure.block_order import BlockOrderRecorder, blocks_of
    from verify.traffic.predict import RunLayout, dmuon_reduce_by_gather

    original = order.execution_block_order
    if model_order:
        order.execution_block_order = lambda model_blocks, recorded, drivers=None: tuple(model_blocks)
    try:
        model, dm, opt = _build(z3, hsdp)
        recorder = BlockOrderRecorder(model, blocks_of(dm.names))
        before = dm.block_order
        with Interposer() as first:
            _step(model, opt, 0)
        ip = Interposer()
        returned: dict[str, int] = {}

        def ret(m, args, out, name) -> None:
            returned.setdefault(name, len(ip.events))

        for j, block in enumerate(model.blocks):
            block.register_forward_hook(lambda m, a, out, j=j: ret(m, a, out, f"blocks.{j}"))
        ns_before = opt.ns_calls
        with ip:
            _step(model, opt, 1)
            dm.wait_pending()  # HSDP: the step's replicate broadcasts, as the harness's window
        ns_calls = opt.ns_calls - ns_before
        _step(model, opt, 2)
    finally:
        order.execution_block_order = original
    fwd = [(k, e.module) for k, e in enumerate(ip.events) if e.op == "broadcast" and e.phase == "forward"]
    r_size = 2 if hsdp else 1
    layout = RunLayout(mode=f"dmuon-{'hsdp-' if hsdp else ''}z{3 if z3 else 2}", replicate_size=r_size,
                       shard_size=dist.get_world_size() // r_size,
                       params=tuple(specs_from_named_parameters(model.named_parameters())),
                       muon_names=tuple(dm.names), reshard_after_forward=z3,
                       dmuon_reduce_by_gather=dmuon_reduce_by_gather(dist.get_backend()),
                       dmuon_block_order=recorder.agreed())
    setup = [(e.op, e.count, e.dtype, e.group_size) for e in first.events if e.phase == "setup"]
    return {"before": before, "setup": setup, "after": dm.block_order, "recorded": recorder.recorded,
            "forward": fwd, "returned": returned, "events": ip.events, "layout": layout,
            "ns_calls": ns_calls, "bucket_names": [tuple(b.names) for b in dm.buckets],
            "params": _params(model, dm)}


def disagreeing_first_step(z3: bool) -> dict:
    """Rank 0 runs every block in step 1, the others skip block 3 (out of model order on
    rank 0 only); then 2 steps with every block on every rank. Returns the warnings, the
    block order and the params (training continues, nothing hangs)."""
    model, dm, opt = _build(z3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.skip = None if dist.get_rank() == 0 else 3
        _step(model, opt, 0)
        model.skip = None
        for step in (1, 2):
            _step(model, opt, step)
    messages = [str(w.message) for w in caught if "DMuon" in str(w.message)]
    return {"warnings": messages, "order": dm.block_order, "params": _params(model, dm)}
