"""The interposer sees every collective, once, on real multi-process gloo runs.

Two independent C++-side counters check it: gloo's per-process-group sequence number
(``ProcessGroup._get_sequence_number_for_group``, bumped once per collective the backend runs)
and, for the plain calls, PyTorch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``,
``_dump_fr_trace_json``), which also gives each call's input sizes.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dmuon import annotate
from tests.distributed.harness import DistributedPool
from tracer.interposer import Interposer
from tracer.timeline import write_chrome_trace

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::FutureWarning")]


# ----------------------------------------------------------------------------- helpers
def _seq_numbers() -> dict[str, int]:
    """gloo's own per-group collective counter, keyed like CollectiveEvent.group_id."""
    from torch.distributed.distributed_c10d import _world

    out = {}
    for pg in _world.pg_map:
        gid = ",".join(map(str, sorted(dist.get_process_group_ranks(pg))))
        out[gid] = out.get(gid, 0) + pg._get_sequence_number_for_group()
    return out


def _calls_per_group(events) -> Counter:
    """Logical calls per group: coalesced events of one call share their times."""
    return Counter(g for g, _, _ in {(e.group_id, e.t_start_ns, e.t_end_ns) for e in events})


def _backend_calls(before: dict[str, int], after: dict[str, int]) -> Counter:
    return Counter({g: n - before.get(g, 0) for g, n in after.items() if n - before.get(g, 0)})


def _brief(events):
    return [(e.op, e.count, e.dtype, e.root, e.group_id, e.seq, e.phase) for e in events]


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


