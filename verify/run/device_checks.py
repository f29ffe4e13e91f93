"""``make gpu-check``'s in-process checks, in a live one-rank group (NCCL on the GPU; gloo on
CPU in the tests): DMuon in each mode against ``torch.optim.Muon`` + ``AdamW``, on the same
device and against the CPU; no host-device synchronisation inside a steady-state step; the
peak device memory per mode; the stream order of DMuon's side streams, with a negative control.

Every mode is built by ``verify.modes.build.build`` and released by
:class:`verify.run.groups.ModeScope` (its ``DedicatedParams`` closed, its groups destroyed),
also when a check raised inside it.

What a check does not see is said where it is defined. Only the CUDA parts need a GPU; the
tests run the rest on CPU (``tests/run/test_gpu_check.py``,
``tests/distributed/phase_d/test_gpu_check_w1.py``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: The DMuon modes a single process can run (``verify.traffic.formulas.MODES`` minus HSDP).
MODES = ("dmuon-ddp", "dmuon-z2", "dmuon-z3")
#: Training steps of the parity part.
PARITY_STEPS = 3
#: Parity bound against torch's optimizers on the same device: max |DMuon - oracle| over each
#: param, relative to the oracle's displacement max |p_T - p_0|. At W = 1 the reduce is an
#: identity and the division is by 1, so the math is the oracle's op for op and on CPU/gloo
#: the runs are bit-identical (tested). On a GPU, cuBLAS may pick other kernels for DMuon's and
#: FSDP2's differently allocated buffers; a one-ulp difference can flip a bf16 rounding in
#: Newton–Schulz, which the 10-step multi-rank parity tests measure at 3-11% on CPU
#: (tests/distributed/parity/test_dmuon_parity.py). 3 steps: 5% is generous for that and far
#: below a wrong update (order 100%).
PARITY_RTOL = 0.05
#: CUDA against CPU: DMuon on the GPU against the oracle on the CPU. Two devices' bf16
#: Newton–Schulz differ in summation order in every matmul; the bound is twice the same-device
#: one and still an order below a wrong update. torch's own CUDA-vs-CPU difference
#: (``oracle_cuda_vs_cpu``) is reported beside it to show the devices' own spread. Not yet
#: calibrated on a GPU.
CPU_PARITY_RTOL = 0.10
#: Steps under ``torch.cuda.set_sync_debug_mode("error")`` after one free step (lazy init and
#: DMuon's setup agreement, which reads digests back to the host by design).
SYNC_STEPS = 2
#: What the stream check builds: DMuon handling every param (no DDP / FSDP2 streams in the
#: way) and one unit per block, so that Z3 re-broadcasts a unit in backward.
STREAM_BUILD = {"rest": "replicate", "coalesce": "block"}
#: Steps of each stream-check run (the first forward issues the first broadcasts).
STREAM_STEPS = 2
#: Text by which torch's CUDA sanitizer (``torch.cuda._sanitizer``) reports a race.
CSAN_MARK = "CSAN detected a possible data race"


def loss_of(model, x, y):
    """Next-token cross-entropy of ``model(x)`` against ``y`` (int64 ``[batch, seq]``)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def step(model, optimizer, x, y) -> None:
    """One training step that reads nothing back to the host (no ``loss.item()``)."""
    import dmuon

    with dmuon.phase("forward"):
        loss = loss_of(model, x, y)
    with dmuon.phase("backward"):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def workload(device: str, steps: int):
    """``(make_model, batches)``: the small TinyGPT (seeded) and ``steps`` byte-corpus batches
    ``(x, y)`` on ``device``."""
    from verify.workload.data import ByteCorpus
    from verify.workload.model import GPTConfig, TinyGPT

    config = GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4)

    def make_model():
        torch.manual_seed(0)
        return TinyGPT(config)

    corpus = ByteCorpus.from_stdlib(200_000)
    batches = [tuple(t.to(device) for t in corpus.global_batch(s, 4, config.seq_len))
               for s in range(steps)]
    return make_model, batches


def oracle(make_model, batches, device: str) -> dict[str, torch.Tensor]:
    """The params after ``batches`` under ``torch.optim.Muon`` (DMuon's targets) and
    single-tensor ``AdamW`` (the rest) in one plain process on ``device``."""
    from verify.modes.build import ADAMW_LR, MUON_LR, muon_names

    model = make_model().to(device)
    targets = set(muon_names(model))
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in named if n in targets], lr=MUON_LR)
    # foreach=False: the single-tensor path, the one DMuon's AdamW group runs
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in targets], lr=ADAMW_LR,
                              foreach=False)
    for x, y in batches:
        loss_of(model, x, y).backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
            init: dict[str, torch.Tensor]) -> float:
    """max over params of max |got - ref| / max |ref - init| (on ``ref``'s device)."""
    worst = 0.0
    for name, r in ref.items():
        disp = max((r - init[name].to(r.device)).abs().max().item(), 1e-12)
        worst = max(worst, (got[name].to(r.device) - r).abs().max().item() / disp)
    return worst


