"""Newton–Schulz of one matrix shared by a team of ranks, against one owner: measured on CPU.

The split: the wide orientation X (m, n), m <= n, is cut into ``k`` column blocks
X_j (m, n/k). Per iteration each member computes its Gram part X_j X_j^T (m, m), the team
all_reduces it (sum, float32), each forms B = bA + cAA redundantly (m^3) and updates its own
block X_j <- aX_j + B X_j. The Frobenius norm of the prologue is one all_reduce of a scalar.
Per member: m*m*(2n/k + m) multiply-adds per iteration (against m*m*(2n + m) alone) and one
all_reduce of m*m elements.

Measured here, in one invocation: the single-owner call (dmuon.optim.muon_math's
zeropower_via_newtonschulz, bfloat16) in rank 0 alone, then the team call on ``k`` forked
gloo ranks, rounds interleaved, medians; the result is compared with the single-owner one
(max |difference|, the bf16 resolution near 1 is 2**-8). Timings on this shared 2-core
machine are noisy and CPU bf16 matmul is not a GPU's: the figure that transfers is the ratio
of the all_reduce cost to the compute saved, which the α-β model of verify.traffic.scale then prices
for NVLink (see docs/scaling.md).

Usage: ``python benchmarks/bench_split_ns.py [--rows 512 --cols 2048 --team 2 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dmuon.optim.muon_math import MUON_DEFAULTS, zeropower_via_newtonschulz  # noqa: E402
from tests.distributed.harness import DistributedPool  # noqa: E402

ABC = MUON_DEFAULTS["ns_coefficients"]
STEPS = MUON_DEFAULTS["ns_steps"]
EPS = 1e-7


def split_ns(block: torch.Tensor, steps: int = STEPS) -> tuple[torch.Tensor, float]:
    """This rank's block of NS(X) for its column block ``block`` (m, n/k); (result, comm s)."""
    a, b, c = ABC
    x = block.to(torch.bfloat16, copy=True)
    comm = 0.0
    sq = x.float().pow(2).sum().reshape(1)
    t = time.perf_counter()
    dist.all_reduce(sq)
    comm += time.perf_counter() - t
    x.div_(sq.sqrt().clamp(min=EPS).to(torch.bfloat16))
    for _ in range(steps):
        gram = (x @ x.T).float()
        t = time.perf_counter()
        dist.all_reduce(gram)
        comm += time.perf_counter() - t
        gram = gram.to(torch.bfloat16)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x, comm


def _team_task(rows: int, cols: int, rounds: int) -> dict:
    k, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(rows, cols)
    width = cols // k
    block = full[:, rank * width:(rank + 1) * width]
    torch.set_num_threads(1)
    single_s, team_s, comm_s = [], [], []
    for _ in range(rounds):  # interleaved: single-owner (rank 0 alone), then the team
        dist.barrier()
        if rank == 0:
            t = time.perf_counter()
            ref = zeropower_via_newtonschulz(full, ABC, STEPS, EPS)
            single_s.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        mine, comm = split_ns(block)
        team_s.append(time.perf_counter() - t)
        comm_s.append(comm)
    parts = [torch.empty_like(mine) for _ in range(k)]
    dist.all_gather(parts, mine)
    out = {"team_s": statistics.median(team_s), "comm_s": statistics.median(comm_s)}
    if rank == 0:
        joined = torch.cat(parts, dim=1).float()
        out.update(single_s=statistics.median(single_s),
                   max_abs_diff=(joined - ref.float()).abs().max().item())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--team", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.rows > args.cols or args.cols % args.team:
        raise SystemExit("Invalid sizes. Must have rows <= cols and team dividing cols.")
    with DistributedPool(args.team, timeout_s=600) as pool:
        res = pool.run(_team_task, args.rows, args.cols, args.rounds)
    r0 = res[0]
    m, n, k = args.rows, args.cols, args.team
    print(f"NS ({m}, {n}) bf16, {STEPS} steps, one thread per rank, median of {args.rounds} "
          f"interleaved rounds, torch {torch.__version__}")
    print(f"single owner: {r0['single_s'] * 1e3:.1f} ms")
    print(f"team of {k}: {max(r['team_s'] for r in res) * 1e3:.1f} ms (slowest member), of which "
          f"all_reduce {max(r['comm_s'] for r in res) * 1e3:.1f} ms; speed-up "
          f"{r0['single_s'] / max(r['team_s'] for r in res):.2f}x; model (compute only) "
          f"{(2 * n + m) / (2 * n / k + m):.2f}x")
    print(f"max |team - single| = {r0['max_abs_diff']:.4f} (bf16 near 1: 0.0039)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
