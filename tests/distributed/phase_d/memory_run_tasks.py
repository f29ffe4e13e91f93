"""Rank-side tasks of ``test_memory_gate.py``: ``run_all`` (what each rank of ``make
verify-traffic`` runs) on a nested model, optionally with the runtime's pre-forward mutated
back to what it did before commit 1f3ca19 (a driver that only encloses blocks waited for its
whole subtree at once)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from tests.distributed.runtime.memory_tasks import Stack
from verify.run.runner import RunConfig, run_all

D, HIDDEN, BLOCKS, ROWS = 32, 96, 6, 8


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.body = Stack(BLOCKS, d=D, hidden=HIDDEN)  # called, as Hugging Face's model.model
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))


def nested_factory():
    """The ``--model`` factory: ``body.layers.{i}``, each block one unit under
    ``coalesce="block"``; regression on a fixed random batch per rank (the same every step,
    so the loss falls)."""
    model = Nested()

    def loss_fn(m, rank, step):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(ROWS, D, generator=g)
        return (m(x).squeeze(-1) - x.sum(-1)).pow(2).mean()

    return model, loss_fn


def _old_pre_forward(original):
    """The pre-forward before 1f3ca19: a driver without buckets of its own also waited for
    every bucket of its subtree (``advance_forward(hi)``), so Z3 held them all at once."""
    def pre_forward(self, module, args):
        original(self, module, args)
        if module not in self._own and not torch._C._current_graph_task_id() != -1:
            self.schedule.advance_forward(self._span[module][1])
    return pre_forward


def memory_run(out_dir: str, modes: tuple[str, ...], mutated: bool = False) -> dict | None:
    """``run_all`` of ``modes`` on :func:`nested_factory` (``coalesce="block"``,
    ``rest="replicate"``, 2 warm-up and 2 measured steps, no profiler); the report on rank 0."""
    from dmuon.runtime.runtime import Runtime

    with contextlib.ExitStack() as stack:
        if mutated:  # fails loudly (AttributeError) if the runtime renames it
            stack.enter_context(mock.patch.object(Runtime, "_pre_forward",
                                                  _old_pre_forward(Runtime._pre_forward)))
        return run_all(RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir,
                                 profiler=False, coalesce="block", rest="replicate",
                                 model=f"{__name__}:nested_factory"))


def window_agreement(coalesce: str, depth: int) -> dict:
    """This rank's ``dm.coalescing()["z3_peak_bytes"]`` and the harness's Z3 window
    (``verify.traffic.memory.predict_memory`` on the job's layout) for :func:`nested_factory`
    under Z3 with ``coalesce`` and ``prefetch_depth=depth``, after one step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from verify.run.record import layout_from_job
    from verify.traffic.memory import predict_memory

    torch.manual_seed(0)
    model, loss_fn = nested_factory()
    dm = dmuon.dedicate_params(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                               reshard_after_forward=True, rest="replicate", coalesce=coalesce,
                               prefetch_depth=depth)
    try:
        opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
        loss_fn(model, dist.get_rank(), 0).backward()
        opt.step()
        bound = predict_memory(layout_from_job(model, dm), depth)[dist.get_rank()]
        return {"runtime": dm.coalescing()["z3_peak_bytes"], "harness": bound.window_bytes,
                "non_held": bound.non_held_bytes}
    finally:
        dm.close()
