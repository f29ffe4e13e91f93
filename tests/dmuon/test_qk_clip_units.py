"""QK-clip's pieces without a process group: HeadLogitMax's checks and maxima (causal, bool
and additive masks, GQA, TP shards), and the row scaling. Each fails without
``dmuon/optim/qk_clip.py`` (it did not exist)."""

import math

import pytest
import torch

from dmuon.optim.qk_clip import HeadLogitMax, scale_rows_


def _site(h=4, kv=2, d=3):
    w = torch.zeros(h * d + kv * d, 5)
    return HeadLogitMax("attn", w, w, n_heads=h, n_kv_heads=kv, head_dim=d, k_row0=h * d)


@pytest.mark.parametrize("kw,match", [(dict(n_heads=3, n_kv_heads=2), "multiple of n_kv_heads"),
                                      (dict(n_heads=0), "n_heads"),
                                      (dict(head_dim=9), "has no rows")])
def test_bad_layouts_are_refused(kw, match):
    args = dict(n_heads=4, n_kv_heads=2, head_dim=3) | kw
    with pytest.raises(ValueError, match=match):
        HeadLogitMax("attn", torch.zeros(12, 5), torch.zeros(6, 5), **args)


def test_maxima_match_a_per_head_loop_under_every_mask_form():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 3, generator=g), torch.randn(2, 2, 5, 3, generator=g)
    want = [max((q[b, h, i] @ k[b, h // 2, j]).item() * 0.5 for b in range(2) for i in range(5)
                for j in range(i + 1)) for h in range(4)]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for kw in (dict(is_causal=True), dict(mask=causal[None, None].expand(2, 1, 5, 5)),
               dict(mask=torch.zeros(5, 5).masked_fill(~causal, -math.inf))):
        site = _site()
        site.observe_qk(q, k, scaling=0.5, **kw)
        assert site.maxima.tolist() == pytest.approx(want, rel=1e-6), kw
        assert site.take(torch.device("cpu")).tolist() == pytest.approx(want, rel=1e-6)
        assert site.maxima is None  # reset for the next step


def test_a_tp_shard_fills_its_own_heads_and_max_accumulates():
    site = _site()
    site.head_shard = 1
    site.observe(torch.tensor([1.0, 2.0]))
    site.observe(torch.tensor([3.0, 0.5]))
    assert site.maxima.tolist() == [-math.inf, -math.inf, 3.0, 2.0]
    with pytest.raises(ValueError, match="h_local"):
        site.observe(torch.ones(3))


def test_scale_rows_scales_each_heads_rows_only():
    w = torch.ones(8, 2)
    scale_rows_(w, 2, torch.tensor([0.5, 0.25]), head_dim=2)
    assert w[:, 0].tolist() == [1, 1, 0.5, 0.5, 0.25, 0.25, 1, 1]
    b = torch.ones(8)
    scale_rows_(b, 0, torch.tensor([2.0]), head_dim=2)
    assert b.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
