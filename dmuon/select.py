"""Which parameters DMuon dedicates (pure): the default predicate and the user's selection.

No collectives here; :func:`dmuon.dedicate_params` (``api.py``) validates the selection on
every rank before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

#: Names of modules treated as an output head by :func:`default_predicate`.
HEAD_NAMES = frozenset({"head", "lm_head", "output", "classifier", "score"})

Predicate = Callable[[str, nn.Parameter, nn.Module], bool]


Predicate = Callable[[str, nn.Parameter, nn.Module], bool]


def default_predicate(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Muon targets by default: 2-D weights of hidden ``nn.Linear`` layers.

    Left to AdamW: embeddings, the output head (a Linear whose own name is one of
    :data:`HEAD_NAMES`, or whose weight is tied to an embedding), norms, biases, 1-D params.
    """
    if param.ndim != 2 or not isinstance(module, nn.Linear):
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
