"""Which parameters DMuon dedicates (pure): the default predicate and the user's selection.

No collectives here; :func:`dmuon.dedicate_params` (``api.py``) validates the selection on
every rank before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

#: Leaf names of modules treated as an output head by :func:`default_predicate` (the name of
#: the Linear itself, e.g. ``lm_head`` in ``model.lm_head``): the usual names of the
#: unembedding / classifier in torch, Hugging Face (``lm_head``, ``embed_out`` of GPT-NeoX,
#: ``score``, ``classifier``), Megatron (``output_layer``), torchtitan (``output``) and
#: TransformerLens-style code (``unembed``).
HEAD_NAMES = frozenset({
    "head", "lm_head", "output", "output_layer", "classifier", "score", "unembed",
    "embed_out", "logits",
})

#: Class name of Hugging Face's GPT-2-style ``Conv1D`` (``transformers.pytorch_utils.Conv1D``):
#: a Linear whose ``weight`` is stored as ``(in_features, out_features)`` = ``(nx, nf)``.
HF_CONV1D = "Conv1D"

Predicate = Callable[[str, nn.Parameter, nn.Module], bool]


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


def default_predicate(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Muon targets by default: trainable 2-D weights of hidden Linear layers.

    A Linear is an ``nn.Linear`` or a Hugging Face ``Conv1D`` (:func:`is_linear_weight`).
    Left to AdamW: frozen params (``requires_grad=False``), embeddings, the output head (a
    Linear whose own name is one of :data:`HEAD_NAMES`, or whose weight is tied to an
    ``nn.Embedding``: checked by :func:`select_params`), norms, biases, 1-D params. Neither
    position nor shape marks a head: a head under another name needs ``predicate=`` or
    ``params=`` (see docs/user-guide.md, "Which params").
    """
    if not param.requires_grad or not is_linear_weight(name, param, module):
        return False
    module_leaf = name.rpartition(".")[0].rpartition(".")[2]
    return module_leaf not in HEAD_NAMES


def select_params(
    model: nn.Module, params, predicate: Predicate | None
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, param, module name) of the dedicated params, validated, in model order."""
    owner_module: dict[int, tuple[str, nn.Parameter, str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owner_module.setdefault(id(p), (full, p, module_name, module))
    tied_to_embedding = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    if params is not None:
        chosen = []
        by_name = {v[0]: v for v in owner_module.values()}
        for i, p in enumerate(params):
            if isinstance(p, str):
                if p not in by_name:
                    raise ValueError(
                        f"Invalid params[{i}]={p!r}: no parameter of that name in the model. "
                        "Must be a name from model.named_parameters() or the Parameter itself."
                    )
                chosen.append(by_name[p])
            elif id(p) in owner_module:
                chosen.append(owner_module[id(p)])
            else:
                raise ValueError(
                    f"Invalid params[{i}] (a tensor of shape {tuple(p.shape)}): it is not a "
                    "parameter of the model. Pass parameters of the module given as `model`."
                )
        ids = {id(c[1]) for c in chosen}
        selected = [v for v in owner_module.values() if id(v[1]) in ids]
    else:
        pred = predicate or default_predicate
        selected = [
            v
            for v in owner_module.values()
            if id(v[1]) not in tied_to_embedding and pred(v[0], v[1], v[3])
        ]
    for name, p, _, _ in selected:
        if p.ndim != 2:
            raise ValueError(
                f"Invalid dedicated param {name} of shape {tuple(p.shape)}: Muon needs 2-D "
                "matrices. Leave 1-D params and embeddings to AdamW (use the default "
                "predicate or filter with p.ndim == 2)."
            )
        if not p.requires_grad:
            raise ValueError(f"Invalid dedicated param {name}: requires_grad is False.")
    return [(name, p, module_name) for name, p, module_name, _ in selected]
