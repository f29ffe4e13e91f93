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
  ``torch.manual_seed(seed)`` (the same seed on every rank, so a task does not depend on what
  ran before it);
- runs ``fn(*args, **kwargs)`` for every :meth:`DistributedPool.run` and sends back the pickled
  result, or the traceback text of an exception.

``fn`` must be picklable (a module-level function; with fork, functions of test modules are);
its result must be picklable (tensors are sent as plain pickles, no shared memory).

Failure handling, so a test never hangs: a task that raises on any rank raises
:class:`RankError` in the parent with that rank's traceback; a task that does not answer within
the per-call timeout raises :class:`TimeoutError` naming the silent ranks. In both cases the
workers are killed (their process group may be broken) and the pool starts fresh ones on the
next :meth:`~DistributedPool.run`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

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
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
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
            torch.manual_seed(seed)
            payload = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent verbatim
            payload = pickle.dumps(("error", traceback.format_exc()))
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
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid {world_size=}. Must be an int >= 1.")
        if not timeout_s > 0:
            raise ValueError(f"Invalid {timeout_s=}. Must be > 0 seconds.")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Invalid {backend=}. Must be 'gloo' or 'nccl'.")
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
        ctx = mp.get_context("fork")
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
