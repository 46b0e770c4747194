"""The publisher process: serves weight pulls from versions the trainer wrote into shared
memory (`transfer/publisher.py` is the trainer's side).

It owns the serving loops of the listening sockets the trainer created (inherited, so a
restarted process serves on the same ports), checksums each version the trainer
announces, and serves every TCP op of `wire.py` with one thread per connection, in an
interpreter where nothing but serving competes for the GIL. The streams of one raw pull
share a `_Deal`: each chunk goes to whichever stream asks next, so the pull ends when
the work does, not when its slowest stream's fixed share does. A version dropped beyond
`keep_versions` stays mapped while a pull reads it; the trainer may write into its slot
again only once this process says `Released`. GPU ops (NCCL, CUDA IPC) read the
trainer's GPU, so their connections go back to the trainer, token checked, with the
socket itself (SCM_RIGHTS).

Imports only what serving needs: no torch (but for the int8 codec, on first use), CUDA,
NCCL or trainer code, so it starts (and restarts) in a fraction of a second.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import socket
import socketserver
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Protocol

import numpy as np

from polyrl.lifetime import exit_with_parent
from polyrl.tls import server_context
from polyrl.transfer.compress import encode_zstd
from polyrl.transfer.delta import encode_delta
from polyrl.transfer.pacing import SendPacer, paced
from polyrl.transfer.schema import Manifest
from polyrl.transfer.wire import (
    CHUNK_INDEX,
    CHUNKS_END,
    ENCODED_OPS,
    GPU_OPS,
    OP_DELTA,
    OP_DESCRIBE,
    OP_SOME,
    OP_ZSTD,
    STATUS_OK,
    STATUS_REFUSED,
    Request,
    TransferError,
    TransferInfo,
    WireVersionError,
    checksum,
    chunk_checksums,
    combined_checksum,
    kernel_timeouts,
    read_request,
    send_text,
    transfer_token,
    wanted_chunks,
)

log = logging.getLogger("polyrl.transfer")

# ------------------------------------------------------------------ messages (trainer <-> here)


@dataclass(frozen=True)
class ServeConfig:
    key: bytes
    chunk_bytes: int
    keep_versions: int
    io_timeout_s: float
    handshake_timeout_s: float
    listener_fds: list[int]
    """The trainer's listening sockets, inherited under these numbers."""
    stats_fd: int
    send_mode: str
    """sendfile or sendall (`publisher.SEND_MODE` says which is the default, and why)."""
    log_level: int = logging.WARNING
    tls_cert_file: str | None = None
    """With its key: every connection is TLS (`manager.transfer.tls`)."""
    tls_key_file: str | None = None
    max_send_bytes_per_s: float | None = None
    """All pulls together (`manager.transfer.max_send_gbps`); None: as fast as the link."""


@dataclass(frozen=True)
class Publish:
    """`version` lies in slot `slot` (its memfd follows the message when `new_fd`)."""

    version: int
    slot: int
    manifest_json: str
    new_fd: bool


@dataclass(frozen=True)
class Forget:
    """The trainer closed slot `slot` (a released one of another size)."""

    slot: int


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Published:
    """`version` is servable; its chunk checksums, computed here."""

    version: int
    chunk_checksums: list[int]


@dataclass(frozen=True)
class Released:
    """No pull reads slot `slot` any more: the trainer may write the next version there."""

    slot: int


@dataclass(frozen=True)
class GpuConn:
    """A GPU-op connection whose token checked out; its socket follows the message."""

    request: Request


STATS_BYTES = 8
"""The shared stats page: bytes sent (u64), kept across restarts of this process."""

# ------------------------------------------------------------------------------ held versions


@dataclass
class _Deal:
    """The chunks of one raw pull, dealt to its streams as they ask (under Versions' lock).

    Kept until every stream has joined and left; one whose streams never all came (the
    receiver gave up) is dropped once idle for `stale_s`."""

    num_streams: int
    chunks: list[int]
    """The chunks asked for, in the order they are dealt (all of them, for op 2)."""
    next: int = 0
    joined: int = 0
    active: int = 0
    idle_since: float = 0.0


