"""Rank-side tasks for tests/distributed/phase_d/test_record.py (module-level: picklable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dmuon


def readme_example(out_dir: str, extra_call: bool = False, tiny_bound: bool = False) -> dict:
    """Run examples/own_script.train; with ``extra_call`` one unpredicted all_reduce is
    issued in the first measured step's forward; with ``tiny_bound`` the harness's memory
    bound (``verify.traffic.memory.predict_memory``) is cut to 1 byte a rank in forward and
    backward, so DMuon's measured bytes exceed it. Returns what was raised or the report."""
    from examples import own_script

    if tiny_bound:
        import dataclasses

        from verify.traffic import memory

        predict = memory.predict_memory
        memory.predict_memory = lambda *a, **k: [dataclasses.replace(b, peak_bytes=1)
                                                 for b in predict(*a, **k)]

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
        if tiny_bound:
            memory.predict_memory = predict


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

    from verify.measure.steptime import StepTime, sample

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

    from examples.my_model import ResidualMLP
    from verify.run.record import TrafficWindow

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bare = ResidualMLP()
    dm = dmuon.dedicate_params(bare, mesh, reshard_after_forward=False, rest=rest)
    model = DistributedDataParallel(bare) if rest == "wrapper" else bare
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    window = TrafficWindow(model, dm, opt, out_dir=out_dir)
    _train_with_window(model, dm, opt, window, rank)
    return window.finish()


def _train_with_window(model, dm, opt, window, rank: int, accumulate: bool = False) -> None:
    """4 steps of examples.my_model's loss, steps 2 and 3 recorded; ``accumulate``: each
    recorded step first backwards one more micro-batch inside ``no_sync``."""
    from examples.my_model import loss_fn
    from verify.run.runner import loss_step

    for step in range(4):
        if step == 2:
            window.start()
        if accumulate and window.recording:
            with dm.no_sync(), dmuon.phase("forward"):
                first = loss_fn(model, rank, step)
            with dm.no_sync(), dmuon.phase("backward"):
                first.backward()
        loss = loss_step(model, opt, loss_fn, rank, step)
        if window.recording:
            window.step_done(loss)


