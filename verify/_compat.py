"""Fallbacks for the harness's newer-only torch calls (torch 2.11 through the newest).

``dist.all_gather_single`` / ``dist.reduce_scatter_single`` where torch has them (2.13 on,
which deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` with a FutureWarning
per call site and rank); the older names on torch 2.11, which lacks the new ones. Both names
of a pair dispatch the same ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_`` op,
so the calls and what every trace source records are the same. The harness keeps its own
copy (not ``dmuon.runtime.collectives``'): it shares no runtime code for what it measures.

Source: torch 2.13 ``torch/distributed/distributed_c10d.py`` (``all_gather_into_tensor``
warns and calls ``all_gather_single``); torch 2.11 has only the older names.
"""

from __future__ import annotations

import torch.distributed as dist

#: ``(output_tensor, input_tensor, group=None, async_op=False)``: ``output`` (n * input.numel(),)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``(output, input, op=SUM, group=None, async_op=False)``: ``output`` (input.numel() / n,)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
