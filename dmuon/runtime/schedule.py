"""The per-step schedule: when each bucket's broadcast and reduce is issued and waited, and
the calls themselves (steps 1-6 of ``docs/protocol.md``, the one description of the protocol).

:class:`Schedule` owns the bucket order (``buckets``, renumbered by :meth:`Schedule.reorder`),
the pass's :class:`Cursors` and one :class:`~dmuon.runtime.collectives.Launcher` per device; it
changes buckets only through their methods (:mod:`dmuon.runtime.bucket`) and issues every
asynchronous call through the launcher, on DMuon's own groups.
"""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING

import torch

from dmuon import annotate
from dmuon.errors import invariant

from dmuon.runtime import collectives, usage
from dmuon.runtime.bucket import Bucket
from dmuon.runtime.state import Copy, Replica

if TYPE_CHECKING:
    from dmuon.options import ResolvedOptions


class Cursors:
    """Where the running pass is in the bucket order. Reset together, when a forward or a
    backward starts (:meth:`reset`); nothing else resets them.

    - ``fwd_issued`` / ``fwd_waited``: the next bucket index whose forward broadcast is
      issued / waited (upwards; step 1);
    - ``bwd_issued`` / ``bwd_waited``: the same for Z3's backward re-broadcasts (downwards;
      step 3); ``bwd_wanted``: the lowest index whose re-broadcast was asked for (prefetch
      included; ``n``: none yet);
    - ``reduced``: how many buckets, in reverse index order, have had their reduce issued
      (step 4); ``released``: how many are done with in this backward (all their grads
      arrived, or their reduce was issued; freed under Z3);
    - ``reducing``: the reduces of this backward, oldest first, not waited yet (a list of
      aligned groups / buckets; :meth:`Schedule._settle`); ``settles``: whether this rank
      still waits them early (False once it issued a call out of the order's triggers).
    """

    def __init__(self, n: int) -> None:
        self.reset(n)

    def reset(self, n: int) -> None:
        """Every cursor at the start of a pass over ``n`` buckets."""
        self.fwd_issued = self.fwd_waited = 0
        self.bwd_issued = self.bwd_waited = n - 1
        self.bwd_wanted = n
        self.reduced = self.released = 0
        self.reducing: list[list[Bucket]] = []
        self.settles = True

    def __repr__(self) -> str:
        return (f"Cursors(fwd {self.fwd_waited}/{self.fwd_issued}, bwd {self.bwd_waited}/"
                f"{self.bwd_issued}/{self.bwd_wanted}, reduced {self.reduced}/{self.released})")


