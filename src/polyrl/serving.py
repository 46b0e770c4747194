"""uvicorn plumbing shared by the worker and the manager: bind first (so port 0 resolves
to a real port to print and register), serve without uvicorn's signal handlers (the
owner drains before stopping), with TLS when configured and bounded connections and
request-receive times (`GuardedProtocol`), and wait until serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from polyrl.config import HttpLimitsConfig, TlsConfig

log = logging.getLogger("polyrl.serving")


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: it would stop serving at once, cutting the
    responses a drain exists to deliver. The owner installs its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.30
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.30
        pass


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    sock.bind((host, port))
    return sock


def server_config(app: Any, limits: HttpLimitsConfig, tls: TlsConfig, graceful_s: int) -> uvicorn.Config:
    """The one uvicorn configuration of both services."""
    return uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=graceful_s,
        timeout_keep_alive=limits.keep_alive_s,
        http=guarded_protocol(limits),
        ssl_certfile=tls.cert_file,
        ssl_keyfile=tls.key_file,
    )


def max_connections(limits: HttpLimitsConfig) -> int:
    if limits.max_connections:
        return limits.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 65536


def guarded_protocol(limits: HttpLimitsConfig) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, whichever it picked) with `limits`."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol, AutoHTTPProtocol),
        {
            "max_connections": max_connections(limits),
            "header_timeout_s": limits.header_timeout_s,
            "body_timeout_s": limits.body_timeout_s,
        },
    )


class GuardedProtocol:
    """Bounds what one client connection may hold, on top of uvicorn's protocol, which
    waits for a request's bytes as long as they take: a client that drips a header a
    byte at a time, or connects and sends nothing, held its connection (and a file
    descriptor) for good, and enough of them exhaust the process's descriptors.

    * A connection beyond `max_connections` is answered 503 and closed at once.
    * A request's headers must arrive within `header_timeout_s` of the connection (or,
      on a kept-alive one, of the request's first byte), then its body within
      `body_timeout_s`; else the connection is closed (408 when no response started).

    It reads only what both of uvicorn's protocols keep: `connections` (the server's
    open connections), `cycle` (the request whose headers were parsed last, with
    `more_body` until its body is complete) and `transport`; `data_received` runs the
    parser synchronously, so comparing `cycle` before and after it tells what arrived."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    connections: set[Any]
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_cycle: Any = None
        if len(self.connections) > self.max_connections:
            _refusals.note(self.max_connections)
            self._close(b"503 Service Unavailable", b"too many open connections")
            return
        self._arm(self.header_timeout_s, None)

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        receiving_body = before is not None and before.more_body
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle
        if cycle is not before or receiving_body:  # headers parsed, or body bytes arrived
            if cycle is not None and cycle.more_body:
                if self._deadline_cycle is not cycle:
                    self._arm(self.body_timeout_s, cycle)
            else:
                self._disarm()
        elif self._deadline is None:  # the first bytes of the next request on this connection
            self._arm(self.header_timeout_s, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def shutdown(self) -> None:
        """The server stops: an idle connection closes at once, as over plain TCP (a TLS
        close would wait for the peer's close_notify, which an idle client never sends,
        and hold the stop for the whole graceful timeout)."""
        super().shutdown()  # type: ignore[misc]
        if self.transport.is_closing():
            self.loop.call_later(ABORT_AFTER_S, self.transport.abort)

    def _arm(self, seconds: float, cycle: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._timed_out)
        self._deadline_cycle = cycle

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()  # type: ignore[union-attr]
        self._deadline, self._deadline_cycle = None, None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._deadline_cycle is None and (self.cycle is None or self.cycle.response_complete):
            self._close(b"408 Request Timeout", b"request not received in time")
        else:  # a handler waits for the body: the disconnect ends it
            self.transport.close()
            self.loop.call_later(ABORT_AFTER_S, self.transport.abort)

    def _close(self, status: bytes, text: bytes) -> None:
        """Answer and close; abort shortly after, since a TLS close waits (30 s) for the
        peer's close_notify, which a stalling client never sends."""
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            b"content-length: " + str(len(text)).encode() + b"\r\n\r\n" + text
        )
        self.transport.close()
        self.loop.call_later(ABORT_AFTER_S, self.transport.abort)


ABORT_AFTER_S = 1.0


class _Refusals:
    """Refused connections, logged at most every 10 s: a flood must not flood the log."""

    def __init__(self) -> None:
        self.count, self.logged_at = 0, -1e9

    def note(self, limit: int) -> None:
        import time

        self.count += 1
        if time.monotonic() - self.logged_at >= 10:
            log.warning("refused %d connections over the limit of %d open (http.max_connections)", self.count, limit)
            self.count, self.logged_at = 0, time.monotonic()


_refusals = _Refusals()


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as an IPv6 socket bound to 127.0.0.1 shows
    return (mapped or address).is_loopback


async def wait_started(server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped the server
            raise RuntimeError("uvicorn stopped before it started serving")
        await asyncio.sleep(0.02)
