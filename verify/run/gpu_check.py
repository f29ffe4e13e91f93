"""``make gpu-check``: the prepared check for a machine with one CUDA GPU (a few minutes).

Two parts, both on NCCL with the world size W = 1 (one process, one GPU):

1. **traffic**: ``verify-traffic --backend nccl --nproc 1`` over every DMuon mode that runs at
   W = 1 (:data:`MODES`; HSDP needs an even W >= 4) with NCCL's ``INIT,COLL`` logs on. Each
   run's report must hold an ``nccl_log`` source that passes: real NCCL COLL lines parsed,
   matched one to one against the interposer's events and against the prediction
   (``verify.sources.nccl_source``). A run without that source fails: the point is the log path.
2. **parity**: :data:`PARITY_STEPS` training steps of DMuon in each mode against
   ``torch.optim.Muon`` + ``torch.optim.AdamW`` in one plain process on the same GPU, the same
   model init and the same batches (:func:`parity_in_group`).

Where the machine cannot run it (no CUDA device, a CPU build of torch, no NCCL), it prints
what is missing and exits with :data:`EXIT_NO_GPU` without running anything.

Exit codes: :data:`EXIT_PASS` (0) both parts pass; :data:`EXIT_FAIL` (1) a part failed (its
problems are printed); :data:`EXIT_NO_GPU` (3, as ``make nsys-verify`` where nsys is missing)
no usable GPU here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXIT_PASS, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 3

#: The DMuon modes a single process can run (``verify.traffic.formulas.MODES`` minus HSDP).
MODES = ("dmuon-ddp", "dmuon-z2", "dmuon-z3")
#: Training steps of the parity part.
PARITY_STEPS = 3
#: Parity bound: max |DMuon - oracle| over each param, relative to the oracle's displacement
#: max |p_T - p_0|. At W = 1 the reduce is an identity and the division is by 1, so the math is
#: the oracle's op for op and on CPU/gloo the runs are bit-identical (tested). On a GPU, cuBLAS
#: may pick other kernels for DMuon's and FSDP2's differently allocated buffers; a one-ulp
#: difference can flip a bf16 rounding in Newton–Schulz, which the 10-step multi-rank parity
#: tests measure at 3-11% (tests/distributed/parity/test_dmuon_parity.py). 3 steps: 5% is generous
#: for that and far below a wrong update (order 100%).
PARITY_RTOL = 0.05
#: Warm-up and measured steps of the traffic part (small: W = 1 only checks the log path).
TRAFFIC_STEPS = ("2", "2")


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

    Every mode of ``modes`` must be there and pass, with an ``nccl_log`` source that read
    events and passed.
    """
    problems = []
    runs = {r.get("mode"): r for r in report.get("runs", [])}
    for mode in modes:
        run = runs.get(mode)
        if run is None:
            problems.append(f"{mode}: no run in the report")
            continue
        nccl = run.get("sources", {}).get("nccl_log")
        if nccl is None:
            problems.append(f"{mode}: no nccl_log source (the NCCL log was not captured: NCCL "
                            "backend with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL and "
                            "NCCL_DEBUG_FILE are needed)")
        elif not nccl.get("events"):
            problems.append(f"{mode}: the NCCL log window holds no COLL line")
        elif not nccl.get("pass"):
            problems.append(f"{mode}: nccl_log failed: {nccl.get('mismatches', [])[:5]}")
        if not run.get("pass"):
            problems.append(f"{mode}: run failed (missing {run.get('missing', [])[:3]}, "
                            f"unexpected {run.get('unexpected', [])[:3]})")
    return problems


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _oracle(make_model, batches, device: str) -> dict[str, torch.Tensor]:
    from verify.run.modes import ADAMW_LR, MUON_LR, muon_names

    model = make_model().to(device)
    targets = set(muon_names(model))
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in named if n in targets], lr=MUON_LR)
    # foreach=False: the single-tensor path, the one DMuon's AdamW group runs
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=ADAMW_LR,
                              foreach=False)
    for x, y in batches:
        _loss(model, x, y).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parity_in_group(device: str, steps: int = PARITY_STEPS, modes: Sequence[str] = MODES) -> dict:
    """DMuon in each of ``modes`` against the single-process oracle, in a live 1-rank group.

    Args:
        device: ``"cuda"`` (NCCL group) or ``"cpu"`` (gloo group, the CPU test).
        steps: training steps.
        modes: DMuon modes of ``verify.run.modes``.

    Returns:
        ``{mode: {"rel_err": float, "bit_identical": bool, "pass": bool}}``: the worst
        max |DMuon - oracle| / max |oracle - init| over all params.

    Raises:
        ValueError: the default group does not have exactly one rank.
    """
    from verify.workload.data import ByteCorpus
    from verify.workload.model import GPTConfig, TinyGPT
    from verify.run.modes import build

    if dist.get_world_size() != 1:
        raise ValueError(f"Invalid world_size={dist.get_world_size()}. Must be 1 (the parity "
                         "part compares one process against the single-process oracle).")
    config = GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4)

    def make_model():
        torch.manual_seed(0)
        return TinyGPT(config)

    corpus = ByteCorpus.from_stdlib(200_000)
    batches = [tuple(t.to(device) for t in corpus.global_batch(s, 4, config.seq_len))
               for s in range(steps)]
    init = {n: p.detach().to(device) for n, p in make_model().named_parameters()}
    ref = _oracle(make_model, batches, device)
    out = {}
    for mode in modes:
        built = build(mode, make_model, device)
        for x, y in batches:
            _loss(built.model, x, y).backward()
            built.optimizer.step()
            built.optimizer.zero_grad()
        got = {}
        for name, p in built.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            got[name.removeprefix("module.")] = full.detach().clone()
        worst, identical = 0.0, True
        for name, r in ref.items():
            disp = max((r - init[name]).abs().max().item(), 1e-12)
            worst = max(worst, (got[name] - r).abs().max().item() / disp)
            identical = identical and torch.equal(got[name], r)
        out[mode] = {"rel_err": worst, "bit_identical": identical, "pass": worst <= PARITY_RTOL}
    return out


