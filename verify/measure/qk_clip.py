"""``verify-traffic --qk-clip [TAU]``: MuonClip's QK-clip in the DMuon modes, and its report entry.

The DMuon modes get a :class:`dmuon.optim.qk_clip.QKClip` on their optimizer (τ = ``TAU``,
α = 0.5) fed by TinyGPT's attention (``CausalSelfAttention.qk_observer``, one
:class:`~dmuon.optim.qk_clip.HeadLogitMax` per block: fused ``qkv``, q rows 0…D, k rows D…2D,
MHA). The layout the harness records gets ``qk_clip_heads`` = Σ ``n_heads`` over the model's
attention modules, counted here from the model itself (not from the runtime's layers), so the
predictor (``verify.traffic.predict.qk_clip_calls``) adds one all_reduce (MAX) per rank and
step over all W ranks, ``qk_clip_heads`` fp32 elements, phase ``qk_clip``.

The baseline modes (``ddp-muon``, ``zero1-muon``, ``naive-*``) have no QK-clip (it is DMuon's
step post-hook): their report entry says so (:func:`not_run_entry`), they are not compared
against a clip they do not run.

The run's ``qk_clip`` entry (:func:`run_entry`) holds the phase's bytes, all of them (the
maxima are not dedicated-param elements, so the dedicated-param tables show 0 there): the
message of one call (``msg_bytes`` = 4 · heads), calls per step, the W-average f(n)·S in bytes
per rank per step measured and predicted, and how many heads the clip scaled at each step.
Whether the calls match the prediction is the ``collectives`` check's (phase ``qk_clip``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from tracer.events import DTYPE_BYTES, CollectiveEvent
from verify.traffic.formulas import avg_elems
from verify.traffic.predict import RunLayout, qk_clip_calls
from verify.workload.model import CausalSelfAttention

#: τ of ``--qk-clip`` without a value: below the per-head max logit of the built-in TinyGPT at
#: init (0.08 … 0.14 measured at W = 1, batch 2: every head is clipped at the first step) and
#: near where training takes it (0.03 … 0.06 after a few steps: some heads clipped again).
DEFAULT_TAU = 0.05
#: The share of the clip factor on W_q (the Kimi K2 report's value).
ALPHA = 0.5
#: Phase of the clip's all_reduce (``dmuon.optim.qk_clip``).
PHASE = "qk_clip"
#: Why a baseline mode has no ``qk_clip`` phase.
NOT_DMUON = ("not a DMuon mode: QK-clip is DMuon's step post-hook (dmuon.optim.qk_clip.QKClip); "
             "this mode's optimizer runs none")


def attention_modules(model: nn.Module) -> list[tuple[str, CausalSelfAttention]]:
    """``(name, module)`` of every TinyGPT attention (``verify.workload.model``) in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, CausalSelfAttention)]


def count_heads(model: nn.Module) -> int:
    """Σ ``n_heads`` over ``model``'s attention modules: the harness's own count for
    ``RunLayout.qk_clip_heads``.

    Raises:
        ValueError: ``model`` has no TinyGPT attention.
    """
    found = attention_modules(model)
    if not found:
        raise ValueError(f"Invalid model {type(model).__name__} for --qk-clip: no "
                         "verify.workload.model.CausalSelfAttention in it. Must be the built-in "
                         "TinyGPT (--model tinygpt), whose attention reports its q, k.")
    return sum(m.n_heads for _, m in found)


def tinygpt_layers(model: nn.Module) -> list:
    """One :class:`~dmuon.optim.qk_clip.HeadLogitMax` per TinyGPT attention of ``model``
    (fused ``qkv``: q rows 0…D, k rows D…2D, MHA), wired to its ``qk_observer``; named by module.

    Raises:
        ValueError: ``model`` has no TinyGPT attention (:func:`count_heads`).
    """
    from dmuon.optim.qk_clip import HeadLogitMax

    count_heads(model)
    layers = []
    for name, attn in attention_modules(model):
        d = attn.qkv.weight.shape[1]
        site = HeadLogitMax(name, attn.qkv.weight, attn.qkv.weight, n_heads=attn.n_heads,
                            n_kv_heads=attn.n_heads, head_dim=d // attn.n_heads, q_row0=0, k_row0=d)
        attn.qk_observer = site
        layers.append(site)
    return layers


def attach(optimizer, model: nn.Module, tau: float):
    """A :class:`~dmuon.optim.qk_clip.QKClip` (τ = ``tau``, α = :data:`ALPHA`) on the DMuon
    ``optimizer`` of the unwrapped ``model`` (after wrapping: the params it scales are the
    optimizer's). Raises ValueError as :class:`QKClip` and :func:`count_heads` do."""
    from dmuon.optim.qk_clip import QKClip

    return QKClip(optimizer, tinygpt_layers(model), tau=tau, alpha=ALPHA)


def clipped_heads(clip) -> int:
    """Heads the clip scaled at its last step (0 before the first)."""
    return sum(len(heads) for heads in clip.clipped.values())


def _avg_bytes(calls: Sequence[tuple[str, int, int, str]], world: int, steps: int) -> float:
    """W-average f(n)·S in bytes per rank per step of ``(op, count, group_size, dtype)`` calls."""
    return sum(avg_elems(op, count, n) * DTYPE_BYTES[dtype] for op, count, n, dtype in calls) / (
        world * steps)


def run_entry(layout: RunLayout, events: Sequence[CollectiveEvent], steps: int, tau: float,
              clipped_per_step: Sequence[int]) -> dict:
    """report.json ``runs[].qk_clip`` of a DMuon run with QK-clip (module docstring).

    Args:
        layout: the run's layout (``qk_clip_heads`` > 0).
        events: every rank's interposer events over ``steps`` measured steps.
        tau: the threshold the run used.
        clipped_per_step: heads clipped at each step of the run (warm-up and measured).

    Returns:
        ``{"applies": True, "tau", "heads", "msg_bytes", "calls_measured_per_step",
        "calls_predicted_per_step", "measured_avg_bytes", "predicted_avg_bytes",
        "clipped_per_step", "pass"}``; bytes per rank per step (W-average), ``msg_bytes`` per
        call (``None`` where the measured calls differ in size), ``pass``: measured calls and
        bytes equal the prediction's.
    """
    w = layout.world_size
    mine = [ev for ev in events if ev.phase == PHASE]
    predicted = [e for r in range(w) for e in qk_clip_calls(layout, r)]
    sizes = {(ev.count or 0) * DTYPE_BYTES.get(ev.dtype or "", 0) for ev in mine}
    measured = _avg_bytes([(ev.op, ev.count or 0, ev.group_size or 1, ev.dtype or "float32")
                           for ev in mine if ev.dtype in DTYPE_BYTES], w, steps)
    expected = _avg_bytes([(e.op, e.count, e.group_size, e.dtype) for e in predicted], w, 1)
    calls = len(mine) / steps
    return {"applies": True, "tau": tau, "heads": layout.qk_clip_heads,
            "msg_bytes": sizes.pop() if len(sizes) == 1 else None,
            "calls_measured_per_step": calls, "calls_predicted_per_step": len(predicted),
            "measured_avg_bytes": measured, "predicted_avg_bytes": expected,
            "clipped_per_step": list(clipped_per_step),
            "pass": calls == len(predicted) and math.isclose(measured, expected, rel_tol=1e-9)}


def not_run_entry(tau: float) -> dict:
    """report.json ``runs[].qk_clip`` of a mode without QK-clip (a baseline): n/a and why."""
    return {"applies": False, "tau": tau, "reason": NOT_DMUON}
