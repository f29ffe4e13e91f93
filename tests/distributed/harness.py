"""One distributed test harness: a pool of forked ranks with a live default process group.

Forking a torch process costs ~0.1 s while starting a fresh interpreter costs 2-3 s (torch
import), so a :class:`DistributedPool` forks its ``world_size`` workers once and then runs many
tasks on them::

    with DistributedPool(4) as pool:
        sums = pool.run(all_reduce_rank)      # list of 4 results, rank order

Each worker:

- initialises the default process group with a *file* rendezvous
  (``init_method="file://<tmpdir>/rendezvous"``, no ports) and
  ``timeout=timedelta(seconds=timeout_s)``;
- sets ``torch.set_num_threads(1)`` (CI has 2 cores for up to 4 ranks) and, before every task,
  ``torch.manual_seed(seed)`` and ``random.seed(seed)`` (the same seed on every rank, so a task
  does not depend on what ran before it);
- runs ``fn(*args, **kwargs)`` for every :meth:`DistributedPool.run` and sends back the pickled
  result, or the traceback text of an exception;
- after every task that succeeded on that rank, undoes what the task left behind (see
  :class:`TaskScope`): it destroys every process group the task created and did not destroy
  itself (in creation order, the same on every rank), clears the DTensor / DeviceMesh caches
  that keep the task's meshes, and restores the environment, the working directory and
  torch's global switches. Without this a long-lived worker gathered every task's gloo groups,
  three threads each (two ``pt_gloo_runloop``, one ``gloo_tcp_loop``): 1,076 threads per rank
  of the 4-rank pool after the default suite, each idle worker then burning ~12% of a core.

``fn`` must be picklable (a module-level function; with fork, functions of test modules are;
an NCCL pool spawns its workers, :func:`start_method_for`, which import it by module path);
its result must be picklable (tensors are sent as plain pickles, no shared memory).

Failure handling, so a test never hangs: a task that raises on any rank raises
:class:`RankError` in the parent with that rank's traceback; a task that does not answer within
the per-call timeout raises :class:`TimeoutError` naming the silent ranks. In both cases the
workers are killed (their process group may be broken) and the pool starts fresh ones on the
next :meth:`~DistributedPool.run`; a failed task's groups die with its workers (the cleanup is
not run there: destroying a group that another rank still waits on would turn that rank's
wait into a second, misleading error). A task that leaves the worker unusable (the default
group destroyed, a dispatch mode still active) is reported as a :class:`RankError` too.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as nn_module
from torch.distributed.distributed_c10d import _world

from verify.run.groups import clear_mesh_caches, init_kwargs

# Imported here, before any fork, so that every worker inherits them instead of importing them
# itself (seconds per process on a 2-core CI machine).
import torch.distributed.device_mesh  # noqa: F401  isort: skip
import torch.distributed.fsdp  # noqa: F401  isort: skip
import torch.distributed.tensor  # noqa: F401  isort: skip
import torch.nn.parallel  # noqa: F401  isort: skip

#: Seconds the parent waits for workers to finish ``init_process_group`` (at least).
STARTUP_TIMEOUT_S = 60.0
#: After a rank reports an error, seconds to wait for the other ranks' own errors.
ERROR_GRACE_S = 0.5
#: Seconds a worker gets to destroy its process group and exit on close before it is killed.
CLOSE_TIMEOUT_S = 10.0


#: torch.nn.Module's global hook registries (a task's ``register_module_*_hook`` handles).
_GLOBAL_HOOK_DICTS = tuple(
    getattr(nn_module, name) for name in (
        "_global_buffer_registration_hooks", "_global_module_registration_hooks",
        "_global_parameter_registration_hooks", "_global_backward_pre_hooks",
        "_global_backward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks",
        "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
    ) if hasattr(nn_module, name)
)


#: Handles of every ``Tensor.register_post_accumulate_grad_hook`` call in this worker, in call
#: order (filled by :func:`_track_post_accumulate_grad_hooks`; weak, they keep no tensor alive).
_GRAD_HOOK_HANDLES: list = []


def _track_post_accumulate_grad_hooks() -> None:
    """Record the handle of every post-accumulate-grad hook registered in this worker.

    Such a hook is held by the tensor's C++ autograd metadata, which Python's garbage collector
    does not traverse, so a hook that refers back to its tensor's owner (``DedicatedParams``'s
    bound-method hooks on the params of its model) makes a cycle that ``gc.collect()`` never
    frees: the model, the optimizer and the process groups, threads and all, live as long as
    the worker. :meth:`TaskScope.close` removes the hooks of the task's handles, which breaks
    those cycles. Called once per worker, after the fork (the parent is left alone).
    """
    register = torch.Tensor.register_post_accumulate_grad_hook

    # Same name: a __torch_function__ subclass that allows methods by name (DMuon's freed Z3
    # params) allows this one too, and calls it again (the handle is then recorded once).
    @functools.wraps(register)
    def register_post_accumulate_grad_hook(self, hook):
        handle = register(self, hook)
        if not _GRAD_HOOK_HANDLES or _GRAD_HOOK_HANDLES[-1] is not handle:
            _GRAD_HOOK_HANDLES.append(handle)
        return handle

    torch.Tensor.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def task_process_groups(before: set) -> list[dist.ProcessGroup]:
    """Live process groups of this rank not in ``before``, in creation order.

    ``_world.pg_names`` is a dict filled by every ``new_group`` (also those of
    ``init_device_mesh`` and DMuon) in call order, and every rank calls ``new_group`` for every
    group in the same order, so this order is the same on every member of each group. A group
    destroyed already (``dist.destroy_process_group``, e.g. by ``DedicatedParams.close()``) is
    gone from it; ranks outside a group never registered it.
    """
    return [pg for pg in _world.pg_names if pg not in before]


class TaskScope:
    """What one task may change in a long-lived worker, taken before the task; :meth:`close`
    undoes it after a task that succeeded on this rank.

    Undone, in this order: process groups the task created (destroyed in creation order; one
    the task destroyed itself is skipped), the DTensor / DeviceMesh caches
    (:func:`clear_mesh_caches`), post-accumulate-grad hooks the task registered (see
    :func:`_track_post_accumulate_grad_hooks`), Dynamo's caches when Dynamo is loaded
    (``torch._dynamo.reset()``, ~0.1 ms when nothing was compiled), hooks registered with the
    global ``torch.nn.modules.module.register_module_*_hook`` functions, the
    ``torch.__future__`` module-conversion flags, the intra-op thread count,
    deterministic-algorithms mode, grad mode, torch's default device and dtype, ``warnings``
    filters, the working directory and ``os.environ``. A destroyed gloo group's threads stop
    only when the group object is freed, so when the thread count is still above the one
    before the task, a ``gc.collect()`` frees the task's cyclic garbage.

    Not undone, only reported (a :class:`RankError`, so the workers are replaced): a task that
    destroyed the default group or left a TorchDispatchMode / TorchFunctionMode active.

    Left alone: the Flight Recorder's ring buffer (no API resets it; bounded by
    ``TORCH_FR_BUFFER_SIZE``, and the tests read the window of their own step), and module
    state of the code under test (e.g. ``dmuon.annotate``'s span listeners, which the tasks
    that add one remove).
    """

    def __init__(self) -> None:
        self.groups = set(_world.pg_map)
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.warning_filters = list(warnings.filters)
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.grad = torch.is_grad_enabled()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.threads = torch.get_num_threads()
        self.future = (torch.__future__.get_overwrite_module_params_on_conversion(),
                       torch.__future__.get_swap_module_params_on_conversion())
        self.hooks = [set(d) for d in _GLOBAL_HOOK_DICTS]
        self.grad_hooks = len(_GRAD_HOOK_HANDLES)
        self.threads_before = _threads()

    def close(self) -> list[str]:
        """Undo the task's changes; the problems that make this worker unusable (empty: fine)."""
        problems = []
        if not dist.is_initialized():
            problems.append("the task destroyed the default process group")
        else:
            for pg in task_process_groups(self.groups):
                if pg in _world.pg_map:  # destroying one group never removes another; cheap
                    dist.destroy_process_group(pg)
        clear_mesh_caches()
        for handle in _GRAD_HOOK_HANDLES[self.grad_hooks:]:
            handle.remove()  # a no-op for a tensor that is gone or a hook removed already
        del _GRAD_HOOK_HANDLES[self.grad_hooks:]
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        for d, keys in zip(_GLOBAL_HOOK_DICTS, self.hooks):
            for key in [k for k in d if k not in keys]:
                del d[key]
        if self.future != (torch.__future__.get_overwrite_module_params_on_conversion(),
                           torch.__future__.get_swap_module_params_on_conversion()):
            torch.__future__.set_overwrite_module_params_on_conversion(self.future[0])
            torch.__future__.set_swap_module_params_on_conversion(self.future[1])
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0],
                                               warn_only=self.deterministic[1])
        torch.set_grad_enabled(self.grad)
        if torch.get_default_device() != self.device:
            # The worker starts without a default device; set_default_device(None) pops the
            # DeviceContext (a TorchFunctionMode) that the task's call pushed.
            torch.set_default_device(None)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if warnings.filters != self.warning_filters:
            warnings.filters[:] = self.warning_filters
            warnings._filters_mutated()
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if _threads() > self.threads_before:
            # The task's objects are garbage now but may sit in reference cycles (modules and
            # their hooks), holding destroyed groups whose threads only stop when the groups
            # are freed. Collect only then; what survives is the worker's own state (a module
            # imported by the task, caches): frozen like the worker's start (gc.freeze above).
            gc.collect()
            gc.freeze()
        if torch._C._len_torch_dispatch_stack():
            problems.append("the task left a TorchDispatchMode active")
        if torch._C._len_torch_function_stack():
            problems.append("the task left a TorchFunctionMode active")
        return problems


