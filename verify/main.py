"""``dmuon-verify-traffic``: the per-process entry point that torchrun starts (see verify/launch.py).

Every process joins the default process group from torchrun's environment (gloo on CPU,
NCCL where CUDA is available), runs :func:`verify.runner.run_all`, and rank 0 prints the
table and writes ``report.json``, ``report.md``, ``traffic.png`` and per-mode traces under
``--out-dir``. The exit code is the CI gate: 0 when every run passes, 1 otherwise.
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
from tqdm import tqdm

from .runner import RunConfig, run_all, runnable_modes
from .traffic import MODES

#: Exit codes.
EXIT_PASS, EXIT_MISMATCH = 0, 1
#: File in --out-dir holding rank 0's verdict (0 pass, 1 mismatch).
VERDICT_FILE = "exit_code"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dmuon-verify-traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="folder for report.* and per-mode traces")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--steps-warmup", type=int, default=RunConfig.steps_warmup)
    parser.add_argument("--steps-measured", type=int, default=RunConfig.steps_measured)
    parser.add_argument("--timeout-s", type=int, default=300, help="process-group timeout (s)")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None,
                        help="MixedPrecisionPolicy(param_dtype=...) for DMuon and fully_shard")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"Invalid --modes entries {unknown}. Must be among {list(MODES)}.")
    if args.steps_measured < 1 or args.steps_warmup < 1:
        parser.error("--steps-warmup and --steps-measured must be >= 1 (the first step is never steady).")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run under torchrun; returns the process exit code."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("dmuon-verify-traffic must run under torchrun; use `make verify-traffic`.", file=sys.stderr)
        return 2
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    config = replace(
        RunConfig(),
        modes=tuple(args.modes.split(",")),
        steps_warmup=args.steps_warmup,
        steps_measured=args.steps_measured,
        out_dir=args.out_dir,
        device="cuda" if use_cuda else "cpu",
        mixed_precision=args.mixed_precision,
    )
    rank = dist.get_rank()
    modes = runnable_modes(config, dist.get_world_size())
    bar = None
    if rank == 0:
        skipped = [m for m in config.modes if m not in modes]
        if skipped:
            print(f"skipping {skipped}: HSDP needs an even world size >= 4", flush=True)
        bar = tqdm(total=len(modes) * (config.steps_warmup + config.steps_measured), desc="training steps", unit="step")
    try:
        report = run_all(config, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    if rank == 0:
        code = _finish(report, Path(args.out_dir))
        # torchrun turns a worker's non-zero exit into a crash report; the verdict travels
        # through a file instead and verify.launch returns it as its exit code.
        (Path(args.out_dir) / VERDICT_FILE).write_text(f"{code}\n")
    dist.destroy_process_group()
    return 0


def _finish(report: dict, out_dir: Path) -> int:
    from .report import format_table, write_report

    report.setdefault("created_utc", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    report.setdefault("run_id", out_dir.name)
    paths = write_report(report, out_dir)
    print(format_table(report), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    print("PASS" if report["pass"] else "FAIL: measured traffic differs from the model (see above)", flush=True)
    return EXIT_PASS if report["pass"] else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
