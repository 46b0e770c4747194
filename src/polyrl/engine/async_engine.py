"""Drives an `Engine` from its own thread and serves it to asyncio code.

The engine is single-threaded: every call into it (add, abort, weight update) is queued
as a command and runs on the engine thread between steps. Deltas go back to each
request's asyncio queue through `call_soon_threadsafe`, one call per request per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping

import torch

from polyrl.config import SwapPolicy
from polyrl.engine.engine import Engine
from polyrl.engine.types import (
    EngineFullError,
    EngineRequest,
    EngineStats,
    RequestError,
    SampleDelta,
)

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005
Command = Callable[[], "list[SampleDelta] | None"]


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the worker should be restarted."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Command, concurrent.futures.Future]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        cfg = engine.cfg
        self.max_in_flight = cfg.max_num_seqs + cfg.max_queued_requests

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            if self.engine.device.type == "cuda":
                # The engine thread must get the GIL back within a fraction of a ~5 ms decode
                # step; at the default 5 ms switch interval a busy HTTP or manager thread in
                # the same process holds it for a whole step while the GPU waits.
                sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._run, name="polyrl-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_work or self.error is not None:
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                deltas = self.engine.step()
            except Exception as e:  # a bug or device error: fail every request, refuse new ones
                log.exception("engine step failed; aborting all requests")
                self.error = e
                deltas = self.engine.abort_all()
            self._dispatch(deltas)

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            # A caller that stopped waiting (its task was cancelled: the manager closing the
            # local window does that) has cancelled the future; the command runs anyway, since
            # the cleanup it queued after it (an abort) expects it done. Marking the future
            # running first makes the cancel-or-run decision atomic.
            waited_for = future.set_running_or_notify_cancel()
            try:
                deltas = command()
            except Exception as e:
                if waited_for:
                    future.set_exception(e)
                continue
            if deltas:
                self._dispatch(deltas)
            if waited_for:
                future.set_result(None)

    def _call(self, command: Command) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, future))
        self._wakeup.set()
        return future

    def _dispatch(self, deltas: list[SampleDelta]) -> None:
        by_rid: dict[str, list[SampleDelta]] = defaultdict(list)
        for d in deltas:
            by_rid[d.rid].append(d)
        with self._lock:
            targets = [(self._subscribers.get(rid), ds) for rid, ds in by_rid.items()]
        for target, ds in targets:
            if target is not None:
                loop, q = target
                try:
                    loop.call_soon_threadsafe(q.put_nowait, ds)
                except RuntimeError:  # the subscriber's loop is closed: nobody is listening
                    pass

    # ---- requests ------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[SampleDelta]]:
        """Yield this request's deltas step by step until all its samples are finished.
        Raises RequestError / EngineFullError / EngineDeadError before yielding anything.
        Leaving the iteration early (a client that went away) aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        self.engine.validate(request)
        q: asyncio.Queue[list[SampleDelta]] = asyncio.Queue()
        with self._lock:
            if request.rid in self._subscribers:
                raise RequestError(f"request id {request.rid!r} is already in flight")
            if len(self._subscribers) >= self.max_in_flight:
                raise EngineFullError(f"{len(self._subscribers)} requests in flight; retry later")
            self._subscribers[request.rid] = (asyncio.get_running_loop(), q)
        remaining = set(range(request.sampling.n))
        try:
            await asyncio.wrap_future(self._call(lambda: self.engine.add_request(request)))
            while remaining:
                deltas = await q.get()
                remaining.difference_update(d.index for d in deltas if d.finished)
                yield deltas
        finally:
            with self._lock:
                self._subscribers.pop(request.rid, None)
            if remaining:
                self._call(lambda: self.engine.abort(request.rid))

    def abort(self, rid: str) -> bool:
        """Abort `rid`; its stream ends with finish reason "abort" and its partial tokens."""
        with self._lock:
            known = rid in self._subscribers
        if known:
            self._call(lambda: self.engine.abort(rid))
        return known

    def abort_all(self) -> int:
        with self._lock:
            count = len(self._subscribers)
        self._call(self.engine.abort_all)
        return count

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor] | None, version: int, policy: SwapPolicy | None = None
    ) -> None:
        """Apply new weights between two engine steps (see `Engine.update_weights`)."""
        await asyncio.wrap_future(self._call(lambda: self.engine.update_weights(weights, version, policy)))

    def submit(self, command: Command) -> concurrent.futures.Future:
        """Run `command` on the engine thread between two steps (its deltas, if it returns
        any, go to their requests); the future holds its outcome."""
        return self._call(command)

    def fail(self, error: BaseException) -> None:
        """The engine cannot go on (its weights are no longer known good): fail every
        request and refuse new ones, as after a crashed step."""
        log.error("engine stopped: %s", error)
        self.error = error
        self._call(self.engine.abort_all)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._subscribers)

    async def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def stats(self) -> EngineStats:
        return self.engine.stats()