class RankError(RuntimeError):
    """A task raised on one or more ranks.

    Attributes:
        tracebacks: ``{rank: traceback text}`` of every rank that reported an error.
        rank: the lowest failing rank (its traceback leads the message).
    """

    def __init__(self, tracebacks: Mapping[int, str], context: str):
        self.tracebacks = dict(sorted(tracebacks.items()))
        self.rank = min(self.tracebacks)
        parts = [f"{context}: rank(s) {sorted(self.tracebacks)} raised."]
        for rank, text in self.tracebacks.items():
            parts.append(f"--- rank {rank} traceback ---\n{text.rstrip()}")
        super().__init__("\n".join(parts))


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    seed: int,
    env: dict[str, str],
    conn,
) -> None:
    """Body of one forked rank: init the default PG, then serve tasks until told to stop."""
    # The parent may be pytest: never run its atexit handlers or flush its buffers here.
    try:
        os.environ.update(env)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        _track_post_accumulate_grad_hooks()
        device = rank % torch.cuda.device_count() if backend == "nccl" else rank
        if backend == "nccl":
            torch.cuda.set_device(device)
        # on NCCL device_id binds the rank's GPU: communicators are created eagerly
        dist.init_process_group(init_method=init_method, rank=rank, world_size=world_size,
                                **init_kwargs(backend, device, timeout_s))
        # What the worker holds now (torch and the test modules, ~300k objects) lives as long
        # as the worker: out of the collector's sight, a full collection after a task scans
        # the task's objects only (measured after a DMuon HSDP step: 0.4-0.8 s -> under 1 ms).
        gc.freeze()
        conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)
    exit_code = 0
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent gone
            exit_code = 1
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            scope = TaskScope()
            torch.manual_seed(seed)
            random.seed(seed)
            payload = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent verbatim
            payload = pickle.dumps(("error", traceback.format_exc()))
        else:
            # After pickling (a result may hold a DTensor, whose mesh names the task's groups),
            # before answering (the next task starts clean, and a slow cleanup counts in this
            # task's timeout).
            try:
                problems = scope.close()
            except BaseException:  # noqa: BLE001
                problems = ["cleanup after the task raised:\n" + traceback.format_exc()]
            if problems:
                payload = pickle.dumps(("error", "; ".join(problems) + "\n"))
        try:
            conn.send_bytes(payload)
        except (BrokenPipeError, OSError):
            exit_code = 1
            break
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(exit_code)


