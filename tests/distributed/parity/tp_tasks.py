"""Rank-side tasks of the tensor-parallel (TP) tests: a model of Linear blocks parallelized
with torch's ``ColwiseParallel`` / ``RowwiseParallel`` on ``mesh["tp"]``, DMuon on the
whole ``("shard", "tp")`` / ``("replicate", "shard", "tp")`` mesh, FSDP2 on the data-parallel
sub-mesh; and the single-process ``torch.optim.Muon`` + ``AdamW`` oracle on the full matrices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests.distributed.noise_floor import nudge_init_, oracle_threads

D_IN, D, HIDDEN, LAYERS = 8, 16, 32, 2
GLOBAL_BATCH = 8
MUON_LR, ADAMW_LR = 0.02, 3e-3


class Block(nn.Module):
    """Pre-norm MLP block: ``up`` (colwise, with a bias) and ``down`` (rowwise), plus ``mix``,
    a matrix left replicated over TP (a dedicated param that is not TP-sharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D, bias=False)
        self.mix = nn.Linear(D, D, bias=False)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return h + self.mix(h)


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_model() -> TPNet:
    torch.manual_seed(0)
    return TPNet()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def loss_of(model, x, y):
    """MSE in fp32: under a bf16 ``MixedPrecisionPolicy`` the output is bf16, and torch 2.11's
    ``mse_loss`` backward fails on mixed dtypes ("Found dtype Float but expected BFloat16",
    pytorch#94086; later releases promote). On fp32 outputs ``.float()`` is a no-op."""
    return F.mse_loss(model(x).float(), y)


def targets(model: nn.Module) -> list[str]:
    modules = dict(model.named_modules())
    return [n for n, p in model.named_parameters()
            if dmuon.default_predicate(n, p, modules[n.rpartition(".")[0]])]


def oracle(steps: int, micro_batches: int = 1, nudge: str | None = None,
           momentum: float = 0.95) -> dict[str, torch.Tensor]:
    """Single process, full matrices: torch.optim.Muon on DMuon's default targets + AdamW; the
    params after ``steps`` steps. ``micro_batches`` > 1: the batch accumulated as that many
    slices; ``nudge``: one of ``noise_floor.NUDGES``; ``momentum``: Muon's (another value is
    a control's planted error)."""
    with oracle_threads(nudge):
        return _oracle(steps, micro_batches, nudge, momentum)


