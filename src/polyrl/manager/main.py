"""Running the manager: standalone (`polyrl manager`) or in-process on trainer rank 0
(`ManagerThread`, an event loop in a background thread with a synchronous facade).

Stopping (SIGTERM/SIGINT, or `ManagerThread.stop`) first fails the open batches, so
their clients read an error line instead of a cut stream, then stops serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

from polyrl.config import ManagerConfig
from polyrl.gc_heap import freeze_gc_heap
from polyrl.manager.batch import Batch
from polyrl.manager.manager import RolloutManager, SyncHook
from polyrl.manager.server import create_app
from polyrl.preflight import resolve_token
from polyrl.protocol.manager_api import (
    BatchError,
    BatchFailed,
    BatchRequest,
    GroupResult,
    WorkerList,
)
from polyrl.serving import QuietServer, bind, server_config, wait_started
from polyrl.tls import base_url

log = logging.getLogger("polyrl.manager")

T = TypeVar("T")
GRACEFUL_S = 5
STARTUP_S = 60.0
"""How long `ManagerThread.start` waits for its thread to run the loop (seconds)."""
EXIT_CONFIG = 2


class ManagerService:
    """One RolloutManager behind its HTTP API, on the running event loop."""

    def __init__(self, cfg: ManagerConfig, listen_fd: int | None = None) -> None:
        """`listen_fd`: a bound socket to serve on, handed over by the parent (`polyrl
        train` binds it, so the URL is known before this process starts and a restart
        serves on the same port)."""
        self.cfg = resolve_token(cfg)
        self.manager = RolloutManager(self.cfg)
        self.listen_fd = listen_fd
        self.sock: socket.socket | None = None
        self.server: uvicorn.Server | None = None
        self.serving: asyncio.Task[None] | None = None
        self.url = ""

    async def start(self) -> str:
        self.sock = (
            socket.socket(fileno=self.listen_fd) if self.listen_fd is not None else bind(self.cfg.host, self.cfg.port)
        )
        await self.manager.start()
        self.server = QuietServer(server_config(create_app(self.manager), self.cfg.http, self.cfg.tls, GRACEFUL_S))
        self.serving = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await wait_started(self.server, self.serving)
        self.url = base_url(self.cfg.host, self.sock.getsockname()[1], self.cfg.tls.enabled)
        # What is alive now (torch's import alone: ~390k objects) lives as long as the
        # service; every full collection walking it stalled the loop for 0.2-0.3 s.
        freeze_gc_heap()
        return self.url

    async def stop(self) -> None:
        await self.manager.close()
        if self.server is not None and self.serving is not None:
            self.server.should_exit = True
            await asyncio.wait({self.serving}, timeout=GRACEFUL_S + 2)
        if self.sock is not None:
            self.sock.close()


def run_manager(cfg: ManagerConfig, ready_file: str | None = None, listen_fd: int | None = None) -> int:
    """`polyrl manager`: serve until SIGTERM/SIGINT. `ready_file`: where to write the URL
    once serving; `listen_fd`: a bound socket to serve on (both for a parent process)."""
    return asyncio.run(_serve(cfg, ready_file, listen_fd))


async def _serve(cfg: ManagerConfig, ready_file: str | None = None, listen_fd: int | None = None) -> int:
    service = ManagerService(cfg, listen_fd)
    try:
        url = await service.start()
    except OSError as e:  # the port is taken, the address is not ours: the operator's to fix
        print(f"config error: manager: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(f"polyrl manager serving on {url}", flush=True)
    log.info("operator page: %s/?token=<manager.token> (also: polyrl status %s --token-file <file with it>)", url, url)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(url)
        os.replace(tmp, ready_file)  # whole or absent, never half-written
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    assert service.serving is not None
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, service.serving}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    crashed = service.serving.done()
    if crashed:
        log.error("the HTTP server stopped unexpectedly: %r", service.serving.exception())
    log.info("manager stopping")
    await service.stop()
    return 1 if crashed else 0


class ManagerThread:
    """The manager on a background event loop, for a synchronous trainer.

    `generate` is a plain iterator over the same GroupResult objects as the HTTP stream;
    breaking out of it cancels the rest of the batch."""

    def __init__(self, cfg: ManagerConfig) -> None:
        self.service = ManagerService(cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="polyrl-manager", daemon=True)
        self.url = ""

    @property
    def manager(self) -> RolloutManager:
        return self.service.manager

    def start(self) -> ManagerThread:
        # `run` refuses a loop that is not running (a dead thread would hang it), and a
        # busy machine may not have scheduled the new thread yet: wait for the loop itself.
        running = threading.Event()
        self.loop.call_soon(running.set)
        self.thread.start()
        if not running.wait(timeout=STARTUP_S):
            raise RuntimeError(f"the manager thread did not start its loop within {STARTUP_S:.0f} s")
        self.url = self.run(self.service.start())
        log.info("rollout manager serving on %s", self.url)
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the manager thread is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a plain manager method on the loop: the manager's state is only ever
        touched from there."""

        async def wrapper() -> T:
            return fn(*args)

        return self.run(wrapper())

    def publish_version(self, version: int) -> None:
        self.call(self.manager.publish_version, version)

    def mark_synced(self, worker_id: str, version: int) -> None:
        self.call(self.manager.mark_synced, worker_id, version)

    def add_sync_hook(self, hook: SyncHook) -> None:
        """`hook(worker, version)` runs on the manager's loop (see RolloutManager.sync_hooks)."""
        self.call(self.manager.sync_hooks.append, hook)

    def worker_list(self) -> WorkerList:
        return self.call(self.manager.worker_list)

    def generate(self, request: BatchRequest) -> Iterator[GroupResult]:
        return self.results(self.submit(request))

    def submit(self, request: BatchRequest) -> Batch:
        """Queue the batch now; read its groups with `results`."""
        return self.call(self.manager.submit, request)

    def results(self, batch: Batch) -> Iterator[GroupResult]:
        """The batch's groups in completion order; leaving the iterator early (or never
        starting it) leaves the rest to `close_batch` or the manager's shutdown."""
        stream: AsyncIterator[GroupResult] = self.call(self.manager.results, batch)
        try:
            while True:
                future = asyncio.run_coroutine_threadsafe(_next(stream), self.loop)
                try:
                    item = future.result()
                except concurrent.futures.CancelledError:  # the loop stopped under us
                    failure = BatchFailed(batch_id="", kind="shutdown", message="the manager thread stopped")
                    raise BatchError(failure) from None
                if item is None:
                    return
                yield item
        finally:
            if self.loop.is_running():
                self.run(stream.aclose())  # type: ignore[attr-defined]
                self.call(self.manager.close_batch, batch)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            self.run(self.service.stop(), timeout_s=GRACEFUL_S + 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)

    def __enter__(self) -> ManagerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _next(stream: AsyncIterator[T]) -> T | None:
    return await anext(stream, None)
