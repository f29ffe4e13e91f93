"""Which parameters DMuon dedicates (pure): the default rule, the user's selection, and the
reason every parameter goes to Muon or to AdamW.

The default rule goes by a tensor's role, not its module's type (docs/selection.md): every
trainable parameter with at least 2 dims that is a hidden matrix goes to Muon, i.e. the
weights of ``nn.Linear`` / Hugging Face ``Conv1D``, 3-D expert stacks ``(E, rows, cols)``
(E matrices), 2-D params of custom modules (MoE routers) and conv weights (one matrix of
their ``(out, in·k…)`` view). Left to AdamW: frozen params, params of fewer than 2 dims,
embedding tables, output heads and anything tied to an embedding.

No collectives here; :func:`dmuon.dedicate_params` (``api.py``) validates the selection on
every rank before any collective.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from dmuon.ownership.buckets import block_of

#: Leaf names of modules treated as an output head by :func:`default_predicate` (the name of
#: the module holding the param, e.g. ``lm_head`` in ``model.lm_head``): the usual names of the
#: unembedding / classifier in torch, Hugging Face (``lm_head``, ``embed_out`` of GPT-NeoX,
#: ``score``, ``classifier``), Megatron (``output_layer``), torchtitan (``output``) and
#: TransformerLens-style code (``unembed``).
HEAD_NAMES = frozenset({
    "head", "lm_head", "output", "output_layer", "classifier", "score", "unembed",
    "embed_out", "logits",
})

#: Words (``_``-separated parts of a name, lower case) that mark a parameter of a custom
#: module as an embedding-like table: learned positions and tokens (``pos_embed``,
#: ``cls_token``, ``position_embeddings``, ``relative_position_bias_table``), looked up or
#: added, never multiplied with activations as a hidden matrix. A part starting with
#: ``emb`` counts too. Checked on the param's own name and its module's; never on the
#: weights of Linear and conv layers.
EMBEDDING_WORDS = frozenset({
    "wte", "wpe", "token", "tokens", "pos", "position", "positions", "positional", "table", "cls",
})

#: Class name of Hugging Face's GPT-2-style ``Conv1D`` (``transformers.pytorch_utils.Conv1D``):
#: a Linear whose ``weight`` is stored as ``(in_features, out_features)`` = ``(nx, nf)``.
HF_CONV1D = "Conv1D"

#: ``Assignment.optimizer`` values.
MUON, ADAMW = "muon", "adamw"

#: ``Assignment.role`` values: hidden matrices (``linear``, ``stack``, ``conv``, ``matrix``)
#: and the rest (``frozen``, ``small``: fewer than 2 dims, ``embedding``: a table or
#: embedding-like by name, ``head``, ``tied``: tied to an embedding, ``shared``: one Parameter
#: registered in two different modules (weight tying between hidden layers), ``vector``: a
#: matrix view with a dimension of 1).
ROLES = ("linear", "stack", "conv", "matrix", "frozen", "small", "embedding", "head", "tied",
         "shared", "vector")

#: Roles that go to AdamW by design: :func:`adamw_matrices` does not report them.
QUIET_ROLES = frozenset({"frozen", "small", "embedding", "head", "tied"})

Predicate = Callable[[str, nn.Parameter, nn.Module], bool]


@dataclass(frozen=True)
class Assignment:
    """Where one parameter goes and why (:meth:`dmuon.DedicatedParams.assignments`).

    Attributes:
        name: fully qualified name (``model.named_parameters()``).
        shape: the full shape.
        numel: elements.
        optimizer: ``"muon"`` (dedicated) or ``"adamw"``.
        reason: the rule that decided, in words.
        matrix: Muon's ``(rows, cols)`` view of the param (``None`` for AdamW params): the
            param is ``numel / (rows·cols)`` such matrices.
        role: what the default rule sees in the tensor, whatever decided: one of
            :data:`ROLES`.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    optimizer: str
    reason: str
    matrix: tuple[int, int] | None = None
    role: str = "matrix"

    def as_row(self) -> tuple:
        """``(name, shape, numel, optimizer, reason)``."""
        return (self.name, self.shape, self.numel, self.optimizer, self.reason)