class Schedule:
    """Cursors and collectives of one DedicatedParams (this module's docstring).

    Args:
        buckets: every bucket, in index order (``b.index == position``).
        groups: DMuon's primary process groups (``world``: the order agreement); each bucket
            moves on its own ``Bucket.groups`` (``broadcast``, ``reduce``, ``replicate``) and
            divides its reduced grads by its ``Bucket.divisor``.
        options: the :class:`~dmuon.options.ResolvedOptions` of its ``DedicatedParams``; read:
            ``prefetch_depth`` (buckets issued ahead of the one needed),
            ``reshard_after_forward`` (Z3: non-holders free after forward and re-receive in
            backward), ``reduce_by_gather`` (reduces as gathers, reduce_scatters as
            all_to_alls, each summed by the receiver: ``collectives.Launcher``;
            ``buckets.LinkCost``: gloo); each bucket reads its reduce dtype itself.
    """

    def __init__(self, buckets: list[Bucket], groups: collectives.DMuonGroups,
                 options: ResolvedOptions) -> None:
        invariant(all(b.index == i for i, b in enumerate(buckets)),
                  lambda: f"Schedule: bucket indices {[b.index for b in buckets]} are not 0..{len(buckets) - 1}")
        self.buckets = buckets
        self.groups = groups
        self.options = options
        self.cursors = Cursors(len(buckets))
        self.reduces = True  # this backward reduces (not under no_sync: the runtime sets it)
        # Z3 under a pipeline step: non-holders keep their copies across the step's
        # micro-batches until its last backward (the runtime sets it: Runtime.pipeline)
        self.hold = False
        self._launchers: dict[torch.device, collectives.Launcher] = {}
        self._index_groups()

    def _index_groups(self) -> None:
        """id(bucket) -> its aligned group (``buckets.py``): the consecutive aligned buckets
        of one unit and dtype, in index order (one call moves them all)."""
        self.groups_of: dict[int, list[Bucket]] = {}
        # bucket index -> its unit's position in the bucket order (the backward's issue order)
        self.unit_at = [0] * len(self.buckets)
        for i, b in enumerate(self.buckets[1:], 1):
            self.unit_at[i] = self.unit_at[i - 1] + (b.module_name != self.buckets[i - 1].module_name)
        self.held_of: dict[int, list[Bucket]] = {}  # id(group) -> the members this rank holds
        key = lambda b: (b.aligned, b.module_name, b.flat.dtype, id(b.groups))  # noqa: E731
        for (aligned, _, _, _), run in groupby(self.buckets, key):
            if aligned:
                run = list(run)
                self.groups_of.update((id(m), run) for m in run)
                self.held_of[id(run)] = [m for m in run if m.is_holder]  # its shard index's R

    def reset(self) -> None:
        """A pass starts: every cursor back to its start."""
        self.cursors.reset(len(self.buckets))

    def reorder(self, buckets: list[Bucket]) -> None:
        """Adopt a new bucket order (a permutation; nothing in flight) and renumber."""
        invariant(sorted(map(id, buckets)) == sorted(map(id, self.buckets)),
                  "Schedule.reorder: the new order is not a permutation of the buckets")
        self.buckets[:] = buckets
        for i, b in enumerate(self.buckets):
            b.index = i
        self._index_groups()

    # ------------------------------------------------------------------ forward (step 1)
    def advance_forward(self, last: int) -> None:
        """Wait for every bucket up to ``last``, after issuing up to ``prefetch_depth``
        buckets beyond it."""
        self.issue_forward(last + self.options.prefetch_depth)
        c = self.cursors
        while c.fwd_waited <= last:
            self.buckets[c.fwd_waited].wait_broadcast()
            c.fwd_waited += 1

    def issue_forward(self, end: int) -> None:
        """Issue the forward broadcast of every bucket up to index ``end`` not issued yet."""
        end = min(end, len(self.buckets) - 1)
        c = self.cursors
        while c.fwd_issued <= end:
            b = self.buckets[c.fwd_issued]
            self.wait_replicate(b)
            if b.copy in (Copy.FREED, Copy.STALE):
                self._broadcast(b, "forward")
            c.fwd_issued += 1

    def refill(self, b: Bucket) -> None:
        """Z3 reuse: a block whose forward runs again in the same forward finds ``b`` freed;
        broadcast it again from its holder (phase ``forward``, issued and waited here; an
        aligned group's all_gather), as FSDP2 re-gathers a reused module. Every rank runs
        the block as often."""
        self.wait_replicate(b)
        self._broadcast(b, "forward")
        for m in self.groups_of.get(id(b), [b]):
            m.wait_broadcast()

    # ------------------------------------------------------------------ backward (steps 3-5)
    def advance_rebroadcast(self, first: int) -> None:
        """Z3: wait for every bucket down to ``first``, after asking for the re-broadcasts of
        up to ``prefetch_depth`` buckets below it; compute needs ``first``, so every
        re-broadcast down to it is issued now (:meth:`_pump`)."""
        self.prefetch_rebroadcast(first - self.options.prefetch_depth, need=first)
        c = self.cursors
        while c.bwd_waited >= first:
            self.buckets[c.bwd_waited].wait_broadcast()
            c.bwd_waited -= 1

    def prefetch_rebroadcast(self, end: int, need: int | None = None) -> None:
        """Ask for the re-broadcast of every bucket down to index ``end`` (issued in the
        backward's order, :meth:`_pump`; ``need``: those down to it are needed now)."""
        c = self.cursors
        c.bwd_wanted = min(c.bwd_wanted, max(end, 0))
        self._pump(need=need)

    def advance_reduce(self, final: bool) -> None:
        """Issue what the backward's order allows now that grads arrived (:meth:`_pump`);
        ``final`` (the end of backward): everything left, a param without a local grad
        contributing zeros. Z3 frees a bucket once all its grads arrived or its reduce is
        issued."""
        self._pump(final=final)

    def _pump(self, need: int | None = None, final: bool = False) -> None:
        """Issue the backward's calls in its one order, the same on every rank (docs/
        performance.md, "One issue order across channels"): buckets by descending unit, each
        unit's re-broadcasts (Z3; bucket ``j`` counts at the unit of bucket
        ``j + prefetch_depth``, where the cursor asks for it) before its reduces; each
        channel in descending bucket index. A call goes once every call before it went and
        its trigger happened: a re-broadcast when asked for, a reduce when all its grads
        arrived or none can arrive in this backward on this rank (``Bucket.grads_pending``:
        a block that did not run here; it sends zeros). Where compute needs a re-broadcast
        (``need``) behind a reduce whose grads can still arrive, the re-broadcast goes first
        (on every rank alike where the same modules ran)."""
        c, n = self.cursors, len(self.buckets)
        while True:
            j = self._next_rebroadcast()
            k = n - 1 - c.reduced if self.reduces and c.reduced < n else None
            asked = j is not None and (final or j >= c.bwd_wanted)
            if j is not None and (k is None or self.unit_at[min(j + self.options.prefetch_depth, n - 1)]
                                  >= self.unit_at[k]):
                if not asked:
                    break
                self._rebroadcast(j)
            elif k is None:
                break
            elif final or self._reduce_ready(k, later=asked):
                self._reduce(k)
            elif asked and need is not None and j >= need:
                c.settles = False  # see _settle
                self._rebroadcast(j)  # compute needs it; the reduce's grads are still to come
            else:
                break
        self._release(final)

    def _next_rebroadcast(self) -> int | None:
        """The next bucket (descending) that a Z3 re-broadcast must refill, or None; the
        cursor passes buckets that need none (VALID: the kept last unit, a group's members
        already in flight)."""
        c = self.cursors
        if not self.options.reshard_after_forward:
            return None
        while c.bwd_issued >= 0 and self.buckets[c.bwd_issued].copy not in (Copy.FREED, Copy.STALE):
            c.bwd_issued -= 1
        return c.bwd_issued if c.bwd_issued >= 0 else None

    def _rebroadcast(self, j: int) -> None:
        self._broadcast(self.buckets[j], "backward")
        self.cursors.bwd_issued = j - 1

    def _reduce_ready(self, k: int, later: bool) -> bool:
        """Whether the reduce of bucket ``k``'s group may go: all its grads arrived, or (only
        asked when a later call waits for it: ``later``) none can still arrive."""
        members = self.groups_of.get(id(self.buckets[k]), [self.buckets[k]])
        if all(len(m.arrived) == len(m.params) for m in members):
            return True
        if later and not any(m.grads_pending() for m in members):
            self.cursors.settles = False  # see _settle
            return True
        return False

    def _reduce(self, k: int) -> None:
        """Issue the reduce of bucket ``k`` (an aligned group's last member: the whole
        group), then settle the reduces issued before it (:meth:`_settle`)."""
        c, b = self.cursors, self.buckets[k]
        members = self.groups_of.get(id(b), [b])
        bufs = [m.reduce_buffer() for m in members]
        with annotate.phase("backward"), annotate.span("dmuon.reduce", module=b.module_name,
                                                       owner=None if b.aligned else b.owner):
            if b.aligned:
                work = self._reduce_scatter(members, bufs, lambda m: m.is_holder,
                                            b.groups.reduce, "reduce", _shard_rank)
            else:
                work = self.launcher(bufs[0]).reduce(bufs[0], b.shard_owner, b.groups.reduce)
        for m, buf in zip(members, bufs):
            m.reduce_issued(work, buf)
        c.reduced += len(members)
        self._settle(self.unit_at[k])
        c.reducing.append(members)

    def _settle(self, unit: int) -> None:
        """Wait for the reduces of the units above ``unit``, whose reduce is being issued
        (each unit's reduces fly while the next unit computes, as FSDP2 waits its previous
        reduce_scatter at the next one): non-holders then free their
        grad buffers (``Bucket.reduce_settled``), so they hold the unit being reduced and
        the one accumulating, not every bucket. On CUDA the wait makes the compute stream
        wait the call's event, so the freed memory is reused only after the call read it.
        Where every rank issues the same calls in the same order (the same blocks ran, each
        call at its trigger), no rank waits for a call another has not issued. A rank that
        sent a reduce without its trigger (a block that did not run here) or a re-broadcast
        before a reduce still due stops these waits for the rest of the backward (its
        reduces are waited at the end, ``finish_reduces``): with ranks whose blocks ran in
        different orders, it may be waiting for a re-broadcast that a rank blocked here
        has not issued yet (measured: a hang of ``test_dmuon_exec_order.py``'s disagreeing
        first step without this)."""
        c = self.cursors
        if not c.settles:
            return
        for members in c.reducing:
            if self.unit_at[members[0].index] > unit:
                for m in members:
                    m.reduce_settled()
        c.reducing[:] = [g for g in c.reducing if self.unit_at[g[0].index] <= unit]

    def _release(self, final: bool) -> None:
        """Z3: free, from the top, every bucket done with in this backward (all its grads
        arrived, or its reduce issued)."""
        c, n = self.cursors, len(self.buckets)
        while c.released < n:
            members = self.groups_of.get(id(self.buckets[n - 1 - c.released]),
                                         [self.buckets[n - 1 - c.released]])
            done = final or c.released < c.reduced or all(
                len(m.arrived) == len(m.params) for m in members)
            if not done:
                break
            for m in members:
                self.free(m)
            c.released += len(members)

    def finish_reduces(self) -> None:
        """Wait for every shard reduce, run the HSDP replicate reduces (issued as each shard
        reduce is waited, all waited before any result is read), then hand the sums to the
        buckets (owners set the averaged grads)."""
        replicate_works = []
        for b in self.buckets[::-1]:
            buf = b.wait_reduce()
            held = self._held(b)
            rep = b.groups.replicate
            if rep is None or not b.is_holder or b is not held[-1]:
                continue  # an aligned group: once, at its last held bucket in this order
            with annotate.phase("backward"), annotate.span(
                "dmuon.reduce", module=b.module_name, owner=None if b.aligned else b.owner
            ):
                if not b.aligned:
                    replicate_works.append(
                        self.launcher(buf).reduce(buf, b.replicate_owner, rep, channel="replicate"))
                else:  # this rank's R held buckets, summed over the replicate axis to their owners
                    replicate_works.append(self._reduce_scatter(
                        held, [m.wait_reduce() for m in held], lambda m: m.is_owner, rep, "replicate",
                        _replicate_rank))
        for work in replicate_works:
            work.wait()
        owned = [b for b in self.buckets if b.is_owner]
        # which owned params had a grad on some rank: from this rank's own usage flags, or
        # (some had none here) the reduced usage sums in one device-to-host copy (usage.py)
        used = usage.used_anywhere([u for b in owned for u in b.sent_usage], lambda: torch.cat(
            [b.wait_reduce()[b.numel :] for b in owned]))
        k = 0
        for b in self.buckets:
            n = len(b.params) if b.is_owner else 0
            b.reduced(used[k : k + n], b.divisor)
            k += n

    def _held(self, b: Bucket) -> list[Bucket]:
        """The buckets this rank holds that move with ``b``: its aligned group's held
        members (its shard index's R, consecutive), else ``b`` alone."""
        members = self.groups_of.get(id(b))
        return [b] if members is None else self.held_of[id(members)]

    # ------------------------------------------------------------------ residency
    def free(self, b: Bucket) -> None:
        """Z3: ``b``'s non-holders free it (a no-op under Z2)."""
        if self.options.reshard_after_forward and not self.hold:
            b.free()

    def wait_replicate(self, b: Bucket) -> None:
        if b.replica is Replica.RECEIVING:
            with annotate.span("dmuon.replicate_wait", module=b.module_name, owner=b.owner):
                b.wait_replicate()

    def replicate(self) -> None:
        """Step 6 (HSDP): each holder receives its buckets from their owners over the
        replicate axis, asynchronously, in index order (waited at the next issue)."""
        with annotate.phase("replicate"):
            for b in self.buckets:
                held = self._held(b)
                if b.groups.replicate is None or not b.is_holder or b is not held[0]:
                    continue  # an aligned group: once, at its first held bucket
                with annotate.span("dmuon.replicate_broadcast", module=b.module_name,
                                   owner=None if b.aligned else b.owner):
                    if not b.aligned:
                        work = self.launcher(b.flat).broadcast(
                            b.flat, b.replicate_owner, b.groups.replicate, channel="replicate")
                    else:  # the owner's bucket to the other holders of its shard index
                        work = self._all_gather(held, [m.flat for m in held], lambda m: m.is_owner,
                                                b.groups.replicate, "replicate", _replicate_rank)
                for m in held:
                    m.replicate_issued(work)

    def sync(self) -> None:
        """``sync_params``: every bucket whose copies are not all current is broadcast from
        its holder (its master copy, synchronously, index order), after its pending
        replicate broadcast; mixed precision casts a current master locally."""
        for b in self.buckets:
            self.wait_replicate(b)
            if (b.master if b.mixed else b.copy) is not Copy.VALID:
                buf = b.receive_buffer(master=True)
                with annotate.phase("checkpoint"), annotate.span("dmuon.sync", module=b.module_name, owner=b.owner):
                    collectives.broadcast_(buf, b.shard_owner, b.groups.broadcast)
                b.master_synced()
            elif b.copy is not Copy.VALID:
                b.compute_from_master()

    def drain(self) -> None:
        """Block until every call on the buckets' devices has finished (before the groups
        are destroyed: CUDA waits only order streams)."""
        for device in dict.fromkeys(b.flat.device for b in self.buckets):
            collectives.synchronize(device)

    def _broadcast(self, b: Bucket, phase: str) -> None:
        """Holder -> shard group, the compute copy, asynchronously (waited by
        :meth:`Bucket.wait_broadcast`); for an aligned bucket, its whole group in one
        all_gather over the shard axis (every member's held buckets, in group order)."""
        members = self.groups_of.get(id(b), [b])
        for m in members:  # HSDP: the held buckets' values must have landed before they are sent
            self.wait_replicate(m)
        invariant(all(m.copy is b.copy for m in members), lambda: (
            f"aligned group of bucket {b.index} ({b.module_name!r}): members' copies differ "
            f"({[m.copy.name for m in members]})"))
        bufs = [m.receive_buffer(master=False) for m in members]
        name = "dmuon.broadcast" if phase == "forward" else "dmuon.rebroadcast"
        with annotate.phase(phase), annotate.span(name, module=b.module_name,
                                                  owner=None if b.aligned else b.owner):
            if b.aligned:
                work = self._all_gather(members, bufs, lambda m: m.is_holder,
                                        b.groups.broadcast, "broadcast", _shard_rank)
            else:
                work = self.launcher(bufs[0]).broadcast(bufs[0], b.shard_owner, b.groups.broadcast)
        for m in members:
            m.broadcast_issued(work)

    def _all_gather(self, members: list[Bucket], bufs: list[torch.Tensor], mine, group, channel: str,
                    rank_of):
        """One all_gather of ``bufs`` (group order; the ``mine(m)`` ones, consecutive, are
        this rank's input; ``rank_of(m)`` the group rank whose part ``m`` is: an all_to_all
        where the parts differ) into a staging buffer; the others' are copied out at the wait."""
        inp = _cat([buf for m, buf in zip(members, bufs) if mine(m)])
        out = torch.empty(sum(buf.numel() for buf in bufs), dtype=inp.dtype, device=inp.device)
        pending = self.launcher(inp).all_gather(out, inp, group, channel, _parts(members, bufs, rank_of))
        return collectives.Fused(pending, [(buf, piece) for m, buf, piece in
                                           zip(members, bufs, _split(out, bufs)) if not mine(m)])

    def _reduce_scatter(self, members: list[Bucket], bufs: list[torch.Tensor], mine, group, channel: str,
                        rank_of):
        """One reduce_scatter (sum) of ``bufs`` concatenated in group order (``rank_of`` as in
        :meth:`_all_gather`); this rank's chunk (the ``mine(m)`` buffers, consecutive) is
        copied into them at the wait."""
        inp = torch.cat(bufs)
        kept = [buf for m, buf in zip(members, bufs) if mine(m)]
        out = torch.empty(sum(buf.numel() for buf in kept), dtype=inp.dtype, device=inp.device)
        pending = self.launcher(inp).reduce_scatter(out, inp, group, channel, _parts(members, bufs, rank_of))
        return collectives.Fused(pending, list(zip(kept, _split(out, kept))))

    def launcher(self, t: torch.Tensor) -> collectives.Launcher:
        """The :class:`~dmuon.runtime.collectives.Launcher` for ``t``'s device (streams on CUDA)."""
        launcher = self._launchers.get(t.device)
        if launcher is None:
            launcher = self._launchers[t.device] = collectives.Launcher(
                t.device, reduce_by_gather=self.options.reduce_by_gather)
        return launcher


def _shard_rank(b: Bucket) -> int:
    """The group rank of ``b``'s holder in a shard group (``broadcast``, ``reduce``)."""
    return b.shard_owner


def _replicate_rank(b: Bucket) -> int:
    """The group rank of ``b``'s owner in a replicate group."""
    return b.replicate_owner


def _parts(members: list[Bucket], bufs: list[torch.Tensor], rank_of) -> list[int]:
    """Elements of ``bufs`` per group rank (``rank_of`` each member), in group-rank order:
    the part each rank sends or keeps in an aligned group's call (members come in group
    order, each rank's consecutive)."""
    parts: dict[int, int] = {}
    for m, buf in zip(members, bufs):
        parts[rank_of(m)] = parts.get(rank_of(m), 0) + buf.numel()
    invariant(list(parts) == sorted(parts), lambda: (
        f"aligned group of {members[0].module_name!r}: group ranks {list(parts)} out of order "
        f"(owners {[m.owner for m in members]})"))
    return list(parts.values())


def _cat(bufs: list[torch.Tensor]) -> torch.Tensor:
    return bufs[0] if len(bufs) == 1 else torch.cat(bufs)


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive views of ``like``'s sizes."""
    return list(torch.split(flat, [t.numel() for t in like]))
