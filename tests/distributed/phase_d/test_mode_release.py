"""verify-traffic releases each mode's process groups and DMuon hooks before the next mode, on
every rank, also when the mode raised (on NCCL each group holds a communicator of
0.5-1.6 GB, and ten modes piled them up). Runs on gloo, where a group is threads and sockets;
the count of live groups is the same whatever the backend.

Without the release (``ModeScope.close`` not called in ``verify.run.runner.run_all``) the
W=2 run below ends with 2 groups per DMuon mode more than it started with (DMuon's own) and
every ``DedicatedParams`` still open (its hooks on the model): both assertions fail.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

#: dmuon-ddp raises in its first measured step on every rank (the factory refuses DDP); the
#: two FSDP2 modes train.
RAISING = "tests.distributed.phase_d.verdict_factories:rising_loss_raises_under_ddp"


def _run_modes_and_count(out_dir: str) -> dict:
    from unittest import mock

    from verify.run import runner
    from verify.run.groups import ModeScope, live_groups

    at_start: list[int] = []
    adopted: list = []  # kept alive here, so that "not closed" cannot hide behind gc

    class Counting(ModeScope):
        def __init__(self) -> None:
            at_start.append(len(live_groups()))
            super().__init__()

        def adopt(self, dedicated) -> None:
            adopted.append(dedicated)
            super().adopt(dedicated)

    before = len(live_groups())
    config = runner.RunConfig(modes=("dmuon-ddp", "dmuon-z2", "dmuon-z3"), steps_warmup=2,
                              steps_measured=1, out_dir=out_dir, model=RAISING, profiler=False)
    with mock.patch.object(runner, "ModeScope", Counting):
        report = runner.run_all(config)
    after = len(live_groups())
    failures = None if report is None else [(f["mode"], f["check"]) for f in report["failures"]]
    return {"before": before, "after": after, "at_start": at_start, "failures": failures,
            "closed": [dm.closed for dm in adopted]}


def test_every_mode_releases_its_groups_and_hooks_also_when_it_raised(pool2, tmp_path):
    results = pool2.run(_run_modes_and_count, str(tmp_path))
    assert ("dmuon-ddp", "error") in results[0]["failures"]  # the raising mode ran and failed
    for rank, r in enumerate(results):
        assert r["after"] == r["before"], (rank, r)  # live process groups
        assert r["at_start"] == [r["before"]] * 3, (rank, r)  # no mode sees another's groups
        assert r["closed"] == [True] * 3, (rank, r)  # each DedicatedParams closed (its hooks gone)
