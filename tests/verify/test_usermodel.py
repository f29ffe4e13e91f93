"""verify.workload.usermodel without processes: resolving --model, the factory checks, FSDP2 blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.my_model import ResidualMLP, factory
from verify.workload.model import TinyGPT
from verify.workload.usermodel import (
    block_names,
    check_factory_output,
    check_loss,
    resolve,
    skip_reasons,
)


def test_resolve_factory_and_errors():
    assert resolve("examples.my_model:factory").factory is factory
    with pytest.raises(ValueError, match="Must be one of tinygpt"):
        resolve("no-such-preset")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.mod'"):
        resolve("no_such_pkg.mod:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        resolve("examples.my_model:nope")


def test_presets_resolve_by_name():
    from verify.workload.presets import PRESETS

    assert "llama-tiny" in PRESETS
    src = resolve("llama-tiny")
    model, loss_fn = src.factory()
    assert isinstance(model, nn.Module) and callable(loss_fn)
    assert block_names(model)[0] == "layers.0"


def test_factory_output_checks():
    with pytest.raises(ValueError, match=r"Must be a tuple \(model, loss_fn\)"):
        check_factory_output(ResidualMLP(), "f")
    with pytest.raises(ValueError, match="Must be a torch.nn.Module"):
        check_factory_output(("model", print), "f")
    with pytest.raises(ValueError, match=r"Must accept \(model, rank, step\)"):
        check_factory_output((ResidualMLP(), lambda model: 0), "f")
    with pytest.raises(ValueError, match="does not require grad"):
        check_loss(torch.tensor(1.0), "f")
    with pytest.raises(ValueError, match="Must be a 0-dim"):
        check_loss(torch.ones(2, requires_grad=True), "f")


def test_block_names_pick_the_largest_module_list():
    assert block_names(TinyGPT()) == ["blocks.0", "blocks.1"]
    assert block_names(ResidualMLP()) == ["blocks.0", "blocks.1", "blocks.2"]
    assert block_names(nn.Linear(2, 2)) == []


def test_skip_reasons():
    assert skip_reasons(("dmuon-z2", "dmuon-hsdp-z2"), 4) == {}
    reasons = skip_reasons(("dmuon-z2", "dmuon-hsdp-z2", "naive-hsdp"), 3)
    assert set(reasons) == {"dmuon-hsdp-z2", "naive-hsdp"}
    assert "have W=3" in reasons["naive-hsdp"]


def test_block_names_name_a_module_repeated_in_the_list_once():
    """ALBERT-style sharing: the same block at indices 0 and 2 is one FSDP2 unit, named by
    its first index (``named_modules`` has no ``blocks.2``; the naive FSDP2 modes failed with
    KeyError on it)."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Module()
    model.blocks = nn.ModuleList([a, b, a])
    assert block_names(model) == ["blocks.0", "blocks.1"]
    assert all(n in dict(model.named_modules()) for n in block_names(model))
