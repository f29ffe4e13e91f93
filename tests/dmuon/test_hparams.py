"""DMuon's hyper-parameter rules (pure): what torch.optim.Muon / AdamW accept passes, the rest
raises with the object, value and rule named."""

import pytest

from dmuon.optim.hparams import validate_adamw, validate_muon
from dmuon.optim.muon_math import MUON_DEFAULTS, polar_express_coefficients

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


@pytest.mark.parametrize("change", [
    {},
    {"adjust_lr_fn": "match_rms_adamw"},
    {"adjust_lr_fn": "original", "nesterov": False, "weight_decay": 0.0, "lr": 0.0},
    {"ns_coefficients": polar_express_coefficients(7), "ns_steps": 7},
    {"ns_steps": 0},
    {"momentum": 0.0},
])
def test_what_torch_muon_accepts_passes(change):
    validate_muon({**MUON_DEFAULTS, **change})


def test_adamw_defaults_pass_and_where_prefixes_the_name():
    validate_adamw(ADAMW)
    with pytest.raises(ValueError, match=r"^Invalid param_groups\[1\]\.adamw_lr=-1"):
        validate_adamw({**ADAMW, "lr": -1}, "param_groups[1].")


@pytest.mark.parametrize("key,value,text", [
    ("ns_coefficients", [(3.4, -4.7, 2.0)] * 4, "Must have exactly ns_steps=5 triples"),
    ("ns_steps", 2.5, "Invalid ns_steps=2.5"),
    ("ns_steps", True, "Invalid ns_steps=True"),
    ("eps", float("inf"), "Invalid eps=inf"),
    ("lr", float("nan"), "Invalid lr=nan"),
])
def test_what_torch_muon_rejects_at_step_is_rejected_up_front(key, value, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        validate_muon({**MUON_DEFAULTS, key: value})
