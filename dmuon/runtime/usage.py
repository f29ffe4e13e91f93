"""The usage elements of a reduce, without a host–device sync in the common case.

A reduce carries one usage element per param after the grads (``docs/protocol.md`` step 4;
``rest.py``): 1 where this rank produced a grad, else 0. After the sum, a param whose
element is 0 had a grad on no rank, and keeps ``.grad = None``. Both directions used to
synchronise the host with the device on CUDA, once per backward: the flags were written by a
copy from a host tensor (``torch.tensor(flags)``: a pageable host-to-device copy, which
blocks the CPU) and read back with ``.tolist()`` (a device-to-host copy, which waits for the
reduce). Here:

- :func:`fill_flags_` writes the flags with one ``fill_`` per run of equal flags (kernels
  enqueued on the current stream; nothing is copied from the host);
- :func:`used_anywhere` answers from what this rank knows on the host: where it sent a 1, the
  sum of 0/1 values is positive on every backend and in every dtype (bf16 included), so no
  read is needed. Only when some param had no grad here (a module that ran on some ranks
  only, an expert without tokens) is the reduced usage read, in one device-to-host copy: the
  answer then depends on the other ranks, and only the reduce can tell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby

import torch

from dmuon.errors import invariant


def fill_flags_(out: torch.Tensor, flags: Sequence[bool]) -> None:
    """``out[i] = 1 if flags[i] else 0`` (``out``: 1-D, ``len(flags)`` elements, any dtype
    and device), one ``fill_`` per run of equal flags, no host-to-device copy."""
    invariant(out.dim() == 1 and out.numel() == len(flags),
              lambda: f"usage flags: buffer of shape {tuple(out.shape)} for {len(flags)} flags")
    start = 0
    with torch.no_grad():
        for flag, run in groupby(flags):
            n = len(list(run))
            out[start : start + n].fill_(1 if flag else 0)
            start += n


def used_anywhere(local: Sequence[bool], reduced: Callable[[], torch.Tensor]) -> list[bool]:
    """Whether each param had a grad on some rank, after the usage elements were summed.

    Args:
        local: what this rank sent, per param (True: a 1).
        reduced: gives the summed usage elements (1-D, ``len(local)`` elements); called only
            when some entry of ``local`` is False (one device-to-host copy then).
    """
    if all(local):
        return [True] * len(local)
    return [bool(sent) or count > 0 for sent, count in zip(local, reduced().tolist(), strict=True)]