@dataclass
class _Slot:
    fd: int
    map: mmap.mmap
    view: memoryview


@dataclass
class _Held:
    slot: int
    view: memoryview
    fd: int
    info: TransferInfo
    readers: int = 0
    dropped: bool = False

    def array(self) -> np.ndarray:
        return np.frombuffer(self.view, np.uint8)


class Versions:
    """The versions this process serves, and which slots pulls still read."""

    def __init__(self, cfg: ServeConfig, conn: Connection, stats: mmap.mmap) -> None:
        self.cfg, self.conn, self.stats = cfg, conn, stats
        self._slots: dict[int, _Slot] = {}
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self._encoded_cache: dict[int, tuple[tuple[int, int], bytes]] = {}  # op -> ((version, base), payload)
        self._deals: dict[tuple[str, int, int], _Deal] = {}  # (worker, version, pull id)
        rate = cfg.max_send_bytes_per_s
        self.pacer = SendPacer(rate) if rate else None

    def send(self, message: object, fd: int | None = None) -> None:
        """To the trainer, from any thread (the message and its fd stay together)."""
        with self._send_lock:
            self.conn.send(message)
            if fd is not None:
                send_handle(self.conn, fd, os.getppid())

    def publish(self, msg: Publish) -> None:
        if msg.new_fd:
            self._map(msg.slot, recv_handle(self.conn))
        slot = self._slots[msg.slot]
        manifest = Manifest.model_validate_json(msg.manifest_json)
        view = slot.view[: manifest.total_bytes]
        t0 = time.perf_counter()
        sums = chunk_checksums(view, self.cfg.chunk_bytes)
        info = TransferInfo(
            manifest=manifest,
            chunk_bytes=self.cfg.chunk_bytes,
            chunk_checksums=sums,
            buffer_checksum=combined_checksum(sums),
        )
        released = []
        with self._lock:
            replaced = self._held.pop(msg.version, None)  # the same version published again
            self._held[msg.version] = _Held(msg.slot, view, slot.fd, info)
            dropped = [self._held.pop(old) for old in sorted(self._held)[: -self.cfg.keep_versions]]
            for held in ([replaced] if replaced is not None else []) + dropped:
                held.dropped = True
                if held.readers == 0 and held.slot != msg.slot:  # the same slot announced twice
                    released.append(held.slot)
        for slot_id in released:  # first: the trainer's next publish may then reuse the slot
            self.send(Released(slot_id))
        self.send(Published(msg.version, sums))
        log.debug(
            "v%d servable: %.1f MB checksummed in %.2fs",
            msg.version,
            manifest.total_bytes / 1e6,
            time.perf_counter() - t0,
        )

    def _map(self, slot_id: int, fd: int) -> None:
        size = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once, not per pull
        m = mmap.mmap(fd, size, flags=flags)
        self._slots[slot_id] = _Slot(fd, m, memoryview(m))

    def forget(self, slot_id: int) -> None:
        slot = self._slots.pop(slot_id, None)
        if slot is not None:
            slot.view.release()
            try:
                slot.map.close()
            except BufferError:  # an encoder's array still points into it: the GC unmaps it
                pass
            os.close(slot.fd)

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    @contextmanager
    def reading(self, version: int) -> Iterator[_Held | None]:
        """The held version, kept from reuse while the caller reads it."""
        with self._lock:
            held = self._held.get(version)
            if held is not None:
                held.readers += 1
        try:
            yield held
        finally:
            if held is not None:
                with self._lock:
                    held.readers -= 1
                    free = held.dropped and held.readers == 0
                if free:
                    self.send(Released(held.slot))

    def join_deal(self, req: Request, num_chunks: int) -> _Deal:
        """The deal of `req`'s pull (a new one for its first stream); ValueError if its
        streams disagree on how many they are, or more of them come than that."""
        key = (req.worker_id, req.version, req.base)
        now = time.monotonic()
        stale_s = self.cfg.io_timeout_s + self.cfg.handshake_timeout_s
        with self._lock:
            for k in [k for k, d in self._deals.items() if d.active == 0 and now - d.idle_since > stale_s]:
                del self._deals[k]
            deal = self._deals.get(key)
            if deal is None:
                wanted = wanted_chunks(req.wanted, num_chunks) if req.op == OP_SOME else list(range(num_chunks))
                deal = self._deals[key] = _Deal(req.num_streams, wanted)
            if deal.num_streams != req.num_streams or deal.joined >= deal.num_streams:
                raise ValueError(
                    f"stream {req.stream} of {req.num_streams} does not fit pull {req.base} of {deal.num_streams}"
                )
            deal.joined += 1
            deal.active += 1
        return deal

    def claim(self, deal: _Deal) -> int | None:
        """The next chunk of `deal` for the calling stream; None once all are dealt."""
        with self._lock:
            if deal.next >= len(deal.chunks):
                return None
            deal.next += 1
            return deal.chunks[deal.next - 1]

    def leave_deal(self, req: Request, deal: _Deal) -> None:
        with self._lock:
            deal.active -= 1
            deal.idle_since = time.monotonic()
            if deal.active == 0 and deal.joined == deal.num_streams:
                self._deals.pop((req.worker_id, req.version, req.base), None)

    def count_sent(self, nbytes: int) -> None:
        with self._lock:
            (sent,) = struct.unpack_from("Q", self.stats)
            struct.pack_into("Q", self.stats, 0, sent + nbytes)

    def encoded(self, op: int, version: int, base: int) -> bytes | None:
        """`version` as the payload of an encoded op (a delta from `base`, zstd, int8),
        made once and shared by every receiver asking for the same; None if a version it
        needs is not held, or a delta's two layouts differ."""
        key = (version, base if op == OP_DELTA else -1)
        with self._encode_lock:  # one encoding at a time: they are large
            cached = self._encoded_cache.get(op)
            if cached is not None and cached[0] == key:
                return cached[1]
            with self.reading(version) as new, self.reading(base) as old:
                payload = encode_payload(op, new, old)
            if payload is not None:
                self._encoded_cache[op] = (key, payload)
            return payload


