"""Rank-side tasks for tests/distributed/test_record.py (module-level: picklable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dmuon


def readme_example(out_dir: str, extra_call: bool = False) -> dict:
    """Run examples/own_script.train; with ``extra_call`` one unpredicted all_reduce is
    issued in the first measured step's forward. Returns what was raised or the report."""
    from examples import own_script

    if extra_call:
        original = own_script.loss_fn

        def loss_with_extra(model, rank, step):
            if step == 2:
                dist.all_reduce(torch.ones(3))
            return original(model, rank, step)

        own_script.loss_fn = loss_with_extra
    try:
        report = own_script.train(out_dir)
        return {"report": report, "error": None}
    except AssertionError as exc:
        return {"report": None, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if extra_call:
            own_script.loss_fn = original


def run_user_model(out_dir: str, modes: tuple[str, ...], model: str) -> dict | None:
    from verify.runner import RunConfig, run_all

    config = RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir, model=model)
    return run_all(config)


def bad_factory_error(model: str) -> str:
    from verify.runner import RunConfig, run_all

    try:
        run_all(RunConfig(modes=("dmuon-z2",), out_dir="/tmp/unused", model=model))
    except ValueError as exc:
        return str(exc)
    return "no error"


_ = dmuon  # imported before fork by the pool's parent
