"""Reward functions by import path, run in a process pool so slow verification never blocks
the learner and a broken or hung reward function can only cost its own score.

Reward functions follow the TRL convention
``fn(prompts: list[str], completions: list[str], **columns) -> list[float]``, each column a
list aligned with ``prompts``. A ``None`` entry means "not applicable to this sample" (as in
TRL) and scores 0.0 for that sample.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from numbers import Real
from typing import Any

from polyrl.lifetime import exit_with_parent

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


def load_callable(path: str, what: str = "reward function") -> Callable[..., Any]:
    """Import ``"package.module:function"``; every failure is a ValueError naming the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is not callable")
    return obj


# ---- worker side -------------------------------------------------------------------------

_WORKER_FNS: dict[str, RewardFn] = {}


class RewardFunctionError(Exception):
    """The user's function raised (anything, SystemExit included). It travels back as text:
    the function's own exception may not pickle, and a BaseException from a worker must not
    stop the trainer."""


def _init_worker(paths: list[str], parent_pid: int) -> None:
    """Leave the trainer's session, then import every function once (so the first batch does
    not pay for it).

    A terminal's Ctrl-C goes to its whole foreground process group; a pool worker in the
    trainer's group died of it, and its calls read as crashes. Ctrl-C is the trainer's to
    handle (finish the step, save): the worker was started with SIGINT blocked (by the
    pool's starter thread, `RewardPool.__init__`), so one that came during its start-up
    waits pending until it is ignored here, and dropped. The worker also dies with the trainer, even by kill -9
    (an orphaned pool worker kept multiprocessing's resource tracker alive, holding its pipe)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    exit_with_parent(parent_pid)
    for path in paths:
        _WORKER_FNS[path] = load_callable(path)


def _ping() -> None:
    """Warm-up task: makes the executor start its workers right away."""


def _as_scores(raw: Any, n: int) -> list[float]:
    """Check one function's output; a bad value voids the whole call (raises ValueError)."""
    values = list(raw)
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(0.0)
            continue
        if not isinstance(v, Real) or not math.isfinite(float(v)):
            raise ValueError(f"value {i} is {v!r}, not a finite number")
        out.append(float(v))
    return out


def _run_one(path: str, prompts: list[str], completions: list[str], columns: dict) -> list[float]:
    """Call one reward function in a worker; validation happens here so only floats travel back."""
    fn = _WORKER_FNS.get(path) or load_callable(path)
    try:
        return _as_scores(fn(prompts, completions, **columns), len(completions))
    except BaseException as e:  # noqa: BLE001 - the function's failure, reported as one
        raise RewardFunctionError(f"{type(e).__name__}: {e}") from None


# ---- parent side -------------------------------------------------------------------------

CRASH_RETRIES = 2
"""A call whose worker died (a crash, a kill, the out-of-memory killer) runs again on a
fresh worker up to this many times; then the pool raises RewardPoolError. A dead worker is
infrastructure, not the function's verdict: it must never become a score of 0."""

START_TIMEOUT_S = 120.0
"""A fresh worker's start-up (spawn, imports, the functions' modules) is not the function's
time: a call's clock starts once its workers are up, which must happen within this long."""


class RewardPoolError(RuntimeError):
    """The pool cannot score: its workers keep dying. Training stops rather than learn from
    scores that no reward function produced."""


@dataclass
class _Generation:
    """One set of workers; a timeout or a crash replaces it with the next."""

    number: int
    executor: ProcessPoolExecutor
    warmup: list[Future]
    ended_by_timeout: bool = False
    """Killed because a call timed out: its other calls did nothing wrong (no crash counted)."""


class RewardFuture:
    """Pending scores of one `RewardPool.submit`. `result()` returns the scores; a function
    that raised, returned a bad value or timed out scores 0.0 for the call's samples (counted
    in `num_failed`); a worker that died is not a score: the call runs again on a fresh
    worker, and RewardPoolError ends it when that keeps failing."""

    def __init__(self, pool: RewardPool, args: tuple, jobs: list[tuple[Future, _Generation]]) -> None:
        self._pool = pool
        self._args = args
        self._jobs = jobs
        self._result: list[float] | None = None
        self.num_failed = 0
        """Samples scored 0.0 for a function's failure (known once `result()` returned)."""

    def done(self) -> bool:
        return self._result is not None or all(f.done() for f, _ in self._jobs)

    def result(self) -> list[float]:
        """Weighted sum over functions. Each function's clock starts when this call starts
        waiting for it (not at submission), so calls queued behind others are not punished
        for the queue."""
        if self._result is None:
            n = len(self._args[1])
            total = [0.0] * n
            failed = False
            for i, path in enumerate(self._pool.functions):
                scores = self._collect(i, path)
                failed |= scores is None
                w = self._pool.weights[i]
                total = [t + w * s for t, s in zip(total, scores or [0.0] * n)]
            self.num_failed = n if failed else 0
            self._result = total
        return list(self._result)

    def _collect(self, i: int, path: str) -> list[float] | None:
        """One function's scores, or None (one warning line) when the function failed."""
        n = len(self._args[1])
        future, gen = self._jobs[i]
        crashes = 0
        while True:
            try:
                self._pool._wait_started(gen)
                return future.result(timeout=self._pool.timeout_s)
            except FutureTimeout:
                logger.warning(
                    "reward function %s timed out after %.1fs; scoring 0.0 for %d samples and "
                    "restarting the reward pool",
                    path,
                    self._pool.timeout_s,
                    n,
                )
                self._pool._restart(gen, by_timeout=True)
                return None
            except (BrokenProcessPool, CancelledError) as e:
                if not gen.ended_by_timeout:  # else another call's timeout killed this one's worker
                    crashes += 1
                    restarted = self._pool._restart(gen, by_timeout=False)
                    if crashes > CRASH_RETRIES:
                        raise RewardPoolError(
                            f"reward function {path}: its worker died {crashes} times in a row "
                            f"({type(e).__name__}: {e}); stopping rather than scoring {n} samples 0.0"
                        ) from None
                    if restarted:  # one line per dead worker, not per call it held
                        logger.warning(
                            "reward function %s: its worker died (%s); scoring again on a fresh worker "
                            "(retry %d of %d)",
                            path,
                            e or type(e).__name__,
                            crashes,
                            CRASH_RETRIES,
                        )
                future, gen = self._pool._submit_one(path, *self._args)
            except Exception as e:  # noqa: BLE001 - a reward bug must never stop training
                logger.warning(
                    "reward function %s failed: %s; scoring 0.0 for %d samples",
                    path,
                    e if isinstance(e, RewardFunctionError) else f"{type(e).__name__}: {e}",
                    n,
                )
                return None


