"""Rank-side tasks for the overlap tests: when DMuon issues its broadcasts relative to the
modules that need them, read from the interposer's ordered events."""

from __future__ import annotations

import dataclasses

from tests.distributed.parity.dmuon_tasks import SMALL, _loss
from tests.distributed.runtime.runtime_tasks import batch, build
from tracer.interposer import Interposer

#: Three blocks: each block is the bucket module of its buckets (dmuon/ownership/buckets.py).
THREE_BLOCKS = dataclasses.replace(SMALL, n_layers=3)


def broadcast_positions(mode: str, prefetch_depth: int) -> dict:
    """One step after a warm-up step, under the interposer, on a 3-block model.

    Every bucket is invalid on every rank after a step, so the k-th forward broadcast is
    bucket k; Z3 keeps the last block's buckets after forward (protocol step 2), so the k-th
    Z3 re-broadcast is bucket B-1-L-k, L the last block's buckets. Returns per block j
    (positions in the interposer's event list): ``first_fwd[j]`` / ``last_rb[j]``: the
    forward broadcast of block j's first bucket / the re-broadcast of its last bucket (None
    for the last block); ``returned[j]``: events
    recorded when block j's forward returned; ``first_grad[j]``: when block j's first
    dedicated grad arrived.
    """
    wrapped, model, dm, opt = build(mode, config=THREE_BLOCKS, prefetch_depth=prefetch_depth, coalesce="block")
    x, y = batch(0, THREE_BLOCKS)
    _loss(wrapped, x, y).backward()
    opt.step()
    opt.zero_grad()
    blocks = len(model.blocks)
    spans = [[b.index for b in dm.buckets if b.module_name == f"blocks.{j}"]
             for j in range(blocks)]
    ip = Interposer()
    returned, first_grad = [None] * blocks, [None] * blocks
    for j, block in enumerate(model.blocks):
        def ret(m, a, out, j=j):
            returned[j] = len(ip.events)

        def grad(p, j=j):
            if first_grad[j] is None:
                first_grad[j] = len(ip.events)

        block.register_forward_hook(ret)
        for b in dm.buckets:
            if b.index in spans[j]:
                for p in b.compute:
                    p.register_post_accumulate_grad_hook(grad)
    x, y = batch(1, THREE_BLOCKS)
    with ip:
        _loss(wrapped, x, y).backward()
    dm.wait_pending()
    ops = [(k, e.phase) for k, e in enumerate(ip.events) if e.op == "broadcast"]
    forward = [k for k, ph in ops if ph == "forward"]
    backward = [k for k, ph in ops if ph == "backward"][::-1]  # by bucket index
    assert len(forward) == len(dm.buckets), (len(forward), len(dm.buckets))
    if dm.reshard_after_forward:  # every bucket but the last block's, none twice
        assert len(backward) == len(dm.buckets) - len(spans[-1]), (len(backward), spans)
    return {"first_fwd": [forward[s[0]] for s in spans],
            "last_rb": [backward[s[-1]] for s in spans[:-1]] + [None] if backward else None,
            "returned": returned, "first_grad": first_grad}


def reduce_issue_and_wait_order(mode: str) -> list[tuple[str, int]]:
    """One step after a warm-up step with DMuon's reduce seam wrapped: the ordered list of
    ``("issue", k)`` / ``("wait", k)`` of its asynchronous shard-axis reduces (k = issue
    number; the HSDP replicate reduces, which need their shard reduce's result, are not
    listed)."""
    import dmuon.runtime.collectives as seam

    wrapped, model, dm, opt = build(mode, config=THREE_BLOCKS, coalesce="block")
    log: list[tuple[str, int]] = []
    # the shard reduce's seam: a gather to the holder on gloo (docs/protocol.md step 4)
    name, group_at = ("gather_", 3) if dm.reduce_by_gather else ("reduce_sum_", 2)
    original = getattr(seam, name)

    class Logged:
        def __init__(self, work, k):
            self.work, self.k = work, k

        def wait(self):
            log.append(("wait", self.k))
            return self.work.wait()

    def logged(*args, async_op=False):
        work = original(*args, async_op=async_op)
        if not async_op or args[group_at] is not dm.groups.reduce:
            return work
        k = sum(kind == "issue" for kind, _ in log)
        log.append(("issue", k))
        return Logged(work, k)

    for step in range(2):
        if step == 1:
            setattr(seam, name, logged)
        try:
            x, y = batch(step, THREE_BLOCKS)
            _loss(wrapped, x, y).backward()
            opt.step()
            opt.zero_grad()
        finally:
            setattr(seam, name, original)
    return log


