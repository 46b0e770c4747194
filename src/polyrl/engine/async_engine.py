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
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

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
        """Each subscriber's deltas of the step, in one call to its loop (the requests of a
        batched `/generate` share one queue, so one call carries them all)."""
        by_queue: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[SampleDelta]]] = {}
        with self._lock:
            for d in deltas:
                target = self._subscribers.get(d.rid)
                if target is not None:
                    by_queue.setdefault(id(target[1]), (*target, []))[2].append(d)
        for loop, q, ds in by_queue.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, ds)
            except RuntimeError:  # the subscriber's loop is closed: nobody is listening
                pass

    # ---- requests ------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[SampleDelta]]:
        """Yield this request's deltas step by step until all its samples are finished.
        Raises RequestError / EngineFullError / EngineDeadError before yielding anything.
        Leaving the iteration early (a client that went away) aborts the request."""
        stream, refused = self.admit([request])
        try:
            refused |= await stream.start()
            if refused:
                raise refused[request.rid]
            async for deltas in stream:
                yield deltas
        finally:
            stream.close()

    def admit(self, requests: list[EngineRequest]) -> tuple[RequestStream, dict[str, Exception]]:
        """Several requests whose deltas come on one stream (a worker's batched `/generate`),
        and the ones refused, by rid (RequestError, EngineFullError): a refused request
        does not stop the others. Raises EngineDeadError. The stream's `start` adds the
        admitted ones to the engine; its `close` aborts what is unfinished."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        queue_: asyncio.Queue[list[SampleDelta]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        refused: dict[str, Exception] = {}
        admitted: list[EngineRequest] = []
        for request in requests:
            try:
                self.engine.validate(request)
            except RequestError as e:
                refused[request.rid] = e
                continue
            with self._lock:
                if request.rid in self._subscribers:
                    refused[request.rid] = RequestError(f"request id {request.rid!r} is already in flight")
                    continue
                if len(self._subscribers) >= self.max_in_flight:
                    refused[request.rid] = EngineFullError(f"{len(self._subscribers)} requests in flight; retry later")
                    continue
                self._subscribers[request.rid] = (loop, queue_)
            admitted.append(request)
        return RequestStream(self, admitted, queue_), refused

    def _unsubscribe(self, rids: Iterable[str]) -> None:
        with self._lock:
            for rid in rids:
                self._subscribers.pop(rid, None)

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


class RequestStream:
    """The deltas of several admitted requests, interleaved in step order on one queue
    (`AsyncEngine.admit`); it ends when every sample of every request has finished."""

    def __init__(self, engine: AsyncEngine, requests: list[EngineRequest], deltas: asyncio.Queue) -> None:
        self._engine, self._requests, self._deltas = engine, requests, deltas
        self._unfinished = {r.rid: set(range(r.sampling.n)) for r in requests}
        self._closed = False

    async def start(self) -> dict[str, Exception]:
        """Add the requests to the engine, in one command between two steps; those it
        refuses after all (an id still in use inside it), by rid."""

        def add() -> None:
            for request in self._requests:
                try:
                    self._engine.engine.add_request(request)
                except RequestError as e:
                    failed[request.rid] = e

        failed: dict[str, Exception] = {}
        if self._requests:
            await asyncio.wrap_future(self._engine.submit(add))
        for rid in failed:
            self._unfinished.pop(rid, None)
        self._engine._unsubscribe(failed)
        return failed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[SampleDelta]:
        if not self._unfinished:
            raise StopAsyncIteration
        deltas = await self._deltas.get()
        for d in deltas:
            if d.finished:
                left = self._unfinished.get(d.rid)
                if left is not None:
                    left.discard(d.index)
                    if not left:
                        del self._unfinished[d.rid]
        return deltas

    def close(self) -> None:
        """Stop listening; the requests with unfinished samples are aborted."""
        if self._closed:
            return
        self._closed = True
        self._engine._unsubscribe(r.rid for r in self._requests)
        if self._unfinished:
            rids = list(self._unfinished)
            self._engine.submit(lambda: [d for rid in rids for d in self._engine.engine.abort(rid)])
