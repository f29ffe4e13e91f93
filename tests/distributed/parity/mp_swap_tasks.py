"""Rank-side tasks of test_dmuon_mp_swaps.py: where a bf16 policy's compute params are
registered (``dmuon/runtime/precision.py``, ``ModuleSwaps``) when a dedicated module runs
outside its block's forward hooks (activation-checkpoint recompute of the block's body)."""

from __future__ import annotations

from tests.distributed.runtime.runtime_tasks import SMALL, _apply_ac, batch, make_model


def train_mp_ac(mode: str, variant: str | None, steps: int = 3) -> dict:
    """verify-traffic's model and ``mode`` with ``--mixed-precision bf16``, every block
    checkpointed (``variant`` of runtime_tasks._apply_ac; None: no AC). Returns the owned
    params after ``steps``, the dtype of ``blocks.0.mlp.fc1.weight`` at each of its forwards
    (recomputes included), and whether every dedicated param is registered again after."""
    from verify.run.modes import build as build_mode
    from verify.run.runner import train_step

    built = build_mode(mode, lambda: make_model(SMALL), mixed_precision="bf16")
    model = built.model.module if mode == "dmuon-ddp" else built.model
    if variant is not None:
        _apply_ac(model, variant)
    seen = []  # registered after DMuon's hooks: sees what the module computes with
    model.get_submodule("blocks.0.mlp.fc1").register_forward_pre_hook(
        lambda m, a: seen.append(str(m.weight.dtype)))
    for step in range(steps):
        x, y = batch(step)
        train_step(built.model, built.optimizer, x, y)
    dm = built.dedicated
    dm.wait_pending()
    owned = {id(p) for p in dm.owned()}
    # checkpoint_wrapper (applied after dedicate_params here) inserts a name component
    names = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in zip(dm.names, dm.params) if id(p) in owned},
            "fc1_dtypes": seen,
            "registered": all(names[n] is p for n, p in zip(dm.names, dm.params))}
