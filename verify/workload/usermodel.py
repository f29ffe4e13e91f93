"""Which model ``verify-traffic`` trains: the built-in TinyGPT, a preset, or the user's factory.

``--model`` takes one of:

- ``tinygpt`` (default): the built-in byte-level GPT (``verify.workload.model``) on the stdlib corpus.
- a preset name from ``verify.workload.presets`` (``gpt2-small``, ``llama-tiny``, ...), trained on the
  same corpus.
- ``pkg.module:factory``: a function found by importing ``pkg.module`` (from ``PYTHONPATH``).

The factory protocol::

    def factory() -> tuple[torch.nn.Module, Callable[[torch.nn.Module, int, int], torch.Tensor]]:
        ...
        return model, loss_fn

    loss_fn(model, rank, step) -> torch.Tensor   # the scalar loss of this rank's batch at step

``factory()`` is called once per mode on every rank, after ``torch.manual_seed(seed)``, and must
build the same bare (unwrapped, CPU) model on every rank. ``loss_fn`` receives the *wrapped*
model (DDP / FSDP2 / DMuon) and runs its forward; it must return a 0-dim floating tensor that
requires grad. It is called with the global rank and the step index (0-based, warm-up
included), so each rank can draw its own slice of a global batch. Everything about a mode's
collectives is then derived from the model's shapes, as for the built-in model.

FSDP2 modes wrap each element of the model's largest ``nn.ModuleList`` (its layers, by
parameter count) with ``fully_shard``, then the root (:func:`block_names`).

Validation happens up front on every rank (:func:`validate_source`): the factory's return, one
``loss_fn`` call on the bare model, and the model's parameter shapes agreeing across ranks;
any failure raises the same ``ValueError`` on every rank before a training collective runs.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from verify.workload.data import ByteCorpus, local_slice
from verify.workload.model import GPTConfig, TinyGPT

#: ``--model`` value of the built-in model.
BUILTIN = "tinygpt"

LossFn = Callable[[nn.Module, int, int], torch.Tensor]
Factory = Callable[[], tuple[nn.Module, LossFn]]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: its name as given and the factory to call per mode."""

    name: str
    factory: Factory


def _preset_names() -> tuple[str, ...]:
    try:
        from verify.workload import presets  # written by the planner; absent on older checkouts
    except ImportError:
        return ()
    return tuple(getattr(presets, "PRESETS", {}))


def corpus_loss(corpus: ByteCorpus, *, global_batch: int, seq_len: int, seed: int) -> LossFn:
    """Next-byte cross-entropy on ``corpus``: rank r of W takes its rows of the step's global
    batch (``ByteCorpus.global_batch`` and ``local_slice``); inputs go to the device of the
    model's first parameter. ``model(x)`` must return logits (B, T, V)."""

    def loss_fn(model: nn.Module, rank: int, step: int) -> torch.Tensor:
        x, y = corpus.global_batch(step, global_batch, seq_len, seed=seed)
        world = dist.get_world_size() if dist.is_initialized() else 1
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        device = next(model.parameters()).device
        logits = model(x.to(device))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1))

    return loss_fn


