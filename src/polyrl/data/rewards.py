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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from numbers import Real
from typing import Any

from polyrl.lifetime import exit_with_parent

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"``; every failure is a ValueError naming the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward function {path!r}: cannot import module {module_name!r}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"reward function {path!r}: module {module_name!r} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"reward function {path!r}: {attr!r} is not callable")
    return obj


# ---- worker side -------------------------------------------------------------------------

_WORKER_FNS: dict[str, RewardFn] = {}


def _init_worker(paths: list[str], parent_pid: int) -> None:
    """Import every function once per worker, so the first batch does not pay for it; and
    die with the trainer, even by kill -9 (an orphaned pool worker also kept
    multiprocessing's resource tracker alive, holding its pipe)."""
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
    return _as_scores(fn(prompts, completions, **columns), len(completions))


# ---- parent side -------------------------------------------------------------------------


class RewardFuture:
    """Pending scores of one `RewardPool.submit`; `result()` never raises."""

    def __init__(self, pool: RewardPool, args: tuple, jobs: list[tuple[Future, int]]) -> None:
        self._pool = pool
        self._args = args
        self._jobs = jobs
        self._result: list[float] | None = None

    def done(self) -> bool:
        return self._result is not None or all(f.done() for f, _ in self._jobs)

    def result(self) -> list[float]:
        """Weighted sum over functions. The timeout clock starts when this call starts waiting
        (not at submission), so calls queued behind others are not punished for the queue."""
        if self._result is None:
            deadline = time.monotonic() + self._pool.timeout_s
            total = [0.0] * len(self._args[1])
            for i, path in enumerate(self._pool.functions):
                scores = self._collect(i, path, deadline)
                w = self._pool.weights[i]
                total = [t + w * s for t, s in zip(total, scores)]
            self._result = total
        return list(self._result)

    def _collect(self, i: int, path: str, deadline: float) -> list[float]:
        """One function's scores, or zeros plus one warning line when anything goes wrong."""
        n = len(self._args[1])
        future, generation = self._jobs[i]
        retried = False
        while True:
            try:
                return future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                logger.warning(
                    "reward function %s timed out after %.1fs; scoring 0.0 for %d samples and "
                    "restarting the reward pool", path, self._pool.timeout_s, n,
                )
                self._pool._restart(generation)
            except BrokenProcessPool as e:
                if not retried and generation != self._pool._generation:
                    # Killed by another call's timeout restart, not by this function: retry once.
                    retried = True
                    future, generation = self._pool._submit_one(path, *self._args)
                    continue
                logger.warning(
                    "reward function %s crashed its worker (%s); scoring 0.0 for %d samples",
                    path, e, n,
                )
                self._pool._restart(generation)
            except Exception as e:  # noqa: BLE001 - a reward bug must never stop training
                logger.warning(
                    "reward function %s failed: %s: %s; scoring 0.0 for %d samples",
                    path, type(e).__name__, e, n,
                )
            return [0.0] * n


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
            raise ValueError(
                f"got {len(weights)} reward weights for {len(functions)} reward functions"
            )
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError("num_workers must be >= 1 and timeout_s > 0")
        for path in functions:
            load_callable(path)  # fail at start-up on a typo, not on the first batch
        self.functions = list(functions)
        self.weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._generation = 0
        self._executor: ProcessPoolExecutor | None = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(
            max_workers=self.num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self.functions, os.getpid()),
        )
        executor.submit(_ping)  # start workers now, overlapping their import time
        return executor

    def _submit_one(self, path: str, *args: Any) -> tuple[Future, int]:
        with self._lock:
            if self._executor is None:
                raise RuntimeError("RewardPool is closed")
            return self._executor.submit(_run_one, path, *args), self._generation

    def submit(
        self, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> RewardFuture:
        """Queue one batch for scoring; returns at once."""
        args = (list(prompts), list(completions), dict(columns or {}))
        jobs = [self._submit_one(path, *args) for path in self.functions]
        return RewardFuture(self, args, jobs)

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
    ) -> list[float]:
        """Blocking convenience: `submit(...).result()`."""
        return self.submit(prompts, completions, columns).result()

    def _restart(self, generation: int) -> None:
        """Kill the workers of `generation` and start fresh ones, so a hung function cannot
        wedge the pool. A no-op when that generation was already replaced or the pool closed."""
        with self._lock:
            if self._executor is None or generation != self._generation:
                return
            old = self._executor
            self._generation += 1
            self._executor = self._new_executor()
        _kill_executor(old)

    def close(self) -> None:
        """Stop the workers; in-flight calls are abandoned (their results read as 0.0)."""
        with self._lock:
            old, self._executor = self._executor, None
        if old is not None:
            _kill_executor(old)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


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
