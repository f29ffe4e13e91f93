"""The harness's memory model (``verify.traffic.memory``) and the ``memory`` check, without
processes: the Z3 window by the documented formula on hand-sized buckets, Z2 resident, holders
by the shard index, the check's named cause, the report's table and memory.png."""

from __future__ import annotations

import pytest

from verify.report.checks import run_checks
from verify.report.memory_view import memory_rows, plot_memory
from verify.traffic.memory import memory_report, predict_memory, z3_window
from verify.traffic.predict import DMuonBucket


def _b(unit: str, owner: int, numel: int, aligned: bool = False) -> DMuonBucket:
    return DMuonBucket(unit, owner, "float32", (f"{unit}.w{owner}",), numel, (unit,), aligned)


def test_z3_window_is_each_units_forward_and_backward_reach():
    """Units a, b, c, d of 10/20/30/40 bytes, depth 1: forward [u, u+1], backward [u-1, u];
    the widest is c+d = 70 (2 units); depth 0: the largest unit; depth 3: everything."""
    buckets = [_b(u, 0, 1) for u in "abcd"]
    sizes = [10, 20, 30, 40]
    assert z3_window(sizes, buckets, 1) == (70, 2)
    assert z3_window(sizes, buckets, 0) == (40, 1)
    assert z3_window(sizes, buckets, 3) == (100, 4)


def test_z3_window_widens_to_the_aligned_group():
    """A unit's buckets of one aligned group arrive in one call: reaching its first member
    holds them all (a non-aligned split would give 10 + 5 = 15)."""
    buckets = [_b("a", 0, 1), _b("b", 1, 1, True), _b("b", 2, 1, True)]
    assert z3_window([10, 5, 7], buckets, 1) == (22, 2)
    plain = [_b("a", 0, 1), _b("b", 1, 1), _b("c", 2, 1)]
    assert z3_window([10, 5, 7], plain, 1) == (15, 2)


def test_z3_window_refuses_bad_input():
    with pytest.raises(ValueError, match="depth >= 0"):
        z3_window([1], [_b("a", 0, 1)], -1)
    with pytest.raises(ValueError, match="one size per bucket"):
        z3_window([1, 2], [_b("a", 0, 1)], 1)


def _layout(z3: bool, **kw):
    """4 blocks of two (16, 16) fp32 matrices at W = 2, one unit per block (no coalescing)."""
    from dmuon.ownership.plan import ParamSpec
    from verify.traffic.predict import RunLayout

    params = tuple(ParamSpec(f"blocks.{i}.{m}.weight", (16, 16), "float32", f"blocks.{i}.{m}")
                   for i in range(4) for m in ("fc1", "fc2"))
    return RunLayout(mode="dmuon-z3" if z3 else "dmuon-z2", replicate_size=1, shard_size=2,
                     params=params, muon_names=tuple(p.name for p in params),
                     reshard_after_forward=z3, dmuon_rest="replicate", **kw)


def test_predict_memory_z3_window_z2_resident_and_grads():
    """Each rank holds half of 8 matrices of 1 KiB; Z3's window at depth 1 is two units'
    non-held bytes, Z2 keeps every one; grads: held buffers (numel + 1 usage element each
    bucket) plus the two units with most non-held buffers; mixed precision adds the held
    compute copy and halves the non-held ones."""
    z3, z2 = predict_memory(_layout(True)), predict_memory(_layout(False))
    for a, b in zip(z3, z2):
        assert a.held_bytes + a.non_held_bytes == 8 * 1024 == b.peak_bytes == b.between_bytes
        assert a.between_bytes == a.held_bytes
        assert a.window_bytes < a.non_held_bytes and a.window_units <= 2
        assert a.peak_bytes == a.held_bytes + a.window_bytes
    total = sum(x.held_bytes for x in z3)
    assert total == 8 * 1024  # every bucket has exactly one holder
    bf16 = predict_memory(_layout(True, mp_param_dtype="bfloat16"))
    for a, m in zip(z3, bf16):
        assert m.held_bytes == a.held_bytes * 3 // 2 and m.window_bytes == a.window_bytes // 2
    assert predict_memory(_layout(True), 0)[0].window_units == 1
    with pytest.raises(ValueError, match="prefetch_depth"):
        predict_memory(_layout(True), -1)


def _run_with(measured_forward: int | None = None) -> dict:
    layout = _layout(True)
    bounds = predict_memory(layout)
    measured = []
    for b in bounds:
        fwd = b.peak_bytes if measured_forward is None else measured_forward
        measured.append({"peak_bytes": {"between": b.between_bytes, "forward": fwd,
                                        "backward": b.peak_bytes},
                         "peak_grads_bytes": b.grads_bytes, "prefetch_depth": 1,
                         "cuda_max_allocated_bytes": None,
                         "trace": [["between", b.between_bytes, 0, None], ["forward", fwd, 10, None]]})
    return {"mode": "dmuon-z3", "memory": memory_report(layout, measured)}


