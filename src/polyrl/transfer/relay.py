"""A worker's relay: it serves the versions it holds, and the one it is pulling, to other
workers, so the trainer's link carries a version once or twice instead of once per worker.

The wire is the publisher's (`wire.py`: DESCRIBE, and raw chunks by op 2 or op 8), so a
receiver pulls from a relay with the same code, and goes on from the next source of its
list (another relay, the publisher last) when this one dies or stalls, keeping the chunks
it has checked. A relay forwards a chunk only once it has checked it itself (`PullWatcher`
of `receiver.pull`), and forwards it as soon as it has: a chain of relays moves a version
in about the time of one pull plus one chunk per hop, not one pull per hop.

Tokens are checked under the relay's own key, which the manager derives from the
publisher's (`wire.relay_key`): the relay can open itself to the receivers the manager
grants, never the publisher. A version held whole is also served as a delta against the
version before or as zstd, made as the publisher makes them; one still arriving is
refused for those with the text a receiver reads as "pull it raw". int8 is never served
(a relay's copies are exact). The relay's sends are capped like the publisher's
(`manager.transfer.max_send_gbps`). Threads here only move bytes.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from polyrl.tls import server_context
from polyrl.transfer.pacing import SendPacer, gbps_to_bytes
from polyrl.transfer.serve import encode_payload, handle_connection, send_chunks, send_payload, token_ok
from polyrl.transfer.wire import (
    CHUNK_OPS,
    ENCODED_OPS,
    OP_DELTA,
    OP_DESCRIBE,
    OP_SOME,
    OP_ZSTD,
    STATUS_OK,
    STATUS_REFUSED,
    Request,
    TransferError,
    TransferInfo,
    send_text,
    wanted_chunks,
)

log = logging.getLogger("polyrl.transfer")

WAIT_FOR_VERSION_S = 30.0
"""How long a DESCRIBE waits for a version this relay has not started pulling yet (the
manager tells parent and child at about the same time)."""


@dataclass
class _Version:
    """A version held or arriving, and which of its chunks have checked out."""

    info: TransferInfo
    buffer: torch.Tensor
    view: memoryview
    landed: list[bool]
    num_landed: int = 0
    gone: str = ""
    """Why it is no longer served (its pull failed, a newer one took its buffer)."""

    @property
    def complete(self) -> bool:
        return self.num_landed == len(self.landed)

    def array(self) -> np.ndarray:
        return np.frombuffer(self.view, np.uint8)


@dataclass
class _Deal:
    """One pull's chunks still to send, dealt to its streams as each lands here."""

    pending: list[int]
    streams_left: int
    joined: int = 0


