"""``dmuon-verify-traffic``: the per-process entry point that torchrun starts (see verify/run/launch.py).

Every process joins the default process group from torchrun's environment (gloo on CPU,
NCCL where CUDA is available), runs :func:`verify.run.runner.run_all`, and rank 0 prints the
table and writes ``report.json``, ``report.md``, ``traffic.png`` and per-mode traces under
``--out-dir``. The exit code is the CI gate: 0 when every check of every mode passes, 1 when
any fails (a mode that raises is a failed check: the others still run and are reported), 2 for
bad input (arguments, ``--model``, no mode runnable at this W). The last line printed names
every failed check and its modes (``verify.report.checks.final_line``), e.g.
``FAIL: loss did not fall (dmuon-z2); NS calls differ from expected (naive-fsdp2-z3)``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from tracer.progress import terminal_bar
from verify.workload.data import global_batch_size
from verify.run.ci import EXIT_FILE, EXIT_OUTPUT, disk_full_text, is_disk_full, write_code
from verify.run.collect import DEFAULT_MAX_MB, collect_to_rank0
from verify.run.failstop import Board, exit_now, watch_sigterm
from verify.run.nodes import node_map, this_node, write_node_file
from verify.run.groups import init_kwargs
from verify.measure.qk_clip import DEFAULT_TAU as QK_CLIP_DEFAULT_TAU
from verify.modes.workloads import workload_of
from verify.run.runner import RunConfig, run_all, runnable_modes
from verify.modes.variants import RUN_MODES as MODES  # modes and their variants
from verify.modes.variants import split_mode
from verify.traffic.predict import DMUON_HIERARCHIES
from verify.workload.usermodel import BUILTIN

#: Exit codes: every check passed; a check failed; bad input (``EXIT_USAGE``, before training);
#: missing hardware (the launcher's, ``--backend nccl`` without a GPU).
EXIT_PASS, EXIT_MISMATCH, EXIT_USAGE, EXIT_NO_HARDWARE = 0, 1, 2, 3
#: File in --out-dir holding rank 0's verdict (0 pass, 1 a check failed); the launcher
#: rewrites it with the run's final code (``verify.run.ci``).
VERDICT_FILE = EXIT_FILE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dmuon-verify-traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="folder for report.* and per-mode traces")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="auto: NCCL where CUDA is available, else gloo")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--steps-warmup", type=int, default=RunConfig.steps_warmup)
    parser.add_argument("--steps-measured", type=int, default=RunConfig.steps_measured)
    parser.add_argument("--timeout-s", type=int, default=300, help="process-group timeout (s)")
    parser.add_argument("--no-profiler", action="store_true",
                        help="do not record the measured steps with torch.profiler (a third source)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per step over all ranks, a multiple of W (default "
                             f"{RunConfig.batch_per_rank} per rank, so it follows the world size)")
    parser.add_argument("--model", default=BUILTIN,
                        help=f"'{BUILTIN}' (built in), a preset of verify.workload.presets, or pkg.module:factory "
                        "returning (model, loss_fn) (docs/verify.md: Verify your own model)")
    parser.add_argument("--collect-max-mb", type=int, default=DEFAULT_MAX_MB,
                        help="on more than one node: the most MiB of trace files sent to rank 0 "
                             "when the nodes share no filesystem (verify/run/collect.py)")
    parser.add_argument("--wide", action="store_true",
                        help="print every column (default: a table that fits 120 columns)")

    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                        help="MixedPrecisionPolicy(param_dtype=...) for DMuon and fully_shard")
    parser.add_argument("--coalesce", choices=["auto", "block", "all"], default="auto",
                        help="DMuon's dedicate_params(coalesce=...): blocks sharing collectives "
                        "(docs/traffic-model.md, 'Coalescing'; 'block' = one call per bucket)")
    parser.add_argument("--rest", choices=["wrapper", "replicate"], default="wrapper",
                        help="DMuon's dedicate_params(rest=...) in the DMuon modes: 'wrapper' (FSDP2, "
                        "or DDP in dmuon-ddp, handles the params DMuon does not dedicate) or "
                        "'replicate' (DMuon all-reduces them itself, one call per dtype per step, "
                        "and nothing wraps the model)")
    parser.add_argument("--hierarchy", choices=DMUON_HIERARCHIES, default="auto",
                        help="DMuon's dedicate_params(hierarchy=...) in the HSDP modes: 'flat' moves "
                        "the dedicated params over all W ranks as on a 1-D mesh, 'hierarchical' over "
                        "the shard then the replicate axis, 'auto' flat on gloo when they form one unit "
                        "(docs/traffic-model.md, 'HSDP: flat or hierarchical')")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree T: the TP-capable modes (dmuon-z2, dmuon-z3, "
                             "naive-fsdp2-z2, naive-fsdp2-z3 on a (W/T) x T mesh ('shard', 'tp'); "
                             "dmuon-hsdp-z2/z3 on (2, W/(2T), T) where W/T is even and >= 4), the "
                             "built-in model's MLPs tensor parallel (verify/modes/tp.py)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree E: the DMuon modes (dmuon-z2, dmuon-z3 on a (W/E) x E "
                             "mesh ('shard', 'ep'); dmuon-hsdp-z2/z3 on (2, W/(2E), E) where 2E divides W) "
                             "with the reference EP layer's tiny Qwen3-MoE and rest='replicate'; the token "
                             "all_to_all is checked as phase 'activations' (verify/modes/ep.py)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages S: ddp-muon (the reference), dmuon-ddp, dmuon-z2, dmuon-z3 "
                             "on an S x (W/S) mesh ('pp', 'dp_shard'), the built-in model cut into S "
                             "stages run by Schedule1F1B, DMuon's rest replicated; the stage-to-stage "
                             "send/recv is checked as phase 'pipeline' (verify/modes/pp.py)")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches per step with --pp (must divide the global batch / (W/S))")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree C: ddp-muon (the reference), dmuon-ddp, dmuon-z2, "
                             "dmuon-z3 on a (W/C) x C mesh ('dp_shard', 'cp'), the CP decoder of "
                             "examples/cp_attention.py at the built-in model's size, both dims DMuon's "
                             "shard dims (N_eff = W), DMuon's rest replicated; the attention's K/V "
                             "exchange is checked as phase 'context' (verify/modes/cp.py)")
    parser.add_argument("--qk-clip", type=float, nargs="?", const=QK_CLIP_DEFAULT_TAU, default=None,
                        metavar="TAU", dest="qk_clip",
                        help="run MuonClip's QK-clip (dmuon.optim.qk_clip.QKClip, alpha 0.5) in the "
                        "DMuon modes at threshold TAU (default %(const)s: it clips the built-in "
                        "model's heads) and verify its all_reduce, phase qk_clip; the other modes "
                        "run without it (docs/verify.md, '--qk-clip')")
    parser.add_argument("--baseline", default=None, metavar="FILE",
                        help="compare every mode's gated figures with FILE (written by --write-baseline) "
                        "and fail on any difference; default: the committed baseline of the default "
                        "run where this is that run (docs/verify.md, 'Baseline')")
    parser.add_argument("--write-baseline", default=None, metavar="FILE",
                        help="write this run's gated figures to FILE when it passes")
    parser.add_argument("--no-baseline", action="store_true",
                        help="do not compare with the committed default baseline")
    parser.add_argument("--no-numerics", action="store_true",
                        help="skip the checks after each DMuon mode's window: one step against a "
                             "single-process torch oracle, owners' grads, losses against the "
                             "reference, a DCP checkpoint round trip (docs/verify.md, 'Numerics')")
    args = parser.parse_args(argv)
    if args.baseline is not None and not Path(args.baseline).is_file():
        parser.error(f"Invalid --baseline {args.baseline}: no such file. Must be a file written "
                     "by --write-baseline.")
    if args.timeout_s < 1:
        parser.error(f"Invalid --timeout-s {args.timeout_s}. Must be >= 1 second (the process "
                     "groups' timeout).")
    if args.microbatches < 1:
        parser.error(f"Invalid --pp {args.pp} / --microbatches {args.microbatches}. Must be >= 1 "
                     "(the schedule's micro-batches per step).")
    try:  # the workload the parallel degrees select (verify.modes.workload), and what it fixes
        problem = workload_of(args).usage_problem(args)
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        parser.error(problem)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"Invalid --modes entries {unknown}. Must be among {list(MODES)}.")
    if args.qk_clip is not None:
        _check_qk_clip(parser, args)
    if args.steps_measured < 1 or args.steps_warmup < 1:
        parser.error("--steps-warmup and --steps-measured must be >= 1 (the first step is never steady).")
    return args


def _check_qk_clip(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--qk-clip TAU``: a finite TAU > 0, the built-in model, and a DMuon mode in ``--modes`` (the only modes that run the clip); else the parser's usage error."""
    if not 0 < args.qk_clip < float("inf"):
        parser.error(f"Invalid --qk-clip {args.qk_clip}. Must be a finite threshold > 0 on the "
                     f"pre-softmax logit (e.g. {QK_CLIP_DEFAULT_TAU}, the default).")
    if args.model != BUILTIN:
        parser.error(f"--qk-clip runs the built-in model only (--model {BUILTIN}): the harness "
                     "reads q and k from its attention (verify/measure/qk_clip.py).")
    if not any(split_mode(m)[0].startswith("dmuon-") for m in args.modes.split(",")):
        parser.error(f"--qk-clip with --modes {args.modes}: no DMuon mode, so nothing would run "
                     "the clip. Add a dmuon-* mode (the baselines have no QK-clip).")


