"""The harness's own record of the blocks' execution order (``RunLayout.dmuon_block_order``)
and of the modules that run more than once per forward (``RunLayout.module_calls``).

DMuon numbers its buckets by the order in which the blocks' forwards first ran in the first
forward after ``dedicate_params`` (``docs/protocol.md``, step 7). The predictor must not ask
the runtime for that order, so the harness watches the same forward with hooks of its own: a
forward pre-hook on the model's root (the module given to ``dedicate_params``) starts the
record, one on each block (:func:`verify.traffic.predict.dmuon_block` of a dedicated param's module)
notes the block the first time it runs, and the root's forward hook ends the record and
removes every hook. Forwards that run inside backward (activation-checkpoint recompute) come
after the root's forward hook, so they are not recorded, as in DMuon. Create the recorder
before the first forward.

The same hooks count how many times each block's forward runs in that forward, and so do
hooks on the ``watch`` modules (the ``fully_shard`` units): weight sharing makes DMuon's Z3
broadcast a block again and FSDP2 gather a unit again (``verify.traffic.rules``), which the
predictor reads from :meth:`BlockOrderRecorder.call_counts`, not from the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from verify.traffic.predict import agreed_block_order, dmuon_block


def blocks_of(names: Sequence[str]) -> tuple[str, ...]:
    """DMuon's blocks of the dedicated params ``names`` (dotted, model order), in model order."""
    return tuple(dict.fromkeys(dmuon_block(n.rpartition(".")[0]) for n in names))


def bare_model(model: nn.Module) -> nn.Module:
    """The module DMuon's hooks are on: ``model.module`` of a ``DistributedDataParallel``,
    else ``model`` itself (``fully_shard`` keeps the module object)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


class BlockOrderRecorder:
    """Record the first forward's block order on this rank (module docstring).

    Args:
        root: the module given to ``dmuon.dedicate_params`` (the bare model, not a DDP wrapper),
            or the model wrapped with ``fully_shard``.
        blocks: DMuon's blocks in model order (:func:`blocks_of` the dedicated names);
            ``""`` is the root itself.
        watch: other modules whose forward runs to count (``fully_shard`` units).

    Raises:
        ValueError: a block or watched module is not a submodule of ``root``.
    """

    def __init__(self, root: nn.Module, blocks: Sequence[str], watch: Sequence[str] = ()) -> None:
        self.blocks = tuple(blocks)
        self.recorded: list[str] = []
        self.calls: dict[str, int] = {}
        self.done = False
        modules = dict(root.named_modules())
        missing = [b for b in (*self.blocks, *watch) if b not in modules]
        if missing:
            raise ValueError(f"Invalid blocks {missing[:3]}: not modules of {type(root).__name__}. "
                             "Must be DMuon's blocks of this model (blocks_of its dedicated names) "
                             "or its fully_shard modules.")
        self._active = False
        self._handles = [root.register_forward_pre_hook(self._root_pre),
                         root.register_forward_hook(self._root_post)]
        for b in self.blocks:
            if b:
                self._handles.append(modules[b].register_forward_pre_hook(
                    lambda m, args, b=b: self._note(b)))
        for w in dict.fromkeys(watch):
            if w and w not in self.blocks:
                self._handles.append(modules[w].register_forward_pre_hook(
                    lambda m, args, w=w: self._count(w)))

    def _root_pre(self, module, args) -> None:
        if not self.done:
            self.recorded.clear()  # a forward that raised is recorded again
            self.calls.clear()
            self._active = True
            if "" in self.blocks:
                self._note("")

    def _count(self, module: str) -> None:
        if self._active:
            self.calls[module] = self.calls.get(module, 0) + 1

    def _note(self, block: str) -> None:
        self._count(block)
        if self._active and block not in self.recorded:
            self.recorded.append(block)

    def _root_post(self, module, args, output) -> None:
        if self._active:
            self._active, self.done = False, True
            self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def agreed(self) -> tuple[str, ...]:
        """``RunLayout.dmuon_block_order`` for this job: every rank's record gathered (one
        ``all_gather_object`` on the default group: call it on every rank, outside a measured
        window), then :func:`verify.traffic.predict.agreed_block_order`."""
        records: list = [None] * dist.get_world_size()
        dist.all_gather_object(records, list(self.recorded))
        return agreed_block_order(records, self.blocks)

    def call_counts(self) -> tuple[tuple[str, int], ...]:
        """``RunLayout.module_calls`` for this job: ``(module, calls)`` of the recorded modules
        that ran more than once, in name order, as rank 0 counted them. One
        ``all_gather_object`` on the default group (every rank, outside a measured window).

        Raises:
            ValueError: the ranks counted differently (DMuon's Z3 and FSDP2 would then issue
                different calls on different ranks: every rank must run a module as often).
        """
        mine = tuple(sorted((m, c) for m, c in self.calls.items() if c > 1))
        records: list = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)
        if len(set(records)) != 1:
            raise ValueError(f"Invalid model: modules ran different numbers of times per forward on "
                             f"different ranks ({records}). Must run every shared module as often "
                             "on every rank.")
        return records[0]
