"""A TCP proxy that misbehaves on demand: the network between manager, workers and the
weight publisher, made slow, lossy or dishonest for fault-injection runs.

Put it in front of any TCP service (a worker's HTTP API, the manager, the publisher's
data plane) and point the other side at `proxy.port`. Faults apply to the bytes flowing
through it from the moment they are set, on open connections too:

* `delay_s`: each forwarded chunk waits this long (a slow or far link);
* `cut_after_bytes`: a connection is closed once it has carried this many bytes;
* `corrupt_rate`: the probability that a forwarded chunk gets one byte flipped;
* `refuse`: new connections are closed at once;
* `cut_all()`: every open connection is reset now.

It runs its own event loop on a background thread, so synchronous test code drives it.
Corruption draws from a seeded generator: a failing run can be repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field, replace
from typing import Literal

Direction = Literal["both", "to_upstream", "to_client"]


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    cut_after_bytes: int | None = None
    corrupt_rate: float = 0.0
    refuse: bool = False
    direction: Direction = "both"
    """Which way the byte faults (delay, cut, corrupt) apply."""


@dataclass
class ProxyStats:
    connections: int = 0
    refused: int = 0
    cut: int = 0
    corrupted_chunks: int = 0
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0


@dataclass(eq=False)
class _Pipe:
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    carried: int = 0


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1", seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.faults = Faults()
        self.stats = ProxyStats()
        self.port = 0
        self._rng = random.Random(seed)
        self._pipes: set[_Pipe] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    # ------------------------------------------------------------------------- control

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, self.host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            assert self._server is not None
            self._server.close()
            self._reset_all()
            # the aborted connections end their forwarding tasks; stopping the loop under
            # them would leave pending tasks behind (and a warning each)
            tasks = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
            if tasks:
                await asyncio.wait(tasks, timeout=2)

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set(self, **faults: object) -> None:
        """Replace some fault settings (`set(delay_s=0.05)`); the others keep their values."""
        self.faults = replace(self.faults, **faults)  # type: ignore[arg-type]

    def heal(self) -> None:
        self.faults = Faults()

    def cut_all(self) -> int:
        """Reset every open connection; returns how many there were."""

        async def cut() -> int:
            return self._reset_all()

        return self._call(cut())

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _reset_all(self) -> int:
        pipes = list(self._pipes)
        for pipe in pipes:
            self._reset(pipe)
        return len(pipes)

    def _reset(self, pipe: _Pipe) -> None:
        if pipe in self._pipes:
            self._pipes.discard(pipe)
            self.stats.cut += 1
        for writer in pipe.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()  # RST, like a machine that vanished

    # ------------------------------------------------------------------------- forwarding

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.faults.refuse:
            self.stats.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 5)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        pipe = _Pipe(writers=[writer, up_writer])
        self._pipes.add(pipe)
        await asyncio.gather(
            self._forward(reader, up_writer, pipe, "to_upstream"), self._forward(up_reader, writer, pipe, "to_client")
        )
        self._pipes.discard(pipe)
        for w in pipe.writers:
            with contextlib.suppress(Exception):
                w.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pipe: _Pipe, way: str) -> None:
        try:
            while data := await reader.read(65536):
                faults = self.faults
                hit = faults.direction in ("both", way)
                if hit and faults.delay_s > 0:
                    await asyncio.sleep(faults.delay_s)
                if hit and faults.corrupt_rate > 0 and self._rng.random() < faults.corrupt_rate:
                    data = self._corrupt(data)
                pipe.carried += len(data)
                if hit and faults.cut_after_bytes is not None and pipe.carried > faults.cut_after_bytes:
                    self._reset(pipe)
                    return
                if way == "to_upstream":
                    self.stats.bytes_to_upstream += len(data)
                else:
                    self.stats.bytes_to_client += len(data)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(Exception):
                writer.write_eof()  # half-close: the other way may still be talking
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            self._reset(pipe)

    def _corrupt(self, data: bytes) -> bytes:
        self.stats.corrupted_chunks += 1
        flipped = bytearray(data)
        i = self._rng.randrange(len(flipped))
        flipped[i] ^= 1 << self._rng.randrange(8)
        return bytes(flipped)