def resolve(spec: str, *, corpus: ByteCorpus | None = None, global_batch: int = 8,
            seq_len: int = 64, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
            seed: int = 0) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource` (see the module docstring).

    The built-in model and presets train on ``corpus`` (the stdlib corpus when None) with
    ``global_batch`` sequences of ``seq_len`` bytes per step; ``d_model``, ``n_layers``,
    ``n_heads`` size the built-in TinyGPT.

    Raises:
        ValueError: the value is neither ``tinygpt``, a preset nor ``module:function``, the
            module cannot be imported, or it has no such callable.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"Invalid --model={spec!r}. Must be '{BUILTIN}', a preset, or 'pkg.module:factory'.")
    presets = _preset_names()
    if spec == BUILTIN or spec in presets:
        data = corpus if corpus is not None else ByteCorpus.from_stdlib()
        loss = corpus_loss(data, global_batch=global_batch, seq_len=seq_len, seed=seed)
        if spec == BUILTIN:
            cfg = GPTConfig(seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
            return ModelSource(spec, lambda: (TinyGPT(cfg), loss))
        return ModelSource(spec, _preset_factory(spec, loss))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        choices = ", ".join((BUILTIN, *presets)) or BUILTIN
        raise ValueError(f"Invalid --model={spec!r}. Must be one of {choices} or "
                         "'pkg.module:factory' (a function on PYTHONPATH returning (model, loss_fn)).")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"Invalid --model={spec!r}: cannot import {module_name!r} ({exc}). "
                         "Must be importable: put its folder on PYTHONPATH.") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"Invalid --model={spec!r}: {module_name} has no callable {attr!r}. "
                         "Must name a function factory() -> (model, loss_fn).")
    return ModelSource(spec, factory)


def _preset_factory(name: str, loss: LossFn) -> Factory:
    from verify.workload import presets as presets

    def factory():
        return presets.build_preset(name, device="cpu"), loss  # a bare nn.Module on the CPU

    return factory


def check_factory_output(out: object, name: str) -> tuple[nn.Module, LossFn]:
    """``(model, loss_fn)`` from a factory's return value, or a clear error.

    Raises:
        ValueError: not a 2-tuple, the model is not an ``nn.Module`` with parameters, a
            parameter is not floating point, or ``loss_fn`` is not callable with
            ``(model, rank, step)``.
    """
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"Invalid return of --model {name}: {type(out).__name__} {out!r:.80}. "
                         "Must be a tuple (model, loss_fn).")
    model, loss_fn = out
    if not isinstance(model, nn.Module):
        raise ValueError(f"Invalid model from --model {name}: {type(model).__name__}. Must be "
                         "a torch.nn.Module.")
    params = list(model.named_parameters())
    if not params:
        raise ValueError(f"Invalid model from --model {name}: it has no parameters. Must have "
                         "2-D weights for Muon to verify.")
    bad = [n for n, p in params if not p.is_floating_point()]
    if bad:
        raise ValueError(f"Invalid model from --model {name}: parameters {bad[:3]} are not "
                         "floating point. Must be trainable float tensors.")
    if not callable(loss_fn):
        raise ValueError(f"Invalid loss_fn from --model {name}: {type(loss_fn).__name__}. Must "
                         "be callable as loss_fn(model, rank, step).")
    try:
        inspect.signature(loss_fn).bind(model, 0, 0)
    except TypeError as exc:
        raise ValueError(f"Invalid loss_fn from --model {name}: {exc}. Must accept "
                         "(model, rank, step).") from exc
    except ValueError:
        pass  # a builtin without a signature: the dry run below decides
    return model, loss_fn


def check_loss(loss: object, name: str) -> torch.Tensor:
    """The loss, or a clear error when it is not a 0-dim floating tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        desc = (f"{type(loss).__name__}" if not isinstance(loss, torch.Tensor)
                else f"tensor shape={tuple(loss.shape)} dtype={loss.dtype}")
        raise ValueError(f"Invalid loss from --model {name}'s loss_fn: {desc}. Must be a 0-dim "
                         "floating-point tensor (e.g. loss.mean()).")
    if not loss.requires_grad:
        raise ValueError(f"Invalid loss from --model {name}'s loss_fn: it does not require grad. "
                         "Must be computed from the model's forward (no .item(), no detach).")
    return loss


def shapes_digest(model: nn.Module) -> str:
    """SHA-256 of ``(name, shape, dtype)`` of every parameter, in order (cross-rank check)."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()


def validate_source(source: ModelSource, seed: int = 0) -> None:
    """Check ``source`` on every rank before any training collective (module docstring).

    Builds the model once (after ``torch.manual_seed(seed)``), checks the factory's return,
    runs ``loss_fn(model, rank, 0)`` on the bare model and backward, then compares every rank's
    verdict and parameter-shape digest (one ``all_gather_object``).

    Raises:
        ValueError: on every rank, naming the failing ranks and the first error.
    """
    rank = dist.get_rank()
    error, digest = None, None
    try:
        torch.manual_seed(seed)
        model, loss_fn = check_factory_output(source.factory(), source.name)
        digest = shapes_digest(model)
        check_loss(loss_fn(model, rank, 0), source.name).backward()
    except Exception as exc:  # reported on every rank below instead of hanging the others
        error = f"{type(exc).__name__}: {exc}"
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (error, digest))
    failed = {r: e for r, (e, _) in enumerate(verdicts) if e is not None}
    if failed:
        first = next(iter(failed))
        raise ValueError(f"Invalid --model {source.name} on ranks {sorted(failed)}: "
                         f"{failed[first]}")
    digests = {d for _, d in verdicts}
    if len(digests) != 1:
        raise ValueError(f"Invalid --model {source.name}: the factory built models with "
                         "different parameter shapes on different ranks. Must build the same "
                         "model on every rank (shapes must not depend on the rank).")


def block_names(model: nn.Module) -> list[str]:
    """Modules FSDP2 wraps one by one: the elements of the model's largest ``nn.ModuleList``
    (by parameter count: a transformer's layers), in order; ``[]`` when it has none. A module
    that sits at several indices is named once, at its first (``named_modules`` knows only that
    name, and FSDP2 cannot wrap one module twice)."""
    best, best_numel = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = name, numel
    if best is None:
        return []
    names, seen = [], set()
    for i, module in enumerate(model.get_submodule(best)):
        if id(module) not in seen:  # the same module at two indices (ALBERT-style): its first name only
            seen.add(id(module))
            names.append(f"{best}.{i}" if best else str(i))
    return names


def skip_reasons(modes: tuple[str, ...] | list[str], world_size: int) -> dict[str, str]:
    """``{mode: reason}`` for the modes this world size cannot run (HSDP: even W >= 4)."""
    reasons = {}
    for mode in modes:
        if "hsdp" in mode and (world_size < 4 or world_size % 2):
            reasons[mode] = (f"HSDP runs on a 2 x W/2 mesh: needs an even W >= 4, "
                             f"have W={world_size}")
    return reasons