def _memory_check(run: dict) -> dict:
    from verify.report.checks import _memory

    return _memory(run)


def test_memory_check_passes_at_the_bound_and_names_the_cause_above_it(tmp_path):
    ok = _memory_check(_run_with())
    assert ok["pass"] and "1.00×" in ok["detail"]
    bad = _memory_check(_run_with(measured_forward=20_970_000))
    assert not bad["pass"]
    assert bad["detail"].startswith("rank 0 peak forward 20.97 MB > bound 0.01 MB (Z3 window of ")
    assert "rank 1 peak forward" in bad["detail"]
    report = {"runs": [_run_with()]}
    assert len(memory_rows(report)[1]) == 2
    assert plot_memory(report, tmp_path / "memory.png").stat().st_size > 0
    assert plot_memory({"runs": [{"mode": "ddp-muon"}]}, tmp_path / "none.png") is None


def test_memory_report_refuses_mixed_depths():
    layout = _layout(True)
    m = {"peak_bytes": {}, "peak_grads_bytes": 0, "cuda_max_allocated_bytes": None, "trace": []}
    with pytest.raises(ValueError, match="same prefetch_depth"):
        memory_report(layout, [{**m, "prefetch_depth": 1}, {**m, "prefetch_depth": 2}])


def _direct_bounds(layout, depth: int) -> list[tuple]:
    """The module docstring's per-rank sums, rank by rank, with :func:`z3_window` over each
    rank's own sizes: the reference ``predict_memory``'s per-class fast path must equal."""
    from tracer.events import DTYPE_BYTES
    from verify.traffic.memory import _units, is_holder
    from verify.traffic.predict import dmuon_layout, layout_buckets

    moved = dmuon_layout(layout)
    buckets = layout_buckets(moved)
    mp = layout.mp_param_dtype
    out = []
    for rank in range(layout.world_size):
        held = grads_held = cast = 0
        sizes, grads = [], []
        for b in buckets:
            lp = DTYPE_BYTES[mp or b.dtype]
            grad = (b.numel + len(b.names)) * lp
            if is_holder(b, rank, moved.shard_size):
                held += b.numel * DTYPE_BYTES[b.dtype] + (b.numel * lp if mp not in (None, b.dtype) else 0)
                grads_held += grad
                cast += b.numel * DTYPE_BYTES[b.dtype] if mp not in (None, b.dtype) else 0
                sizes.append(0)
                grads.append(0)
            else:
                sizes.append(b.numel * lp)
                grads.append(grad)
        window = z3_window(sizes, buckets, depth) if layout.reshard_after_forward else (sum(sizes), len(_units(buckets)))
        per_unit = [sum(grads[lo : hi + 1]) for lo, hi in _units(buckets)]
        two = max((a + c for a, c in zip(per_unit, per_unit[1:])), default=sum(per_unit))
        out.append((rank, held, sum(sizes), *window, grads_held, grads_held + two + cast))
    return out


@pytest.mark.parametrize("mesh", [(1, 6), (2, 3)])
@pytest.mark.parametrize("z3", [True, False])
@pytest.mark.parametrize("mp", [None, "bfloat16"])
def test_predict_memory_per_class_equals_the_direct_sums(mesh, z3, mp):
    """predict_memory computes each holder class once from all-non-held sums less the held
    buckets (for W = 1024 speed); on uneven blocks (some with fewer matrices than ranks: idle
    holders), coalesced units with aligned groups, HSDP and mixed precision it equals the
    formula evaluated rank by rank."""
    from dmuon.ownership.plan import ParamSpec
    from verify.traffic.predict import RunLayout, layout_buckets

    shapes = [(16, 16), (32, 16), (8, 24), (16, 40)]
    params = tuple(ParamSpec(f"blocks.{i}.m{j}.weight", shapes[(i + j) % 4], "float32", f"blocks.{i}.m{j}")
                   for i in range(5) for j in range(1 + i % 4))
    # block 5: six equal matrices, one per owner: an aligned group
    params += tuple(ParamSpec(f"blocks.5.m{j}.weight", (16, 16), "float32", f"blocks.5.m{j}")
                    for j in range(6))
    for coalesce in (0, 6000):
        layout = RunLayout(mode=f"dmuon-{'hsdp-' if mesh[0] > 1 else ''}{'z3' if z3 else 'z2'}",
                           replicate_size=mesh[0], shard_size=mesh[1], params=params,
                           muon_names=tuple(p.name for p in params), reshard_after_forward=z3,
                           dmuon_rest="replicate", dmuon_coalesce_bytes=coalesce,
                           mp_param_dtype=mp)
        assert any(b.aligned for b in layout_buckets(layout)) == (coalesce > 0)
        for depth in (0, 1, 2):
            got = [(m.rank, m.held_bytes, m.non_held_bytes, m.window_bytes, m.window_units,
                    m.grads_held_bytes, m.grads_bytes) for m in predict_memory(layout, depth)]
            assert got == _direct_bounds(layout, depth)
