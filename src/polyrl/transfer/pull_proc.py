"""A receiver process: pulls its share of a version's streams into shared memory.

`transfer/receive_pool.py` starts a few of these once per worker and gives each the
streams of a pull (stream i to process i mod N), so receiving and checking the chunks
is spread over several interpreters instead of contending for one GIL. Each writes
straight into the landing buffer the engine then reads (a memfd it maps once), checks
every chunk's xxh3 as it lands, and answers with an error text or None, and the indices
of the chunks it got (the publisher deals chunks to streams as they ask: `wire.py`).
`receiver.py` runs the same streams on threads for small versions.

With cores to spare, each stream receives on one thread and hashes on a second, one
piece behind: recv_into and xxh3 both release the GIL, so the check runs beside the copy
instead of after it (inline, it cost a single stream about a tenth of its rate).

Imports the standard library and xxhash only (no torch, pydantic or polyrl), so a
process costs a few MB and starts in well under a second.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import xxhash

HASH_PIECE = 1 << 20
"""A chunk is received and hashed piece by piece, so the hash reads from cache, not DRAM."""

CHUNKS_END = 0xFFFFFFFF
"""wire.CHUNKS_END (this module imports no polyrl)."""
_INDEX = struct.Struct("!I")


@dataclass(frozen=True)
class Chunks:
    """How the version is cut, and what each chunk must hash to."""

    chunk_bytes: int
    total_bytes: int
    checksums: list[int]
    """xxh3_64 of each chunk."""

    def range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)


@dataclass(frozen=True)
class Job:
    buffer_id: int
    new_fd: bool
    """The landing buffer's memfd follows the message (first use in this process)."""
    host: str
    port: int
    timeout_s: float
    requests: list[bytes]
    """One per stream this process runs (each an encoded OP_CHUNKS request)."""
    chunks: Chunks
    pipelined: bool = True
    """Hash each stream on a thread of its own (False: after each piece, on the
    receiving thread); see `spare_cores_for_checking`."""
    tls: bool = False
    """The publisher speaks TLS: verify it against `ca_file` (None: the system's store)."""
    ca_file: str | None = None
    hash_piece: int = field(default_factory=lambda: HASH_PIECE)
    """Bytes received and hashed at a time: `HASH_PIECE` as it is when the job is made, in
    the process that deals out the streams, so a benchmark that sets it reaches the
    receiver processes too."""


class PullFailed(Exception):
    pass


def spare_cores_for_checking(num_streams: int) -> bool:
    """Whether to hash on a second thread per stream: only with a core to spare for
    each. On the 16-core GPU host, 8 and 16 streams ran as fast or faster hashing inline,
    1 stream 10% faster pipelined (BENCHMARKS.md, the weight-pull section)."""
    return 2 * num_streams <= (os.cpu_count() or 1)


def pull_stream(
    host: str,
    port: int,
    timeout_s: float,
    request: bytes,
    chunks: Chunks,
    view: memoryview,
    tls: ssl.SSLContext | None = None,
    pipelined: bool = True,
    hash_piece: int = HASH_PIECE,
    done: Callable[[int], None] | None = None,
) -> list[int]:
    """One stream of a pull: the chunks the publisher dealt it, each checked; their indices.
    `done(index)` is called as each chunk checks out (a relay serves it on from then)."""
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
        sock.sendall(request)
        status = _recv(sock, memoryview(bytearray(1)))
        if status[0] != 0:
            length = struct.unpack("!I", _recv(sock, memoryview(bytearray(4))))[0]
            text = bytes(_recv(sock, memoryview(bytearray(min(length, 1 << 16))))).decode(errors="replace")
            raise PullFailed(f"publisher refused: {text}")
        return (_receive_pipelined if pipelined else _receive_inline)(sock, chunks, view, hash_piece, done)


_Chunk = tuple[int, int, int, int]
"""index, start, end, expected xxh3."""


def _next_chunk(sock: socket.socket, chunks: Chunks) -> _Chunk | None:
    """The header of the next chunk the publisher deals this stream; None at the end."""
    (index,) = _INDEX.unpack(_recv(sock, memoryview(bytearray(_INDEX.size))))
    if index == CHUNKS_END:
        return None
    if index >= len(chunks.checksums):
        raise PullFailed(f"publisher sent chunk {index} of a version of {len(chunks.checksums)} chunks")
    return (index, *chunks.range(index), chunks.checksums[index])