# ----------------------------------------------------------- plain torch.distributed calls
def _plain_calls_task():
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    fr_before = len(json.loads(torch._C._distributed_c10d._dump_fr_trace_json()).get("entries", []))
    seq_before = _seq_numbers()
    with Interposer() as ip, annotate.phase("forward"):
        dist.all_reduce(torch.ones(3))
        dist.all_reduce(torch.ones(3, dtype=torch.bfloat16), async_op=True).wait()
        dist.reduce(torch.ones(5), dst=1)
        dist.broadcast(torch.ones(6, dtype=torch.float64), src=1)
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), async_op=True).wait()
        dist.all_gather([torch.empty(2, 2), torch.empty(2, 2)], torch.ones(2, 2))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6))
        dist.all_to_all_single(torch.empty(4, 3), torch.ones(4, 3))
        dist.all_to_all_single(torch.empty(3), torch.ones(3), [2 - rank, 1 + rank],
                               [2 - rank, 1 + rank])
        if rank == 0:
            dist.send(torch.ones(7), dst=1)
            dist.irecv(torch.empty(2), src=1).wait()
        else:
            dist.recv(torch.empty(7), src=0)
            dist.isend(torch.ones(2), dst=0).wait()
        ops = [dist.P2POp(dist.isend, torch.ones(9), peer),
               dist.P2POp(dist.irecv, torch.empty(9), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
            dist.all_gather_into_tensor(torch.empty(6), torch.ones(3))
        cm.wait()
        dist.barrier()
    fr = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())["entries"][fr_before:]
    fr_inputs = [[math.prod(s) for s in e["input_sizes"]] for e in fr]
    return ip.events, _backend_calls(seq_before, _seq_numbers()), fr_inputs


def _fr_view(event) -> int | None:
    """Input elements the Flight Recorder logs for one interposer event on gloo."""
    if event.op == "barrier":
        return None
    if event.op in ("reduce_scatter", "all_to_all"):  # FR logs the full input
        return event.count * event.group_size if event.count is not None else 3
    return event.count


@pytest.fixture(scope="module")
def fr_pool2():
    """A 2-rank pool with the Flight Recorder on (it must be set before the PG exists)."""
    with DistributedPool(2, timeout_s=120, env={"TORCH_FR_BUFFER_SIZE": "2000"}) as pool:
        yield pool


def test_plain_calls_recorded_once_with_nccl_counts(fr_pool2):
    results = fr_pool2.run(_plain_calls_task)
    expected_common = [
        ("all_reduce", 3, "float32", None),
        ("all_reduce", 3, "bfloat16", None),
        ("reduce", 5, "float32", 1),
        ("broadcast", 6, "float64", 1),
        ("all_gather", 4, "float32", None),
        ("all_gather", 4, "float32", None),
        ("all_gather", 4, "float32", None),
        ("reduce_scatter", 3, "float32", None),  # recvcount = 6 / 2
        ("all_to_all", 6, "float32", None),  # per peer = 12 / 2
        ("all_to_all", None, "float32", None),  # uneven splits
    ]
    p2p = {
        0: [("send", 7, "float32", 1), ("recv", 2, "float32", 1)],
        1: [("recv", 7, "float32", 0), ("send", 2, "float32", 0)],
    }
    for rank, (events, backend_calls, fr_inputs) in enumerate(results):
        peer = 1 - rank
        expected = expected_common + p2p[rank] + [
            ("send", 9, "float32", peer),
            ("recv", 9, "float32", peer),
            ("all_gather", 4, "float32", None),  # coalesced: one event per tensor
            ("all_gather", 3, "float32", None),
            ("barrier", None, None, None),
        ]
        assert [(e.op, e.count, e.dtype, e.root) for e in events] == expected
        assert [e.seq for e in events] == list(range(len(expected)))
        assert {(e.rank, e.group_id, e.group_size, e.group_rank, e.phase) for e in events} == {
            (rank, "0,1", 2, rank, "forward")
        }
        assert events[0].msg_bytes == 12 and events[1].msg_bytes == 6
        # all_to_all totals: 4x3 even; splits [2, 1] / [1, 2] give 3 in and 3 out, odd over 2
        assert [(e.in_elems, e.out_elems) for e in events[8:10]] == [(12, 12), (3, 3)]
        assert {(e.in_elems, e.out_elems) for e in events if e.op != "all_to_all"} == {(None, None)}
        assert "in_splits=[2, 1] out_splits=[2, 1]" in events[9].source_ref or \
            "in_splits=[1, 2] out_splits=[1, 2]" in events[9].source_ref
        assert events[3].source_ref == f"interposer:rank{rank}:#3"
        assert all(e.t_start_ns <= e.t_end_ns for e in events)
        # Independent counters: gloo ran exactly the logical calls recorded, no more, no less.
        assert backend_calls == _calls_per_group(events)
        # Flight Recorder: same calls, same input sizes (a coalesced call is one entry; FR on
        # gloo does not record send / recv).
        views = [_fr_view(e) for e in events if e.op not in ("send", "recv")]
        grouped = views[:-3] + [views[-3:-1], views[-1]]
        fr_flat = [x[0] if len(x) == 1 else (x or None) for x in fr_inputs]
        assert fr_flat == grouped


# ------------------------------------------------------------------------------------ DDP
def _ddp_task(use_interposer: bool, bucket_cap_mb: float):
    model = _mlp()
    seq_before = _seq_numbers()
    ip = Interposer()
    with ip if use_interposer else _null():
        with annotate.phase("setup"):
            ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            torch.manual_seed(100 + dist.get_rank() + step)
            with annotate.phase(f"forward/{step}"):
                loss = ddp(torch.randn(5, 4)).square().sum()
            with annotate.phase(f"backward/{step}"):
                loss.backward()
            with annotate.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    return ip.events, _backend_calls(seq_before, _seq_numbers()), params


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("bucket_cap_mb", [25, 1e-4])
def test_ddp_reducer_all_reduce_is_seen(pool2, bucket_cap_mb):
    """DDP's C++ Reducer issues the gradient all-reduce: the dispatch mode sees it."""
    n_params = sum(p.numel() for p in _mlp().parameters())  # 32 + 8 + 24 + 3 = 67
    results = pool2.run(_ddp_task, True, bucket_cap_mb)
    for events, backend_calls, _ in results:
        assert backend_calls == _calls_per_group(events)
        for step in range(2):
            backward = [e for e in events if e.phase == f"backward/{step}"]
            assert {e.op for e in backward} == {"all_reduce"}
            assert sum(e.count for e in backward) == n_params
            # Step 0 uses DDP's first bucket (1 MiB cap): one bucket. Buckets are rebuilt in
            # the forward of step 1 from the gradient-ready order and the real cap.
            n_buckets = 1 if step == 0 or bucket_cap_mb == 25 else 2
            assert len(backward) == n_buckets
        setup_ops = Counter(e.op for e in events if e.phase == "setup")
        assert setup_ops["broadcast"] >= 1  # module state sync from rank 0
        # The bucket rebuild broadcasts rank 0's bucket layout (int32) in step 1's forward.
        assert not [e for e in events if e.phase == "forward/0"]
        rebuild = [e for e in events if e.phase == "forward/1"]
        assert rebuild and {(e.op, e.dtype, e.root) for e in rebuild} == {
            ("broadcast", "int32", 0)
        }
        assert not [e for e in events if e.phase == "optimizer"]


def test_ddp_results_bit_identical_with_and_without_interposer(pool2):
    with_ip = pool2.run(_ddp_task, True, 25)
    without = pool2.run(_ddp_task, False, 25)
    for (_, _, a), (_, _, b) in zip(with_ip, without, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------- FSDP2 / HSDP
def _shard_numel(module: torch.nn.Module, n: int) -> int:
    """FSDP2's per-rank all-gather count: dim-0 padded to a multiple of n, per parameter."""
    return sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0])
               for p in module.parameters())


