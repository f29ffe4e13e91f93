"""What the optimizer computes, checked against a single-process oracle (docs/verify.md, "Numerics").

The traffic checks see what a mode sends; these see what it computes. After a DMuon mode's
measured window (outside it: no call of this module is in the compared traffic) every rank
runs one more step, the *probe step* ``P`` (= warm-up + measured steps), and records

- before the step: each owned dedicated param (its owner's master) and its momentum, and the
  full value and AdamW state of every other param (``full_tensor()`` of FSDP2's shards);
- after backward: each owned dedicated param's ``.grad`` (the owner's reduced grad) and the
  global norm DMuon's ``clip_grad_norm_`` returns (called with a max norm no grad reaches, so
  nothing is scaled);
- after ``step()``: the same params and momentum again.

Rank 0 then loads the state before the step into a fresh copy of the model in one process
and computes what the step should have done with torch alone (``torch.optim.Muon`` over every
matrix, ``verify.modes.baselines.MatrixMuon``; ``torch.optim.AdamW``; no code of ``dmuon``'s
arithmetic): the global mean grad (the mean over the W ranks' losses of step P, each rank's
rows as the mode sees them), its norm, the new momentum and the update of every param.

**Noise floors, measured at run time.** Distributed and single-process arithmetic differ in
rounding only, and by how much is measured on the spot, per param, from two legitimate
orderings of the same arithmetic in the oracle itself:

- grads and the clip norm: the mean grad as one backward of the mean loss (``A``) and as W
  per-rank backwards summed in reverse rank order (``B``): ``floor = |A - B| / |A|``, at least
  ``W`` fp32 epsilons (a sum of W terms rounds W - 1 times);
- Muon's update and momentum: torch's step from ``A``, from ``B`` and from the owner's own
  grad (which the ``owner_grads`` check holds to ``A`` within its floor): the floor is the
  largest relative distance of the three, at least :data:`MIN_UPDATE_REL` (torch's
  Newton–Schulz runs in bfloat16: a few elements one bfloat16 ulp apart, as a batched NS may
  leave them). So what is left is DMuon's own arithmetic on the same inputs;
- AdamW's update: the steps from ``A`` and ``B``, at least 8 fp32 epsilons.

A param passes when its relative distance to the oracle is at most :data:`SAFETY` times its
floor. Each failure names the param, the mode and the size of the difference; a grad off by a
factor names the factor and the divisor it implies (``2.000× the mean: divided by N=2, not
W=4``; ``verify.report.checks.factor_text``).

**Losses.** Every DMuon mode's loss at every step (warm-up, measured and the probe step;
mean over ranks) must equal the reference mode's (``ddp-muon``: DDP + ``torch.optim.Muon``),
or the oracle's own trajectory where the reference did not run, within :data:`SAFETY` times
the trajectory's noise floor: rank 0 trains the oracle twice from the same init on the same
global batches, once as is and once with every Muon grad rounded differently by up to half a
bfloat16 ulp at every step, and the floor at step s is the largest loss difference of the two
up to s (at least 2 fp32 epsilons of the loss).

Where this does not run: TP and EP modes (their matrices are sharded; the probe is not
written for them), mixed precision (the grads are reduced in the low dtype: another floor),
QK-clip (it edits the params after the step), ``--model pkg.module:factory`` (its ``loss_fn``
is written for the wrapped model; the built-in model and the presets run). Those runs carry no
``numerics`` or ``checkpoint`` entry (:func:`applies`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import dmuon
from verify.measure.block_order import bare_model
from verify.modes.baselines import MatrixMuon
from verify.workload.usermodel import check_loss

#: The reference mode: DDP + ``torch.optim.Muon`` (``verify.modes.build``).
REFERENCE_MODE = "ddp-muon"
#: A run passes a numeric check when its distance is at most SAFETY times the measured floor.
SAFETY = 8.0
#: Half a bfloat16 ulp, relative: how differently a bfloat16 Newton–Schulz may round its input.
NS_INPUT_REL = 2.0 ** -9
#: float32's machine epsilon.
FP32_EPS = float(torch.finfo(torch.float32).eps)
#: The smallest floor of Muon's update, relative to its norm: 2**-12, a bfloat16 ulp (2**-8)
#: over 16: what a handful of elements of a 64 x 64 NS output one ulp apart add up to (the
#: measured distances on the same inputs are 0 in the control runs of docs/verify.md).
MIN_UPDATE_REL = 2.0 ** -12
#: ``clip_grad_norm_``'s max norm in the probe: above any norm, so no grad is scaled.
CLIP_UNREACHED = 1e30


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A dedicated grad shown as a DTensor (``dmuon/runtime/grad_view.py``): its local tensor
    (the owner's whole grad); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: ``full_tensor()`` of a DTensor (a collective), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def applies(config, mode: str) -> str | None:
    """``None`` where the probe runs for ``mode`` under ``config`` (a ``RunConfig``), else why not."""
    if not mode.startswith("dmuon-"):
        return "not a DMuon mode"
    from verify.modes.workloads import workload_of  # the modes import this module's callers

    why = workload_of(config).numerics_why  # a parallel workload's params are not whole matrices
    if why is not None:
        return why
    if config.mixed_precision is not None:
        return "mixed precision: grads are reduced in the low dtype (another noise floor)"
    if config.qk_clip_tau is not None:
        return "QK-clip edits the params after the step (the oracle runs Muon alone)"
    if ":" in config.model:
        return "a --model factory: the oracle would run its loss_fn on a bare model in one process"
    return None


def probe_step(model: nn.Module, opt, dm, loss_fn: Callable, step: int, *, capture: bool = True,
               after_backward: Callable[[], None] | None = None) -> dict:
    """Run training step ``step`` on this rank (forward, backward, ``opt.clip_grad_norm_``
    with a max norm nothing reaches, ``step()``, ``zero_grad()``), recording what the oracle
    needs (module docstring) where ``capture``. A collective on every rank (the step's own, one
    ``all_reduce`` for the norm, and, where ``capture``, ``full_tensor()`` of each FSDP2
    param and state twice).

    Returns:
        ``{"loss": float, "clip_norm": float, "owned": {name: {"before", "grad",
        "momentum_before", "after", "momentum_after"}}, "rest": {name: {"before", "after",
        "exp_avg", "exp_avg_sq", "step"}}}`` (CPU tensors; ``rest`` filled on rank 0 only,
        ``owned`` and ``rest`` empty without ``capture``).
    """
    rank = dist.get_rank()
    bare = bare_model(model)
    owned = {id(p) for p in dm.owned()}
    dedicated = {id(p) for p in dm.params}
    named = [(n, p) for n, p in bare.named_parameters() if p.requires_grad]
    out: dict = {"owned": {}, "rest": {}}

    def rest_values(key: str) -> None:
        for name, p in named:
            if id(p) in dedicated:
                continue
            full = _full(p.detach())
            state = {k: _full(v) for k, v in opt.state.get(p, {}).items() if k in ("exp_avg", "exp_avg_sq")}
            if rank == 0:
                entry = out["rest"].setdefault(name, {})
                entry[key] = _clone(full)
                if key == "before":
                    entry.update({k: _clone(v) for k, v in state.items()})
                    s = opt.state.get(p, {}).get("step")
                    entry["step"] = float(s) if s is not None else 0.0

    if capture:
        for name, p in named:
            if id(p) in owned:
                out["owned"][name] = {"before": _clone(p), "momentum_before": _clone(opt.momentum_of(p))}
        rest_values("before")
    with dmuon.phase("forward"):
        loss = check_loss(loss_fn(model, rank, step), "loss_fn")
    with dmuon.phase("backward"):
        loss.backward()
    if after_backward is not None:
        after_backward()
    if capture:
        for name, p in named:
            if id(p) in owned:
                out["owned"][name]["grad"] = _clone(_plain(p.grad)) if p.grad is not None else None
    out["clip_norm"] = float(opt.clip_grad_norm_(CLIP_UNREACHED))
    opt.step()
    if capture:
        for name, p in named:
            if id(p) in owned:
                out["owned"][name].update(after=_clone(p), momentum_after=_clone(opt.momentum_of(p)))
        rest_values("after")
    opt.zero_grad()
    out["loss"] = loss.item()
    return out


# --------------------------------------------------------------------------- rank 0: the oracle
def _mean_grads(model: nn.Module, loss_fn: Callable, world: int, step: int, per_rank: bool) -> dict:
    """The global mean grad of step ``step`` on the bare ``model``: one backward of the mean of
    the W ranks' losses (``per_rank=False``), or W backwards summed in reverse rank order."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    if not per_rank:
        total = sum(check_loss(loss_fn(model, r, step), "loss_fn") for r in range(world)) / world
        total.backward()
        return {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    acc: dict[str, torch.Tensor] = {}
    for r in reversed(range(world)):
        model.zero_grad(set_to_none=True)
        check_loss(loss_fn(model, r, step), "loss_fn").backward()
        for n, p in params:
            if p.grad is not None:
                acc[n] = acc[n] + p.grad if n in acc else p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return {n: g / world for n, g in acc.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius, float64); ``inf`` where b is 0 and a is not."""
    a, b = a.double(), b.double()
    d, n = (a - b).norm().item(), b.norm().item()
    return d / n if n else (0.0 if d == 0 else math.inf)


def _perturbed(g: torch.Tensor, seed: int) -> torch.Tensor:
    """``g`` with every element scaled by ``1 + u·2**-9``, u uniform in [-1, 1] (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(g.shape, generator=gen, dtype=torch.float64) * 2 - 1
    return (g.double() * (1 + u * NS_INPUT_REL)).to(g.dtype)


def muon_step(before: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor,
              matrix_shape: tuple[int, int] | None, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``torch.optim.Muon`` step (torch's defaults but ``lr``) of a param holding
    ``before`` with ``grad`` and the momentum ``momentum`` (each matrix as its own param,
    :class:`~verify.modes.baselines.MatrixMuon`): ``(update, momentum after)``, shapes of ``before``."""
    p = nn.Parameter(before.clone())
    opt = MatrixMuon([p], [matrix_shape], lr=lr)
    _, (rows, cols), views = opt._views[0]
    m = momentum.reshape(-1, rows, cols)
    for i, v in enumerate(views):
        opt.muon.state[v]["momentum_buffer"] = m[i].clone()
    p.grad = grad.clone()
    opt.step()
    after = torch.stack([opt.muon.state[v]["momentum_buffer"] for v in views]).reshape(before.shape)
    return (p.detach() - before), after


def adamw_step(before: torch.Tensor, grad: torch.Tensor, state: Mapping, lr: float) -> torch.Tensor:
    """One ``torch.optim.AdamW`` step (torch's defaults but ``lr``) from ``state``
    (``exp_avg``, ``exp_avg_sq``, ``step``; empty: the first step): the update."""
    p = nn.Parameter(before.clone())
    opt = torch.optim.AdamW([p], lr=lr)
    if "exp_avg" in state:
        opt.state[p] = {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"].clone(),
                        "exp_avg_sq": state["exp_avg_sq"].clone()}
    p.grad = grad.clone()
    opt.step()
    return p.detach() - before


def oracle_report(source, seed: int, world: int, step: int, parts: Sequence[Mapping], *,
                  mesh: Sequence[int], muon_names: Sequence[str], matrix_shapes: Mapping,
                  muon_lr: float, adamw_lr: float) -> dict:
    """Rank 0: compare every rank's :func:`probe_step` record of step ``step`` with the
    oracle's (module docstring). ``mesh`` ``(R, N)`` (``(1, W)`` on a 1-D mesh) names divisors.

    Returns:
        ``{"step", "grads": [{"param", "rel", "floor", "ratio", "pass"}], "clip_norm": {...},
        "updates": [{"param", "kind", "rel", "floor", "max_abs", "momentum_rel", "pass"}]}``.
    """
    torch.manual_seed(seed)
    model, loss_fn = source.factory()
    model = model.cpu()
    named = dict(model.named_parameters())
    owned = {n: rec for part in parts for n, rec in part["owned"].items()}
    rest = parts[0]["rest"]
    with torch.no_grad():
        for n, rec in owned.items():
            named[n].copy_(rec["before"])
        for n, rec in rest.items():
            named[n].copy_(rec["before"])
    grad_a = _mean_grads(model, loss_fn, world, step, per_rank=False)
    grad_b = _mean_grads(model, loss_fn, world, step, per_rank=True)
    grad_floor_min = world * FP32_EPS
    grads = []
    for n in muon_names:
        if n not in owned:
            continue
        got, want = owned[n]["grad"], grad_a.get(n)
        if want is None:
            continue
        floor = max(_rel(grad_b[n], want), grad_floor_min)
        if got is None:
            grads.append({"param": n, "rel": math.inf, "floor": floor, "ratio": 0.0, "pass": False})
            continue
        rel = _rel(got, want)
        ratio = float((got.double() * want.double()).sum() / (want.double().square().sum() or 1.0))
        grads.append({"param": n, "rel": rel, "floor": floor, "ratio": ratio, "pass": rel <= SAFETY * floor})
    norm_a = math.sqrt(sum(float(g.double().square().sum()) for g in grad_a.values()))
    norm_b = math.sqrt(sum(float(g.double().square().sum()) for g in grad_b.values()))
    got_norm = parts[0]["clip_norm"]
    norm_floor = max(abs(norm_a - norm_b) / norm_a if norm_a else 0.0, grad_floor_min)
    norm_rel = abs(got_norm - norm_a) / norm_a if norm_a else abs(got_norm)
    clip = {"measured": got_norm, "oracle": norm_a, "rel": norm_rel, "floor": norm_floor,
            "pass": norm_rel <= SAFETY * norm_floor}
    updates = []
    for n, rec in sorted(owned.items()):
        if n not in grad_a:
            continue
        shape = matrix_shapes.get(n)
        got = rec["after"] - rec["before"]
        want, mom = muon_step(rec["before"], grad_a[n], rec["momentum_before"], shape, muon_lr)
        # the legitimate inputs: the mean grad summed in another order, and the owner's own grad
        # (within its floor where the owner_grads check passes) through torch's Muon
        alt = [muon_step(rec["before"], g, rec["momentum_before"], shape, muon_lr)
               for g in (grad_b[n], rec["grad"]) if g is not None]
        floor = max([_rel(u, want) for u, _ in alt] + [MIN_UPDATE_REL])
        mom_floor = max([_rel(m, mom) for _, m in alt] + [grad_floor_min])
        rel, mom_rel = _rel(got, want), _rel(rec["momentum_after"], mom)
        updates.append({"param": n, "kind": "muon", "rel": rel, "floor": floor,
                        "max_abs": float((got - want).abs().max()), "momentum_rel": mom_rel,
                        "momentum_floor": mom_floor,
                        "pass": rel <= SAFETY * floor and mom_rel <= SAFETY * mom_floor})
    for n, rec in sorted(rest.items()):
        if n not in grad_a or "after" not in rec:
            continue
        got = rec["after"] - rec["before"]
        want = adamw_step(rec["before"], grad_a[n], rec, adamw_lr)
        floor = max(_rel(adamw_step(rec["before"], grad_b[n], rec, adamw_lr), want), 8 * FP32_EPS)
        rel = _rel(got, want)
        updates.append({"param": n, "kind": "adamw", "rel": rel, "floor": floor,
                        "max_abs": float((got - want).abs().max()), "pass": rel <= SAFETY * floor})
    return {"step": step, "mesh": list(mesh), "world": world, "safety": SAFETY, "grads": grads,
            "clip_norm": clip, "updates": updates}


def oracle_losses(source, seed: int, world: int, steps: int, *, muon_names: Sequence[str],
                  matrix_shapes: Mapping, muon_lr: float, adamw_lr: float,
                  perturb: bool = False) -> list[float]:
    """Rank 0: the oracle's loss (mean over the W ranks' rows) at steps ``0 .. steps-1``,
    trained in one process with ``torch.optim.Muon`` (``MatrixMuon``) and ``torch.optim.AdamW``
    on the mean grad; ``perturb``: every Muon grad rounded differently by up to half a
    bfloat16 ulp (:func:`_perturbed`) at every step."""
    torch.manual_seed(seed)
    model, loss_fn = source.factory()
    model = model.cpu()
    named = dict(model.named_parameters())
    muon_set = [n for n in muon_names if named[n].requires_grad]
    muon = MatrixMuon([named[n] for n in muon_set], [matrix_shapes.get(n) for n in muon_set], lr=muon_lr)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_set and p.requires_grad],
                              lr=adamw_lr)
    out = []
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        loss = sum(check_loss(loss_fn(model, r, s), "loss_fn") for r in range(world)) / world
        loss.backward()
        out.append(loss.item())
        if perturb:
            with torch.no_grad():
                for i, n in enumerate(muon_set):
                    if named[n].grad is not None:
                        named[n].grad.copy_(_perturbed(named[n].grad, 1000 * s + i))
        muon.step()
        adamw.step()
    return out


def loss_floor(reference: Sequence[float], perturbed: Sequence[float]) -> list[float]:
    """Per step s: the largest ``|reference - perturbed|`` up to s, at least 2 fp32 epsilons
    of the loss."""
    out, worst = [], 0.0
    for a, b in zip(reference, perturbed):
        worst = max(worst, abs(a - b), 2 * FP32_EPS * abs(a))
        out.append(worst)
    return out


def loss_findings(losses: Sequence[float], reference: Sequence[float], floor: Sequence[float]) -> list[dict]:
    """Steps where ``losses`` differ from ``reference`` by more than :data:`SAFETY` × ``floor``:
    ``[{"step", "loss", "reference", "diff", "tol"}]``."""
    out = []
    for s, (a, b, f) in enumerate(zip(losses, reference, floor)):
        if not (math.isfinite(a) and abs(a - b) <= SAFETY * f):
            out.append({"step": s, "loss": a, "reference": b, "diff": abs(a - b), "tol": SAFETY * f})
    return out


# --------------------------------------------------------------------------- rank 0: the report
def run_entry(gathered: Sequence[Mapping], source, config, layout, *, muon_lr: float,
              adamw_lr: float) -> dict:
    """Rank 0: report.json ``runs[].numerics`` of a probed DMuon mode: :func:`oracle_report`
    of every rank's probe record (``gathered[r]["numerics"]``), its probe loss and, filled in
    later by :func:`add_loss_checks`, ``losses``."""
    world = len(gathered)
    mesh = (layout.replicate_size, layout.shard_size)
    shapes = {s.name: s.matrix_shape for s in layout.params}
    entry = oracle_report(source, config.seed, world, config.steps_warmup + config.steps_measured,
                          [r["numerics"] for r in gathered], mesh=mesh, muon_names=layout.muon_names,
                          matrix_shapes=shapes, muon_lr=muon_lr, adamw_lr=adamw_lr)
    entry["probe_loss"] = sum(r["numerics"]["loss"] for r in gathered) / world
    return entry


def checkpoint_entry(gathered: Sequence[Mapping]) -> dict:
    """Rank 0: report.json ``runs[].checkpoint``: ``{"step", "compared", "differ": [{"rank",
    "names"}]}`` (ranks whose resumed step was not bit-identical)."""
    first = gathered[0]["checkpoint"]
    return {"step": first["step"], "compared": sum(r["checkpoint"]["compared"] for r in gathered),
            "differ": [{"rank": i, "names": r["checkpoint"]["differ"]}
                       for i, r in enumerate(gathered) if r["checkpoint"]["differ"]]}


def add_loss_checks(runs: list[dict], source, config, world: int, layout_of: Mapping, *,
                    targets: Sequence[str], muon_lr: float, adamw_lr: float) -> None:
    """Rank 0, after every mode ran: each probed run's ``numerics["losses"]``: its per-step
    losses (``run["losses"]``) against the reference mode's, or the oracle trajectory's where
    the reference did not run, with the floor of :func:`loss_floor` (module docstring).
    ``layout_of``: mode -> its ``RunLayout``; ``targets``: the Muon targets of the reference
    (a variant that leaves some to AdamW gets ``{"skipped": why}``)."""
    probed = [r for r in runs if r.get("numerics") is not None]
    if not probed:
        return
    steps = max(len(r["losses"]) for r in probed)
    specs = layout_of[probed[0]["mode"]].params
    kw = dict(muon_names=tuple(targets), matrix_shapes={s.name: s.matrix_shape for s in specs},
              muon_lr=muon_lr, adamw_lr=adamw_lr)
    oracle = oracle_losses(source, config.seed, world, steps, **kw)
    floor = loss_floor(oracle, oracle_losses(source, config.seed, world, steps, perturb=True, **kw))
    ref_run = next((r for r in runs if r["mode"] == REFERENCE_MODE and len(r.get("losses", ())) >= steps
                    and None not in r["losses"]), None)
    reference, name = (ref_run["losses"], REFERENCE_MODE) if ref_run is not None else (oracle, "oracle")
    for run in probed:
        if tuple(layout_of[run["mode"]].muon_names) != tuple(targets):
            run["numerics"]["losses"] = {"skipped": "the variant leaves some matrices to AdamW: "
                                                    "its losses differ from the reference's by design"}
            continue
        if any(x is None for x in run["losses"]):
            found = [{"step": s, "loss": None, "reference": reference[s], "diff": None, "tol": SAFETY * floor[s]}
                     for s, x in enumerate(run["losses"]) if x is None]
        else:
            found = loss_findings(run["losses"], reference, floor)
        run["numerics"]["losses"] = {"reference": name, "floor": floor, "safety": SAFETY,
                                     "max_diff": max((abs(a - b) for a, b in zip(run["losses"], reference)
                                                      if a is not None), default=0.0),
                                     "off": found}