def _pieces(start: int, end: int, piece: int) -> range:
    return range(start, end, piece)


def _bad(chunk: _Chunk) -> str:
    index, start, end, _ = chunk
    return f"chunk {index} (bytes {start}-{end}) failed its checksum"


def _receive_inline(
    sock: socket.socket, chunks: Chunks, view: memoryview, piece_bytes: int, done: Callable[[int], None] | None = None
) -> list[int]:
    got = []
    while (chunk := _next_chunk(sock, chunks)) is not None:
        _, start, end, expected = chunk
        hasher = xxhash.xxh3_64()
        for piece in _pieces(start, end, piece_bytes):
            hasher.update(_recv(sock, view[piece : min(piece + piece_bytes, end)]))
        if hasher.intdigest() != expected:
            raise PullFailed(_bad(chunk))
        got.append(chunk[0])
        if done is not None:
            done(chunk[0])
    return got


def _receive_pipelined(
    sock: socket.socket, chunks: Chunks, view: memoryview, piece_bytes: int, done: Callable[[int], None] | None = None
) -> list[int]:
    """Receive on this thread; a checker thread hashes each piece once it has landed.
    A bad chunk stops the receiving at its next piece; a receive error stops the checker
    (once it has checked what landed before it)."""
    landed: queue.SimpleQueue[tuple[memoryview, _Chunk | None] | None] = queue.SimpleQueue()
    failed: list[str] = []
    got: list[int] = []

    def check() -> None:
        hasher = xxhash.xxh3_64()
        while (item := landed.get()) is not None:
            part, last_of = item
            hasher.update(part)
            if last_of is not None:  # the chunk's last piece
                if hasher.intdigest() != last_of[3]:
                    failed.append(_bad(last_of))
                    return
                hasher.reset()
                got.append(last_of[0])
                if done is not None:
                    done(last_of[0])

    checker = threading.Thread(target=check, name="polyrl-check", daemon=True)
    checker.start()
    try:
        while (chunk := _next_chunk(sock, chunks)) is not None:
            _, start, end, _ = chunk
            for piece in _pieces(start, end, piece_bytes):
                if failed:
                    raise PullFailed(failed[0])
                stop = min(piece + piece_bytes, end)
                landed.put((_recv(sock, view[piece:stop]), chunk if stop == end else None))
    finally:
        landed.put(None)  # the checker ends once it has hashed what came before
        checker.join()
    if failed:
        raise PullFailed(failed[0])
    return got


def _recv(sock: socket.socket, view: memoryview) -> memoryview:
    got = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], 0, flags)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
            raise PullFailed(
                f"TimeoutError: no data for the socket's timeout after {got} of {len(view)} bytes"
            ) from None
        if n == 0:
            raise PullFailed(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return view


def run(job: Job, view: memoryview, done: Callable[[int], None] | None = None) -> tuple[str | None, list[int]]:
    """Every stream of `job` on its own thread: the first error, if any, and the indices
    of the chunks received and checked, those of failed streams included (the next
    source is asked only for the rest). `done(index)` as each chunk checks out."""
    errors: list[str] = []
    got: list[int] = []
    tls = ssl.create_default_context(cafile=job.ca_file) if job.tls else None

    def checked(index: int) -> None:
        got.append(index)
        if done is not None:
            done(index)

    def one(request: bytes) -> None:
        try:
            pull_stream(
                job.host,
                job.port,
                job.timeout_s,
                request,
                job.chunks,
                view,
                tls,
                job.pipelined,
                job.hash_piece,
                checked,
            )
        except (OSError, PullFailed) as e:
            errors.append(f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in job.requests[1:]]
    for t in threads:
        t.start()
    one(job.requests[0])  # the first stream on this thread: one thread less to start
    for t in threads:
        t.join()
    return (errors[0] if errors else None), got


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
            # every page mapped now: chunks go to whichever stream asks, so without this each
            # pull would fault in (4 KiB at a time) the pages it happens to land on
            m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.close(fd)
            maps[msg.buffer_id] = (m, memoryview(m))
        conn.send(run(msg, maps[msg.buffer_id][1]))