class RewardPool:
    """Weighted reward functions evaluated in "spawn" worker processes (the parent holds torch
    threads, which fork would copy in a broken state)."""

    def __init__(
        self,
        functions: list[str],
        weights: list[float] | None = None,
        num_workers: int = 1,
        timeout_s: float = 10.0,
    ) -> None:
        if not functions:
            raise ValueError("RewardPool needs at least one reward function")
        if weights is not None and len(weights) != len(functions):
            raise ValueError(f"got {len(weights)} reward weights for {len(functions)} reward functions")
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError("num_workers must be >= 1 and timeout_s > 0")
        for path in functions:
            load_callable(path)  # fail at start-up on a typo, not on the first batch
        self.functions = list(functions)
        self.weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        # Workers are started from this one long-lived thread, whichever thread asks for a
        # restart: their parent-death signal fires when the *thread* that started them ends.
        # SIGINT stays blocked in it, and the workers inherit the mask (see _init_worker).
        self._starter = ThreadPoolExecutor(1, "polyrl-reward-start", initializer=_block_sigint)
        self._gen: _Generation | None = self._start_generation(0)

    def _start_generation(self, number: int) -> _Generation:
        return self._starter.submit(self._new_generation, number).result()

    def _new_generation(self, number: int) -> _Generation:
        executor = ProcessPoolExecutor(
            max_workers=self.num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self.functions, os.getpid()),
        )
        # One task per worker starts them all now, here, overlapping their import time; no
        # later submit finds a worker missing and starts one from its own thread.
        return _Generation(number, executor, [executor.submit(_ping) for _ in range(self.num_workers)])

    def _wait_started(self, gen: _Generation) -> None:
        """Until the workers of `gen` are up; BrokenProcessPool if they are not in time."""
        try:
            for f in gen.warmup:
                f.result(timeout=START_TIMEOUT_S)
        except FutureTimeout:
            raise BrokenProcessPool(f"the reward workers did not start within {START_TIMEOUT_S:.0f}s") from None

    def _submit_one(self, path: str, *args: Any) -> tuple[Future, _Generation]:
        with self._lock:
            gen = self._gen
            if gen is None:
                raise RuntimeError("RewardPool is closed")
            try:
                return gen.executor.submit(_run_one, path, *args), gen
            except BrokenProcessPool as e:  # a worker died while idle: the caller retries
                failed: Future = Future()
                failed.set_exception(e)
                return failed, gen

    def submit(
        self, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> RewardFuture:
        """Queue one batch for scoring; returns at once."""
        args = (list(prompts), list(completions), dict(columns or {}))
        jobs = [self._submit_one(path, *args) for path in self.functions]
        return RewardFuture(self, args, jobs)

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None) -> list[float]:
        """Blocking convenience: `submit(...).result()`."""
        return self.submit(prompts, completions, columns).result()

    def _restart(self, gen: _Generation, by_timeout: bool) -> bool:
        """Kill the workers of `gen` and start fresh ones, so a hung function cannot wedge the
        pool and a dead worker is replaced. False (nothing done) when `gen` was already
        replaced or the pool closed."""
        with self._lock:
            if self._gen is not gen:
                return False
            gen.ended_by_timeout = by_timeout
            self._gen = self._start_generation(gen.number + 1)
        _kill_executor(gen.executor)
        return True

    def close(self) -> None:
        """Stop the workers; in-flight calls are abandoned (their `result()` raises)."""
        with self._lock:
            gen, self._gen = self._gen, None
        if gen is not None:
            _kill_executor(gen.executor)
        self._starter.shutdown(wait=False)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _block_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _kill_executor(executor: ProcessPoolExecutor) -> None:
    """Shut down without waiting on busy workers: ProcessPoolExecutor has no public way to
    stop a running task before Python 3.14, so kill its processes directly."""
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=1.0)
