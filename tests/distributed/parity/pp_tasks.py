"""Rank-side tasks of the pipeline-parallel tests: a stack of MLP blocks cut into stage
modules, each dedicated on its stage's data-parallel slice of a ``("pp", "dp_shard")`` mesh,
run by torch's ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` inside
``dmuon.pipeline_step``; and the single-process ``torch.optim.Muon`` + ``AdamW`` oracle on the
whole model and the whole batch.

A stage module keeps the whole model's names (its blocks in a ``ModuleDict`` keyed by their
index in the model), so its params compare with the oracle's by name and its DCP checkpoint
keys are the model's.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests.distributed.noise_floor import nudge_init_, oracle_threads

D_IN, D, HIDDEN, LAYERS = 8, 16, 32, 4
GLOBAL_BATCH = 16
MICRO_BATCHES = 2
MUON_LR, ADAMW_LR = 0.02, 3e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """The whole model: ``inp``, ``blocks["0"]`` .. ``blocks[str(LAYERS - 1)]``, ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks.values():
            h = b(h)
        return self.head(h)


class Stage(nn.Module):
    """Blocks ``indices`` of a copy of ``net``, with ``inp`` on the first stage and ``head``
    on the last (the whole model's names)."""

    def __init__(self, net: Net, indices: list[int], first: bool, last: bool) -> None:
        super().__init__()
        net = copy.deepcopy(net)
        self.inp = net.inp if first else None
        self.blocks = nn.ModuleDict({str(i): net.blocks[str(i)] for i in indices})
        self.head = net.head if last else None

    def forward(self, x):
        h = self.inp(x) if self.inp is not None else x
        for b in self.blocks.values():
            h = b(h)
        return self.head(h) if self.head is not None else h


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def is_target(name: str, p: torch.Tensor, module=None) -> bool:
    """The dedicated params: every block's matrices (the oracle's Muon params)."""
    return name.startswith("blocks.") and p.ndim == 2


def oracle(steps: int, nudge: str | None = None) -> dict[str, torch.Tensor]:
    """Single process, the whole model and batch: torch.optim.Muon on the blocks' matrices,
    AdamW on the rest; the params after ``steps`` steps."""
    with oracle_threads(nudge):
        model = nudge_init_(make_model(), nudge)
        named = dict(model.named_parameters())
        muon = torch.optim.Muon([p for n, p in named.items() if is_target(n, p)], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for n, p in named.items() if not is_target(n, p)], lr=ADAMW_LR)
        for step in range(steps):
            x, y = batch(step)
            F.mse_loss(model(x), y).backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
        return {n: p.detach().clone() for n, p in named.items()}


def stage_indices(stage: int, num_stages: int) -> list[int]:
    per = LAYERS // num_stages
    return list(range(stage * per, (stage + 1) * per))


def pp_mesh(pp: int = 2):
    return init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp_shard"))


