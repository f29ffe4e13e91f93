"""``--pp S``: the harness's PP-capable modes on a ``("pp", "dp_shard")`` mesh of S × (W/S).

The workload is the built-in TinyGPT cut into S stage modules (:class:`GPTStage`: stage s holds
blocks ``s·L/S .. (s+1)·L/S - 1``, the first also the embeddings, the last ``ln_f`` and
``head``; the whole model's names), each in a ``torch.distributed.pipelining.PipelineStage``
with static shapes on the pipeline group, run by ``Schedule1F1B`` with M micro-batches. Stage
s's data-parallel rank j (world rank ``s·N + j``) reads rows ``[j·B/N, (j+1)·B/N)`` of the
step's global batch, M micro-batches of ``B/(N·M)`` rows.

Modes (``verify.traffic.pp.PP_MODES``): the DMuon modes dedicate each stage module on its
stage's ``mesh["dp_shard"]`` with ``rest="replicate"`` (nothing wraps the stage; ``dmuon-ddp``
is Z2 there), the schedule runs inside ``dmuon.pipeline_step``; ``ddp-muon``, the reference,
wraps the stage module in DDP (torch's schedules run the first M - 1 backwards under
``no_sync``) and steps ``torch.optim.Muon`` + AdamW on every rank.

The harness tags the whole ``schedule.step`` with phase ``pipeline``
(``verify.traffic.pp.PIPELINE``): the stage-to-stage send / recv run in it; DMuon tags its own
calls ``forward`` / ``backward`` inside it, and DDP's all_reduce runs inside a
``backward`` tag the harness puts around the stage's last backward.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon import annotate
from dmuon.ownership.plan import specs_from_named_parameters
from dmuon.ownership.select import matrix_shapes
from verify.modes.workload import Running, Workload
from verify.traffic.pp import PIPELINE, PP_MODES, PPRunLayout, pp_skip_reason
from verify.traffic.predict import dmuon_coalesce_bytes, dmuon_reduce_by_gather, dmuon_uneven_aligned
from verify.workload.data import ByteCorpus, local_slice

#: Micro-batches per step (``--microbatches``' default).
MICROBATCHES = 4
#: The schedule every PP run uses.
SCHEDULE = "1F1B"


def pp_mesh(world: int, pp: int, device: str):
    """The ``("pp", "dp_shard")`` mesh (S, W/S).

    Raises:
        ValueError: S < 2, S does not divide W, or W/S < 2.
    """
    if pp < 2 or world % pp or world // pp < 2:
        raise ValueError(f"Invalid --pp {pp} at W={world}. Must be >= 2, divide W, and leave "
                         "W/S >= 2 data-parallel ranks per stage.")
    return init_device_mesh(device, (pp, world // pp), mesh_dim_names=("pp", "dp_shard"))


class GPTStage(nn.Module):
    """Blocks ``indices`` of a copy of a TinyGPT ``net``, with ``tok_emb`` / ``pos_emb`` on the
    first stage and ``ln_f`` / ``head`` on the last (the whole model's names: ``blocks`` is a
    ModuleDict keyed by the block's index in the model).

    Forward: first stage token ids (B, T) int64, else activations (B, T, D) float; returns
    (B, T, D), or on the last stage logits (B, T, V)."""

    def __init__(self, net: nn.Module, indices: list[int], first: bool, last: bool) -> None:
        super().__init__()
        net = copy.deepcopy(net)
        self.tok_emb = net.tok_emb if first else None
        self.pos_emb = net.pos_emb if first else None
        self.blocks = nn.ModuleDict({str(i): net.blocks[i] for i in indices})
        self.ln_f = net.ln_f if last else None
        self.head = net.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def stage_blocks(stage: int, pp: int, n_layers: int) -> list[int]:
    """The model's block indices of stage ``stage`` of ``pp``.

    Raises:
        ValueError: ``pp`` does not divide ``n_layers``.
    """
    if n_layers % pp:
        raise ValueError(f"Invalid --pp {pp} for the model's n_layers={n_layers}. Must divide it "
                         "(each stage the same number of blocks).")
    per = n_layers // pp
    return list(range(stage * per, (stage + 1) * per))


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class PPRun:
    """This rank's stage module, schedule and optimizer; :meth:`step` runs one training step
    and returns the step's loss (mean over the micro-batches) on the last stage, ``None`` on
    the others."""

    def __init__(self, mode: str, make_model, device: str, pp: int, microbatches: int, *,
                 corpus: ByteCorpus, global_batch: int, seq_len: int, seed: int,
                 muon_lr: float, adamw_lr: float, coalesce: str = "auto") -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.nn.parallel import DistributedDataParallel

        from verify.modes.baselines import MatrixMuon
        from verify.modes.build import DDP_BUCKET_CAP_MB, _count_torch_muon_ns, _Pair, muon_names

        if mode not in PP_MODES:
            raise ValueError(f"Invalid mode {mode!r} with --pp. Must be one of {PP_MODES}.")
        world = dist.get_world_size()
        self.mesh = pp_mesh(world, pp, device)
        self.stage = self.mesh.get_local_rank("pp")
        self.dp_index = self.mesh.get_local_rank("dp_shard")
        n = world // pp
        if global_batch % (n * microbatches):
            raise ValueError(f"Invalid --microbatches {microbatches}: the {global_batch} sequences of "
                             f"a step over N={n} data-parallel ranks do not split into {microbatches} "
                             "equal micro-batches. Must divide B/N.")
        net = make_model().to(device)
        n_layers = len(net.blocks)
        targets = muon_names(net)
        specs = tuple(specs_from_named_parameters(net.named_parameters(), matrix_shapes(net, targets)))
        parts = [GPTStage(net, stage_blocks(s, pp, n_layers), s == 0, s == pp - 1) for s in range(pp)]
        stage_names = tuple(tuple(name for name, _ in p.named_parameters()) for p in parts)
        self.module = part = parts[self.stage]
        del parts, net
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.corpus, self.global_batch, self.seq_len, self.seed = corpus, global_batch, seq_len, seed
        self.n, self.microbatches = n, microbatches
        mb = global_batch // n // microbatches
        d_model = part.blocks[next(iter(part.blocks))].ln1.normalized_shape[0]
        vocab = part.head.out_features if self.last else None
        backend = "nccl" if device.startswith("cuda") else "gloo"
        self.dm = None
        stage_targets = [t for t in targets if t in set(stage_names[self.stage])]
        if mode.startswith("dmuon-"):
            self.dm = dmuon.dedicate_params(part, self.mesh["dp_shard"], params=stage_targets,
                                            reshard_after_forward=mode.endswith("z3"),
                                            rest="replicate", coalesce=coalesce)
            wrapped = part
            self.optimizer = dmuon.DMuon(part.parameters(), dedicated=self.dm, lr=muon_lr, adamw_lr=adamw_lr)
        else:  # ddp-muon: the reference
            named = dict(part.named_parameters())
            wrapped = DistributedDataParallel(part, bucket_cap_mb=DDP_BUCKET_CAP_MB,
                                              process_group=self.mesh.get_group("dp_shard"))
            shapes = matrix_shapes(part, stage_targets)
            muon = MatrixMuon([named[t] for t in stage_targets], [shapes[t] for t in stage_targets], lr=muon_lr)
            adamw = torch.optim.AdamW([p for k, p in named.items() if k not in stage_targets], lr=adamw_lr)
            self.optimizer = _Pair(muon, adamw, _count_torch_muon_ns(muon.muon))
        self.model = wrapped
        dev = torch.device(device)
        inp = (torch.zeros(mb, seq_len, dtype=torch.int64, device=dev) if self.first
               else torch.zeros(mb, seq_len, d_model, device=dev, requires_grad=True))
        out = torch.zeros(mb, seq_len, vocab if self.last else d_model, device=dev, requires_grad=True)
        self.pipe_stage = PipelineStage(wrapped, self.stage, pp, dev, input_args=inp, output_args=out,
                                        group=self.mesh.get_group("pp"))
        if not self.dm:
            self._tag_last_backward()
        self.schedule = Schedule1F1B(self.pipe_stage, microbatches, loss_fn=_ce)
        activation = mb * seq_len * d_model
        self.layout = PPRunLayout(
            mode=mode, replicate_size=1, shard_size=n, params=specs, muon_names=targets,
            reshard_after_forward=mode.endswith("z3"), ddp_bucket_cap_bytes=DDP_BUCKET_CAP_MB * 1024 * 1024,
            dmuon_rest="replicate" if self.dm is not None else "wrapper",
            dmuon_coalesce_bytes=dmuon_coalesce_bytes(coalesce, backend),
            dmuon_reduce_by_gather=dmuon_reduce_by_gather(backend),
            dmuon_uneven_aligned=dmuon_uneven_aligned(backend),
            frozen_names=tuple(k for k, p in self.module.named_parameters() if not p.requires_grad),
            pp_size=pp, microbatches=microbatches, stage_names=stage_names,
            pp_activations=tuple((activation, "float32") for _ in range(pp - 1)))

    def _tag_last_backward(self) -> None:
        """DDP's all_reduce runs in the stage's last backward: tag that one ``backward`` (an
        instance attribute over torch's method, removed by nothing: the stage is the mode's)."""
        stage = self.pipe_stage
        inner = stage.backward_maybe_with_nosync

        def tagged(backward_type, bwd_kwargs, last_backward=False):
            ctx = annotate.phase("backward") if last_backward else contextlib.nullcontext()
            with ctx:
                return inner(backward_type, bwd_kwargs, last_backward=last_backward)

        stage.backward_maybe_with_nosync = tagged

    def step(self, step: int) -> float | None:
        """One training step (``schedule.step`` in phase ``pipeline``, inside
        ``dmuon.pipeline_step`` in the DMuon modes), ``optimizer.step()``, ``zero_grad()``."""
        x, y = self.corpus.global_batch(step, self.global_batch, self.seq_len, seed=self.seed)
        device = next(self.module.parameters()).device
        x = local_slice(x, self.dp_index, self.n).to(device)
        y = local_slice(y, self.dp_index, self.n).to(device)
        losses: list = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        around = (dmuon.pipeline_step(self.schedule, self.dm) if self.dm is not None
                  else contextlib.nullcontext())
        with annotate.phase(PIPELINE), around:
            self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(torch.stack([v.detach() for v in losses]).mean()) if self.last else None


class PPWorkload(Workload):
    """``--pp S``: the PP-capable modes on :func:`pp_mesh`, the built-in model cut into S
    stages run by ``Schedule1F1B`` (:class:`PPRun`; ``verify.modes.workload``)."""

    axes = ("pp",)
    model_why = "the stages are cut from the built-in model"
    flat_why = "each stage is a 1-D data-parallel slice"
    qk_clip_why = "the PP builder attaches no QK-clip"
    mixed_precision_why = "the PP builder runs fp32"
    rest = "replicate"
    numerics_why = ("pipeline parallel: the probe runs one forward and backward of the whole model "
                    "on every rank, outside a schedule")
    whole_model = False

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        return pp_skip_reason(mode, world_size, cfg.pp)

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        pp, m = cfg.pp, cfg.microbatches
        if world_size % pp or world_size // pp < 2:
            return (f"Invalid --pp {pp} at W={world_size}{where}. Must divide W and leave W/S >= 2 "
                    f"data-parallel ranks per stage: give an --nproc of at least {2 * pp} that {pp} divides.")
        if m < pp:  # torch's Schedule1F1B: one micro-batch per stage in flight
            return (f"Invalid --microbatches {m} with --pp {pp}: torch's Schedule{SCHEDULE} needs at least one "
                    f"micro-batch per stage. Give --microbatches >= {pp}.")
        if global_batch % (world_size // pp * m):  # each data-parallel rank's rows in M micro-batches
            return (f"Invalid --microbatches {m} with --pp {pp} at W={world_size}: the {global_batch} "
                    f"sequences of a step over {world_size // pp} data-parallel ranks do not split into "
                    "equal micro-batches. Must divide B/N (give --global-batch or another M).")
        return None

    def start(self, mode: str, config, *, make_model, made: list, corpus, global_batch: int) -> Running:
        from verify.modes.build import ADAMW_LR, MUON_LR, Built

        self.check(config)
        run = PPRun(mode, make_model, config.device, config.pp, config.microbatches,
                    corpus=corpus or ByteCorpus.from_stdlib(), global_batch=global_batch,
                    seq_len=config.seq_len, seed=config.seed, muon_lr=MUON_LR, adamw_lr=ADAMW_LR,
                    coalesce=config.coalesce)
        return Running(Built(run.model, run.optimizer, run.layout, run.dm), None, run_step=run.step)
