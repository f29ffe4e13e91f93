"""``make gpu-check``'s W=1 paths run here on CPU/gloo, so the GPU run is not their first run:
the parity part end to end, the sync and stream parts with stand-ins for the CUDA-only
detectors (set_sync_debug_mode, the CUDA sanitizer), and verify-traffic's runner at W=1 for
every DMuon mode."""

import contextlib
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
    assert sorted(result) == sorted([*G.MODES, "oracle_cuda_vs_cpu"])
    assert result.pop("oracle_cuda_vs_cpu") is None  # on CPU there is no second device
    for mode, r in result.items():
        # W=1: the reduce is an identity and the division is by 1: the oracle's math op for op
        assert r["pass"] and r["bit_identical"], (mode, r)
        assert r["rel_err_cpu"] is None and r["memory"] is None


@contextlib.contextmanager
def _sync_in_loss():
    """Stand-in for set_sync_debug_mode("error") (CPU has no device to sync with): the loss
    raises as a synchronising call would, from where it is made."""
    from verify.run import device_checks

    original = device_checks.F.cross_entropy

    def syncing(*args, **kwargs):
        raise RuntimeError("called a synchronizing CUDA operation (stand-in)")

    device_checks.F.cross_entropy = syncing
    try:
        yield
    finally:
        device_checks.F.cross_entropy = original


def _sync_task() -> dict:
    from verify.run import device_checks as D
    from verify.run.groups import live_groups

    before = len(live_groups())
    clean = D.sync_in_group("cpu", ("dmuon-z3",), guard=contextlib.nullcontext)
    syncing = D.sync_in_group("cpu", ("dmuon-z3",), guard=_sync_in_loss)
    return {"clean": clean, "syncing": syncing, "groups": (before, len(live_groups()))}


def test_sync_part_reports_where_a_step_synchronised_and_releases_the_mode(pool1):
    (r,) = pool1.run(_sync_task)
    assert r["clean"] == {"dmuon-z3": {"pass": True, "error": None}}
    error = r["syncing"]["dmuon-z3"]["error"]
    assert not r["syncing"]["dmuon-z3"]["pass"]
    assert error.startswith("RuntimeError: called a synchronizing CUDA operation (stand-in) at ")
    assert "device_checks.py:" in error and error.endswith("in loss_of")  # the project frame
    assert r["groups"][0] == r["groups"][1]  # the raising mode's groups were released too


def _streams_task() -> dict:
    from verify.run import device_checks as D

    return D.streams_in_group("cpu", ("dmuon-z3",), detector=contextlib.nullcontext)


def test_stream_control_that_plants_nothing_fails_the_check(pool1):
    """On gloo DMuon waits on work handles, not events: the control skips no event wait, and
    the check must say so rather than pass (on a GPU the sanitizer must then catch the race)."""
    (r,) = pool1.run(_streams_task)
    assert r["dmuon-z3"]["clean"] == {"race": False, "error": None, "waits_skipped": 0}
    assert r["dmuon-z3"]["control"]["waits_skipped"] == 0
    from verify.run.device_checks import stream_problems

    assert stream_problems(r) == ["streams dmuon-z3: negative control planted nothing (no event "
                                  "wait skipped)"]


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
