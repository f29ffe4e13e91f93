"""Rank-side tasks for DedicatedParams' lifecycle: close() / the context manager release
everything DMuon attached (hooks, class swaps, DDP ignore list, process groups), and the
modules' moves are followed where ``_apply`` runs."""

from __future__ import annotations

import copy
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import dmuon
# HSDP keeps the hierarchical protocol here: its 4 groups, the lifecycle of the most groups
from tests.distributed.parity.dmuon_tasks import _loss, _mesh, dedicate, make_model
from tests.distributed.runtime.runtime_tasks import batch


def resources() -> tuple[int, int]:
    """(threads, open fds) of this process, after a garbage collection: the minimum of a few
    samples 20 ms apart (a transient fd, such as a file-store read, is not a leak)."""
    gc.collect()
    samples = []
    for _ in range(5):
        samples.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
        time.sleep(0.02)
    return min(s[0] for s in samples), min(s[1] for s in samples)


def _one_step(model, dm) -> None:
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def build_close_cycles(kind: str, cycles: int) -> dict:
    """``cycles`` times: a fresh model, dedicate_params (Z3) on one mesh built once, one
    training step, close(). Returns this process's (threads, fds) before the cycles (after one
    warm-up cycle), after each, and right after one more build before its close (what an
    unclosed DedicatedParams holds)."""
    mesh = _mesh(kind)
    model = make_model()
    _one_step(model, dedicate(model, mesh))
    dedicate(make_model(), mesh).close()  # warm-up (gloo's first-use threads)
    before = resources()
    after = []
    for _ in range(cycles):
        model = make_model()
        dm = dedicate(model, mesh)
        _one_step(model, dm)
        dm.close()
        del dm, model
        after.append(resources())
    model = make_model()
    dm = dedicate(model, mesh)
    _one_step(model, dm)
    open_ = resources()
    dm.close()
    return {"before": before, "after": after, "open": open_, "closed": resources()}


def _hooks_left(model: nn.Module) -> list[str]:
    out = []
    for name, m in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks",
                     "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            if getattr(m, kind):
                out.append(f"{name}:{kind}")
    for name, p in model.named_parameters():
        if p._post_accumulate_grad_hooks:
            out.append(f"{name}:grad")
    return out


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return "no error"


def close_semantics(mode: str) -> dict:
    """Train one step, close(); report what is left, what raises, and that the same model
    can be dedicated and trained again."""
    mesh = _mesh("hsdp" if mode.startswith("hsdp") else "flat")
    model = make_model()
    classes = {n: type(m) for n, m in model.named_modules()}
    dm = dedicate(model, mesh, reshard_after_forward=mode.endswith("z3"))
    swapped = sorted(n for n, m in model.named_modules() if type(m) is not classes[n])
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    _loss(model, x, y).backward()
    opt.step()
    owned = {n: p.detach().clone() for n, p in zip(dm.names, dm.params) if p in set(dm.owned())}
    dm.close()
    dm.close()  # a no-op
    out = {
        "swapped": swapped,
        "classes_restored": all(type(m) is classes[n] for n, m in model.named_modules()),
        "hooks_left": _hooks_left(model),
        "ddp_ignore": getattr(model, "_ddp_params_and_buffers_to_ignore", None),
        "owned": owned,
        "values": {n: p.detach().clone() for n, p in model.named_parameters() if n in dm.names},
        "errors": [_error(f) for f in (dm.sync_params, dm.owned, lambda: model.blocks[0].mlp.fc1.weight in dm, opt.step)],
        "closed": dm.closed,
    }
    _loss(model, x, y).backward()  # a plain model now
    with dedicate(model, mesh) as again:
        again_opt = dmuon.DMuon(model.parameters(), dedicated=again)
        model.zero_grad()
        _loss(model, x, y).backward()
        again_opt.step()
    out["again_closed"] = again.closed
    return out


def exception_in_with() -> dict:
    """A ``with`` block left by an exception closes without the sync collective."""
    mesh = _mesh("flat")
    model = make_model()
    try:
        with dedicate(model, mesh) as dm:
            x, y = batch(0)
            _loss(model, x, y)
            raise KeyError("boom")
    except KeyError:
        pass
    return {"closed": dm.closed, "hooks_left": _hooks_left(model), "state": dm.state.name}