def start_method_for(backend: str) -> str:
    """How a pool on ``backend`` starts its workers: ``"spawn"`` for NCCL, ``"fork"`` otherwise.

    Once the parent has touched CUDA, a forked child cannot: ``torch.cuda.is_available()``
    without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` calls ``cudaGetDeviceCount`` (``cuInit``) and
    registers torch's fork handler, after which every CUDA call in a forked child raises
    "Cannot re-initialize CUDA in forked subprocess" (torch/cuda/__init__.py, ``is_available``
    and ``_lazy_init``). pytest's ``skipif(not torch.cuda.is_available())`` runs in the parent
    at collection, so an NCCL pool must spawn (a fresh interpreter: 2-3 s per worker, and the
    task's function must be importable by its module path, as test modules' are). Gloo pools
    keep fork (~0.1 s per worker)."""
    return "spawn" if backend == "nccl" else "fork"


class DistributedPool:
    """``world_size`` forked ranks sharing a live default process group; a context manager.

    Args:
        world_size: number of ranks (>= 1).
        backend: ``torch.distributed`` backend, ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per
            rank, ``cuda:rank``).
        timeout_s: process-group timeout and default per-call timeout, in seconds (> 0).
        seed: ``torch.manual_seed`` applied on every rank before every task.
        env: extra environment variables set in each worker before ``init_process_group``
            (e.g. ``{"TORCH_FR_BUFFER_SIZE": "2000"}``); ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
            are always set.
        start_method: ``"fork"`` or ``"spawn"``; default :func:`start_method_for` the backend
            (spawn for NCCL: a forked child of a process that touched CUDA cannot use it).

    Workers start lazily on the first :meth:`run` (or :meth:`start`) and are destroyed by
    :meth:`close`, which the ``with`` block calls.

    Raises:
        ValueError: ``world_size < 1``, ``timeout_s <= 0``, or an unknown ``backend``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 120,
        seed: int = 0,
        env: Mapping[str, str] | None = None,
        start_method: str | None = None,
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid {world_size=}. Must be an int >= 1.")
        if not timeout_s > 0:
            raise ValueError(f"Invalid {timeout_s=}. Must be > 0 seconds.")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Invalid {backend=}. Must be 'gloo' or 'nccl'.")
        if start_method not in (None, "fork", "spawn"):
            raise ValueError(f"Invalid {start_method=}. Must be None, 'fork' or 'spawn'.")
        self.start_method = start_method or start_method_for(backend)
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.seed = seed
        self.env = dict(env or {})
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list = []
        self._tmpdir: str | None = None
        self.generation = 0  # how many times workers were (re)started

    # ----------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def started(self) -> bool:
        """Whether workers are alive and serving tasks."""
        return bool(self._procs)

    def start(self) -> None:
        """Fork the workers and wait until every rank has initialised its process group.

        Raises:
            RankError: a rank failed to initialise (its traceback is attached).
            TimeoutError: some ranks did not finish ``init_process_group`` in time.
        """
        if self.started:
            return
        ctx = mp.get_context(self.start_method)
        self._tmpdir = tempfile.mkdtemp(prefix="dmuon_pool_")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, init_method, self.timeout_s,
                      self.seed, self.env, child_conn),
                name=f"dmuon-pool-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self.generation += 1
        self._collect(max(self.timeout_s, STARTUP_TIMEOUT_S), "process group init")

    def close(self) -> None:
        """Stop the workers (each destroys its process group); kill any that do not exit."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._teardown()

    def _teardown(self) -> None:
        """Kill whatever is still alive and forget the workers."""
        for proc in self._procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ---------------------------------------------------------------------------- tasks
    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the per-rank results in rank order.

        Uses the pool's ``timeout_s`` as the per-call timeout (see :meth:`run_with_timeout`).
        """
        return self.run_with_timeout(self.timeout_s, fn, *args, **kwargs)

    def run_with_timeout(
        self, timeout_s: float, fn: Callable[..., Any], *args, **kwargs
    ) -> list[Any]:
        """:meth:`run` with an explicit per-call timeout in seconds.

        Raises:
            ValueError: ``fn`` (or its arguments) cannot be pickled, or ``timeout_s <= 0``.
            RankError: ``fn`` raised on some rank (workers are restarted on next use).
            TimeoutError: some ranks did not answer within ``timeout_s`` (workers killed,
                restarted on next use); the message names them.
        """
        if not timeout_s > 0:
            raise ValueError(f"Invalid {timeout_s=}. Must be > 0 seconds.")
        try:
            task = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise ValueError(
                f"Invalid fn={getattr(fn, '__qualname__', fn)!r} or arguments: cannot pickle "
                f"them ({exc}). Must be a module-level function with picklable arguments."
            ) from exc
        self.start()
        for conn in self._conns:
            conn.send_bytes(task)
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(timeout_s, f"task {name}")

    def _collect(self, timeout_s: float, context: str) -> list[Any]:
        """One message from every rank, in rank order; tears down on error or timeout."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    status, value = "error", f"worker process exited (exitcode={code})\n"
                if status == "error":
                    errors[rank] = value
                else:
                    results[rank] = value
            if errors and pending:
                # Give the other ranks a moment to report their own errors, then stop.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if errors:
            self._teardown()
            raise RankError(errors, context)
        if pending:
            silent = sorted(pending.values())
            self._teardown()
            raise TimeoutError(
                f"{context}: rank(s) {silent} of world_size={self.world_size} did not answer "
                f"within {timeout_s:g} s; all workers were killed (a new pool starts on next "
                "use). Raise the timeout or look for a collective that only some ranks issued."
            )
        return [results[r] for r in range(self.world_size)]


def run_distributed(fn: Callable[..., Any], world_size: int, *args, **kwargs) -> list[Any]:
    """One-shot :class:`DistributedPool`: run ``fn(*args, **kwargs)`` on ``world_size`` gloo
    ranks and return the per-rank results in rank order."""
    with DistributedPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)
