"""Builders shared by several single-process test modules (test modules do not import each
other; see also ``nsys_builders.py`` and ``report_builders.py``)."""

from __future__ import annotations

from dmuon.ownership.plan import ParamSpec, specs_from_named_parameters
from tracer.events import CollectiveEvent
from verify.run.modes import muon_names
from verify.traffic.predict import RunLayout, predict_step
from verify.workload.model import GPTConfig, TinyGPT


def tinygpt_layout(mode: str, world: int, *, d_model: int = 64, n_heads: int = 4,
                   **extra) -> RunLayout:
    """The layout ``verify.run.modes.build`` records for TinyGPT (same wrapping, no processes)."""
    model = TinyGPT(GPTConfig(d_model=d_model, n_heads=n_heads, n_layers=2))
    specs = tuple(specs_from_named_parameters(model.named_parameters()))
    targets = muon_names(model)
    r, n = (2, world // 2) if "hsdp" in mode else (1, world)
    fsdp = ()
    if mode != "ddp-muon" and mode != "dmuon-ddp":
        per_linear = [] if mode.startswith("dmuon-") else sorted(
            {t.rpartition(".")[0] for t in targets}, key=[s.module for s in specs].index)
        fsdp = (*per_linear, "blocks.0", "blocks.1", "")
    reshard = mode.endswith("z3") or mode == "naive-hsdp"
    return RunLayout(mode=mode, replicate_size=r, shard_size=n, params=specs, muon_names=targets,
                     fsdp_modules=fsdp, reshard_after_forward=reshard, **extra)


def llama_specs(n_layers: int = 8, d: int = 1024, kv: int = 256, ff: int = 2816) -> list[ParamSpec]:
    """A LLaMA-like stack with grouped-query attention: matrices of very different NS cost."""
    shapes = {
        "attn.q": (d, d),
        "attn.k": (kv, d),
        "attn.v": (kv, d),
        "attn.o": (d, d),
        "mlp.gate": (ff, d),
        "mlp.up": (ff, d),
        "mlp.down": (d, ff),
    }
    return [
        ParamSpec(f"layers.{i}.{m}.weight", shape, "bfloat16", f"layers.{i}.{m}")
        for i in range(n_layers)
        for m, shape in shapes.items()
    ]


#: The ``dmuon-verify check`` tests' layout: two Linears, dmuon-z2 on 4 ranks.
CHECK_LAYOUT = RunLayout(
    mode="dmuon-z2", replicate_size=1, shard_size=4,
    params=(ParamSpec(name="fc1.weight", shape=(16, 8), dtype="float32", module="fc1"),
            ParamSpec(name="fc2.weight", shape=(8, 16), dtype="float32", module="fc2"),
            ParamSpec(name="fc2.bias", shape=(8,), dtype="float32", module="fc2")),
    muon_names=("fc1.weight", "fc2.weight"), fsdp_modules=("",), reshard_after_forward=False)


def measured(steps: int = 2) -> list[CollectiveEvent]:
    """What a perfect interposer would record for :data:`CHECK_LAYOUT`: the prediction,
    ``steps`` times, per rank."""
    out, seen = [], {}
    for _ in range(steps):
        for e in predict_step(CHECK_LAYOUT):
            i = seen[e.rank] = seen.get(e.rank, -1) + 1
            out.append(CollectiveEvent(
                source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                group_size=e.group_size, count=e.count, dtype=e.dtype, root=e.root,
                phase=e.phase, module=e.module, source_ref=f"events_rank{e.rank}.parquet#{i}"))
    return out


class RecordingDomain:
    """Stands in for ``nvtx.get_domain("DMuon")``: records what DMuon pushes and pops."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def get_event_attributes(self, message=None):
        return message

    def push_range(self, attributes=None):
        self.calls.append(("push", attributes))

    def pop_range(self):
        self.calls.append(("pop", None))
