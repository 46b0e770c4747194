"""The trainer's side of the weight data plane: hold recent versions, serve pulls.

`publish` snapshots the weights into a new host buffer (the trainer goes on training
while workers pull), computes the chunk checksums, and keeps the newest `keep_versions`
versions. Receivers pull; the publisher never waits on one: each connection has its own
thread, a deadline for its request and a socket timeout, and a receiver that dies
mid-transfer only ends its own connection.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from polyrl.transfer.compress import encode_zstd
from polyrl.transfer.delta import encode_delta
from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.manifest import Manifest, flatten
from polyrl.transfer.quantize import encode_int8
from polyrl.transfer.wire import (
    ENCODED_OPS,
    GPU_OPS,
    OP_DELTA,
    OP_DESCRIBE,
    OP_ZSTD,
    STATUS_OK,
    STATUS_REFUSED,
    Request,
    TransferError,
    TransferInfo,
    checksum,
    chunk_checksums,
    combined_checksum,
    kernel_timeouts,
    read_request,
    send_text,
    transfer_token,
)

log = logging.getLogger("polyrl.transfer")

DEFAULT_CHUNK_BYTES = 8 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0
"""A connection's whole request must arrive within this long (a receiver sends it at once):
the socket's per-read timeout alone let a client dripping one byte at a time hold its
connection and thread forever."""


@dataclass
class _Held:
    buffer: torch.Tensor
    view: memoryview
    info: TransferInfo
    readers: int = 0
    dropped: bool = False


class WeightPublisher:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        key: bytes | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_versions: int = 2,
        io_timeout_s: float = 30.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        num_groups: int = 1,
        group_hosts: Sequence[str] = (),
    ) -> None:
        """`num_groups` listeners serve the same versions (the seeds' sender groups): group
        g binds `group_hosts[g]` (one per network interface) or `host`, on `port + g` when
        `port` is set, else on any free port; the manager spreads workers over them."""
        if chunk_bytes < 4096 or keep_versions < 1 or num_groups < 1:
            raise ValueError("chunk_bytes must be >= 4096, keep_versions and num_groups >= 1")
        if group_hosts and len(group_hosts) != num_groups:
            raise ValueError(f"{len(group_hosts)} group_hosts for {num_groups} groups")
        self.key = key if key is not None else os.urandom(32)
        self.chunk_bytes, self.keep_versions, self.io_timeout_s = chunk_bytes, keep_versions, io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._held: dict[int, _Held] = {}
        self._spare: torch.Tensor | None = None
        """A dropped version's buffer, no longer read: the next snapshot lands in it."""
        self._lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self._encoded_cache: dict[int, tuple[tuple[int, int], bytes]] = {}  # op -> ((version, base), payload)
        self.bytes_sent = 0
        self.device: DeviceVersions | None = None
        """Versions held on the trainer's GPU for same-host workers (NCCL, CUDA IPC): set it
        and `device.publish` each version there too (`transfer/device.py`)."""
        self._servers: list[_Server] = []
        try:
            for g in range(num_groups):
                server = _Server((group_hosts[g] if group_hosts else host, port + g if port else 0), _Handler)
                server.publisher = self
                self._servers.append(server)
        except BaseException:
            for server in self._servers:
                server.server_close()
            raise
        self.addresses: list[tuple[str, int]] = [s.server_address[:2] for s in self._servers]  # type: ignore[misc]
        """Where each group listens."""
        self.address = self.addresses[0]
        self._threads = [
            threading.Thread(target=s.serve_forever, name=f"polyrl-publisher-{g}", daemon=True)
            for g, s in enumerate(self._servers)
        ]  # fmt: skip

    def start(self) -> WeightPublisher:
        for thread in self._threads:
            thread.start()
        log.info("weight publisher serving on %s", ", ".join(f"{h}:{p}" for h, p in self.addresses))
        return self

    def stop(self) -> None:
        for server, thread in zip(self._servers, self._threads):
            if thread.is_alive():
                server.shutdown()
            server.server_close()
        if self.device is not None:
            self.device.close()

    def __enter__(self) -> WeightPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> TransferInfo:
        """Snapshot `state_dict` as `version`; the oldest versions beyond `keep_versions`
        are dropped (a pull already reading one finishes; new pulls of it are refused)."""
        with self._lock:
            spare, self._spare = self._spare, None
        buffer, manifest = flatten(state_dict, version, out=spare)
        view = memoryview(buffer.numpy()).cast("B")
        sums = chunk_checksums(view, self.chunk_bytes)
        info = TransferInfo(
            manifest=manifest, chunk_bytes=self.chunk_bytes, chunk_checksums=sums, buffer_checksum=combined_checksum(sums)
        )
        with self._lock:
            self._held[version] = _Held(buffer, view, info)
            for old in sorted(self._held)[: -self.keep_versions]:
                self._retire(self._held.pop(old))
        log.debug("weights v%d published: %.1f MB in %d chunks", version, manifest.total_bytes / 1e6, info.num_chunks)
        return info

    def grant(self, worker_id: str, version: int) -> str:
        """The secret that lets `worker_id` pull `version` (hand it out over an
        authenticated channel, e.g. the manager's API)."""
        return transfer_token(self.key, worker_id, version)

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def _retire(self, held: _Held) -> None:
        """A dropped version's buffer is the next snapshot's, once no pull reads it:
        allocating 1.2 GB of pinned memory per version took 1.3 s on an H200 host, the
        copy into it 0.02 s (BENCHMARKS.md). Called with the lock held."""
        held.dropped = True
        self._reuse_if_unread(held)

    def _reuse_if_unread(self, held: _Held) -> None:
        """Called with the lock held."""
        if held.dropped and held.readers == 0:
            self._spare = held.buffer

    @contextmanager
    def _reading(self, version: int) -> Iterator[_Held | None]:
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
                    self._reuse_if_unread(held)

    def _lookup(self, version: int) -> _Held | None:
        with self._lock:
            return self._held.get(version)

    def _encoded(self, op: int, version: int, base: int) -> bytes | None:
        """`version` as the payload of an encoded op (a delta from `base`, zstd, int8),
        made once and shared by every receiver asking for the same; None if a version it
        needs is not held, or a delta's two layouts differ."""
        key = (version, base if op == OP_DELTA else -1)
        with self._encode_lock:  # one encoding at a time: they are large
            cached = self._encoded_cache.get(op)
            if cached is not None and cached[0] == key:
                return cached[1]
            with self._reading(version) as new, self._reading(base) as old:
                return self._encode(op, key, new, old)

    def _encode(self, op: int, key: tuple[int, int], new: _Held | None, old: _Held | None) -> bytes | None:
        """Called with the encode lock held and both versions kept from reuse."""
        if new is None or (op == OP_DELTA and (old is None or old.info.manifest.tensors != new.info.manifest.tensors)):
            return None
        t0 = time.perf_counter()
        if op == OP_DELTA:
            payload = encode_delta(old.buffer.numpy(), new.buffer.numpy())  # type: ignore[union-attr]
        elif op == OP_ZSTD:
            payload = encode_zstd(new.buffer.numpy(), word_bytes(new.info.manifest))
        else:
            payload = encode_int8(new.buffer, new.info.manifest)
        self._encoded_cache[op] = (key, payload)
        log.debug("v%d as %s: %.1f MB (%.1f%% of raw) in %.2fs", key[0], ENCODED_OPS[op], len(payload) / 1e6,
                  100 * len(payload) / max(new.info.manifest.total_bytes, 1), time.perf_counter() - t0)  # fmt: skip
        return payload


def word_bytes(manifest: Manifest) -> int:
    """The element size that covers most of the buffer (zstd's byte planes)."""
    by_size: dict[int, int] = {}
    for e in manifest.tensors:
        by_size[e.itemsize] = by_size.get(e.itemsize, 0) + e.nbytes
    return max(by_size, key=by_size.__getitem__, default=1)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    publisher: WeightPublisher


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        pub: WeightPublisher = self.server.publisher  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        try:
            req = read_request(sock, timeout_s=pub.handshake_timeout_s)
            kernel_timeouts(sock, pub.io_timeout_s)
            with pub._reading(req.version) as held:
                self._serve(pub, sock, req, held, peer)
        except (OSError, ValueError, TransferError) as e:  # a receiver that died, stalled or spoke garbage
            log.debug("weight pull from %s ended: %s: %s", peer, type(e).__name__, e)

    def _serve(self, pub: WeightPublisher, sock: socket.socket, req: Request, held: _Held | None, peer: str) -> None:
        if not _token_ok(pub, req.worker_id, req.version, req.token):
            log.warning("weight pull refused for %r from %s: bad token for v%d", req.worker_id, peer, req.version)
            send_text(sock, STATUS_REFUSED, b"bad transfer token for this worker and version")
        elif req.op in GPU_OPS:
            if pub.device is None:
                send_text(sock, STATUS_REFUSED, f"no versions on a GPU here for {GPU_OPS[req.op]}".encode())
            else:
                pub.device.serve(sock, req)
        elif held is None:
            send_text(sock, STATUS_REFUSED, f"version {req.version} is not held (held: {pub.versions})".encode())
        elif req.op == OP_DESCRIBE:
            send_text(sock, STATUS_OK, held.info.model_dump_json().encode())
        elif req.op in ENCODED_OPS:
            payload = pub._encoded(req.op, req.version, req.base)
            if payload is None:
                send_text(sock, STATUS_REFUSED, f"no {ENCODED_OPS[req.op]} from v{req.base} (held: {pub.versions})".encode())
            else:
                sock.sendall(bytes([STATUS_OK]) + len(payload).to_bytes(8, "big") + checksum(payload).to_bytes(8, "big"))
                sock.sendall(payload)
                pub.bytes_sent += len(payload)
        else:
            sock.sendall(bytes([STATUS_OK]))
            for index in range(req.stream, held.info.num_chunks, req.num_streams):
                start, end = held.info.chunk_range(index)
                sock.sendall(held.view[start:end])
                pub.bytes_sent += end - start


def _token_ok(pub: WeightPublisher, worker: str, version: int, token: str) -> bool:
    return hmac.compare_digest(token.encode(), pub.grant(worker, version).encode())