def is_linear_weight(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Whether ``param`` is the 2-D weight of a Linear layer: an ``nn.Linear`` (``(out, in)``)
    or, recognised by duck typing without importing ``transformers``, a Hugging Face
    ``Conv1D`` (class name ``Conv1D``, ``weight`` of shape ``(nx, nf)`` with ``module.nf ==
    weight.shape[1]``).

    The ``(in, out)`` layout of ``Conv1D`` is fine for Muon: the orthogonalized update is
    transpose-invariant (Newton–Schulz works on the wide orientation, so
    ``NS(G^T) = NS(G)^T`` op for op), as are momentum and weight decay (element-wise). Only
    ``adjust_lr_fn=None``/``"original"`` reads the stored orientation: its factor
    ``sqrt(max(1, rows / cols))`` is ``sqrt(max(1, in / out))`` for a ``Conv1D`` where an
    ``nn.Linear`` of the same layer gets ``sqrt(max(1, out / in))``; ``"match_rms_adamw"``
    (``0.2 * sqrt(max(rows, cols))``) is symmetric. Either way DMuon equals
    ``torch.optim.Muon`` given the same parameter.
    """
    if param.ndim != 2 or name.rpartition(".")[2] != "weight":
        return False
    if isinstance(module, nn.Linear):
        return module.weight is param
    if type(module).__name__ == HF_CONV1D and getattr(module, "weight", None) is param:
        return getattr(module, "nf", None) == param.shape[1]
    return False


#: torch's convolutions (their shared base class is private).
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
              nn.ConvTranspose3d)


def is_conv_weight(param: nn.Parameter, module: nn.Module) -> bool:
    """Whether ``param`` is the weight of a torch convolution (``nn.Conv1d/2d/3d`` and the
    transposed ones): ``(out, in/groups, k…)``."""
    return isinstance(module, CONV_TYPES) and getattr(module, "weight", None) is param


def matrix_shape(param: nn.Parameter, module: nn.Module) -> tuple[int, int]:
    """Muon's ``(rows, cols)`` view of a param of at least 2 dims: a conv weight is one matrix
    ``(out, in·k…)`` (flattened, as Muon is usually applied to convolutions); anything else
    is a stack of ``shape[-2:]`` matrices over its leading dims (a 2-D weight is one matrix, a
    3-D expert stack ``(E, rows, cols)`` is E).

    Raises:
        ValueError: ``param`` has fewer than 2 dims.
    """
    if param.ndim < 2:
        raise ValueError(f"Invalid param of shape {tuple(param.shape)}: Muon needs at least 2 dims.")
    if is_conv_weight(param, module):
        return (param.shape[0], math.prod(param.shape[1:]))
    return (param.shape[-2], param.shape[-1])


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[_.\d]+", name.lower()) if w]


def _embedding_like_by_name(name: str, module_name: str) -> str | None:
    """The name (param or module) whose words mark an embedding-like table, or ``None``."""
    for n in (name.rpartition(".")[2], module_name.rpartition(".")[2]):
        if any(w in EMBEDDING_WORDS or w.startswith("emb") for w in _words(n)):
            return n
    return None


def _default_rule(name: str, param: nn.Parameter, module: nn.Module) -> tuple[bool, str, str]:
    """``(to Muon, role, reason)`` of the default rule for one param (tying is checked by the
    caller, which sees the whole model)."""
    if not param.requires_grad:
        return False, "frozen", "frozen (requires_grad=False)"
    if param.ndim < 2:
        return False, "small", f"{param.ndim}-D (bias, norm gain or scalar)"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False, "embedding", f"embedding table ({type(module).__name__})"
    module_name = name.rpartition(".")[0]
    leaf = module_name.rpartition(".")[2]
    if leaf in HEAD_NAMES:
        return False, "head", f"output head (module named {leaf!r}, HEAD_NAMES)"
    linear = is_linear_weight(name, param, module)
    conv = is_conv_weight(param, module)
    if not (linear or conv):
        word = _embedding_like_by_name(name, module_name)
        if word is not None:
            return False, "embedding", f"embedding-like table (name {word!r}, EMBEDDING_WORDS)"
    rows, cols = matrix_shape(param, module)
    kind = type(module).__name__
    if min(rows, cols) == 1:
        return False, "vector", f"a vector stored as a matrix ({rows}, {cols}): Muon would only normalise it"
    if linear:
        return True, "linear", f"weight of a hidden {kind}"
    if conv:
        return True, "conv", f"conv weight ({kind}), Muon on its ({rows}, {cols}) view"
    if param.ndim >= 3:
        count = param.numel() // (rows * cols)
        return True, "stack", f"stack of {count} ({rows}, {cols}) matrices ({kind})"
    return True, "matrix", f"matrix of a {kind} (e.g. a router)"


def default_predicate(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Muon targets by default: every trainable hidden matrix, by role (docs/selection.md).

    True for a trainable param of at least 2 dims (``matrix_shape`` with both dims > 1) that
    is a Linear weight (``nn.Linear``, Hugging Face ``Conv1D``), a conv weight, a stack of
    matrices (3-D expert weights) or a 2-D param of a custom module (a router). False for
    frozen params, params of fewer than 2 dims, ``nn.Embedding`` / ``nn.EmbeddingBag``
    tables, params of a module whose own name is in :data:`HEAD_NAMES`, and params of custom
    modules whose name or module name carries a word of :data:`EMBEDDING_WORDS`. Params tied
    to an ``nn.Embedding`` weight go to AdamW too (checked by :func:`select_params`, which
    sees the whole model). Neither position nor shape marks a head: a head under another
    name needs ``predicate=`` or ``params=``.
    """
    return _default_rule(name, param, module)[0]


def _named_with_modules(model: nn.Module) -> dict[int, tuple[str, nn.Parameter, str, nn.Module]]:
    """id(param) -> (name, param, module name, module), first occurrence in model order."""
    owner_module: dict[int, tuple[str, nn.Parameter, str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owner_module.setdefault(id(p), (full, p, module_name, module))
    return owner_module


def shared_params(model: nn.Module) -> dict[int, list[str]]:
    """id(param) -> the paths of the modules that register it, for every Parameter that is

    - registered in two or more different module objects (weight tying between layers:
      ``blocks[1].weight = blocks[0].weight``), or
    - registered in one module object that is reached through two or more different block
      objects (:func:`dmuon.ownership.buckets.block_of`; ``blocks[3].fc = blocks[0].fc``).

    DMuon moves a dedicated param with the block of its first path: that block's hooks
    broadcast, free and re-receive it, and nothing makes the other holder or block wait for
    them. A block object reused at two places (``ModuleList([a, b, a])``) is one block: its
    params are not shared (its hooks run at each call)."""
    at = dict(model.named_modules(remove_duplicate=False))
    paths: dict[int, list[str]] = {}
    for path, module in at.items():
        paths.setdefault(id(module), []).append(path)
    holders: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():  # each module object once
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module_name or "<root>")
    shared = {k: v for k, v in holders.items() if len(v) > 1}
    for module_name, module in model.named_modules():
        where = paths[id(module)]
        if len({id(at[block_of(path)]) for path in where}) > 1:
            for p in module.parameters(recurse=False):
                shared.setdefault(id(p), where)
    return shared


def assign_params(
    model: nn.Module, params=None, predicate: Predicate | None = None
) -> list[Assignment]:
    """Where every parameter of ``model`` goes and why, in model order (no validation: see
    :func:`select_params`)."""
    entries = _named_with_modules(model)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    shared = shared_params(model)
    chosen = _explicit_ids(entries, params) if params is not None else None
    out = []
    for key, (name, p, _, module) in entries.items():
        default, role, why = _default_rule(name, p, module)
        if key in tied and not isinstance(module, nn.Embedding):
            default, role, why = False, "tied", "tied to an nn.Embedding weight"
        elif key in shared and default:
            default, role, why = False, "shared", (
                f"shared by modules {shared[key]}: DMuon moves a dedicated param with the one "
                "module and block that hold it, so params= cannot dedicate it (reuse a whole "
                "block object instead)")
        if chosen is not None:
            muon = key in chosen
            why = "listed in params=" if muon else f"not in params= (default: {why})"
        elif predicate is not None:  # never an embedding weight or what is tied to one
            muon = key not in tied and bool(predicate(name, p, module))
            if key not in tied:
                why = "predicate= returned True" if muon else f"predicate= returned False (default: {why})"
        else:
            muon = default
        matrix = matrix_shape(p, module) if muon and p.ndim >= 2 else None
        out.append(Assignment(name, tuple(p.shape), p.numel(), MUON if muon else ADAMW, why,
                              matrix, role))
    return out


def _explicit_ids(entries, params) -> set[int]:
    by_name = {v[0]: k for k, v in entries.items()}
    ids = set()
    for i, p in enumerate(params):
        if isinstance(p, str):
            if p not in by_name:
                raise ValueError(
                    f"Invalid params[{i}]={p!r}: no parameter of that name in the model. "
                    "Must be a name from model.named_parameters() or the Parameter itself."
                )
            ids.add(by_name[p])
        elif id(p) in entries:
            ids.add(id(p))
        else:
            raise ValueError(
                f"Invalid params[{i}] (a tensor of shape {tuple(p.shape)}): it is not a "
                "parameter of the model. Pass parameters of the module given as `model`."
            )
    return ids


def select_params(
    model: nn.Module, params, predicate: Predicate | None,
    assignments: list[Assignment] | None = None,
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, param, module name) of the dedicated params, validated, in model order.

    ``assignments``: :func:`assign_params`'s result for the same arguments, when the caller
    already has it (computed here otherwise).

    Raises:
        ValueError: a name or tensor in ``params`` that is not the model's, or a selected
            param with fewer than 2 dims, ``requires_grad=False`` or registered in two
            different modules (:func:`shared_params`).
    """
    entries = {v[0]: v for v in _named_with_modules(model).values()}
    if assignments is None:
        assignments = assign_params(model, params, predicate)
    selected = [a for a in assignments if a.optimizer == MUON]
    shared = shared_params(model)
    for a in selected:
        p = entries[a.name][1]
        if id(p) in shared:
            raise ValueError(
                f"Invalid dedicated param {a.name}: the same Parameter is registered in modules "
                f"{shared[id(p)]} (different module objects, or one object inside different "
                "blocks). Must belong to one module in one block: DMuon broadcasts, frees and "
                "reduces a dedicated param with the block that holds it, so another holder "
                "would read a freed (Z3) or stale copy, or hand the param back to DDP. Leave it "
                "to AdamW (drop it from params= / predicate=), or reuse a whole block object "
                "(ModuleList([block] * n)) instead of tying weights or sharing sub-modules."
            )
        if p.ndim < 2:
            raise ValueError(
                f"Invalid dedicated param {a.name} of shape {a.shape}: Muon needs a matrix, a "
                "stack of matrices (E, rows, cols) or a conv weight, at least 2 dims. Leave "
                "1-D params (biases, norm gains) to AdamW (filter with p.ndim >= 2)."
            )
        if not p.requires_grad:
            raise ValueError(f"Invalid dedicated param {a.name}: requires_grad is False.")
    return [(a.name, entries[a.name][1], entries[a.name][2]) for a in selected]


def matrix_shapes(model: nn.Module, names) -> dict[str, tuple[int, int]]:
    """name -> Muon's ``(rows, cols)`` view (:func:`matrix_shape`) of each named param of
    ``model`` with at least 2 dims (what :func:`dmuon.plan.specs_from_named_parameters`
    takes)."""
    wanted = set(names)
    return {
        name: matrix_shape(p, module)
        for name, p, _, module in _named_with_modules(model).values()
        if name in wanted and p.ndim >= 2
    }


def adamw_matrices(assignments: list[Assignment]) -> list[Assignment]:
    """The AdamW params :func:`dmuon.dedicate_params` warns about: those whose role is not in
    :data:`QUIET_ROLES` (trainable, at least 2 dims, not an embedding table, an output head
    or tied to an embedding: those go to AdamW by design)."""
    return [a for a in assignments if a.optimizer == ADAMW and a.role not in QUIET_ROLES]
