"""Rank-side tasks for tests/distributed/phase_d/test_record.py (module-level: picklable)."""

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


def run_user_model(out_dir: str, modes: tuple[str, ...], model: str, profiler: bool = True,
                   coalesce: str = "auto") -> dict | None:
    from verify.run.runner import RunConfig, run_all

    config = RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir, model=model,
                       profiler=profiler, coalesce=coalesce)
    return run_all(config)


def raising_mode_cleanup(out_dir: str) -> dict:
    """run_all on a mode whose loss_fn raises in its first measured step; what is left behind:
    the report's failures, and the interposer's hooks (wait listeners, dispatch modes)."""
    from tracer import interposer
    from verify.run.runner import RunConfig, run_all

    config = RunConfig(modes=("dmuon-ddp",), steps_warmup=2, steps_measured=1, out_dir=out_dir,
                       model="tests.distributed.phase_d.verdict_factories:rising_loss_raises_under_ddp")
    report = run_all(config)
    return {"failures": None if report is None else report["failures"],
            "runs": None if report is None else report["runs"],
            "wait_listeners": len(interposer._wait_listeners),
            "dispatch_modes": torch._C._len_torch_dispatch_stack()}


def bad_factory_error(model: str, modes: tuple[str, ...] = ("dmuon-z2",)) -> str:
    from verify.run.runner import RunConfig, run_all

    try:
        run_all(RunConfig(modes=modes, out_dir="/tmp/unused", model=model))
    except ValueError as exc:
        return str(exc)
    return "no error"


_ = dmuon  # imported before fork by the pool's parent


def blocked_in_collective(sleep_s: float) -> dict:
    """Rank 1 sleeps before an all_reduce; rank 0 waits for it inside the collective."""
    import time

    from verify.run.steptime import StepTime, sample

    dist.barrier()
    before = sample()
    if dist.get_rank() == 1:
        time.sleep(sleep_s)  # sleeping is blocked time too, but not inside a collective
    dist.all_reduce(torch.ones(4))
    step = StepTime.between(before, sample())
    return {"wall_ns": step.wall_ns, "blocked_ns": step.blocked_ns}


def ddp_window(out_dir: str, rest: str = "wrapper") -> dict:
    """The own-script window on DMuon + DDP (examples.my_model); with ``rest="replicate"``
    DMuon keeps the rest and nothing wraps the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from examples.my_model import ResidualMLP, loss_fn
    from verify.run.record import TrafficWindow

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bare = ResidualMLP()
    dm = dmuon.dedicate_params(bare, mesh, reshard_after_forward=False, rest=rest)
    model = DistributedDataParallel(bare) if rest == "wrapper" else bare
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    window = TrafficWindow(model, dm, opt, out_dir=out_dir)
    for step in range(4):
        if step == 2:
            window.start()
        with dmuon.phase("forward"):
            loss = loss_fn(model, rank, step)
        with dmuon.phase("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        if window.recording:
            window.step_done(loss)
    return window.finish()