def _fsdp_task(use_interposer: bool, hsdp: bool):
    model = _mlp()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    seq_before = _seq_numbers()
    ip = Interposer()
    with ip if use_interposer else _null():
        torch.manual_seed(7 + dist.get_rank())
        with annotate.phase("forward"):
            loss = model(torch.randn(3, 4)).square().sum()
        with annotate.phase("backward"):
            loss.backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    return ip.events, _backend_calls(seq_before, _seq_numbers()), grads


def test_fsdp2_all_gather_and_reduce_scatter(pool2):
    model = _mlp()
    c0, c2 = _shard_numel(model[0], 2), _shard_numel(model[2], 2)  # 20, 18 (3 rows -> 2 + pad)
    results = pool2.run(_fsdp_task, True, False)
    for events, backend_calls, _ in results:
        assert backend_calls == _calls_per_group(events)
        assert [(e.op, e.count, e.phase, e.group_id) for e in events] == [
            ("all_gather", c0, "forward", "0,1"),
            ("all_gather", c2, "forward", "0,1"),
            ("all_gather", c2, "backward", "0,1"),  # resharded after forward: gather again
            ("all_gather", c0, "backward", "0,1"),
            ("reduce_scatter", c2, "backward", "0,1"),
            ("reduce_scatter", c0, "backward", "0,1"),
        ]
    plain = pool2.run(_fsdp_task, False, False)
    for (_, _, a), (_, _, b) in zip(results, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_hsdp_replicate_all_reduce_on_2d_mesh(pool4):
    model = _mlp()
    c0, c2 = _shard_numel(model[0], 2), _shard_numel(model[2], 2)
    results = pool4.run(_fsdp_task, True, True)
    for rank, (events, backend_calls, _) in enumerate(results):
        shard_group = "0,1" if rank < 2 else "2,3"
        replicate_group = f"{rank % 2},{rank % 2 + 2}"
        assert backend_calls == _calls_per_group(events)
        by_group = Counter((e.op, e.group_id, e.count) for e in events)
        assert by_group == Counter({
            ("all_gather", shard_group, c0): 2, ("all_gather", shard_group, c2): 2,
            ("reduce_scatter", shard_group, c0): 1, ("reduce_scatter", shard_group, c2): 1,
            ("all_reduce", replicate_group, c0): 1, ("all_reduce", replicate_group, c2): 1,
        })
        replicate = [e for e in events if e.group_id == replicate_group]
        assert [e.seq for e in replicate] == [0, 1]
        assert {(e.group_size, e.group_rank) for e in replicate} == {(2, rank // 2)}


# ------------------------------------------------------------ DTensor / functional collectives
def _functional_task():
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    dt = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])
    seq_before = _seq_numbers()
    with Interposer() as ip:
        full = dt.full_tensor()
        rep = dt.redistribute(mesh, [Replicate()]).to_local()
        ar = funcol.all_reduce(torch.full((5,), float(rank)), "sum", mesh)
        rs = funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, mesh)
        bc = funcol.broadcast(torch.full((3,), float(rank)), 1, mesh)
        values = [funcol.wait_tensor(t) for t in (ar, rs, bc)]
        ag_c = funcol.all_gather_into_tensor_coalesced([torch.ones(4), torch.ones(2)], mesh)
        rs_c = funcol.reduce_scatter_tensor_coalesced([torch.ones(4), torch.ones(6)],
                                                      "sum", [0, 0], mesh)
        values += [funcol.wait_tensor(t) for t in (*ag_c, *rs_c)]
    return ip.events, _backend_calls(seq_before, _seq_numbers()), full, rep, values