def class_swap_behaviour() -> dict:
    """The subclass DMuon puts on modules keeps names, repr, pickling and deepcopy, composes
    with fully_shard, and reacts to .to() without DMuon being polled."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh("flat")
    model = make_model()
    plain_repr = repr(model)
    dm = dedicate(model, mesh, reshard_after_forward=False)
    fc1 = model.blocks[0].mlp.fc1
    out = {"name": type(fc1).__name__, "isinstance": isinstance(fc1, nn.Linear),
           "exact": type(fc1) is nn.Linear, "repr_same": repr(model) == plain_repr}
    # (pickling a module DMuon hooks fails on the hooks' closures, as before: tests/dmuon/test_attach.py)
    out["deepcopy_exact"] = type(copy.deepcopy(fc1)) is nn.Linear
    flat_before = {b.flat.dtype for b in dm.buckets}
    model.double()  # followed in _apply: re-bound now, before any DMuon call
    out["dtypes"] = sorted(str(d) for d in flat_before | {b.flat.dtype for b in dm.buckets})
    out["rebound_now"] = all(b.flat.dtype == torch.float64 for b in dm.buckets)
    model.float()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=set(dm))
    fully_shard(model, mesh=mesh, ignored_params=set(dm))
    out["fsdp_mro"] = [c.__name__ for c in type(model.blocks[0]).__mro__[:3]]
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    dm.close()
    out["fsdp_kept_after_close"] = type(model.blocks[0]).__name__
    return out


def moved_block_alone() -> dict:
    """Moving one module of a bucket (not its block) leaves the bucket split across dtypes:
    the next forward names the params and the fix; moving the rest then trains."""
    mesh = _mesh("flat")
    model = make_model()
    dm = dedicate(model, mesh, reshard_after_forward=False)
    split = next(b for b in dm.buckets if len(set(map(id, b.param_modules))) > 1)
    split.param_modules[0].double()  # the same bucket on every rank
    x, y = batch(0)
    error = _error(lambda: _loss(model, x, y))
    model.double()
    opt_params = dmuon.DMuon(model.parameters(), dedicated=dm)
    _loss(model, x.clone(), y).backward()
    opt_params.step()
    # a param re-pointed by hand (no _apply): adopted at the next forward
    p = model.blocks[0].mlp.fc2.weight
    with torch.no_grad():
        p.data = p.data.clone()
    adopted = _error(lambda: _loss(model, x, y))
    dm.close()
    return {"error": error, "adopted": adopted, "rank": dist.get_rank()}


def close_misuse() -> dict:
    """close() with no_sync grads never reduced raises (before any collective, on every
    rank); a backward of a forward run before close() raises naming close()."""
    mesh = _mesh("flat")
    model = make_model()
    dm = dedicate(model, mesh)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm)
    x, y = batch(0)
    with dm.no_sync():
        _loss(model, x, y).backward()
    unreduced = _error(dm.close)
    opt.zero_grad()
    loss = _loss(model, x, y)
    dm.close()
    return {"unreduced": unreduced, "backward_after_close": _error(loss.backward), "closed": dm.closed}


def dropped_without_close() -> dict:
    """A DedicatedParams and its model dropped without close() are garbage (the grad hooks
    hold the runtime weakly); the process groups stay until close() (documented)."""
    import weakref

    mesh = _mesh("flat")
    model = make_model()
    dm = dedicate(model, mesh)
    _one_step(model, dm)
    refs = {"model": weakref.ref(model), "dm": weakref.ref(dm)}
    del model, dm
    gc.collect()
    return {k: r() is None for k, r in refs.items()}


def group_timeouts(kind: str) -> tuple[float, list[float]]:
    """The default group's timeout and that of every DMuon group of this rank, in seconds."""
    def seconds(g) -> float:
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    dm = dedicate(make_model(), _mesh(kind))
    try:
        g = dm.groups
        mine = [seconds(x) for x in (g.broadcast, g.reduce, g.replicate, g.world) if x is not None]
        return seconds(dist.distributed_c10d._get_default_group()), mine
    finally:
        dm.close()
