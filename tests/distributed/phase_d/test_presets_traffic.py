"""``--model llama-tiny`` (GQA with fused QKV, SwiGLU, untied head, dims not divisible by 4):
every mode's measured collectives equal the prediction at W=4. Slow: ~10-25 s per mode on
2 cores (``make test-all``)."""

from __future__ import annotations

import pytest

from tests.distributed.phase_d import record_tasks
from verify.traffic.formulas import MODES

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

@pytest.mark.parametrize("mode", MODES)
def test_llama_tiny_w4(pool4, tmp_path, mode):
    report = pool4.run(record_tasks.run_user_model, str(tmp_path), (mode,), "llama-tiny")[0]
    run = report["runs"][0]
    assert report["model"] == "llama-tiny"
    assert run["pass"], (run["missing"] + run["unexpected"])[:6]
    assert run["measured_avg_elems"] == pytest.approx(run["predicted_avg_elems"], rel=1e-12)
    assert run["wire"]["mean_recv_elems"] == pytest.approx(run["measured_avg_elems"], rel=1e-9)
    assert run["wire"]["max_recv_elems"] >= run["measured_avg_elems"] * (1 - 1e-12)
