"""Builders shared by several single-process test modules (test modules do not import each
other; see also ``nsys_builders.py`` and ``report_builders.py``)."""

from __future__ import annotations

from fractions import Fraction

from dmuon.ownership.plan import ParamSpec, specs_from_named_parameters
from tracer.events import CollectiveEvent
from verify.modes.build import muon_names
from verify.traffic.predict import RunLayout, predict_step
from verify.workload.model import GPTConfig, TinyGPT


def tinygpt_layout(mode: str, world: int, *, d_model: int = 64, n_heads: int = 4,
                   **extra) -> RunLayout:
    """The layout ``verify.modes.build.build`` records for TinyGPT (same wrapping, no processes)."""
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


def predicted_events(layout: RunLayout, steps: int = 1) -> list[CollectiveEvent]:
    """The prediction of ``layout`` as a perfect interposer would record it, ``steps`` times
    (an all_to_all's totals, but not its own chunk: no source sees that)."""
    return [
        CollectiveEvent(source="interposer", op=e.op, rank=e.rank, group_id=e.group_id,
                        group_size=e.group_size, group_rank=e.group_id.split(",").index(str(e.rank)),
                        count=e.count, dtype=e.dtype, root=e.root, phase=e.phase,
                        in_elems=e.in_elems, out_elems=e.out_elems)
        for _ in range(steps) for e in predict_step(layout)
    ]


def dedicated_w_average(layout: RunLayout, phase: str | None = None) -> Fraction:
    """Exact W-average (rationals) of the Muon-param share of the predicted calls of one step,
    in ``phase`` (all phases: ``None``): f(n)·S per call (verify.traffic.formulas, written
    out here), an all_to_all of known own chunk the dedicated elements it sends."""
    total = Fraction(0)
    for e in predict_step(layout):
        if phase is not None and e.phase != phase:
            continue
        if e.uneven:
            total += e.dedicated_in_elems - e.dedicated_count
        elif e.count:
            n = e.group_size
            f = {"all_reduce": Fraction(2 * (n - 1), n), "gather": Fraction(n - 1, n * n)}.get(
                e.op, Fraction(n - 1, n))
            s = n * e.count if e.op in ("all_gather", "reduce_scatter", "all_to_all", "gather") else e.count
            total += f * s * Fraction(e.dedicated_count, e.count)
    return total / layout.world_size


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
