"""The reference EP layer on CUDA/NCCL (skipped without a GPU): ``cuda_check.py`` in a fresh
process, one rank. It failed before ``EPMoE._by_expert`` built its expert ids on the counts'
device (a CPU ``arange`` indexed by CUDA counts: "Expected all tensors to be on the same
device", seen on an H100 with torch 2.11); the gloo tests cannot show it (CPU only)."""

import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

SCRIPT = pathlib.Path(__file__).with_name("cuda_check.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NCCL")
@pytest.mark.timeout(300)
def test_ep_layer_on_cuda_matches_hugging_face(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "rendezvous")],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and "CUDA_CHECK_OK" in res.stdout, res.stdout + res.stderr
