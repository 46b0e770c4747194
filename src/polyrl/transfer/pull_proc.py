"""A receiver process: pulls its share of a version's streams into shared memory.

`transfer/receive_pool.py` starts a few of these once per worker and gives each the
streams of a pull (stream i to process i mod N), so receiving and checking the chunks
is spread over several interpreters instead of contending for one GIL. Each writes
straight into the landing buffer the engine then reads (a memfd it maps once), checks
every chunk's xxh3 as it lands, and answers with None or an error text.

Imports the standard library and xxhash only (no torch, pydantic or polyrl), so a
process costs a few MB and starts in well under a second.
"""

from __future__ import annotations

import mmap
import os
import socket
import ssl
import struct
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import xxhash

HASH_PIECE = 1 << 20
"""As the thread receiver: each piece is hashed while it is still in cache."""


@dataclass(frozen=True)
class StreamJob:
    """One stream of a pull: the request to send, then (start, end, xxh3) per chunk."""

    request: bytes
    chunks: list[tuple[int, int, int]]


@dataclass(frozen=True)
class Job:
    buffer_id: int
    new_fd: bool
    """The landing buffer's memfd follows the message (first use in this process)."""
    host: str
    port: int
    timeout_s: float
    streams: list[StreamJob]
    tls: bool = False
    """The publisher speaks TLS: verify it against `ca_file` (None: the system's store)."""
    ca_file: str | None = None


class PullFailed(Exception):
    pass


def pull_stream(
    host: str, port: int, timeout_s: float, job: StreamJob, view: memoryview, tls: ssl.SSLContext | None = None
) -> None:
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise PullFailed(f"cannot reach the publisher at {host}:{port}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:  # Python's timeout stays (wire.kernel_timeouts says why)
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except OSError as e:
            sock.close()
            raise PullFailed(f"TLS with the publisher at {host}:{port} failed: {e}") from None
    with sock:
        if tls is None:
            sock.settimeout(None)  # the kernel enforces the timeout (wire.kernel_timeouts)
            timeval = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        sock.sendall(job.request)
        status = _recv(sock, memoryview(bytearray(1)))
        if status[0] != 0:
            length = struct.unpack("!I", _recv(sock, memoryview(bytearray(4))))[0]
            text = bytes(_recv(sock, memoryview(bytearray(min(length, 1 << 16))))).decode(errors="replace")
            raise PullFailed(f"publisher refused: {text}")
        for index, (start, end, expected) in enumerate(job.chunks):
            hasher = xxhash.xxh3_64()
            for piece in range(start, end, HASH_PIECE):
                part = _recv(sock, view[piece : min(piece + HASH_PIECE, end)])
                hasher.update(part)
            if hasher.intdigest() != expected:
                raise PullFailed(f"chunk at bytes {start}-{end} failed its checksum")


def _recv(sock: socket.socket, view: memoryview) -> memoryview:
    got = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], 0, flags)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
            raise PullFailed(f"TimeoutError: no data for the socket's timeout after {got} of {len(view)} bytes") from None
        if n == 0:
            raise PullFailed(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return view


def run(job: Job, view: memoryview) -> str | None:
    """Every stream of `job` on its own thread; the first error, if any."""
    errors: list[str] = []
    tls = ssl.create_default_context(cafile=job.ca_file) if job.tls else None

    def one(stream: StreamJob) -> None:
        try:
            pull_stream(job.host, job.port, job.timeout_s, stream, view, tls)
        except (OSError, PullFailed) as e:
            errors.append(f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in job.streams[1:]]
    for t in threads:
        t.start()
    one(job.streams[0])  # the first stream on this thread: one thread less to start
    for t in threads:
        t.join()
    return errors[0] if errors else None


def main(control_fd: int, parent_pid: int) -> None:
    """Serve jobs until the worker closes the channel or dies (its end closes with it: no
    PR_SET_PDEATHSIG, which would fire when the worker thread that started us ends)."""
    if os.getppid() != parent_pid:
        sys.exit(1)
    conn = Connection(control_fd)
    maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(msg, int):  # a landing buffer the worker closed
            m, view = maps.pop(msg, (None, None))
            if view is not None:
                view.release()
                m.close()  # type: ignore[union-attr]
            continue
        if msg.new_fd:
            fd = recv_handle(conn)
            m = mmap.mmap(fd, os.fstat(fd).st_size)
            os.close(fd)
            maps[msg.buffer_id] = (m, memoryview(m))
        conn.send(run(msg, maps[msg.buffer_id][1]))
