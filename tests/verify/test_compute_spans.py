"""verify.measure.compute_spans: the harness's block forward / backward spans on the interposer clock."""

from __future__ import annotations

import torch
from torch import nn

from verify.measure.compute_spans import BACKWARD, FORWARD, BlockCompute, compute_blocks
from verify.workload.model import GPTConfig, TinyGPT


def test_each_block_forward_in_order_then_backward_in_reverse():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(d_model=16, n_heads=2, n_layers=3, seq_len=8))
    x = torch.randint(0, 256, (2, 8))
    with BlockCompute(model) as compute:
        model(x).sum().backward()
        with torch.no_grad():
            model(x)  # a forward without grad: forward spans only
    fwd = [s for s in compute.spans if s.name == FORWARD]
    bwd = [s for s in compute.spans if s.name == BACKWARD]
    assert [s.module for s in fwd] == ["blocks.0", "blocks.1", "blocks.2"] * 2
    assert [s.module for s in bwd] == ["blocks.2", "blocks.1", "blocks.0"]
    assert all(s.t_start_ns <= s.t_end_ns for s in compute.spans)
    # after every forward of the step; block i's backward starts when the grad of its output
    # (block i+1's input) arrives, so at block i+1's end (the two hooks of one tensor)
    assert fwd[2].t_end_ns <= bwd[0].t_start_ns
    for later, earlier in zip(bwd, bwd[1:]):
        assert later.t_start_ns <= earlier.t_start_ns and later.t_end_ns <= earlier.t_end_ns
    model(x).sum().backward()  # after exit: hooks removed, nothing recorded
    assert len(compute.spans) == 9


def test_blocks_without_a_module_list_are_the_roots_children_with_params():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [n for n, _ in compute_blocks(model)] == ["0", "2"]
    with BlockCompute(nn.Linear(2, 2)) as compute:  # no block: nothing to time
        nn.Linear(2, 2)(torch.ones(2))
    assert compute.blocks == [] and compute.spans == []