class HeldVersion(Protocol):
    """What an encoder reads of a version: the publisher's `_Held`, a relay's `_Version`."""

    info: TransferInfo

    def array(self) -> np.ndarray: ...


def encode_payload(op: int, new: HeldVersion | None, old: HeldVersion | None) -> bytes | None:
    """`new` as the payload of encoded op `op` (a delta from `old`, zstd, int8); None if
    a version it needs is missing, or a delta's two layouts differ."""
    if new is None or (op == OP_DELTA and (old is None or old.info.manifest.tensors != new.info.manifest.tensors)):
        return None
    t0 = time.perf_counter()
    if op == OP_DELTA:
        payload = encode_delta(old.array(), new.array())  # type: ignore[union-attr]
    elif op == OP_ZSTD:
        payload = encode_zstd(new.array(), word_bytes(new.info.manifest))
    else:  # the one op that needs torch: imported on first use, not at every (re)start
        import torch

        from polyrl.transfer.quantize import encode_int8

        torch.set_num_threads(1)  # the trainer's cores are for learning
        payload = encode_int8(torch.from_numpy(new.array()), new.info.manifest)
    total = new.info.manifest.total_bytes
    log.debug(
        "v%d as %s: %.1f MB (%.1f%% of raw) in %.2fs",
        new.info.manifest.version,
        ENCODED_OPS[op],
        len(payload) / 1e6,
        100 * len(payload) / max(total, 1),
        time.perf_counter() - t0,
    )
    return payload


def word_bytes(manifest: Manifest) -> int:
    """The element size that covers most of the buffer (zstd's byte planes)."""
    by_size: dict[int, int] = {}
    for e in manifest.tensors:
        by_size[e.itemsize] = by_size.get(e.itemsize, 0) + e.nbytes
    return max(by_size, key=by_size.__getitem__, default=1)