class Relay:
    """Serves, over TCP (TLS with a certificate), the versions `watch` was told about."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        key: bytes | None = None,
        max_send_gbps: float | None = None,
        keep_versions: int = 2,
        io_timeout_s: float = 30.0,
        wait_for_version_s: float = WAIT_FOR_VERSION_S,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        self.key = key
        """Set by the manager's grant (`wire.relay_key`); None refuses every pull."""
        self.keep_versions, self.io_timeout_s, self.wait_for_version_s = keep_versions, io_timeout_s, wait_for_version_s
        rate = gbps_to_bytes(max_send_gbps)
        self.pacer = SendPacer(rate) if rate else None
        self.bytes_sent = 0
        self._versions: dict[int, _Version] = {}
        self._deals: dict[tuple[str, int, int], _Deal] = {}
        self._cond = threading.Condition()
        self._encode_lock = threading.Lock()
        self._encoded_cache: tuple[tuple[int, int, int], bytes] | None = None
        tls = server_context(tls_cert_file, tls_key_file) if tls_cert_file and tls_key_file else None
        self._server = _Server((host, port), self, tls)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name="polyrl-relay", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def grant(self, key: bytes, max_send_gbps: float | None) -> None:
        """The manager's grant (with each pull it asks for): the key, and the send cap."""
        rate = gbps_to_bytes(max_send_gbps)
        with self._cond:
            self.key = key
            if (self.pacer.bytes_per_s if self.pacer else None) != rate:
                self.pacer = SendPacer(rate) if rate else None

    # ----------------------------------------------------------------- the worker's own pulls

    def watch(self, version: int) -> _Watch:
        """A `receiver.PullWatcher` for the worker's pull of `version`: it is served from
        the moment its description is known, each chunk once it has checked out."""
        return _Watch(self, version)

    def _started(self, version: int, info: TransferInfo, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        with self._cond:
            for v, held in list(self._versions.items()):
                if held.buffer.data_ptr() == buffer.data_ptr() or v == version:  # the pull lands on it
                    self._drop(v, f"v{v}'s buffer now takes v{version}")
            self._versions[version] = _Version(info, buffer, view, [False] * info.num_chunks)
            for old in sorted(self._versions)[: -self.keep_versions]:
                self._drop(old, f"v{old} is older than the {self.keep_versions} kept")
            self._cond.notify_all()

    def _checked(self, version: int, index: int) -> None:
        with self._cond:
            held = self._versions.get(version)
            if held is not None and not held.landed[index]:
                held.landed[index] = True
                held.num_landed += 1
                self._cond.notify_all()

    def failed(self, version: int, why: str) -> None:
        """The worker's pull of `version` failed: its receivers here go on elsewhere."""
        with self._cond:
            if version in self._versions:
                self._drop(version, why)
            self._cond.notify_all()

    def _drop(self, version: int, why: str) -> None:
        held = self._versions.pop(version)
        held.gone = why

    def holds(self, version: int) -> bool:
        with self._cond:
            held = self._versions.get(version)
            return held is not None and held.complete

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._cond:
            for v in list(self._versions):
                self._drop(v, "the relay closed")
            self._cond.notify_all()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- serving

    def _version(self, version: int, wait_s: float) -> _Version | None:
        """`version`, waiting up to `wait_s` for its pull to start here; None if it does
        not (or an older version is asked for than what is held)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                held = self._versions.get(version)
                newest = max(self._versions, default=-1)
                remaining = deadline - time.monotonic()
                if held is not None or version < newest or remaining <= 0:
                    return held
                self._cond.wait(remaining)

    def _next_chunk(self, held: _Version, deal: _Deal) -> int | None:
        """The first of `deal`'s chunks that has landed (waiting for one); None when all are
        dealt. TransferError when the version is dropped or nothing lands for the timeout."""
        with self._cond:
            while deal.pending:
                if held.gone:
                    raise TransferError(f"the relay lost the version: {held.gone}")
                for i, index in enumerate(deal.pending):
                    if held.landed[index]:
                        return deal.pending.pop(i)
                if not self._cond.wait(self.io_timeout_s):
                    raise TransferError(f"no chunk landed at the relay for {self.io_timeout_s:g}s")
            return None

    def _join(self, req: Request, num_chunks: int) -> _Deal:
        key = (req.worker_id, req.version, req.base)
        with self._cond:
            deal = self._deals.get(key)
            if deal is None:
                wanted = wanted_chunks(req.wanted, num_chunks) if req.op == OP_SOME else list(range(num_chunks))
                deal = self._deals[key] = _Deal(wanted, req.num_streams)
            if deal.joined >= req.num_streams:
                raise ValueError(f"stream {req.stream} of {req.num_streams} does not fit pull {req.base}")
            deal.joined += 1
            return deal

    def _leave(self, req: Request, deal: _Deal) -> None:
        with self._cond:
            deal.streams_left -= 1
            if deal.streams_left <= 0:
                self._deals.pop((req.worker_id, req.version, req.base), None)

    def serve(self, sock: socket.socket, req: Request, peer: str) -> None:
        """The token is checked once the version is here: the manager grants this relay its
        key with the worker's own pull, which may reach it after a receiver's first request."""
        if req.op not in (OP_DESCRIBE, OP_DELTA, OP_ZSTD, *CHUNK_OPS):
            send_text(sock, STATUS_REFUSED, f"no {ENCODED_OPS.get(req.op, req.op)} at a relay".encode())
            return
        held = self._version(req.version, self.wait_for_version_s if req.op == OP_DESCRIBE else 0.0)
        with self._cond:
            key = self.key
        if key is None or not token_ok(key, req):
            log.warning("relay refused %r from %s: bad token for v%d", req.worker_id, peer, req.version)
            send_text(sock, STATUS_REFUSED, b"bad transfer token for this worker and version")
        elif held is None:
            with self._cond:
                have = sorted(self._versions)
            send_text(sock, STATUS_REFUSED, f"version {req.version} is not held here (held: {have})".encode())
        elif req.op == OP_DESCRIBE:
            send_text(sock, STATUS_OK, held.info.model_dump_json().encode())
        elif req.op in ENCODED_OPS:
            payload = self._encoded(req.op, req.version, req.base)
            if payload is None:  # "no delta" is what a receiver reads as: pull this version raw
                what = ENCODED_OPS[req.op]
                text = f"no {what} from v{req.base}" if req.op == OP_DELTA else f"no {what} payload"
                send_text(sock, STATUS_REFUSED, f"{text} at this relay yet: pull v{req.version} raw".encode())
                return
            send_payload(sock, payload, self.pacer)
            self._count_sent(len(payload))
        else:
            self._serve_chunks(sock, req, held)

    def _encoded(self, op: int, version: int, base: int) -> bytes | None:
        """A delta (from `base`) or zstd payload of `version`, as the publisher makes them,
        once both versions are here whole (a version still arriving is served raw, chunk
        by chunk); made once and shared by every receiver asking for the same."""
        key = (op, version, base if op == OP_DELTA else -1)
        with self._encode_lock:
            if self._encoded_cache is not None and self._encoded_cache[0] == key:
                return self._encoded_cache[1]
            with self._cond:
                new, old = self._versions.get(version), self._versions.get(base)
            if new is None or not new.complete or (op == OP_DELTA and (old is None or not old.complete)):
                return None
            payload = encode_payload(op, new, old)
            if new.gone or (old is not None and old.gone):  # a pull took a buffer meanwhile
                return None
            if payload is not None:
                self._encoded_cache = (key, payload)
            return payload

    def _serve_chunks(self, sock: socket.socket, req: Request, held: _Version) -> None:
        try:
            deal = self._join(req, held.info.num_chunks)
        except ValueError as e:
            send_text(sock, STATUS_REFUSED, str(e).encode())
            return
        try:  # sendall copies: the buffer may change hands once this returns
            send_chunks(
                sock,
                held.info,
                lambda: self._next_chunk(held, deal),
                lambda start, end: sock.sendall(held.view[start:end]),
                self.pacer,
                self._count_sent,
            )
        finally:
            self._leave(req, deal)

    def _count_sent(self, nbytes: int) -> None:
        with self._cond:
            self.bytes_sent += nbytes


class _Watch:
    """`receiver.PullWatcher` of one version for a `Relay`."""

    def __init__(self, relay: Relay, version: int) -> None:
        self.relay, self.version = relay, version

    def started(self, info: TransferInfo, buffer: torch.Tensor) -> None:
        self.relay._started(self.version, info, buffer)

    def checked(self, index: int) -> None:
        self.relay._checked(self.version, index)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], relay: Relay, tls: ssl.SSLContext | None) -> None:
        self.relay, self.tls = relay, tls
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        log.warning("relay: a pull from %s failed", client_address, exc_info=log.isEnabledFor(logging.DEBUG))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        relay: Relay = self.server.relay  # type: ignore[attr-defined]
        timeout_s = relay.io_timeout_s
        tls: ssl.SSLContext | None = self.server.tls  # type: ignore[attr-defined]
        handle_connection(self.request, self.client_address, tls, timeout_s, timeout_s, relay.serve, "relayed pull")