def test_dtensor_and_functional_collectives(pool2):
    for events, backend_calls, full, rep, values in pool2.run(_functional_task):
        assert torch.equal(full, torch.arange(24.0).reshape(6, 4)) and torch.equal(rep, full)
        assert values[0].tolist() == [1.0] * 5 and values[2].tolist() == [1.0] * 3
        assert [(e.op, e.count, e.root) for e in events] == [
            ("all_gather", 12, None),  # full_tensor(): 3 x 4 shard per rank
            ("all_gather", 12, None),  # redistribute Shard(0) -> Replicate
            ("all_reduce", 5, None),
            ("reduce_scatter", 4, None),
            ("broadcast", 3, 1),
            ("all_gather", 4, None),  # coalesced: one event per tensor
            ("all_gather", 2, None),
            ("reduce_scatter", 2, None),
            ("reduce_scatter", 3, None),
        ]
        assert [v.numel() for v in values[3:]] == [8, 4, 2, 3]
        # The nested c10d op of each functional call is not counted a second time: gloo ran
        # 5 single calls, the coalesced all-gather as one call, and (having no coalesced
        # reduce-scatter) the coalesced reduce-scatter as one all_reduce per tensor.
        assert _calls_per_group(events) == Counter({"0,1": 7})
        assert backend_calls == Counter({"0,1": 5 + 1 + 2})


# -------------------------------------------------- attribution, state, re-entrancy, gaps
def _attribution_task():
    listeners_before = list(annotate._listeners)
    with Interposer() as outer:
        with annotate.phase("backward"), annotate.span("dmuon.reduce", module="fc1", owner=1):
            dist.all_reduce(torch.ones(2))
        with Interposer() as inner:
            dist.broadcast(torch.ones(4), src=0)
        mode_inside = type(_get_current_dispatch_mode()).__name__
    mode_after = _get_current_dispatch_mode()
    dist.all_reduce(torch.ones(2))  # after exit: not recorded
    try:
        with outer:
            pass
        reuse_error = None
    except ValueError as exc:
        reuse_error = str(exc)
    return dict(
        events=outer.events, outer=_brief(outer.events), outer_modules=[e.module for e in outer.events],
        inner=_brief(inner.events), spans=outer.spans, inner_spans=inner.spans,
        mode_inside=mode_inside, mode_after=mode_after,
        listeners_restored=annotate._listeners == listeners_before, reuse_error=reuse_error,
    )


def test_phase_module_spans_nesting_and_no_state_left(pool2):
    for rank, out in enumerate(pool2.run(_attribution_task)):
        assert out["outer"] == [
            ("all_reduce", 2, "float32", None, "0,1", 0, "backward"),
            ("broadcast", 4, "float32", 0, "0,1", 1, None),
        ]
        assert out["outer_modules"] == ["fc1", None]
        assert out["inner"] == [("broadcast", 4, "float32", 0, "0,1", 0, None)]  # once each
        assert [(s.name, s.module, s.owner, s.phase) for s in out["spans"]] == [
            ("dmuon.reduce", "fc1", 1, "backward")
        ]
        assert out["inner_spans"] == []
        assert out["mode_inside"] == "Interposer"
        assert out["mode_after"] is None and out["listeners_restored"]
        assert "Must create a new Interposer()" in out["reuse_error"]