def main(argv: list[str] | None = None) -> int:
    """Run under torchrun; returns the process exit code."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("dmuon-verify-traffic must run under torchrun; use `make verify-traffic`.", file=sys.stderr)
        return EXIT_USAGE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # every rank checks the same thing before any collective
        rows = global_batch_size(world, per_rank=RunConfig.batch_per_rank, global_batch=args.global_batch)
    except ValueError as exc:
        print(f"dmuon-verify-traffic: {exc}", file=sys.stderr)
        return EXIT_USAGE
    workload = workload_of(args)
    problem = workload.mesh_problem(world, args, global_batch=rows, seq_len=RunConfig.seq_len)
    if problem is not None:  # the launcher checks this before torchrun too
        print(f"dmuon-verify-traffic: {problem}", file=sys.stderr)
        return EXIT_USAGE
    use_cuda = args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    watch_sigterm(nccl=use_cuda)  # before any thread starts (verify.run.failstop)
    # NCCL: device_id, communicators created here, not in DMuon's first hook (verify.run.groups)
    dist.init_process_group(**init_kwargs("nccl" if use_cuda else "gloo", local_rank, args.timeout_s))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    config = replace(
        RunConfig(),
        modes=tuple(args.modes.split(",")),
        steps_warmup=args.steps_warmup,
        steps_measured=args.steps_measured,
        global_batch=args.global_batch,
        profiler=not args.no_profiler,
        out_dir=args.out_dir,
        device="cuda" if use_cuda else "cpu",
        model=args.model,
        mixed_precision=args.mixed_precision,
        coalesce=args.coalesce,
        rest=workload.rest or args.rest,  # the rest a workload runs (EP, PP, CP: replicated)
        hierarchy=args.hierarchy,
        tp=args.tp,
        qk_clip_tau=args.qk_clip,
        ep=args.ep,
        pp=args.pp,
        microbatches=args.microbatches,
        cp=args.cp,
        numerics=not args.no_numerics,
    )
    rank = dist.get_rank()
    modes = runnable_modes(config, dist.get_world_size())
    bar = None
    if rank == 0:
        reasons = workload.skip_reasons(config.modes, dist.get_world_size(), config)
        for mode, why in reasons.items():
            if why:
                print(f"skipping {mode}: {why}", flush=True)
        bar = terminal_bar(len(modes) * (config.steps_warmup + config.steps_measured),
                           desc="training steps", unit="step")  # None unless stderr is a terminal
    board = Board()
    infos: list = [None] * dist.get_world_size()
    dist.all_gather_object(infos, this_node())  # verify.run.nodes: each rank's node
    nodes = node_map(infos)
    try:
        report = run_all(config, progress=bar.update if bar else None, board=board, nodes=nodes)
    except ValueError as exc:  # a user mistake (e.g. --model), raised alike on every rank
        if rank == 0:
            print(f"verify-traffic: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return EXIT_USAGE
    finally:
        if bar:
            bar.close()
    collected = None
    if board.stopped is None and nodes["count"] > 1:  # no shared filesystem: files to rank 0
        collected = collect_to_rank0(args.out_dir, args.collect_max_mb * 2**20)
    if report is not None:  # rank 0, or the survivor that reports a stopped run
        report["nodes"] = {**nodes, "collected": collected}
        if collected and collected["error"]:
            print(f"verify-traffic: {collected['error']}", file=sys.stderr, flush=True)
        try:
            code = _finish(report, Path(args.out_dir), wide=args.wide, baseline=args.baseline,
                           write_baseline=args.write_baseline, use_default=not args.no_baseline)
        except OSError as exc:  # the report did not fit: say where, exit 5 (verify.run.ci)
            if not is_disk_full(exc):
                raise
            print(f"verify-traffic: {disk_full_text(exc.filename or args.out_dir, exc)}",
                  file=sys.stderr, flush=True)
            code = EXIT_OUTPUT
        # torchrun turns a worker's non-zero exit into a crash report; the verdict travels
        # through a file instead and verify.run.launch returns it as its exit code (written in
        # place: the launcher reserved the file, so it fits on a full disk).
        write_code(Path(args.out_dir) / VERDICT_FILE, code)
        board.store.set("verdict", str(code))
    elif nodes["of_rank"][rank] != nodes["of_rank"][0] and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        _node_verdict(board, nodes, rank, args)  # this node's launcher returns rank 0's verdict
    if board.stopped is not None:  # a rank failed: end without a collective (verify.run.failstop)
        exit_now(0)
    dist.destroy_process_group()
    return 0


def _node_verdict(board, nodes: dict, rank: int, args) -> None:
    """On a node without rank 0 (its local rank 0): wait for rank 0's verdict in the store and
    write it, with ``node.json`` naming the report's host, to this node's ``--out-dir``."""
    try:
        board.store.wait(["verdict"], datetime.timedelta(seconds=args.timeout_s))
        code = int(board.store.get("verdict"))
    except Exception as exc:  # noqa: BLE001 - rank 0 failed: the launcher says no verdict
        print(f"verify-traffic: rank {rank}: no verdict from rank 0 ({exc})", file=sys.stderr, flush=True)
        return
    node = nodes["of_rank"][rank]
    write_node_file(args.out_dir, node, [r for r, n in enumerate(nodes["of_rank"]) if n == node],
                    nodes["hosts"][nodes["of_rank"][0]], code)
    write_code(Path(args.out_dir) / VERDICT_FILE, code)


def _finish(report: dict, out_dir: Path, wide: bool = False, baseline: str | None = None,
            write_baseline: str | None = None, use_default: bool = True) -> int:
    from verify.report import baseline as bl
    from verify.report.checks import final_line
    from verify.report.render import write_report
    from verify.report.terminal import format_table

    report.setdefault("created_utc", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    report.setdefault("run_id", out_dir.name)
    if baseline is not None:  # --baseline FILE (checked to exist before torchrun)
        bl.apply_baseline(report, bl.read_baseline(baseline), baseline, explicit=True)
    elif use_default and bl.DEFAULT_BASELINE.is_file():
        committed = bl.committed_baseline(report)
        bl.apply_baseline(report, bl.read_baseline(committed),
                          str(committed.relative_to(Path(bl.__file__).parents[2])), explicit=False)
    paths = write_report(report, out_dir)
    print(format_table(report, wide=wide), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    for line in bl.summary_lines(report):
        print(line, flush=True)
    if write_baseline is not None:
        try:
            print(f"wrote baseline {bl.write_baseline(report, write_baseline)}", flush=True)
        except ValueError as exc:
            print(f"verify-traffic: {exc}", file=sys.stderr, flush=True)
    print(final_line(report), flush=True)  # CI reads this line: every failed check, by mode
    return EXIT_PASS if report["pass"] else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
