"""DCP resume across a change of layout, for each composition on torchtitan's dim names
(``dcp_layout_tasks.py``): saved with ``get_state_dict`` + ``dcp.save`` on one mesh, loaded with
``dcp.load`` + ``set_state_dict`` by a fresh run (seeded otherwise) on another.

Every case checks that what was saved is what loads, bit for bit: every param's full value, and
every momentum buffer (full shape; an expert stack's per EP index) on whichever ranks hold it
under the new layout (its owners differ: TP matrices have one Newton–Schulz rank, matrices
replicated over "tp" one owner per "tp" column). Then the next step:

- where the layout change keeps the arithmetic, it equals the uninterrupted run's bit for bit:
  ``dp_shard 2 x tp 2 -> dp_replicate 2 x dp_shard 1 x tp 2`` keeps each TP column's matmuls and
  averages the same 2 data-parallel grads (a sum of two fp32 values is the same in either order
  and halving it is exact), only over the replicate dim instead of the shard dim;
- elsewhere the data-parallel sums or the TP matmuls run in another order, and the step lands
  within the bound of the single-process oracle's noise floor at that step (``noise_floor.py``:
  the oracle against its nudged runs). The control: a load that leaves out the optimizer's state
  (Muon's momentum and AdamW's moments restart from zero) lands beyond it.

``dp_shard x cp <-> dp_shard`` is in ``parity/test_dmuon_cp.py``; EP degree changes (EP 2 -> 4,
EP 4 -> HSDP x EP 2) in ``ep/test_dmuon_ep.py``.
"""

import pytest
import torch

from tests.distributed import noise_floor as NF
from tests.distributed.api import dcp_layout_tasks as D
from tests.distributed.parity import tp_tasks as T

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def dense_oracle():
    """(init, the dense oracle's params after 2 steps, its noise floor at step 2: the nudged runs
    and the oracle fed the batch as 2 micro-batches, Frobenius). Measured on a 2-core AMD EPYC:
    floor 10 % (ulp- on blocks.1.mix), the resumes 2e-6 to 5e-6, the control's worst param 78 %."""
    init = T.make_model().state_dict()
    ref = NF.floored(lambda nudge: NF.final_only(init, T.oracle(2, nudge=nudge)),
                     {"2 micro-batches": lambda: NF.final_only(init, T.oracle(2, micro_batches=2))},
                     norm="fro")
    return init, ref["final"], ref["floors"][0]


def _holders(results: list[dict]) -> dict[str, list[torch.Tensor]]:
    """name -> every momentum buffer the ranks hold of it."""
    out: dict[str, list[torch.Tensor]] = {}
    for r in results:
        for n, t in r["state"]["momenta"].items():
            out.setdefault(n, []).append(t)
    return out


def _assert_dense_state_moved(saved: list[dict], loaded: list[dict]) -> None:
    want = saved[0]["state"]["params"]
    for rank, r in enumerate(loaded):
        assert r["state"]["params"].keys() == want.keys()
        assert all(torch.equal(r["state"]["params"][n], t) for n, t in want.items()), rank
    before, after = _holders(saved), _holders(loaded)
    assert before.keys() == after.keys() and len(after) == len(T.targets(T.make_model())), sorted(after)
    for n, bufs in {**before, **after}.items():  # every holder, old and new, the same buffer
        assert all(torch.equal(b, before[n][0]) for b in bufs + after[n]), n


def _save(pool, layout: str, path: str) -> list[dict]:
    """Save after step 1 of 2 on ``layout``; its ``final``: the uninterrupted run."""
    return pool.run_with_timeout(TIMEOUT_S, D.dense_run, layout, path, 0, 2, 1)


def _load(pool, layout: str, path: str, plant=None) -> list[dict]:
    """Resume step 2 on ``layout`` from ``path``."""
    return pool.run_with_timeout(TIMEOUT_S, D.dense_run, layout, path, 1, 2, None, plant)


@pytest.fixture(scope="module")
def saved_tp(pool4, tmp_path_factory):
    """(path, the ranks' results) of a save on dp_shard 2 x tp 2, which three tests load."""
    path = str(tmp_path_factory.mktemp("dp_shard2xtp2") / "ckpt")
    return path, _save(pool4, "dp_shard2xtp2", path)


@pytest.mark.parametrize("saved, loaded", [
    ("dp_shard2xtp2", "dp_shard4"),
    pytest.param("dp_replicate2xdp_shard2", "dp_shard4", marks=pytest.mark.slow),  # HSDP resumes: test_checkpoint.py
    pytest.param("dp_shard4", "dp_replicate2xdp_shard2", marks=pytest.mark.slow),
    pytest.param("dp_shard4", "dp_replicate2xdp_shard1xtp2", marks=pytest.mark.slow),
])
def test_dense_resume_lands_on_the_oracle(pool4, dense_oracle, saved_tp, tmp_path, saved, loaded):
    """dp_shard x tp -> dp_shard (TP 2 -> 1, dp_shard 2 -> 4), HSDP -> dp_shard, and back."""
    init, ref, floor = dense_oracle
    if saved == "dp_shard2xtp2":
        path, before = saved_tp
    else:
        path = str(tmp_path / "ckpt")
        before = _save(pool4, saved, path)
    after = _load(pool4, loaded, path)
    _assert_dense_state_moved(before, after)
    NF.assert_within(NF.distances(after[0]["final"], ref, init, norm="fro"), floor,
                     f"{saved} -> {loaded}")