@contextlib.contextmanager
def released(mode: str, make_model, device: str, **build_kw) -> Iterator:
    """``verify.modes.build.build(mode, ...)`` inside a :class:`verify.run.groups.ModeScope`,
    released on exit (also after an exception)."""
    from verify.run.groups import ModeScope
    from verify.modes.build import build

    scope = ModeScope()
    try:
        built = build(mode, make_model, device, **build_kw)
        if built.dedicated is not None:
            scope.adopt(built.dedicated)
        yield built
    finally:
        scope.close()


def _full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().clone()
    return out


def parity_in_group(device: str, steps: int = PARITY_STEPS, modes: Sequence[str] = MODES,
                    memory: Callable[[], dict] | None = None) -> dict:
    """DMuon in each of ``modes`` against the single-process oracle, in a live 1-rank group.

    Args:
        device: ``"cuda"`` (NCCL group) or ``"cpu"`` (gloo group, the CPU test).
        steps: training steps.
        modes: DMuon modes of ``verify.modes.build``.
        memory: on CUDA :func:`cuda_memory` (a mode's figures, read after its steps and reset
            before); ``None`` records none.

    Returns:
        ``{mode: {"rel_err", "bit_identical", "pass", "rel_err_cpu", "pass_cpu", "memory"}}``:
        the worst max |DMuon - oracle| / max |oracle - init| over all params against the
        oracle on ``device`` and against the oracle on the CPU (``None`` when ``device`` is
        the CPU: the same comparison); plus ``"oracle_cuda_vs_cpu"`` (torch's own spread,
        ``None`` on CPU).

    Raises:
        ValueError: the default group does not have exactly one rank.
    """
    if dist.get_world_size() != 1:
        raise ValueError(f"Invalid world_size={dist.get_world_size()}. Must be 1 (the parity "
                         "part compares one process against the single-process oracle).")
    make_model, batches = workload(device, steps)
    init = {n: p.detach().to(device) for n, p in make_model().named_parameters()}
    ref = oracle(make_model, batches, device)
    on_cpu = device == "cpu"
    ref_cpu = None if on_cpu else oracle(make_model, [(x.cpu(), y.cpu()) for x, y in batches], "cpu")
    init_cpu = {n: t.cpu() for n, t in init.items()}
    out: dict = {"oracle_cuda_vs_cpu": None if on_cpu else rel_err(ref, ref_cpu, init_cpu)}
    for mode in modes:
        if memory is not None:
            memory(reset=True)
        with released(mode, make_model, device) as built:
            for x, y in batches:
                step(built.model, built.optimizer, x, y)
            got = _full_params(built.model)
            used = memory() if memory is not None else None
        worst = rel_err(got, ref, init)
        cpu = None if on_cpu else rel_err(got, ref_cpu, init_cpu)
        out[mode] = {"rel_err": worst, "pass": worst <= PARITY_RTOL,
                     "bit_identical": all(torch.equal(got[n], r) for n, r in ref.items()),
                     "rel_err_cpu": cpu, "pass_cpu": None if cpu is None else cpu <= CPU_PARITY_RTOL,
                     "memory": used}
    return out


def cuda_memory(reset: bool = False) -> dict | None:
    """``reset``: ``torch.cuda.reset_peak_memory_stats()`` and ``None``; else
    ``{"max_allocated_bytes", "allocated_bytes"}`` of device 0 since the reset (bytes)."""
    if reset:
        torch.cuda.reset_peak_memory_stats()
        return None
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "allocated_bytes": torch.cuda.memory_allocated()}


