"""``--model`` factories that fail on one rank only (tests/run/test_rank_failure.py): a Python
exception on rank 1, the end of rank 1's or rank 0's process without one, or rank 1 hanging,
in the first measured step of the first DMuon mode they meet (``--steps-warmup 2``)."""

from __future__ import annotations

import os
import time

import torch

from examples.my_model import ResidualMLP, loss_fn

#: The planted error's text, which the report must carry.
PLANTED = "planted failure on rank 1"
#: The exit code of the planted process end.
EXIT_CODE = 7


def _fails_on_rank1(action, on_rank: int = 1):
    def failing(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
        if rank == on_rank and step == 2:  # the others go on into the step's collectives
            action()
        return loss_fn(model, rank, step)

    return failing


def raises_on_rank1():
    """examples.my_model whose loss_fn raises ``RuntimeError(PLANTED)`` on rank 1 at step 2."""

    def boom():
        raise RuntimeError(PLANTED)

    return ResidualMLP(), _fails_on_rank1(boom)


def exits_on_rank1():
    """examples.my_model whose loss_fn ends rank 1's process (``os._exit(EXIT_CODE)``) at step 2."""
    return ResidualMLP(), _fails_on_rank1(lambda: os._exit(EXIT_CODE))


def exits_on_rank0():
    """examples.my_model whose loss_fn ends rank 0's process (``os._exit(EXIT_CODE)``) at step 2:
    rank 0 holds the gathered results, so a survivor must write the report."""
    return ResidualMLP(), _fails_on_rank1(lambda: os._exit(EXIT_CODE), on_rank=0)


def hangs_on_rank1():
    """examples.my_model whose loss_fn blocks rank 1 for good at step 2 (a deadlocked data
    loader, say): its peers time out in the step's collectives (``--timeout-s``) and report; the
    launcher must still end, taking the hung rank with it."""
    return ResidualMLP(), _fails_on_rank1(lambda: time.sleep(10**6))