class PPRun:
    """This rank's stage modules, handles, schedule and optimizer.

    ``schedule``: "gpipe", "1f1b" or "interleaved" (4 virtual stages on the 2 pipeline ranks:
    rank p holds stages p and p + 2); ``z3``: ``reshard_after_forward``; ``layout``: "dp" (a
    ``("pp", "dp_shard")`` mesh) or "hsdp/<hierarchy>" (``("pp", "dp_replicate", "dp_shard")``
    of shape (2, 2, 1), each stage an HSDP slice of R = 2 replicas, moved by ``hierarchy``)."""

    def __init__(self, schedule: str, z3: bool = False, pp: int = 2, layout: str = "dp") -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        extra = {}
        if layout == "dp":
            self.mesh = pp_mesh(pp)
            dp_mesh = self.mesh["dp_shard"]
            self.dp_index = self.mesh.get_local_rank("dp_shard")
        else:
            self.mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // pp, 1),
                                         mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
            dp_mesh = self.mesh["dp_replicate", "dp_shard"]
            self.dp_index = self.mesh.get_local_rank("dp_replicate")
            extra = dict(replicate_dim="dp_replicate", shard_dims="dp_shard",
                         hierarchy=layout.partition("/")[2])
        self.pp_index = self.mesh.get_local_rank("pp")
        self.dp_size = dp_mesh.size()
        pp_group = self.mesh.get_group("pp")
        virtual = 2 if schedule == "interleaved" else 1
        num_stages = pp * virtual
        self.stage_ids = [self.pp_index + v * pp for v in range(virtual)]
        net = make_model()
        self.parts = [Stage(net, stage_indices(s, num_stages), s == 0, s == num_stages - 1)
                      for s in self.stage_ids]
        self.dms = [dmuon.dedicate_params(part, dp_mesh, predicate=is_target,
                                          reshard_after_forward=z3, rest="replicate", **extra)
                    for part in self.parts]
        mb = GLOBAL_BATCH // self.dp_size // MICRO_BATCHES
        stages = []
        for s, part in zip(self.stage_ids, self.parts):
            # shapes given (static metadata); a later stage's input carries a grad back
            inp = torch.zeros(mb, D_IN if s == 0 else D, requires_grad=s > 0)
            out = torch.zeros(mb, 1 if s == num_stages - 1 else D, requires_grad=True)
            stages.append(PipelineStage(part, s, num_stages, torch.device("cpu"),
                                        input_args=inp, output_args=out, group=pp_group))
        loss_fn = F.mse_loss
        if schedule == "gpipe":
            self.schedule = ScheduleGPipe(stages[0], MICRO_BATCHES, loss_fn=loss_fn)
        elif schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], MICRO_BATCHES, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, MICRO_BATCHES, loss_fn=loss_fn)
        self.first = 0 in self.stage_ids
        self.last = num_stages - 1 in self.stage_ids
        params = [p for part in self.parts for p in part.parameters()]
        self.opt = dmuon.DMuon(params, dedicated=self.dms if virtual > 1 else self.dms[0],
                               lr=MUON_LR, adamw_lr=ADAMW_LR)

    def handles(self):
        return self.dms if len(self.dms) > 1 else self.dms[0]

    def train_step(self, step: int, skip_step: bool = False, plain: bool = False) -> None:
        x, y = batch(step)
        rows = slice(self.dp_index * (GLOBAL_BATCH // self.dp_size),
                     (self.dp_index + 1) * (GLOBAL_BATCH // self.dp_size))
        args = (x[rows],) if self.first else ()
        kwargs = {"target": y[rows], "losses": []} if self.last else {}
        if plain:  # planted: the schedule outside dmuon.pipeline_step
            self.schedule.step(*args, **kwargs)
        else:
            with dmuon.pipeline_step(self.schedule, self.handles()):
                self.schedule.step(*args, **kwargs)
        if not skip_step:
            self.opt.step()
        self.opt.zero_grad()

    def params(self) -> dict[str, torch.Tensor]:
        for dm in self.dms:
            dm.sync_params()
        return {n: p.detach().clone() for part in self.parts for n, p in part.named_parameters()}

    def close(self) -> None:
        for dm in self.dms:
            dm.close()


def train(schedule: str, steps: int, z3: bool = False, skip_stage: int | None = None,
          layout: str = "dp") -> dict:
    """``steps`` steps; ``skip_stage``: that pipeline rank never calls ``opt.step()`` (a
    planted error). Returns this rank's params (the whole model's names), the number of
    collectives per group size DMuon issued during setup, and the handles' ownership."""
    run = PPRun(schedule, z3=z3, layout=layout)
    for step in range(steps):
        run.train_step(step, skip_step=run.pp_index == skip_stage)
    out = {"params": run.params(), "stages": run.stage_ids, "dp": run.dp_index,
           "flat": run.dms[0].flat}
    run.close()
    return out


def stages_never_wait(steps: int = 1) -> dict:
    """Stage 1's ranks start only after stage 0's ranks have set up DMuon and trained without
    the pipeline (each stage on its own data: ``dm.no_sync`` then one reducing backward): any
    world-wide collective in DMuon's setup or step would hang stage 0 (the test's timeout)."""
    mesh = pp_mesh()
    pp = mesh.get_local_rank("pp")
    store = dist.distributed_c10d._get_default_store()
    key = f"pp-test/stage0-done/{os.getpid() if False else 0}"
    net = make_model()
    part = Stage(net, stage_indices(pp, 2), pp == 0, pp == 1)
    if pp == 1:
        store.wait([key])
    dm = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, rest="replicate")
    opt = dmuon.DMuon(part.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    x = torch.randn(4, D_IN if pp == 0 else D)
    for _ in range(steps):
        part(x).sum().backward()
        opt.step()
        opt.zero_grad()
    dm.sync_params()
    groups = {"reduce": sorted(dist.get_process_group_ranks(dm.groups.reduce)),
              "world": sorted(dist.get_process_group_ranks(dm.groups.world))}
    if pp == 0:
        if store.add("pp-test/stage0-count", 1) == 2:
            store.set(key, "1")
    dm.close()
    return groups


def error_case(case: str) -> str:
    """The error text of a bad pipeline setup on this rank ("" if nothing raised)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = pp_mesh()
    pp = mesh.get_local_rank("pp")
    net = make_model()
    part = Stage(net, stage_indices(pp, 2), pp == 0, pp == 1)
    try:
        if case == "stage_without_matrix":
            # stage 1 dedicates nothing; stage 0 is fine and must not wait for stage 1
            predicate = is_target if pp == 0 else (lambda n, p, m: False)
            dm = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=predicate, rest="replicate")
            dm.close()
            return ""
        if case == "mismatched_parts":
            # a second part on another valid stage slice (the transposed mesh: ranks [0, 2] and
            # [1, 3]), the same module on every rank so that its own setup agrees
            from torch.distributed.device_mesh import DeviceMesh

            other = Stage(net, stage_indices(0, 2), True, False)
            moved = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T.contiguous(),
                               mesh_dim_names=("pp", "dp_shard"))
            dm_a = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, rest="replicate")
            dm_b = dmuon.dedicate_params(other, moved["dp_shard"], predicate=is_target, rest="replicate")
            try:
                dmuon.DMuon(list(part.parameters()) + list(other.parameters()), dedicated=[dm_a, dm_b])
            finally:
                dm_a.close()
                dm_b.close()
            return ""
        if case == "lr_mismatch":  # rank 1 (stage 0) builds its optimizer with another lr
            dm = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, rest="replicate")
            try:
                dmuon.DMuon(part.parameters(), dedicated=dm, lr=0.03 if dist.get_rank() == 1 else 0.02)
            finally:
                dm.close()
            return ""
        if case in ("empty_parts", "repeated_part"):
            dm = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, rest="replicate")
            try:
                dmuon.DMuon(part.parameters(), dedicated=[] if case == "empty_parts" else [dm, dm])
            finally:
                dm.close()
            return ""
        mb = GLOBAL_BATCH // 2 // MICRO_BATCHES
        dp_mesh = mesh["pp"] if case == "mesh_across_stages" else mesh["dp_shard"]
        dm = dmuon.dedicate_params(part, dp_mesh, predicate=is_target, rest="replicate")
        try:
            kwargs = {} if case == "dynamic_stage" else dict(
                input_args=torch.zeros(mb, D_IN if pp == 0 else D, requires_grad=pp > 0),
                output_args=torch.zeros(mb, 1 if pp == 1 else D, requires_grad=True))
            module = Stage(net, stage_indices(pp, 2), pp == 0, pp == 1) if case == "foreign_stage" else part
            stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"), **kwargs)
            schedule = ScheduleGPipe(stage, MICRO_BATCHES, loss_fn=F.mse_loss)
            target = object() if case == "not_a_schedule" else schedule
            with dmuon.pipeline_step(target, dm):
                pass
        finally:
            dm.close()
        return ""
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"{type(exc).__name__}: {exc}"


def _flat_options():
    """Flattened optimizer state dicts (as torchtitan saves under PP): each stage's param
    groups keyed by its own params; an unflattened ``param_groups`` list would be one DCP key
    that every stage writes with its own params."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _holder(run: PPRun) -> nn.Module:
    """What DCP's get_state_dict sees: the stage module, or a ModuleList of this rank's parts
    (every param of the one optimizer)."""
    return run.parts[0] if len(run.parts) == 1 else nn.ModuleList(run.parts)


def dcp_save(root: str, steps: int, schedule: str = "gpipe") -> dict:
    """Train ``steps`` steps of ``schedule`` at this world size, save model and optimizer with
    DCP (get_state_dict of this rank's stage module, or of its parts), return the params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = PPRun(schedule)
    for step in range(steps):
        run.train_step(step)
    model_sd, optim_sd = get_state_dict(_holder(run), run.opt, options=_flat_options())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    out = {"params": run.params()}
    run.close()
    return out


def dcp_resume(root: str, start: int, steps: int, schedule: str = "gpipe") -> dict:
    """A fresh ``schedule`` run at this world size loads the DCP checkpoint and trains steps
    ``start`` .. ``steps - 1``; returns the loaded params and the final ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run = PPRun(schedule)
    model_sd, optim_sd = get_state_dict(_holder(run), run.opt, options=_flat_options())
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    set_state_dict(_holder(run), run.opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_flat_options())
    loaded = run.params()
    for step in range(start, steps):
        run.train_step(step)
    out = {"loaded": loaded, "params": run.params()}
    run.close()
    return out


#: Ops of DMuon's dedicated traffic (the pipeline's activations move by send / recv).
BROADCASTS = ("broadcast", "all_gather")
REDUCES = ("reduce", "gather", "reduce_scatter", "all_to_all")


def step_traffic(schedule: str, z3: bool, hold: bool = True) -> dict:
    """The DMuon collectives of this rank in the second step (the first agrees on the block
    order), as ``(op, phase, count)`` lists; ``hold=False`` plants Z3's per-micro-batch
    re-broadcast (non-holders free after every forward, as outside a pipeline step). Also
    the reduces of one plain step of the same stage module on one micro-batch (no pipeline),
    the once-per-step reference."""
    from dmuon.runtime import schedule as schedule_mod
    from tracer.interposer import Interposer

    run = PPRun(schedule, z3=z3)
    run.train_step(0)
    original = schedule_mod.Schedule.free
    if not hold:  # planted: frees while the pipeline step holds
        def free(self, b):
            if self.options.reshard_after_forward:
                b.free()
        schedule_mod.Schedule.free = free
    try:
        with Interposer() as ip:
            run.train_step(1)
    finally:
        schedule_mod.Schedule.free = original
    events = [(e.op, e.phase, e.count) for e in ip.events if e.op in BROADCASTS + REDUCES]
    run.close()
    # the reference: one forward and backward of the first stage module on one micro-batch
    mesh = pp_mesh()
    pp = mesh.get_local_rank("pp")
    part = Stage(make_model(), stage_indices(pp, 2), pp == 0, pp == 1)
    dm = dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, reshard_after_forward=z3,
                               rest="replicate")
    x = torch.randn(GLOBAL_BATCH // 4, D_IN if pp == 0 else D)
    with Interposer() as ref:
        part(x).sum().backward()
    reference = [(e.op, e.phase, e.count) for e in ref.events if e.op in REDUCES and e.phase == "backward"]
    elements = sum(p.numel() for p in dm.params)
    dm.close()
    return {"events": events, "reference_reduces": reference, "dedicated_elements": elements}


def plain_sub_mesh_error() -> str:
    """The control of :func:`stages_never_wait`: with stage slices not recognised
    (``topology.stage_ranks`` planted to say none is one), a stage's ``mesh["dp_shard"]`` is
    refused by the whole-world rule on every rank. Returns the error text."""
    from dmuon.ownership import topology

    mesh = pp_mesh()
    pp = mesh.get_local_rank("pp")
    part = Stage(make_model(), stage_indices(pp, 2), pp == 0, pp == 1)
    original = topology.stage_ranks
    topology.stage_ranks = lambda m: None
    try:
        dmuon.dedicate_params(part, mesh["dp_shard"], predicate=is_target, rest="replicate")
        return ""
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        topology.stage_ranks = original


def clip_total(schedule: str, across_stages: bool = True) -> float:
    """The total grad norm ``opt.clip_grad_norm_`` returns after the first pipeline step
    (``pipeline_group``: this rank's pipeline group; ``across_stages=False``: none, the stage's own
    norm, the control)."""
    run = PPRun(schedule)
    x, y = batch(0)
    rows = slice(run.dp_index * (GLOBAL_BATCH // run.dp_size), (run.dp_index + 1) * (GLOBAL_BATCH // run.dp_size))
    with dmuon.pipeline_step(run.schedule, run.handles()):
        run.schedule.step(*((x[rows],) if run.first else ()),
                          **({"target": y[rows], "losses": []} if run.last else {}))
    group = run.mesh.get_group("pp") if across_stages else None
    total = run.opt.clip_grad_norm_(1e-3, pipeline_group=group).item()
    run.opt.step()
    run.close()
    return total


def oracle_total(nudge: str | None = None) -> float:
    """The single-process oracle's total grad norm of the whole model on the first batch."""
    with oracle_threads(nudge):
        model = nudge_init_(make_model(), nudge)
        x, y = batch(0)
        F.mse_loss(model(x), y).backward()
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