@contextlib.contextmanager
def cuda_sync_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block: every synchronising CUDA
    call (a device-to-host copy, ``.item()``, a stream or device synchronize) raises
    ``RuntimeError`` from where it was made. The mode is process-wide, so autograd's device
    thread is covered too. Put back to the previous mode on exit."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def where_raised(exc: BaseException) -> str:
    """``Type: message`` (first line) at the innermost frame of this project or, without one,
    the innermost frame: ``path:line in function``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if any(part in f.filename for part in ("/dmuon/", "/verify/", "/tracer/"))]
    at = (ours or frames)[-1] if frames else None
    first = (str(exc).strip().splitlines() or [""])[0]
    spot = f" at {at.filename}:{at.lineno} in {at.name}" if at else ""
    return f"{type(exc).__name__}: {first}{spot}"


def sync_in_group(device: str, modes: Sequence[str] = MODES,
                  guard: Callable[[], contextlib.AbstractContextManager] = cuda_sync_errors,
                  steps: int = SYNC_STEPS) -> dict:
    """Each mode: one free step, then ``steps`` steps inside ``guard()`` (on CUDA
    :func:`cuda_sync_errors`). Returns ``{mode: {"pass", "error"}}``: ``error`` is
    :func:`where_raised` of what the guard raised (``None`` when nothing did).

    Covers forward, backward, ``optimizer.step()`` and ``zero_grad()`` of a steady-state step
    with the batches already on the device; not the first step, not the data loading, not
    ``close()``.
    """
    make_model, batches = workload(device, 1 + steps)
    out = {}
    for mode in modes:
        error = None
        with released(mode, make_model, device) as built:
            step(built.model, built.optimizer, *batches[0])
            try:
                with guard():
                    for x, y in batches[1:]:
                        step(built.model, built.optimizer, x, y)
            except Exception as exc:  # noqa: BLE001 - the finding itself
                error = where_raised(exc)
        out[mode] = {"pass": error is None, "error": error}
    return out


class _NoWait:
    def wait_event(self, event) -> None:  # the compute stream goes on without DMuon's event
        pass


@contextlib.contextmanager
def skip_event_waits() -> Iterator[list]:
    """The negative control's planted bug: ``Pending.wait()`` (``dmuon.runtime.collectives``)
    no longer makes the current stream wait for the event recorded after a collective on
    DMuon's side stream, so the compute stream reads the buffer the collective writes without
    ordering. Yields the list of skipped waits (one entry per skipped event).

    Raises:
        AttributeError: ``Pending`` no longer has the ``_event`` / ``_wait_stream`` slots this
            patches (the control then fails loudly instead of passing by accident).
    """
    from dmuon.runtime.collectives import Pending

    for slot in ("_event", "_wait_stream"):
        if slot not in Pending.__slots__:
            raise AttributeError(f"dmuon.runtime.collectives.Pending has no slot {slot!r}: the "
                                 "stream check's negative control must follow its rename.")
    original = Pending.wait
    skipped: list = []

    def wait_without_event(self) -> None:
        if self._event is not None:
            skipped.append(self._event)
            self._wait_stream = _NoWait
        original(self)

    Pending.wait = wait_without_event
    try:
        yield skipped
    finally:
        Pending.wait = original


@contextlib.contextmanager
def cuda_race_detector() -> Iterator[None]:
    """torch's CUDA sanitizer (CSAN, ``torch.cuda._sanitizer``) for the block: every kernel's
    tensor reads and writes with its stream, against the events recorded and waited; an access
    not ordered after a conflicting one on another stream raises ``CUDASanitizerErrors``
    (text :data:`CSAN_MARK`). Importing the module registers its CUDA trace callbacks for the
    rest of the process, so the stream check runs last."""
    from torch.cuda._sanitizer import cuda_sanitizer

    cuda_sanitizer.enable()
    try:
        yield
    finally:
        cuda_sanitizer.disable()


def _is_race(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        if type(seen).__name__ == "CUDASanitizerErrors" or CSAN_MARK in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def streams_in_group(device: str, modes: Sequence[str] = ("dmuon-z2", "dmuon-z3"),
                     detector: Callable[[], contextlib.AbstractContextManager] = cuda_race_detector,
                     steps: int = STREAM_STEPS) -> dict:
    """The stream-order check: each mode built with :data:`STREAM_BUILD`, ``steps`` steps
    inside ``detector()``, first as DMuon is (no race may be found), then with
    :func:`skip_event_waits` (the negative control: a race must be found, else the detector
    does not see DMuon's streams and the check proves nothing).

    Returns:
        ``{mode: {"clean": {"race", "error", "waits_skipped"}, "control": {...}}}``; ``race``
        whether the detector reported one, ``error`` :func:`where_raised` of what raised
        (``None``: nothing), ``waits_skipped`` the events the control skipped (0 in ``clean``).
        :func:`stream_problems` judges it.
    """
    make_model, batches = workload(device, steps)
    out = {}
    for mode in modes:
        runs = {}
        for run, planted in (("clean", contextlib.nullcontext([])), ("control", skip_event_waits())):
            race, error, skipped = False, None, []
            try:
                with planted as skipped, released(mode, make_model, device, **STREAM_BUILD) as built:
                    with detector():
                        for x, y in batches:
                            step(built.model, built.optimizer, x, y)
            except Exception as exc:  # noqa: BLE001 - a race is the control's expected outcome
                race, error = _is_race(exc), where_raised(exc)
            runs[run] = {"race": race, "error": error, "waits_skipped": len(skipped)}
        out[mode] = runs
    return out


def stream_problems(result: dict) -> list[str]:
    """Why a :func:`streams_in_group` result fails (empty: it passes): a race or an error in
    the clean run; in the control, no race found (or no event skipped: nothing was planted)."""
    problems = []
    for mode, runs in result.items():
        clean, control = runs["clean"], runs["control"]
        if clean["error"] is not None:
            kind = "race between DMuon's streams" if clean["race"] else "error"
            problems.append(f"streams {mode}: {kind}: {clean['error']}")
        if control["waits_skipped"] == 0:
            problems.append(f"streams {mode}: negative control planted nothing (no event wait "
                            f"skipped{': ' + control['error'] if control['error'] else ''})")
        elif not control["race"]:
            why = f" (it raised {control['error']})" if control["error"] else ""
            problems.append(f"streams {mode}: negative control not detected: "
                            f"{control['waits_skipped']} event waits skipped and no race "
                            f"reported{why}")
    return problems