def _run_parity(out_dir: Path) -> dict:
    rdzv = Path(tempfile.mkdtemp(prefix="dmuon_gpu_check_")) / "rendezvous"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{rdzv}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        return parity_in_group("cuda")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=None, help="default traces/gpu-check-<UTC time>/")
    args = parser.parse_args(argv)
    missing = missing_requirements(torch.cuda.is_available(), torch.cuda.device_count(),
                                   dist.is_nccl_available())
    if missing:
        print("gpu-check: skipped, this machine lacks " + "; ".join(missing), flush=True)
        return EXIT_NO_GPU
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir) if args.out_dir else Path("traces") / f"gpu-check-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
          f"{nccl}; output in {out_dir}/", flush=True)
    problems = []
    t0 = time.perf_counter()
    code = subprocess.call(traffic_command(out_dir / "traffic"))
    report_path = out_dir / "traffic" / "report.json"
    if not report_path.is_file():
        problems.append(f"traffic: verify-traffic exited with {code} and wrote no report")
    else:
        problems += [f"traffic: {p}" for p in traffic_problems(json.loads(report_path.read_text()))]
    print(f"gpu-check: traffic part {time.perf_counter() - t0:.0f} s", flush=True)
    t1 = time.perf_counter()
    parity = _run_parity(out_dir)
    for mode, r in parity.items():
        print(f"parity {mode}: max rel err {r['rel_err']:.2e} (bound {PARITY_RTOL}), "
              f"bit-identical {r['bit_identical']}", flush=True)
        if not r["pass"]:
            problems.append(f"parity {mode}: rel err {r['rel_err']:.3g} > {PARITY_RTOL}")
    (out_dir / "parity.json").write_text(json.dumps(parity, indent=1))
    print(f"gpu-check: parity part {time.perf_counter() - t1:.0f} s", flush=True)
    for p in problems:
        print(f"FAIL {p}", flush=True)
    print("gpu-check: PASS" if not problems else "gpu-check: FAIL", flush=True)
    return EXIT_PASS if not problems else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
