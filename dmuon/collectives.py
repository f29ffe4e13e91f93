"""Every collective DMuon issues, in one place (the seam to audit for traffic).

Sizes in NCCL's convention: a broadcast or reduce of a tensor of ``numel`` elements has
``count = numel`` on every member. Roots are *group* ranks (``group_src`` / ``group_dst``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import annotate


def broadcast_(buf: torch.Tensor, src: int, group: dist.ProcessGroup, *, async_op: bool = False):
    """Broadcast ``buf`` in place from group rank ``src`` to every member of ``group``.

    Returns the ``Work`` handle when ``async_op`` (the caller must keep ``buf`` alive and
    wait before reading it), else ``None``.
    """
    return dist.broadcast(buf, group_src=src, group=group, async_op=async_op)


def reduce_sum_(buf: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Sum ``buf`` over ``group`` into group rank ``dst`` (others' ``buf`` is left undefined)."""
    dist.reduce(buf, group_dst=dst, op=dist.ReduceOp.SUM, group=group)


def check_plan_agreement(digest: str, what: str) -> None:
    """Raise on every rank if the ranks' plan digests differ (before any DMuon collective).

    One all_gather of 32 bytes per rank on the default group (phase ``"setup"``), so a plan
    computed differently on some rank (different model shapes, predicate, or mesh) fails
    here with a message instead of hanging later in mismatched collectives.

    Args:
        digest: 64 hex characters (sha256) of this rank's plan.
        what: what the digest describes, for the error message.

    Raises:
        ValueError: ``digest`` is not 64 hex characters.
        RuntimeError: the digests differ; lists which ranks hold which digest.
    """
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"Invalid digest={digest!r}. Must be a sha256 hex digest (64 chars).")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    world = dist.get_world_size()
    gathered = torch.empty(world * 32, dtype=torch.uint8)
    with annotate.phase("setup"), annotate.span("dmuon.plan_agreement"):
        dist.all_gather_single(gathered, mine)
    digests = [bytes(gathered[i * 32 : (i + 1) * 32].tolist()).hex() for i in range(world)]
    if len(set(digests)) != 1:
        by_digest: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            by_digest.setdefault(d, []).append(rank)
        detail = "; ".join(f"ranks {ranks}: {d[:12]}…" for d, ranks in by_digest.items())
        raise RuntimeError(
            f"DMuon {what} differs across ranks ({detail}). Every rank must build the same "
            "model (same parameter names, shapes and dtypes), use the same predicate and the "
            "same mesh before dmuon.dedicate_params."
        )