# ------------------------------------------------------------------------------------ serving


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    versions: Versions

    def __init__(self, listener: socket.socket, versions: Versions) -> None:
        super().__init__(listener.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket, self.versions = listener, versions  # the trainer's socket: bound and listening
        cfg = versions.cfg
        self.tls = (
            server_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file and cfg.tls_key_file else None
        )

    def handle_error(self, request: object, client_address: object) -> None:
        """A handler's unexpected error ends its connection with one line, not a traceback."""
        log.warning("weight pull from %s failed", client_address, exc_info=log.isEnabledFor(logging.DEBUG))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        versions: Versions = self.server.versions  # type: ignore[attr-defined]
        cfg = versions.cfg

        def answer(sock: socket.socket, req: Request, peer: str) -> None:
            with versions.reading(req.version) as held:
                serve(versions, sock, req, held, peer)

        handle_connection(
            self.request,
            self.client_address,
            self.server.tls,  # type: ignore[attr-defined]
            cfg.handshake_timeout_s,
            cfg.io_timeout_s,
            answer,
            "weight pull",
        )


def handle_connection(
    sock: socket.socket,
    client_address: tuple[str, int],
    tls: ssl.SSLContext | None,
    handshake_timeout_s: float,
    io_timeout_s: float,
    answer: Callable[[socket.socket, Request, str], None],
    what: str,
) -> None:
    """One connection of the weight wire, at the publisher or a relay (`relay.py`): the
    TLS handshake and the request within `handshake_timeout_s`, then `answer` on a socket
    with kernel-enforced idle timeouts. A receiver that died, stalled or spoke garbage
    ends it with one debug line; one speaking another wire version is told so."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer = f"{client_address[0]}:{client_address[1]}"
    try:
        if tls is not None:  # the TLS handshake falls under the request's deadline too
            sock.settimeout(handshake_timeout_s)
            sock = tls.wrap_socket(sock, server_side=True)
        req = read_request(sock, timeout_s=handshake_timeout_s)
        kernel_timeouts(sock, io_timeout_s)
        answer(sock, req, peer)
    except WireVersionError as e:
        log.warning("%s from %s refused: %s", what, peer, e)
        with suppress(OSError):
            send_text(sock, STATUS_REFUSED, str(e).encode())
    except (OSError, ValueError, TransferError) as e:
        log.debug("%s from %s ended: %s: %s", what, peer, type(e).__name__, e)


def serve(versions: Versions, sock: socket.socket, req: Request, held: _Held | None, peer: str) -> None:
    if not token_ok(versions.cfg.key, req):
        log.warning("weight pull refused for %r from %s: bad token for v%d", req.worker_id, peer, req.version)
        send_text(sock, STATUS_REFUSED, b"bad transfer token for this worker and version")
    elif req.op in GPU_OPS and isinstance(sock, ssl.SSLSocket):
        send_text(sock, STATUS_REFUSED, f"{GPU_OPS[req.op]} is not served over TLS: pull over TCP".encode())
    elif req.op in GPU_OPS:
        versions.send(GpuConn(req), sock.fileno())  # the trainer serves it from its GPU
        os.close(sock.detach())  # without the shutdown socketserver would send the trainer's peer
    elif held is None:
        send_text(sock, STATUS_REFUSED, f"version {req.version} is not held (held: {versions.versions})".encode())
    elif req.op == OP_DESCRIBE:
        send_text(sock, STATUS_OK, held.info.model_dump_json().encode())
    elif req.op in ENCODED_OPS:
        payload = versions.encoded(req.op, req.version, req.base)
        if payload is None:
            send_text(
                sock, STATUS_REFUSED, f"no {ENCODED_OPS[req.op]} from v{req.base} (held: {versions.versions})".encode()
            )
        else:
            send_payload(sock, payload, versions.pacer)
            versions.count_sent(len(payload))
    else:
        _serve_chunks(versions, sock, req, held)


def send_payload(sock: socket.socket, payload: bytes, pacer: SendPacer | None) -> None:
    """An encoded op's reply: status, length, xxh3, then the payload (paced)."""
    sock.sendall(bytes([STATUS_OK]) + len(payload).to_bytes(8, "big") + checksum(payload).to_bytes(8, "big"))
    view = memoryview(payload)
    for start, end in paced(pacer, 0, len(payload)):
        sock.sendall(view[start:end])


def _serve_chunks(versions: Versions, sock: socket.socket, req: Request, held: _Held) -> None:
    """This stream's part of a raw pull: chunks as the deal gives them, each after its
    index, then CHUNKS_END."""
    try:
        deal = versions.join_deal(req, held.info.num_chunks)
    except ValueError as e:
        send_text(sock, STATUS_REFUSED, str(e).encode())
        return
    try:
        # sendfile would bypass the TLS layer: TLS connections always send from this process
        sendfile = versions.cfg.send_mode == "sendfile" and not isinstance(sock, ssl.SSLSocket)
        send = _sendfile if sendfile else _sendall
        send_chunks(
            sock,
            held.info,
            lambda: versions.claim(deal),
            lambda start, end: send(sock, held, start, end),
            versions.pacer,
            versions.count_sent,
        )
        if sendfile:
            _wait_for_close(sock)
    finally:
        versions.leave_deal(req, deal)


def send_chunks(
    sock: socket.socket,
    info: TransferInfo,
    claim: Callable[[], int | None],
    send: Callable[[int, int], None],
    pacer: SendPacer | None,
    count: Callable[[int], None],
) -> None:
    """One stream of a raw pull, at the publisher or a relay: STATUS_OK, then each chunk
    `claim` deals this stream, after its index, in the paced pieces `send` puts on the
    socket (`count`ed once the chunk is out), then CHUNKS_END."""
    sock.sendall(bytes([STATUS_OK]))
    more = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_MORE  # the index rides with its chunk
    while (index := claim()) is not None:
        start, end = info.chunk_range(index)
        sock.sendall(CHUNK_INDEX.pack(index), more)
        for piece, piece_end in paced(pacer, start, end):
            send(piece, piece_end)
        count(end - start)
    sock.sendall(CHUNK_INDEX.pack(CHUNKS_END))


def _wait_for_close(sock: socket.socket) -> None:
    """Until the receiver closes its end (it has every byte) or the socket's timeout. The
    pages sendfile gave the socket stay in its queue after the call returns, so the
    version must stay held (its slot not rewritten) until they are delivered; sendall's
    bytes are copies and need no wait. A receiver that sends anything instead is done
    with this stream as well."""
    with suppress(OSError):
        sock.recv(1)


def _sendall(sock: socket.socket, held: _Held, start: int, end: int) -> None:
    sock.sendall(held.view[start:end])


def _sendfile(sock: socket.socket, held: _Held, start: int, end: int) -> None:
    """The kernel copies from the shared-memory file: no pass through this process."""
    while start < end:
        try:
            sent = os.sendfile(sock.fileno(), held.fd, start, end - start)
        except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
            raise TimeoutError(f"receiver read nothing for the socket's timeout at byte {start}") from None
        if sent == 0:
            raise TransferError("receiver closed the connection")
        start += sent


def token_ok(key: bytes, req: Request) -> bool:
    """The request's token is the one granted for its worker and version under `key`."""
    return hmac.compare_digest(req.token.encode(), transfer_token(key, req.worker_id, req.version).encode())


# ------------------------------------------------------------------------------ process entry


def main(control_fd: int, parent_pid: int) -> None:
    """The publisher process: its config, then the inherited listeners and stats page;
    serve until the trainer says stop or goes away."""
    exit_with_parent(parent_pid)
    conn = Connection(control_fd)
    cfg: ServeConfig = conn.recv()
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s[serve]: %(message)s")
    versions = Versions(cfg, conn, mmap.mmap(cfg.stats_fd, STATS_BYTES))
    for g, fd in enumerate(cfg.listener_fds):
        server = _Server(socket.socket(fileno=fd), versions)
        threading.Thread(target=server.serve_forever, args=(0.5,), name=f"polyrl-serve-{g}", daemon=True).start()
    versions.send(Ready(os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone or closed the channel: stop serving
        if isinstance(msg, Publish):
            versions.publish(msg)
        elif isinstance(msg, Forget):
            versions.forget(msg.slot)
        else:
            return