def test_real_events_and_spans_on_a_chrome_timeline(pool2, tmp_path):
    results = pool2.run(_attribution_task)
    per_rank = {rank: (out["events"], out["spans"]) for rank, out in enumerate(results)}
    doc = json.loads(write_chrome_trace(tmp_path / "trace.json", per_rank).read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["args"]["source_ref"]) for e in complete
                  if e["cat"] == "collective") == sorted(
        (r, ev.source_ref) for r, out in enumerate(results) for ev in out["events"])
    assert [(e["pid"], e["name"]) for e in complete if e["cat"] == "dmuon"] == [
        (0, "dmuon.reduce"), (1, "dmuon.reduce")]


# ------------------------------------------------------------------- waits of async handles
def _wait_task():
    rank = dist.get_rank()
    original_wait = dist.Work.wait
    with Interposer() as ip:
        late = torch.full((4,), float(rank))
        if rank == 1:
            time.sleep(0.1)  # rank 0 is blocked in wait() until rank 1 sends
        work = dist.broadcast(late, src=1, async_op=True)
        work.wait()
        first = ip.events[-1]
        work.wait()  # a second wait keeps the first one's times
        if rank == 0:
            time.sleep(0.1)  # rank 1 is blocked in the synchronous call's own wait
        dist.broadcast(torch.ones(4), src=0)  # synchronous: c10d's own wait is timed
        polled = dist.all_reduce(torch.ones(2), async_op=True)  # never wait()ed
        fut = polled.get_future()
        fut.wait()
        while not polled.is_completed():
            time.sleep(0.001)
        patched = dist.Work.wait is not original_wait
    return dict(events=ip.events, first=first, late=late.tolist(), patched=patched,
                restored=dist.Work.wait is original_wait, reduced=fut.value()[0].tolist())


def test_wait_times_recorded_for_async_and_sync_unwaited_left_empty(pool2):
    for rank, out in enumerate(pool2.run(_wait_task)):
        bcast, sync, polled = out["events"]
        assert out["late"] == [1.0] * 4 and out["reduced"] == [2.0, 2.0]
        assert out["patched"] and out["restored"]
        assert bcast.t_end_ns <= bcast.t_wait_start_ns <= bcast.t_waited_ns
        assert bcast == out["first"]  # the second wait changed nothing
        if rank == 0:  # blocked on rank 1's 0.1 s sleep: the interval is the transfer's
            assert bcast.t_waited_ns - bcast.t_wait_start_ns > 50e6
            assert bcast.in_flight_ns > 50e6
        assert sync.op == "broadcast" and sync.t_end_ns <= sync.t_wait_start_ns <= sync.t_waited_ns
        if rank == 1:  # blocked on rank 0's sleep inside the synchronous call
            assert sync.t_waited_ns - sync.t_wait_start_ns > 50e6
        assert (polled.op, polled.t_waited_ns) == ("all_reduce", None)


def _gather_scatter_task():
    rank = dist.get_rank()
    with Interposer() as ip:
        out = [torch.empty(3), torch.empty(3)] if rank == 1 else None
        dist.gather(torch.full((3,), float(rank)), out, dst=1)
        received = torch.empty(2, dtype=torch.float64)
        chunks = [torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)] if rank == 0 else None
        dist.scatter(received, chunks, src=0)
    return [(e.op, e.count, e.dtype, e.root, e.group_size) for e in ip.events], ip.unrecorded, received


def test_gather_and_scatter_recorded_with_send_and_receive_counts(pool2):
    for rank, (events, unrecorded, received) in enumerate(pool2.run(_gather_scatter_task)):
        assert events == [("gather", 3, "float32", 1, 2), ("scatter", 2, "float64", 0, 2)]
        assert unrecorded == [] and received.tolist() == [float(rank)] * 2