def _oracle(steps: int, micro_batches: int, nudge: str | None, momentum: float) -> dict:
    model = nudge_init_(make_model(), nudge)
    named = dict(model.named_parameters())
    muon_names = targets(model)
    muon = torch.optim.Muon([named[n] for n in muon_names], lr=MUON_LR, momentum=momentum)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=ADAMW_LR)
    for step in range(steps):
        x, y = batch(step)
        for m in range(micro_batches):
            rows = slice(m * GLOBAL_BATCH // micro_batches, (m + 1) * GLOBAL_BATCH // micro_batches)
            (loss_of(model, x[rows], y[rows]) / micro_batches).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def tp_mesh(kind: str, T: int = 2, titan: bool = False):
    """``"z"``: (W/T, T) named ("shard", "tp"); ``"hsdp"``: (2, W/(2T), T) named
    ("replicate", "shard", "tp"); ``titan``: the data-parallel dims named as torchtitan names
    them, ``"dp_replicate"`` and ``"dp_shard"`` (declared to ``dedicate_params``:
    :func:`declared_dims`)."""
    world = dist.get_world_size()
    rep, shard = ("dp_replicate", "dp_shard") if titan else ("replicate", "shard")
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // (2 * T), T), mesh_dim_names=(rep, shard, "tp"))
    return init_device_mesh("cpu", (world // T, T), mesh_dim_names=(shard, "tp"))


def declared_dims(mesh) -> dict:
    """``dedicate_params``' declaration of ``mesh``'s data-parallel dims: nothing for the
    default names; ``replicate_dim`` / ``shard_dims`` for torchtitan's."""
    names = mesh.mesh_dim_names
    if "dp_shard" not in names:
        return {}
    return {"shard_dims": ("dp_shard",), **({"replicate_dim": "dp_replicate"} if "dp_replicate" in names else {})}


def parallelize(model: TPNet, mesh) -> None:
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def dp_mesh(mesh):
    """The data-parallel sub-mesh (every dim but "tp")."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def dp_index(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index r·N + s, the data-parallel size R·N)."""
    dp = dp_mesh(mesh)
    coord = dp.get_coordinate()
    idx = coord[0] * dp.shape[1] + coord[1] if dp.ndim == 2 else coord[0]
    return idx, dp.size()


def build(mode: str, *, mp: bool = False, meta: bool = False, **dm_kw):
    """(model, dm, opt, mesh) for mode "z2", "z3", "hsdp-z2", "hsdp-z3": blocks parallelized
    on mesh["tp"], then dedicate_params on the whole mesh, then fully_shard on the
    data-parallel sub-mesh (torchtitan's order). ``meta``: built on the meta device,
    dedicated, then ``to_empty`` and :func:`make_model`'s values copied in (the user guide's
    meta-device init; a TP model's DTensor params take ``swap_tensors`` in ``to_empty``).
    ``mode`` prefixed ``"titan-"``: the mesh named as torchtitan names it (:func:`tp_mesh`)."""
    titan = mode.startswith("titan-")
    mode = mode.removeprefix("titan-")
    mesh = tp_mesh("hsdp" if mode.startswith("hsdp") else "z", titan=titan)
    dm_kw = {**declared_dims(mesh), **dm_kw}
    if meta:
        with torch.device("meta"):
            model = TPNet()
    else:
        model = make_model()
    parallelize(model, mesh)
    reshard = mode.endswith("z3")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard, mp_policy=policy, **dm_kw)
    if meta:
        model.to_empty(device="cpu")
        ref = dict(make_model().named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(ref[n].detach(), p.device_mesh, p.placements).to_local())
                else:
                    p.copy_(ref[n])
    dp = dp_mesh(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=dp, reshard_after_forward=reshard, ignored_params=set(dm),
                    **({"mp_policy": policy} if mp else {}))
    fully_shard(model, mesh=dp, ignored_params=set(dm), **({"mp_policy": policy} if mp else {}))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=MUON_LR, adamw_lr=ADAMW_LR)
    return model, dm, opt, mesh


def full_params(model, dm) -> dict[str, torch.Tensor]:
    """Every param's full value (a collective: every rank, model order)."""
    dm.sync_params()
    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def run_steps(model, opt, mesh, start: int, steps: int) -> list[float]:
    """Steps ``start .. start + steps - 1`` on this rank's slice of each global batch (the
    TP ranks of one data-parallel index share it); returns the local losses."""
    idx, dp_size = dp_index(mesh)
    rows = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = loss_of(model, x[idx * rows:(idx + 1) * rows], y[idx * rows:(idx + 1) * rows])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def momenta(opt, dm) -> dict[str, torch.Tensor]:
    """The momentum buffers this rank keeps (full shape for TP matrices), by name."""
    return {n: opt.state[p]["momentum_buffer"].clone() for n, p in zip(dm.names, dm.params)
            if "momentum_buffer" in opt.state.get(p, {})}


def dcp_save(mode: str, root: str, before: int, after: int) -> dict:
    """Train ``before`` steps, save with DCP (get_state_dict + dcp.save), record the full
    params and momenta, then train ``after`` more steps (the uninterrupted reference)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, dm, opt, mesh = build(mode)
    run_steps(model, opt, mesh, 0, before)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    saved = {"params": full_params(model, dm), "momenta": momenta(opt, dm)}
    run_steps(model, opt, mesh, before, after)
    out = {"saved": saved, "final": full_params(model, dm)}
    dm.close()
    return out


def dcp_load(mode: str, root: str, before: int, after: int) -> dict:
    """A fresh run (any data-parallel size) loads the DCP checkpoint (get_state_dict,
    dcp.load, set_state_dict), records what it loaded and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, dm, opt, mesh = build(mode)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = {"params": full_params(model, dm), "momenta": momenta(opt, dm),
              "ns_calls": opt.ns_calls}
    run_steps(model, opt, mesh, before, after)
    out = {"loaded": loaded, "final": full_params(model, dm)}
    dm.close()
    return out


def train(mode: str, steps: int, *, mp: bool = False, checkpoint_blocks: bool = False,
          meta: bool = False, **dm_kw) -> dict:
    """Train ``steps`` steps under DMuon × TP; the full params, and where NS and momentum ran.
    ``dm_kw``: ``dedicate_params``' keywords over :func:`build`'s (a control's declaration)."""
    import warnings

    with warnings.catch_warnings():
        if dm_kw:
            warnings.simplefilter("ignore")  # a control's undeclared dim warns
        model, dm, opt, mesh = build(mode, mp=mp, meta=meta, **dm_kw)
    if checkpoint_blocks:
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            fwd = block.forward
            block.forward = lambda x, fwd=fwd: checkpoint(fwd, x, use_reentrant=False)
    seen = set()
    hook = model.blocks[0].up.register_forward_hook(
        lambda m, args, out: seen.add(str(out.dtype)))
    losses = run_steps(model, opt, mesh, 0, steps)
    hook.remove()
    momentum = {n: tuple(opt.state[p]["momentum_buffer"].shape)
                for n, p in zip(dm.names, dm.params) if "momentum_buffer" in opt.state.get(p, {})}
    registered = sorted({str(p.dtype) for p in dm.params})
    momentum_dtypes = sorted({str(opt.state[p]["momentum_buffer"].dtype) for p in dm.params
                              if "momentum_buffer" in opt.state.get(p, {})})
    result = {"params": full_params(model, dm), "ns_calls": opt.ns_calls, "momentum": momentum,
              "losses": losses, "compute_dtypes": sorted(seen), "registered": registered,
              "momentum_dtypes": momentum_dtypes,
              "tp_names": sorted(dm.layout.ns_index), "dtensor": sorted(
                  n for n, p in zip(dm.names, dm.params) if isinstance(p, DTensor))}
    dm.close()
    return result


def expect_error(case: str) -> str:
    """One bad-input case; the exception type and message this rank raised (before any
    DMuon collective)."""
    from torch.distributed.tensor import Replicate

    mesh = tp_mesh("z")
    model = make_model()
    try:
        if case == "replicate_placement":
            from torch.distributed.tensor import distribute_tensor

            parallelize(model, mesh)
            mix = model.blocks[0].mix
            mix.weight = nn.Parameter(distribute_tensor(mix.weight.detach(), mesh["tp"], [Replicate()]))
        elif case == "not_dividing":
            model.blocks[0].up = nn.Linear(D, 33)
            model.blocks[0].down = nn.Linear(33, D, bias=False)
            parallelize(model, mesh)
        elif case == "no_tp_axis":
            parallelize(model, mesh)
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        elif case == "bad_names":
            parallelize(model, mesh)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        elif case == "strided_shard":
            from torch.distributed.tensor.placement_types import _StridedShard

            parallelize(model, mesh)
            up = model.blocks[0].up
            up.weight = nn.Parameter(DTensor.from_local(up.weight.to_local(), mesh["tp"],
                                                        [_StridedShard(0, split_factor=2)], run_check=False))
        elif case == "fsdp_wrapped":
            parallelize(model, mesh)
            fully_shard(model, mesh=mesh["shard"])
        dmuon.dedicate_params(model, mesh)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return "no error"


def clip_total_norm(mode: str, max_norm: float) -> dict:
    """One backward under DMuon x TP, then ``opt.clip_grad_norm_``; the total norm and, after
    ``step()``, the full params (the clipped grads' update)."""
    model, dm, opt, mesh = build(mode)
    idx, dp_size = dp_index(mesh)
    rows = GLOBAL_BATCH // dp_size
    x, y = batch(0)
    loss_of(model, x[idx * rows:(idx + 1) * rows], y[idx * rows:(idx + 1) * rows]).backward()
    total = opt.clip_grad_norm_(max_norm)
    opt.step()
    out = {"total": total.item(), "params": full_params(model, dm)}
    dm.close()
    return out


def oracle_clip(max_norm: float) -> dict:
    """The single-process oracle of :func:`clip_total_norm`: torch's clip_grad_norm_ over
    every param, then one Muon + AdamW step."""
    model = make_model()
    named = dict(model.named_parameters())
    muon_names = targets(model)
    muon = torch.optim.Muon([named[n] for n in muon_names], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=ADAMW_LR)
    x, y = batch(0)
    loss_of(model, x, y).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    muon.step()
    adamw.step()
    return {"total": total.item(), "params": {n: p.detach().clone() for n, p in named.items()}}


def bucket_names(bucket_cap_mb: float, coalesce="block") -> list[tuple[str, ...]]:
    """The runtime's buckets (names, index order) of Z2 x TP with ``bucket_cap_mb``."""
    model, dm, _, _ = build("z2", bucket_cap_mb=bucket_cap_mb, coalesce=coalesce)
    out = [tuple(b.names) for b in dm.buckets]
    dm.close()
    return out


def freed_read(mode: str = "z3") -> dict:
    """After one Z3 x TP step, read every dedicated TP param on every rank: a non-holder's
    (storage freed) raises DMuon's error instead of reading freed memory; after
    ``dm.sync_params()`` every read works."""
    model, dm, opt, mesh = build(mode)
    idx, dp_size = dp_index(mesh)
    rows = GLOBAL_BATCH // dp_size
    x, y = batch(0)
    loss_of(model, x[idx * rows:(idx + 1) * rows], y[idx * rows:(idx + 1) * rows]).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # a forward with no backward to follow: Z3 non-holders free
        model(x[:2])       # every unit after it, the last one too (protocol step 2)
    errors, fine = {}, []
    for n, p in zip(dm.names, dm.params):
        if isinstance(p, DTensor):
            try:
                p.to_local().sum()
                fine.append(n)
            except RuntimeError as e:
                errors[n] = str(e)
    dm.sync_params()
    after = [float(p.to_local().sum()) for p in dm.params if isinstance(p, DTensor)]
    holder = {n: dm.owner_of(p) % dm.topology.shard_size == dm.topology.shard_index
              for n, p in zip(dm.names, dm.params)}
    dm.close()
    return {"errors": errors, "fine": fine, "holder": holder, "after": len(after)}


def warns_without_tp_params() -> list[str]:
    """dedicate_params on a TP mesh with a model nothing parallelized: the warning texts."""
    import warnings

    mesh = tp_mesh("z")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = dmuon.dedicate_params(make_model(), mesh)
    dm.close()
    return [str(w.message) for w in caught if "'tp' axis" in str(w.message)]


def train_accumulated(mode: str) -> dict[str, torch.Tensor]:
    """One step of batch 0 as two micro-batches (each half of this rank's rows, loss halved),
    the first inside ``dm.no_sync()``; the full params after it."""
    model, dm, opt, mesh = build(mode)
    idx, dp_size = dp_index(mesh)
    rows = GLOBAL_BATCH // dp_size
    x, y = batch(0)
    x, y = x[idx * rows:(idx + 1) * rows], y[idx * rows:(idx + 1) * rows]
    half = rows // 2
    with dm.no_sync():
        (loss_of(model, x[:half], y[:half]) / 2).backward()
    (loss_of(model, x[half:], y[half:]) / 2).backward()
    opt.step()
    out = full_params(model, dm)
    dm.close()
    return out