def window_case(out_dir: str, case: str) -> str:
    """TrafficWindow on cases a break-it trial found (every rank returns its outcome):

    - ``"mp"``: FSDP2 per block and root, one bf16 policy for both calls: must pass (the
      layout used to ignore the policy and fail correct bf16 traffic);
    - ``"accum"``: a recorded step of two micro-batches (``no_sync``): a clear error, not a
      closed-form mismatch;
    - ``"unwritable"``: ``out_dir`` is a file, so rank 0 cannot write the report: every rank
      raises (the other ranks used to wait for rank 0 forever);
    - ``"tp"``: a ("shard", "tp") mesh: rejected at construction (the layout ignored TP and
      rank 0 failed alone, stranding the others);
    - ``"permuted"``: a mesh whose ranks are not in ``init_device_mesh``'s order: rejected at
      construction on every rank (its groups were mispredicted: a false FAIL).
    """
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from examples.my_model import ResidualMLP
    from verify.run.record import TrafficWindow

    rank = dist.get_rank()
    if case == "permuted":  # a mesh not in init_device_mesh's order: its groups were mispredicted
        from torch.distributed.device_mesh import DeviceMesh

        model = ResidualMLP()
        dm = dmuon.dedicate_params(model, DeviceMesh("cpu", torch.tensor([1, 0])), rest="replicate")
        try:
            TrafficWindow(model, dm, dmuon.DMuon(model.parameters(), dedicated=dm))
        except ValueError as exc:
            return f"ValueError: {exc}"
        finally:
            dm.close()
        return "no error"
    if case == "tp":
        from tests.distributed.parity import tp_tasks

        model, dm, opt, _ = tp_tasks.build("z2")
        try:
            TrafficWindow(model, dm, opt)
        except ValueError as exc:
            return f"ValueError: {exc}"
        finally:
            dm.close()
        return "no error"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ResidualMLP()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "mp" else None
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=case == "mp", mp_policy=policy,
                               rest="wrapper" if case == "mp" else "replicate")
    if case == "mp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=set(dm), mp_policy=policy)
        fully_shard(model, mesh=mesh, ignored_params=set(dm), mp_policy=policy)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    if case == "unwritable":
        Path(out_dir, "a-file").write_text("not a folder")
        out_dir = str(Path(out_dir, "a-file"))
    window = TrafficWindow(model, dm, opt, out_dir=out_dir)
    try:
        _train_with_window(model, dm, opt, window, rank, accumulate=case == "accum")
        report = window.finish()
        return "pass" if rank != 0 or report["pass"] else "fail"
    except (ValueError, RuntimeError, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dm.close()


def clipped_window(out_dir: str, mode: str, accumulate_warmup: bool = False,
                   start_at: int = 2, before_start: str | None = None) -> dict:
    """The nanoGPT-style loop on examples.my_model under TrafficWindow: ``mode`` ``"ddp"``
    (DDP), ``"z3"`` (FSDP2 per block and root) or ``"hsdp-z3"``; ``opt.clip_grad_norm_(1.0)``
    between backward and step, as the guide prescribes, in every step. With
    ``accumulate_warmup``, the warm-up steps run two micro-batches each (DDP's
    ``require_backward_grad_sync``), so ``start()`` must refuse. ``start_at``: the step before
    which the window starts; ``before_start``: ``"eval"`` (an evaluation forward under
    ``no_grad``) or ``"state_dict"`` (every rank's ``model.state_dict()``, a checkpoint) or ``"sync_params"``
    right before ``start()``. Returns ``{"error", "report"}`` (the report on rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from examples.my_model import ResidualMLP, loss_fn
    from verify.run.record import TrafficWindow

    rank, world = dist.get_rank(), dist.get_world_size()
    hsdp = mode.startswith("hsdp")
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    bare = ResidualMLP()
    dm = dmuon.dedicate_params(bare, mesh, reshard_after_forward=mode.endswith("z3"))
    if mode == "ddp":
        model = DistributedDataParallel(bare)
    else:
        for block in bare.blocks:
            fully_shard(block, mesh=mesh, ignored_params=set(dm))
        model = fully_shard(bare, mesh=mesh, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    window = TrafficWindow(model, dm, opt, out_dir=out_dir)
    out = {"error": None, "report": None}
    try:
        for step in range(4):
            if step == start_at:
                if before_start == "eval":
                    with torch.no_grad():
                        loss_fn(model, rank, step)
                elif before_start == "state_dict":
                    model.state_dict()
                elif before_start == "sync_params":
                    dm.sync_params()
                window.start()
            micro = 2 if accumulate_warmup and not window.recording else 1
            for m in range(micro):
                if mode == "ddp":
                    model.require_backward_grad_sync = m == micro - 1
                with dmuon.phase("forward"):
                    loss = loss_fn(model, rank, step) / micro
                with dmuon.phase("backward"):
                    loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if window.recording:
                window.step_done(loss)
        out["report"] = window.finish()
    except (ValueError, RuntimeError, AssertionError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def qk_clip_window(out_dir: str, tell_heads: bool) -> dict:
    """TinyGPT under DMuon + DDP with MuonClip's QK-clip (``verify.measure.qk_clip.attach``, τ low
    enough to clip) and ``opt.clip_grad_norm_`` each step, recorded by a TrafficWindow told the
    heads (``tell_heads``) or not. Returns ``{"error", "report"}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from tests.distributed.parity import dmuon_tasks as T
    from verify.measure import qk_clip
    from verify.run.record import TrafficWindow
    from verify.workload.data import local_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    bare = T.make_model()
    dm = dmuon.dedicate_params(bare, init_device_mesh("cpu", (world,)), reshard_after_forward=False)
    model = DistributedDataParallel(bare)
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)
    clip = qk_clip.attach(opt, bare, qk_clip.DEFAULT_TAU)
    heads = qk_clip.count_heads(bare) if tell_heads else 0
    window = TrafficWindow(model, dm, opt, out_dir=out_dir, qk_clip_heads=heads)
    out = {"error": None, "report": None, "clipped": 0}
    try:
        for step in range(4):
            if step == 2:
                window.start()
            x, y = T.corpus().global_batch(step, T.GLOBAL_BATCH, T.SMALL.seq_len)
            with dmuon.phase("forward"):
                loss = T._loss(model, local_slice(x, rank, world), local_slice(y, rank, world))
            with dmuon.phase("backward"):
                loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            out["clipped"] += qk_clip.clipped_heads(clip)
            opt.zero_grad()
            if window.recording:
                window.step_done(loss)
        out["report"] = window.finish()
    except (ValueError, RuntimeError, AssertionError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out
