"""uvicorn plumbing shared by the worker and the manager: bind first (so port 0 resolves
to a real port to print and register), serve without uvicorn's signal handlers (the
owner drains before stopping), and wait until serving."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn


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


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def wait_started(server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped the server
            raise RuntimeError("uvicorn stopped before it started serving")
        await asyncio.sleep(0.02)
