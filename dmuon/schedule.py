"""The per-step schedule of :class:`dmuon.dedicate.DedicatedParams`: when each bucket's
broadcast and reduce is issued and waited, and the calls themselves (protocol steps 1-5 in
``dedicate.py``'s docstring, which stays the one description of the protocol).

:class:`Schedule` is a base class of ``DedicatedParams``; it reads that object's buckets,
groups, knobs and cursors (``_fwd_cursor`` / ``_fwd_issued``, ``_rb_cursor`` /
``_rb_issued``, ``_reduce_cursor``), and issues every asynchronous call through
:class:`dmuon.collectives.Launcher`.
"""

from __future__ import annotations

import torch

from . import annotate, collectives, residency
from .copies import Bucket


class Schedule:
    """Cursors and collectives of DedicatedParams (this module's docstring)."""

    # ------------------------------------------------------------------ cursors
    def _advance_forward(self, last: int) -> None:
        """Wait for every bucket up to ``last``, after issuing up to ``prefetch_depth``
        buckets beyond it (``dedicate.py`` docstring, step 1)."""
        self._issue_forward(last + self.prefetch_depth)
        while self._fwd_cursor <= last:
            self._wait_broadcast(self.buckets[self._fwd_cursor])
            self._fwd_cursor += 1

    def _issue_forward(self, end: int) -> None:
        """Issue the forward broadcast of every bucket up to index ``end`` not issued yet."""
        end = min(end, len(self.buckets) - 1)
        while self._fwd_issued <= end:
            b = self.buckets[self._fwd_issued]
            self._wait_replicate(b)
            if not b.valid and b.broadcast_work is None:
                self._broadcast(b, "forward")
            self._fwd_issued += 1

    def _advance_rebroadcast(self, first: int) -> None:
        """Wait for every bucket down to ``first``, after issuing up to ``prefetch_depth``
        buckets below it (``dedicate.py`` docstring, step 3)."""
        end = max(first - self.prefetch_depth, 0)
        while self._rb_issued >= end:
            b = self.buckets[self._rb_issued]
            if not b.valid and b.broadcast_work is None:
                self._broadcast(b, "backward")
            self._rb_issued -= 1
        while self._rb_cursor >= first:
            self._wait_broadcast(self.buckets[self._rb_cursor])
            self._rb_cursor -= 1

    def _advance_reduce(self, final: bool) -> None:
        order = self.buckets[::-1]
        while self._reduce_cursor < len(order):
            b = order[self._reduce_cursor]
            if not final and len(b.ready) < len(b.params):
                return
            self._issue_reduce(b)
            self._reduce_cursor += 1

    # ------------------------------------------------------------------ collectives
    def _launcher(self, t: torch.Tensor) -> collectives.Launcher:
        """The :class:`~dmuon.collectives.Launcher` for ``t``'s device (streams on CUDA)."""
        launcher = self._launchers.get(t.device)
        if launcher is None:
            launcher = self._launchers[t.device] = collectives.Launcher(t.device)
        return launcher

    def _wait_replicate(self, b: Bucket) -> None:
        if b.replicate_work is not None:
            with annotate.span("dmuon.replicate_wait", module=b.module_name, owner=b.owner):
                b.replicate_work.wait()
            b.replicate_work = None
            b.refresh_compute()  # mixed precision: the holder casts the received master

    def _broadcast(self, b: Bucket, phase: str) -> None:
        """Holder -> shard group: the compute copy (forward, backward: asynchronous, waited
        by :meth:`_wait_broadcast`) or, for ``checkpoint``, the master copy (synchronous;
        the compute copy is then cast locally)."""
        master = phase == "checkpoint"
        if not b.is_holder:
            b.alloc_master() if master else b.alloc_compute()
        buf = b.flat if master else b.lp
        name = {"forward": "dmuon.broadcast", "backward": "dmuon.rebroadcast"}.get(phase, "dmuon.sync")
        with annotate.phase(phase), annotate.span(name, module=b.module_name, owner=b.owner):
            if not master:
                b.broadcast_work = self._launcher(buf).broadcast(buf, b.shard_owner, self.groups.broadcast)
                return  # valid once waited
            collectives.broadcast_(buf, b.shard_owner, self.groups.broadcast)
        b.master_valid = True
        if b.mixed:
            b.refresh_compute()
        b.valid = True

    def _wait_broadcast(self, b: Bucket) -> None:
        """Wait for ``b``'s in-flight broadcast, if any; ``b`` is then valid."""
        if b.broadcast_work is not None:
            b.broadcast_work.wait()
            b.broadcast_work = None
            b.valid = True

    def _issue_reduce(self, b: Bucket) -> None:
        buf = b.fill_grad_buffer()
        rd = self._reduce_dtype
        if rd is not None and buf.dtype != rd:
            buf = buf.to(rd)
        with annotate.phase("backward"), annotate.span("dmuon.reduce", module=b.module_name, owner=b.owner):
            b.reduce_work = self._launcher(buf).reduce(buf, b.shard_owner, self.groups.reduce)
        b.reduce_buf = buf
        b.reduced = True
        if not b.is_owner or b.mixed:
            for q in b.compute:
                q.grad = None
        self._free_non_holder(b)  # Z3: its module's backward is done (its grads arrived)

    def _finish_reduces(self) -> None:
        rep = self.groups.replicate
        replicate_works = []
        for b in self.buckets[::-1]:
            b.reduce_work.wait()
            b.reduce_work = None
            if rep is not None and b.is_holder:
                with annotate.phase("backward"), annotate.span(
                    "dmuon.reduce", module=b.module_name, owner=b.owner
                ):
                    replicate_works.append(
                        self._launcher(b.reduce_buf).reduce(b.reduce_buf, b.replicate_owner, rep, channel="replicate")
                    )
        for work in replicate_works:
            work.wait()
        owned = [b for b in self.buckets if b.is_owner]
        # the usage sums of every owned param, read in one device-to-host copy
        counts = torch.cat([b.reduce_buf[b.numel :] for b in owned]).tolist() if owned else []
        k = 0
        for b in self.buckets:
            buf, b.reduce_buf = b.reduce_buf, None
            b.used = [False] * len(b.params)
            if not b.is_holder:  # every wait on its buffer is done: a known point to free
                b.free_grad_buffer()
            if b.is_owner:
                same = buf.dtype == b.flat.dtype
                if same:
                    buf.div_(self.topology.world_size)
                offset = 0
                for p in b.params:
                    n = p.numel()
                    g = buf[offset : offset + n].view_as(p)
                    if not same:  # mixed precision: the master grad, averaged in its dtype
                        g = g.to(p.dtype).div_(self.topology.world_size)
                    # unused on every rank: None, unless the owner kept a grad tensor
                    # (zero_grad(set_to_none=False)), which torch would step on (zeros)
                    p.grad = g if counts[k] > 0 or p.grad is not None else None
                    offset += n
                    k += 1

    # ------------------------------------------------------------------ residency
    def _free_non_holder(self, b: Bucket) -> None:
        """Z3: non-holders free ``b``; every rank marks it invalid (a no-op under Z2)."""
        self._wait_broadcast(b)  # never free a buffer a broadcast is writing
        if self.reshard_after_forward:
            if not b.is_holder and residency.is_allocated(b.lp):
                b.free_compute()
            b.valid = False
