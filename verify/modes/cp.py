"""``--cp C``: the harness's CP-capable modes on a ``("dp_shard", "cp")`` mesh of (W/C) × C.

The workload is the reference CP decoder (``examples/cp_attention.py``: :class:`CPDecoder`, at
the built-in model's width, depth, heads, vocabulary 256 and ``max_len`` = seq_len): rank
(d, c) (world rank ``d·C + c``) reads rows ``[d·B/N, (d+1)·B/N)`` of the step's global batch
and positions ``[c·L/C, (c+1)·L/C)`` of each; its attention all-gathers K and V over the CP
group (the backward all-reduces their grads). The loss is the mean over the rank's tokens, and
every mode averages the grads over all W ranks, so a step is the whole batch's mean.

Modes (``verify.traffic.cp.CP_MODES``): the DMuon modes declare both dims shard dims
(``dedicate_params(model, mesh, shard_dims=("dp_shard", "cp"), rest="replicate")``: N_eff = N·C;
``dmuon-ddp`` is Z2 there, nothing wraps the model); ``ddp-muon``, the reference, wraps the
model in DDP over all W ranks and steps ``torch.optim.Muon`` + AdamW on every rank.

Tags: the harness wraps the example's ``gather_sequence`` while a step runs (the module
attribute, restored after the step) so that the all_gather runs in phase ``context``
(``verify.traffic.cp.CONTEXT``) and its backward all_reduce too (identity autograd nodes open
the tag where the exchange's output gets its grad and close it where its input does, as
``verify.modes.ep`` does for the token all_to_all); forward and backward run in phases
``forward`` / ``backward``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes
from verify.modes.ep import _MarkInBackward, _Tag
from verify.modes.workload import Running, Workload
from verify.traffic.cp import CONTEXT, CP_MODES, CPRunLayout, cp_skip_reason
from verify.traffic.predict import dmuon_coalesce_bytes, dmuon_reduce_by_gather, dmuon_uneven_aligned
from verify.workload.data import ByteCorpus, local_slice

#: The CP decoder's vocabulary (the byte corpus's).
VOCAB = 256


def cp_mesh(world: int, cp: int, device: str):
    """The ``("dp_shard", "cp")`` mesh (W/C, C).

    Raises:
        ValueError: C < 2, C does not divide W, or W/C < 2.
    """
    if cp < 2 or world % cp or world // cp < 2:
        raise ValueError(f"Invalid --cp {cp} at W={world}. Must be >= 2, divide W, and leave "
                         "W/C >= 2 data-parallel ranks.")
    return init_device_mesh(device, (world // cp, cp), mesh_dim_names=("dp_shard", "cp"))


@contextlib.contextmanager
def tagged_exchange(tag: _Tag):
    """While open, ``examples.cp_attention.gather_sequence`` runs its all_gather in phase
    :data:`CONTEXT` and marks its backward to run there too (module docstring)."""
    import examples.cp_attention as example

    inner = example.gather_sequence

    def tagged(x: torch.Tensor, group):
        if group is None:
            return inner(x, group)
        with dmuon.phase(CONTEXT):
            out = inner(_MarkInBackward.apply(x, tag, "exit"), group)
        return _MarkInBackward.apply(out, tag, "enter")

    example.gather_sequence = tagged
    try:
        yield
    finally:
        example.gather_sequence = inner


class CPRun:
    """This rank's CP model and optimizer; :meth:`step` runs one training step and returns its
    loss (this rank's tokens' mean).

    Raises:
        ValueError: ``mode`` has no CP variant, N does not divide the global batch, or C the
            sequence length.
    """

    def __init__(self, mode: str, device: str, cp: int, *, corpus: ByteCorpus, global_batch: int,
                 seq_len: int, seed: int, d_model: int, n_layers: int, n_heads: int,
                 muon_lr: float, adamw_lr: float, coalesce: str = "auto") -> None:
        from torch.nn.parallel import DistributedDataParallel

        from examples.cp_attention import CPDecoder
        from verify.modes.baselines import MatrixMuon
        from verify.modes.build import DDP_BUCKET_CAP_MB, _count_torch_muon_ns, _Pair, muon_names

        if mode not in CP_MODES:
            raise ValueError(f"Invalid mode {mode!r} with --cp. Must be one of {CP_MODES}.")
        world = dist.get_world_size()
        self.mesh = cp_mesh(world, cp, device)
        self.d, self.c = self.mesh.get_local_rank("dp_shard"), self.mesh.get_local_rank("cp")
        n = world // cp
        if global_batch % n or seq_len % cp:
            raise ValueError(f"Invalid --cp {cp} at W={world}: the {global_batch} sequences of {seq_len} "
                             f"tokens must split over N={n} data-parallel ranks and C={cp} sequence parts "
                             "(N | B and C | seq_len).")
        torch.manual_seed(seed)
        net = CPDecoder(vocab=VOCAB, dim=d_model, layers=n_layers, heads=n_heads, max_len=seq_len).to(device)
        targets = muon_names(net)
        specs = tuple(specs_from_named_parameters(net.named_parameters(), matrix_shapes(net, targets)))
        self.corpus, self.global_batch, self.seq_len, self.seed = corpus, global_batch, seq_len, seed
        self.n, self.cp, self.part = n, cp, seq_len // cp
        self.group = self.mesh.get_group("cp")
        self.tag = _Tag(CONTEXT)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        self.dm = None
        if mode.startswith("dmuon-"):
            self.dm = dmuon.dedicate_params(net, self.mesh, shard_dims=("dp_shard", "cp"), params=list(targets),
                                            reshard_after_forward=mode.endswith("z3"),
                                            rest="replicate", coalesce=coalesce)
            self.model = net
            self.optimizer = dmuon.DMuon(net.parameters(), dedicated=self.dm, lr=muon_lr, adamw_lr=adamw_lr)
        else:  # ddp-muon: the reference, DDP over all W ranks
            named = dict(net.named_parameters())
            self.model = DistributedDataParallel(net, bucket_cap_mb=DDP_BUCKET_CAP_MB)
            shapes = matrix_shapes(net, targets)
            muon = MatrixMuon([named[t] for t in targets], [shapes[t] for t in targets], lr=muon_lr)
            adamw = torch.optim.AdamW([p for k, p in named.items() if k not in targets], lr=adamw_lr)
            self.optimizer = _Pair(muon, adamw, _count_torch_muon_ns(muon.muon))
        self.net = net
        rows = global_batch // n
        kv = rows * self.part * d_model  # one rank's part of K (or V): B_r·H·(L/C)·D_h
        self.layout = CPRunLayout(
            mode=mode, replicate_size=1, shard_size=n, params=specs, muon_names=targets,
            reshard_after_forward=mode.endswith("z3"), ddp_bucket_cap_bytes=DDP_BUCKET_CAP_MB * 1024 * 1024,
            dmuon_rest="replicate" if self.dm is not None else "wrapper",
            dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
            dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
            dmuon_uneven_aligned=dmuon_uneven_aligned(backend),
            cp_size=cp, cp_layers=tuple((f"blocks.{i}", kv, "float32") for i in range(n_layers)))

    def check_closed(self) -> None:
        """Raise if a backward opened the ``context`` tag and never closed it.

        Raises:
            RuntimeError: naming the open tags.
        """
        if self.tag.open:
            k = len(self.tag.open)
            while self.tag.open:
                self.tag.exit()
            raise RuntimeError(f"verify.modes.cp: {k} 'context' phase tag(s) opened in a backward "
                               "were not closed: the K/V exchange's input got no gradient.")

    def step(self, step: int) -> float:
        """One training step: this rank's rows and sequence part, forward (phase ``forward``),
        backward (``backward``), the K/V exchange in ``context``, ``optimizer.step()``,
        ``zero_grad()``."""
        x, y = self.corpus.global_batch(step, self.global_batch, self.seq_len, seed=self.seed)
        device = next(self.net.parameters()).device
        part = slice(self.c * self.part, (self.c + 1) * self.part)
        x = local_slice(x, self.d, self.n)[:, part].to(device)
        y = local_slice(y, self.d, self.n)[:, part].to(device)
        with tagged_exchange(self.tag):
            with dmuon.phase("forward"):  # DDP passes the args to CPDecoder.forward
                logits = self.model(x, part.start, self.group)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            with dmuon.phase("backward"):
                loss.backward()
        self.check_closed()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


class CPWorkload(Workload):
    """``--cp C``: the CP-capable modes on :func:`cp_mesh`, the reference CP decoder at the
    built-in model's size (:class:`CPRun`; ``verify.modes.workload``)."""

    axes = ("cp",)
    model_why = "the CP decoder is examples/cp_attention.py's"
    flat_why = "the CP mesh has no replicate dim"
    qk_clip_why = "the CP builder attaches no QK-clip"
    mixed_precision_why = "the CP builder runs fp32"
    rest = "replicate"
    numerics_why = ("context parallel: the probe runs one forward and backward of the whole model on "
                    "every rank's whole sequences, without the CP group")
    whole_model = False

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        return cp_skip_reason(mode, world_size, cfg.cp)

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        cp = cfg.cp
        if world_size % cp or world_size // cp < 2:
            return (f"Invalid --cp {cp} at W={world_size}{where}. Must divide W and leave W/C >= 2 "
                    f"data-parallel ranks: give an --nproc of at least {2 * cp} that {cp} divides.")
        if global_batch % (world_size // cp) or seq_len % cp:  # rows per rank, C equal parts each
            return (f"Invalid --cp {cp} at W={world_size}: the {global_batch} sequences of {seq_len} tokens "
                    f"of a step must split over {world_size // cp} data-parallel ranks and {cp} sequence "
                    "parts (give --global-batch, or a --cp that divides the sequence length).")
        return None

    def start(self, mode: str, config, *, make_model, made: list, corpus, global_batch: int) -> Running:
        from verify.modes.build import ADAMW_LR, MUON_LR, Built

        self.check(config)
        run = CPRun(mode, config.device, config.cp, corpus=corpus or ByteCorpus.from_stdlib(),
                    global_batch=global_batch, seq_len=config.seq_len, seed=config.seed,
                    d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
                    muon_lr=MUON_LR, adamw_lr=ADAMW_LR, coalesce=config.coalesce)
        return Running(Built(run.model, run.optimizer, run.layout, run.dm), None, run_step=run.step)
