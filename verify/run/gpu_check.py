"""``make gpu-check``: the device check for a machine with one CUDA GPU (offline, one command,
a few minutes), with one output file to attach to a bug report.

Every part runs on NCCL with the world size W = 1 (one process, one GPU):

1. **traffic**: ``verify-traffic --backend nccl --nproc 1`` (torchrun) over every DMuon mode
   that runs at W = 1 (:data:`MODES`; HSDP needs an even W >= 4) with NCCL's ``INIT,COLL``
   logs on. Each run must pass and carry every source of :data:`SOURCES`, each with events
   and passing: the interposer against the prediction, and one to one against it the CUDA
   Flight Recorder, torch.profiler and the NCCL log (:func:`traffic_problems`).
2. **parity**: DMuon in each mode against ``torch.optim.Muon`` + ``AdamW`` on the GPU
   (bound ``PARITY_RTOL``) and against the same oracle on the CPU (CUDA against CPU, bound
   ``CPU_PARITY_RTOL``); the peak device memory of each mode
   (``torch.cuda.max_memory_allocated``) is reported, not gated.
3. **sync**: steady-state steps of each mode under ``torch.cuda.set_sync_debug_mode("error")``:
   no host-device synchronisation inside a step.
4. **streams**: steps of dmuon-z2 / dmuon-z3 under torch's CUDA sanitizer: no unordered access
   between DMuon's side streams and the compute stream; and a negative control with DMuon's
   event waits skipped, which the sanitizer must catch.

(Parts 2-4: ``verify.run.device_checks``.) What one GPU cannot show is listed as not checked
(:data:`NOT_CHECKED`). Where the machine cannot run it (no CUDA device, a CPU build of torch,
no NCCL) it runs nothing and says what is missing.

Output: ``<out-dir>/gpu-check.json`` (:data:`REPORT_FILE`: environment, verdict, every part's
figures, the problems, the not-checked list and a text ``summary``, the lines also printed)
and ``<out-dir>/exit_code``; the traffic part's traces under ``<out-dir>/traffic/``.

Exit codes: :data:`EXIT_PASS` (0) every part passed; :data:`EXIT_FAIL` (1) a part failed
(its problems are printed and in the report); :data:`EXIT_NO_GPU` (3) no usable GPU here.
``make gpu-check`` can only say 2 for both failures; ``bin/dmuon-ci gpu-check`` returns them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from verify.run.ci import record_exit
from verify.run.device_checks import (CPU_PARITY_RTOL, MODES, PARITY_RTOL, cuda_memory,
                                      parity_in_group, stream_problems, streams_in_group,
                                      sync_in_group)

EXIT_PASS, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 3
#: The one file to attach to a bug report.
REPORT_FILE = "gpu-check.json"
REPORT_SCHEMA_VERSION = 1
#: The sources each traffic run must carry, with events, passing.
SOURCES = ("interposer", "flight_recorder", "profiler", "nccl_log")
#: Warm-up and measured steps of the traffic part (small: W = 1 checks the paths, not scale).
TRAFFIC_STEPS = ("2", "2")
#: The traffic part's wall-clock limit, seconds (the whole check is meant to take < 5 min).
TRAFFIC_TIMEOUT_S = 240
#: What one GPU cannot show, and where it is checked instead.
NOT_CHECKED = (
    {"what": "W >= 2: multi-rank collectives, owners on other ranks, busiest-rank bytes",
     "why": "one GPU runs W = 1 only; `make verify-traffic` on >= 2 GPUs"},
    {"what": "HSDP (dmuon-hsdp-z2 / z3, naive-hsdp), flat or hierarchical",
     "why": "needs an even W >= 4"},
    {"what": "NVLink counters", "why": "no peer GPU to link to; `make verify-traffic` on >= 2 GPUs"},
    {"what": "nsys (Nsight Systems) source", "why": "`make nsys-verify`, >= 2 GPUs and nsys on PATH"},
    {"what": "the baselines (ddp-muon, zero1-muon, naive FSDP2)", "why": "not DMuon; `make verify-traffic`"},
    {"what": "tensor parallelism on NCCL", "why": "needs W >= 2 (`--tp`)"},
)


def missing_requirements(cuda_available: bool, device_count: int, nccl_available: bool) -> list[str]:
    """What this machine lacks for the check (empty: it can run). Pure, for testing.

    Args:
        cuda_available: ``torch.cuda.is_available()``.
        device_count: ``torch.cuda.device_count()``.
        nccl_available: ``torch.distributed.is_nccl_available()``.
    """
    missing = []
    if not cuda_available or device_count < 1:
        missing.append(
            f"a CUDA GPU (torch {torch.__version__} sees torch.cuda.is_available()="
            f"{cuda_available}, device_count={device_count}; a CPU build of torch or no driver)"
        )
    if not nccl_available:
        missing.append("NCCL (torch.distributed.is_nccl_available() is False in this build)")
    return missing


def traffic_command(out_dir: Path, modes: Sequence[str] = MODES) -> list[str]:
    """The ``verify.run.launch`` command line of the traffic part (a pure function, tested)."""
    return [
        sys.executable, "-m", "verify.run.launch", "--backend", "nccl", "--nproc", "1",
        "--out-dir", str(out_dir), "--modes", ",".join(modes),
        "--steps-warmup", TRAFFIC_STEPS[0], "--steps-measured", TRAFFIC_STEPS[1],
    ]


def traffic_problems(report: dict, modes: Sequence[str] = MODES) -> list[str]:
    """Why a ``report.json`` of the traffic part fails (empty: it passes).

    Every mode of ``modes`` must be there and pass, with every source of :data:`SOURCES`
    present, holding events, and passing.
    """
    problems = []
    runs = {r.get("mode"): r for r in report.get("runs", [])}
    hints = {"nccl_log": "the NCCL log was not captured: NCCL backend with NCCL_DEBUG=INFO, "
                         "NCCL_DEBUG_SUBSYS=INIT,COLL and NCCL_DEBUG_FILE are needed",
             "flight_recorder": "TORCH_FR_BUFFER_SIZE > 0 and the CUDA recorder's dump "
                                "(tracer/fr/dump.py) are needed",
             "profiler": "verify-traffic ran with --no-profiler, or the profiler failed"}
    for mode in modes:
        run = runs.get(mode)
        if run is None:
            problems.append(f"{mode}: no run in the report")
            continue
        for name in SOURCES:
            source = run.get("sources", {}).get(name)
            if source is None:
                problems.append(f"{mode}: no {name} source ({hints.get(name, 'not recorded')})")
            elif not source.get("events"):
                problems.append(f"{mode}: the {name} source holds no event in the window")
            elif not source.get("pass"):
                problems.append(f"{mode}: {name} failed: {source.get('mismatches', [])[:5]}")
        if not run.get("pass"):
            failed = [c["check"] for c in run.get("checks", []) if not c.get("pass")]
            problems.append(f"{mode}: run failed (checks {failed}; missing "
                            f"{run.get('missing', [])[:3]}, unexpected {run.get('unexpected', [])[:3]})")
    return problems


def parity_problems(parity: dict) -> list[str]:
    """Why the parity part fails: a mode over ``PARITY_RTOL`` (same device) or over
    ``CPU_PARITY_RTOL`` (against the CPU oracle)."""
    problems = []
    for mode, r in parity.items():
        if not isinstance(r, dict):
            continue  # oracle_cuda_vs_cpu
        if not r["pass"]:
            problems.append(f"parity {mode}: rel err {r['rel_err']:.3g} > {PARITY_RTOL} against "
                            "torch's Muon + AdamW on the same device")
        if r.get("pass_cpu") is False:
            problems.append(f"parity {mode}: rel err {r['rel_err_cpu']:.3g} > {CPU_PARITY_RTOL} "
                            "against the CPU oracle (CUDA against CPU)")
    return problems


def sync_problems(sync: dict) -> list[str]:
    """Why the sync part fails: a mode whose steady-state step synchronised with the host."""
    return [f"sync {mode}: a host-device synchronisation inside a step: {r['error']}"
            for mode, r in sync.items() if not r["pass"]]


def verdict(problems: Sequence[str]) -> tuple[str, int]:
    """``("PASS", 0)`` without problems, else ``("FAIL", 1)``."""
    return ("PASS", EXIT_PASS) if not problems else ("FAIL", EXIT_FAIL)


def summary_lines(report: dict) -> list[str]:
    """The report in text, one line each (printed, and kept in the report)."""
    env = report["environment"]
    lines = [f"gpu-check {report['verdict']} (exit {report['exit_code']}) on "
             f"{env.get('gpu', 'no GPU')}, torch {env['torch']}, CUDA {env.get('cuda')}, "
             f"NCCL {env.get('nccl')}, Python {env['python']}"]
    if report.get("missing"):
        lines.append("skipped, this machine lacks " + "; ".join(report["missing"]))
    parts = report.get("parts", {})
    for mode, r in parts.get("parity", {}).items():
        if isinstance(r, dict):
            cpu = "" if r.get("rel_err_cpu") is None else f", vs CPU {r['rel_err_cpu']:.2e}"
            mem = r.get("memory") or {}
            peak = mem.get("max_allocated_bytes")
            lines.append(f"parity {mode}: rel err {r['rel_err']:.2e}{cpu}"
                         + ("" if peak is None else f"; peak memory {peak / 2**20:.1f} MiB"))
    for mode, r in parts.get("sync", {}).items():
        lines.append(f"sync {mode}: {'no host sync' if r['pass'] else r['error']}")
    for mode, runs in parts.get("streams", {}).items():
        lines.append(f"streams {mode}: clean {'race' if runs['clean']['race'] else 'ordered'}, "
                     f"control {'detected' if runs['control']['race'] else 'NOT detected'} "
                     f"({runs['control']['waits_skipped']} waits skipped)")
    lines += [f"FAIL {p}" for p in report.get("problems", [])]
    lines += [f"not checked: {n['what']} ({n['why']})" for n in report.get("not_checked", [])]
    return lines


def environment() -> dict:
    """Versions and the device, as a bug report needs them (no CUDA call where CUDA is absent)."""
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        env.update(gpu=torch.cuda.get_device_name(0),
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return env


def build_report(env: dict, parts: dict, problems: list[str], missing: list[str],
                 durations_s: dict) -> dict:
    """The content of :data:`REPORT_FILE` (pure). A run with ``missing`` is ``SKIPPED`` (3)."""
    if missing:
        word, code = "SKIPPED", EXIT_NO_GPU
    else:
        word, code = verdict(problems)
    report = {"schema_version": REPORT_SCHEMA_VERSION, "tool": "gpu-check", "verdict": word,
              "exit_code": code, "created_utc": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "environment": env, "missing": missing,
              "parts": parts, "problems": problems, "durations_s": durations_s,
              "not_checked": list(NOT_CHECKED)}
    report["summary"] = summary_lines(report)
    return report


def _run_limited(cmd: list[str], timeout_s: float) -> int | None:
    """Run ``cmd`` in its own session; its exit status, or ``None`` after killing it (and
    torchrun's workers with it) at ``timeout_s``."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def _traffic_part(out_dir: Path) -> tuple[dict, list[str]]:
    code = _run_limited(traffic_command(out_dir), TRAFFIC_TIMEOUT_S)
    path = out_dir / "report.json"
    if code is None:
        return {"exit_code": None}, [f"traffic: verify-traffic ran past {TRAFFIC_TIMEOUT_S} s"]
    if not path.is_file():
        return {"exit_code": code}, [f"traffic: verify-traffic exited with {code} and wrote no report"]
    report = json.loads(path.read_text())
    runs = {r["mode"]: {"pass": r.get("pass"), "sources": {
        k: {f: v.get(f) for f in ("events", "matched", "pass")} for k, v in r.get("sources", {}).items()}}
        for r in report.get("runs", [])}
    return {"exit_code": code, "runs": runs}, [f"traffic: {p}" for p in traffic_problems(report)]


def _device_parts() -> tuple[dict, list[str], dict]:
    """Parts 2-4 in a one-rank NCCL group (``verify.run.groups.init_kwargs``: device_id)."""
    from verify.run.groups import init_kwargs

    rdzv = Path(tempfile.mkdtemp(prefix="dmuon_gpu_check_")) / "rendezvous"
    torch.cuda.set_device(0)
    dist.init_process_group(init_method=f"file://{rdzv}", rank=0, world_size=1,
                            **init_kwargs("nccl", 0, 120))
    parts, problems, durations = {}, [], {}
    try:
        t = time.perf_counter()
        parts["parity"] = parity_in_group("cuda", memory=cuda_memory)
        problems += parity_problems(parts["parity"])
        durations["parity"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        parts["sync"] = sync_in_group("cuda")
        problems += sync_problems(parts["sync"])
        durations["sync"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()  # last: the sanitizer's trace callbacks stay registered
        parts["streams"] = streams_in_group("cuda")
        problems += stream_problems(parts["streams"])
        durations["streams"] = round(time.perf_counter() - t, 1)
    finally:
        dist.destroy_process_group()
    return parts, problems, durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n\n")[0],
                                     epilog="Exit codes: 0 pass, 1 a part failed, 3 no usable GPU.")
    parser.add_argument("--out-dir", default=None, help="default traces/gpu-check-<UTC time>/")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir) if args.out_dir else Path("traces") / f"gpu-check-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = missing_requirements(torch.cuda.is_available(), torch.cuda.device_count(),
                                   dist.is_nccl_available())
    parts, problems, durations = {}, [], {}
    if not missing:
        print(f"gpu-check: output in {out_dir}/", flush=True)
        t = time.perf_counter()
        parts["traffic"], found = _traffic_part(out_dir / "traffic")
        problems += found
        durations["traffic"] = round(time.perf_counter() - t, 1)
        try:
            device, found, timed = _device_parts()
            parts.update(device)
            problems += found
            durations.update(timed)
        except Exception as exc:  # noqa: BLE001 - a part that raised is a failed part
            from verify.run.device_checks import where_raised

            problems.append(f"device parts raised: {where_raised(exc)}")
    report = build_report(environment(), parts, problems, missing, durations)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(report["summary"]), flush=True)
    print(f"gpu-check: report in {out_dir / REPORT_FILE}", flush=True)
    return record_exit(out_dir, report["exit_code"], "gpu-check")


if __name__ == "__main__":
    sys.exit(main())
