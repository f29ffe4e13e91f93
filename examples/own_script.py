"""Phase D in your own training script: ``verify.run.record.TrafficWindow`` (docs/verify.md:
"Verify your own training script"). Run with
``torchrun --nproc-per-node 4 examples/own_script.py`` (repo root on PYTHONPATH);
``tests/distributed/phase_d/test_record.py`` runs :func:`train` on 2 gloo ranks.

The block between the ``docs/verify.md`` markers is that page's example, verbatim (a test
checks).
"""

from __future__ import annotations

import sys

import torch.distributed as dist

# docs/verify.md example begins
import dmuon
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from verify.run.record import TrafficWindow
from examples.my_model import ResidualMLP, loss_fn


def train(out_dir: str, steps: int = 4, measured: int = 2) -> dict | None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ResidualMLP()
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True)  # Z3
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=set(dm))
    fully_shard(model, mesh=mesh, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-3)

    window = TrafficWindow(model, dm, opt, out_dir=out_dir)
    for step in range(steps):
        if step == steps - measured:
            window.start()                      # after the warm-up steps
        with dmuon.phase("forward"):
            loss = loss_fn(model, rank, step)
        with dmuon.phase("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        if window.recording:
            window.step_done(loss)
    return window.finish()  # rank 0: the report; raises TrafficMismatch on every rank
# docs/verify.md example ends


if __name__ == "__main__":
    dist.init_process_group("gloo")
    report = train(sys.argv[1] if len(sys.argv) > 1 else "traces/own-script")
    if report is not None:
        print("PASS" if report["pass"] else "FAIL")
    dist.destroy_process_group()