def train_with_depth(mode: str, prefetch_depth: int, steps: int = 2) -> dict:
    """Owned params after ``steps`` steps with the given ``prefetch_depth``."""
    from tests.distributed.runtime.runtime_tasks import _train_steps

    wrapped, model, dm, opt = build(mode, config=THREE_BLOCKS, prefetch_depth=prefetch_depth, coalesce="block")
    return _train_steps(wrapped, model, dm, opt, steps)


def grad_buffer_layout(mode: str) -> dict:
    """Two steps, the second with two micro-batches (the first under ``no_sync``), recording
    where each dedicated param's ``.grad`` lives: after the ``no_sync`` backward (every
    local grad must be a view of its bucket's flat grad buffer) and after the reducing
    backward (owners: views of the buffer, holding the average; non-holders: no grads and
    the buffer's storage freed). Under FSDP2 a ``.grad`` is then shown as a DTensor
    (``dmuon/runtime/grad_view.py``): owners' local tensor is the view checked; for the others
    the plain grad it stands for (``None``). Returns the checks and the owned params after step 2."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(g):
        return g.to_local() if isinstance(g, DTensor) else g

    wrapped, model, dm, opt = build(mode, config=THREE_BLOCKS, coalesce="block")

    def inside(g, flat) -> bool:
        lo = flat.data_ptr()
        g = local(g)
        return g is not None and lo <= g.data_ptr() < lo + flat.numel() * flat.element_size()

    out = {"accumulated_in_buffer": [], "owner_grad_in_buffer": [], "non_holder_freed": []}
    for step in range(2):
        if step == 1:
            x, y = batch(10, THREE_BLOCKS)
            with dm.no_sync():
                _loss(wrapped, x, y).backward()
            out["accumulated_in_buffer"] = [inside(q.grad, b.grad_flat) for b in dm.buckets
                                            for q in b.compute]
        x, y = batch(step, THREE_BLOCKS)
        _loss(wrapped, x, y).backward()
        if step == 1:
            for b in dm.buckets:
                if b.is_owner and not b.mixed:
                    out["owner_grad_in_buffer"] += [inside(p.grad, b.grad_flat) for p in b.params]
                if not b.is_holder:
                    out["non_holder_freed"].append(
                        b.grad_flat.untyped_storage().nbytes() == 0
                        and all(getattr(q.grad, "dmuon_plain_grad", q.grad) is None
                                for q in b.compute))
        opt.step()
        opt.zero_grad()
    out["owned"] = {n: p.detach().clone() for b in dm.buckets if b.is_owner
                    for n, p in zip(b.names, b.params)}
    out["torch"] = torch.__version__
    return out


def copies_after_forward(mode: str) -> dict:
    """Z3, one unit per block: the non-holders' copy state of every block's buckets after a
    forward with grad enabled, after its backward and after a forward under ``no_grad``
    (protocol step 2: only the last unit stays allocated into the backward). Values are
    ``{block: ["VALID" / "FREED" per bucket this rank does not hold]}``."""
    import torch

    wrapped, model, dm, opt = build(mode, config=THREE_BLOCKS, coalesce="block")

    def states() -> dict:
        out: dict[str, list[str]] = {}
        for b in dm.buckets:
            if not b.is_holder:
                out.setdefault(b.module_name, []).append(b.copy.name)
        return out

    x, y = batch(0, THREE_BLOCKS)
    loss = _loss(wrapped, x, y)
    after_forward = states()
    loss.backward()
    after_backward = states()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        _loss(wrapped, x, y)
    return {"forward": after_forward, "backward": after_backward, "no_grad": states(),
            "last": dm.buckets[-1].module_name}
