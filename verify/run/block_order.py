"""The harness's own record of the blocks' execution order (``RunLayout.dmuon_block_order``).

DMuon numbers its buckets by the order in which the blocks' forwards first ran in the first
forward after ``dedicate_params`` (``dmuon/runtime/dedicate.py``, step 7). The predictor must not ask
the runtime for that order, so the harness watches the same forward with hooks of its own: a
forward pre-hook on the model's root (the module given to ``dedicate_params``) starts the
record, one on each block (:func:`verify.traffic.predict.dmuon_block` of a dedicated param's module)
notes the block the first time it runs, and the root's forward hook ends the record and
removes every hook. Forwards that run inside backward (activation-checkpoint recompute) come
after the root's forward hook, so they are not recorded, as in DMuon. Create the recorder
before the first forward.
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
        root: the module given to ``dmuon.dedicate_params`` (the bare model, not a DDP wrapper).
        blocks: DMuon's blocks in model order (:func:`blocks_of` the dedicated names);
            ``""`` is the root itself.

    Raises:
        ValueError: a block is not a submodule of ``root``.
    """

    def __init__(self, root: nn.Module, blocks: Sequence[str]) -> None:
        self.blocks = tuple(blocks)
        self.recorded: list[str] = []
        self.done = False
        modules = dict(root.named_modules())
        missing = [b for b in self.blocks if b not in modules]
        if missing:
            raise ValueError(f"Invalid blocks {missing[:3]}: not modules of {type(root).__name__}. "
                             "Must be DMuon's blocks of this model (blocks_of its dedicated names).")
        self._active = False
        self._handles = [root.register_forward_pre_hook(self._root_pre),
                         root.register_forward_hook(self._root_post)]
        for b in self.blocks:
            if b:
                self._handles.append(modules[b].register_forward_pre_hook(
                    lambda m, args, b=b: self._note(b)))

    def _root_pre(self, module, args) -> None:
        if not self.done:
            self.recorded.clear()  # a forward that raised is recorded again
            self._active = True
            if "" in self.blocks:
                self._note("")

    def _note(self, block: str) -> None:
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