def _unknown_op_task():
    import tracer.interposer as interposer_module

    handler = interposer_module._HANDLERS.pop("c10d::broadcast_")  # as if torch added an op
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Interposer() as ip:
                dist.broadcast(torch.ones(2), src=0)
                dist.broadcast(torch.ones(2), src=0)
    finally:
        interposer_module._HANDLERS["c10d::broadcast_"] = handler
    return ip.events, ip.unrecorded, [str(w.message) for w in caught
                                      if issubclass(w.category, RuntimeWarning)]


def test_an_unknown_collective_is_listed_as_unrecorded_with_one_warning(pool2):
    for events, unrecorded, messages in pool2.run(_unknown_op_task):
        assert events == []
        assert [name for name, _ in unrecorded] == ["c10d::broadcast_"] * 2
        assert len(messages) == 1 and "c10d::broadcast_" in messages[0]
        assert "unknown collective op" in messages[0]


# ------------------------------------------------------- GPU: autograd's device threads
def _ddp_cuda_thread_task():
    import threading

    model = _mlp().cuda()
    ddp = DDP(model)
    hook_threads = []
    model[0].weight.register_hook(lambda g: hook_threads.append(threading.get_ident()))
    with Interposer() as ip, annotate.phase("backward"):
        ddp(torch.randn(3, 4, device="cuda")).sum().backward()
        torch.cuda.synchronize()
    return ip.events, threading.get_ident(), hook_threads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NCCL")
def test_ddp_all_reduce_seen_from_autograd_device_thread():
    """On CUDA, autograd runs hooks (and DDP's reducer) on its device thread; the dispatch
    mode must follow it there (autograd restores the caller's thread-local state). The skipif
    above touched CUDA in this process, so the pool spawns its rank (next test)."""
    with DistributedPool(1, backend="nccl", timeout_s=120) as pool:
        [(events, caller, hook_threads)] = pool.run(_ddp_cuda_thread_task)
    assert hook_threads and hook_threads[0] != caller  # really another thread
    backward = [e for e in events if e.phase == "backward"]
    assert [e.op for e in backward] == ["all_reduce"]
    assert backward[0].count == sum(p.numel() for p in _mlp().parameters())


#: Stand-in for "this process has initialised CUDA" (set by the test below in the parent only).
_PARENT_TOUCHED_CUDA = False


def _sees_parent_cuda_state() -> bool:
    return _PARENT_TOUCHED_CUDA


def test_nccl_pools_spawn_so_a_parent_that_touched_cuda_does_not_poison_them(monkeypatch):
    """The GPU test above failed on its first GPU run with "Cannot re-initialize CUDA in forked
    subprocess": pytest's skipif called ``torch.cuda.is_available()`` (``cuInit``, torch's fork
    handler armed) and the pool forked. Stand-in, no GPU here: a module flag set in the parent
    plays the initialised CUDA state; a forked rank inherits it (what CUDA refuses), a spawned
    one does not. Fails without the fix: an NCCL pool's default start method was fork."""
    from tests.distributed.harness import start_method_for

    assert DistributedPool(1, backend="nccl").start_method == start_method_for("nccl") == "spawn"
    assert DistributedPool(1).start_method == "fork"  # gloo keeps the cheap fork
    monkeypatch.setattr(f"{__name__}._PARENT_TOUCHED_CUDA", True)
    with DistributedPool(1, start_method="fork", timeout_s=60) as pool:
        assert pool.run(_sees_parent_cuda_state) == [True]


@pytest.mark.slow  # a spawned rank imports torch afresh (~10 s); the start methods: test above
def test_a_spawned_pool_rank_does_not_inherit_the_parents_state(monkeypatch):
    """The other half of the test above: the pool really starts a spawned rank in a fresh
    interpreter, so the parent's (stand-in) CUDA state does not reach it."""
    monkeypatch.setattr(f"{__name__}._PARENT_TOUCHED_CUDA", True)
    with DistributedPool(1, start_method="spawn", timeout_s=60) as pool:
        assert pool.run(_sees_parent_cuda_state) == [False]  # a fresh interpreter
