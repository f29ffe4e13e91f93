"""``make gpu-check``'s W=1 paths run here on CPU/gloo, so the GPU run is not their first run:
the parity part end to end, and verify-traffic's runner at W=1 for every DMuon mode."""

from dataclasses import replace

import pytest

from tests.distributed.harness import DistributedPool
from verify.run import gpu_check as G

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def pool1():
    with DistributedPool(1, timeout_s=120) as pool:
        yield pool


def test_parity_part_at_w1_on_cpu_is_bit_identical(pool1):
    (result,) = pool1.run(G.parity_in_group, "cpu")
    assert sorted(result) == sorted(G.MODES)
    for mode, r in result.items():
        # W=1: the reduce is an identity and the division is by 1: the oracle's math op for op
        assert r["pass"] and r["bit_identical"], (mode, r)


def _w1_traffic(mode: str, out_dir: str) -> dict:
    from verify.run.runner import RunConfig, run_all

    config = replace(RunConfig(), modes=(mode,), steps_warmup=2, steps_measured=1, out_dir=out_dir,
                     n_layers=1)
    (run,) = run_all(config)["runs"]
    return {"pass": run["pass"], "missing": run["missing"], "unexpected": run["unexpected"]}


def test_traffic_at_w1_dmuon_ddp(pool1, tmp_path):
    (run,) = pool1.run(_w1_traffic, "dmuon-ddp", str(tmp_path))
    assert run["pass"], run


@pytest.mark.parametrize("mode", ["dmuon-z2", "dmuon-z3"])
def test_traffic_at_w1_fsdp2_modes(pool1, tmp_path, mode):
    # FSDP2 issues no all_gather / reduce_scatter on a one-rank shard group; the predictor
    # models that (verify/traffic/predict.py, _fsdp_calls)
    (run,) = pool1.run(_w1_traffic, mode, str(tmp_path))
    assert run["pass"], run