def test_dense_resume_that_keeps_the_arithmetic_is_bit_identical(pool4, saved_tp):
    """dp_shard 2 x tp 2 -> dp_replicate 2 x dp_shard 1 x tp 2 (module docstring)."""
    path, before = saved_tp
    after = _load(pool4, "dp_replicate2xdp_shard1xtp2", path)
    _assert_dense_state_moved(before, after)
    for r in after:
        assert all(torch.equal(r["final"][n], t) for n, t in before[0]["final"].items())


def test_control_resume_without_the_optimizer_state_misses_the_oracle(pool4, dense_oracle, saved_tp):
    init, ref, floor = dense_oracle
    after = _load(pool4, "dp_shard4", saved_tp[0], "no-optim")
    errs = NF.distances(after[0]["final"], ref, init, norm="fro")
    NF.assert_beyond({"worst param": max(errs.values())}, floor, "resumed without the optimizer state")


# ------------------------------------------------------------------ TP x EP (Qwen3-MoE)
@pytest.fixture(scope="module")
def moe_oracle():
    """The single-process Qwen3-MoE oracle of 2 data-parallel batches (q / k norms frozen, as
    every layout here runs it), 2 steps, with its floor after each."""
    pytest.importorskip("transformers")
    from tests.distributed.ep import dmuon_ep_tasks as E

    ref = E.oracle(2, 2, None, frozen_qk_norms=True)
    nudged = {nudge: E.oracle(2, 2, nudge, frozen_qk_norms=True) for nudge in NF.NUDGES}
    ref["floors"] = NF.floors(ref, nudged, part=_router_part, norm="fro")
    return ref


def _router_part(name: str, t: torch.Tensor) -> torch.Tensor:
    """A router without its mean over the experts, which no routing sees
    (``hf_tasks.routing_part``); other params as they are."""
    return t - t.mean(dim=0, keepdim=True) if name.endswith(".mlp.router") else t


def _stack(name: str) -> bool:
    from examples.ep_moe import EXPERT_STACKS

    return name.rpartition(".")[2] in EXPERT_STACKS


def _part(r: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s part that rank result ``r`` holds: its EP index's experts of a stack."""
    if not _stack(name):
        return t
    k = t.shape[0] // r["ep"]
    return t[r["ep_rank"] * k:(r["ep_rank"] + 1) * k]


@pytest.mark.parametrize("saved, loaded", [
    ("dp_shard1xep2xtp2", "dp_shard1xep2"),
    pytest.param("dp_shard1xep2", "dp_shard1xep2xtp2", marks=pytest.mark.slow),
])
def test_tp_x_ep_resume_lands_on_the_oracle(pool4, pool2, moe_oracle, tmp_path, saved, loaded):
    """TP x EP (attention on "tp", experts on "ep") -> EP alone, and back: the saved params and
    momenta load bit for bit (per EP index), and step 2 lands within the oracle's step-2 bound."""
    pools = {"dp_shard1xep2xtp2": pool4, "dp_shard1xep2": pool2}
    path = str(tmp_path / "ckpt")
    before = pools[saved].run_with_timeout(TIMEOUT_S, D.moe_run, saved, path, 0, 2, 1)
    after = pools[loaded].run_with_timeout(TIMEOUT_S, D.moe_run, loaded, path, 1, 2)
    by_ep = {r["ep_rank"]: r for r in before}
    saved_m: dict[tuple[str, int], list[torch.Tensor]] = {}
    for r in before:
        for n, t in r["state"]["momenta"].items():
            saved_m.setdefault((n, r["ep_rank"] if _stack(n) else 0), []).append(t)
    loaded_m: dict[tuple[str, int], list[torch.Tensor]] = {}
    for r in after:
        want = by_ep[r["ep_rank"]]["state"]["params"]
        assert r["state"]["params"].keys() == want.keys()
        assert all(torch.equal(r["state"]["params"][n], t) for n, t in want.items()), r["ep_rank"]
        for n, t in r["state"]["momenta"].items():
            loaded_m.setdefault((n, r["ep_rank"] if _stack(n) else 0), []).append(t)
    assert saved_m.keys() == loaded_m.keys() and saved_m, sorted(saved_m)
    for key, bufs in loaded_m.items():
        assert all(torch.equal(b, saved_m[key][0]) for b in bufs + saved_m[key]), key
    dist = {}
    for rank, r in enumerate(after):
        for n, got in r["final"].items():
            want, init = (_part(r, n, moe_oracle[k][n]) for k in ("final", "init"))
            dist[f"rank {rank}: {n}"] = NF.distance(*(_router_part(n, t) for t in (got, want, init)),
                                                    norm="fro")
    NF.assert_within(dist, moe_oracle["floors"][1], f"{saved} -> {loaded}")
