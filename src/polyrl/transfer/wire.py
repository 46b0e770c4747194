"""The weight data plane's wire format (TCP, one request per connection).

A receiver opens one connection for the version's description, then N connections that
share the version's chunks, straight into the receiver's preallocated buffer: the
publisher deals each chunk to whichever stream of the pull is ready for one, so a stream
that runs faster (a less busy core, a better path) carries more of the version. Every
request names the worker, the version and a per-transfer token (HMAC of both under the
publisher's key, handed out by whoever authenticated the worker, i.e. the manager), so a
connection can only read the version it was granted.

    request  = MAGIC | op:u8 | version:i64 | base:i64 | stream:u16 | num_streams:u16
               | worker_len:u16 | worker | token_len:u16 | token
    op 1 (DESCRIBE) reply = status:u8 | len:u32 | JSON TransferInfo (or an error text)
    op 2 (CHUNKS)   `base` = the pull's id (random, the same on its N streams).
                    reply = status:u8 | then, until every chunk of the version has gone
                            out on one of the pull's streams: index:u32 | the raw bytes of
                            chunk `index`; then 0xFFFFFFFF (or len:u32 | error text when
                            status != 0)
    op 3 (DELTA)    reply = status:u8 | len:u64 | xxh3:u64 | the delta of `version` against
                            `base` (`transfer/delta.py`), or len:u32 | error text
    op 4 (ZSTD)     reply = the same framing; the version zstd-compressed (`transfer/compress.py`)
    op 5 (INT8)     reply = the same framing; the version quantized to int8, LOSSY
                            (`transfer/quantize.py`)
    op 8 (SOME)     op 2 for some chunks only: the request goes on with wanted_len:u32 |
                    a bitmap (bit i of byte i // 8, least significant first: chunk i
                    wanted). A receiver whose source failed asks the next source for
                    the chunks it has not verified yet.

With `manager.transfer.tls` every connection is TLS from its first byte (the publisher
presents its certificate, the receiver verifies it against its CA file), then the same
bytes as above; the GPU ops are refused on such a listener (their socket is handed to
another process, which a TLS session cannot follow).

Same-host GPU paths (`transfer/device.py`): the same request, then the data moves outside
this socket, which stays open as the control channel until the transfer ends.

    op 6 (NCCL)     `base` = the pair session the receiver holds (-1: none).
                    reply = status:u8 | len:u32 | JSON NcclOffer (or an error text);
                    receiver -> READY:u8 once its side of the pair group exists; one
                    broadcast from the publisher (rank 0); then status:u8 | len:u32 | text
    op 7 (IPC)      reply = status:u8 | len:u32 | JSON IpcOffer (a CUDA IPC handle of the
                    version); receiver -> DONE:u8 once it has copied it and let go
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError

from polyrl.transfer.schema import Manifest

MAGIC = b"PRLW3\n"
"""Ends in the wire's version: PRLW2 was the same but for op 2, which sent stream i the
chunks i, i+N, ... (a fixed share)."""
OP_DESCRIBE, OP_CHUNKS, OP_DELTA, OP_ZSTD, OP_INT8, OP_NCCL, OP_IPC, OP_SOME = 1, 2, 3, 4, 5, 6, 7, 8
CHUNK_OPS = {OP_CHUNKS, OP_SOME}
"""Ops whose reply is raw chunks, dealt to the pull's streams."""
ENCODED_OPS = {OP_DELTA: "delta", OP_ZSTD: "zstd", OP_INT8: "int8"}
"""Ops whose reply is one payload made by the publisher (once per version, shared)."""
GPU_OPS = {OP_NCCL: "nccl", OP_IPC: "cuda_ipc"}
"""Ops served from the version held on the trainer's GPU (`WeightPublisher.device`)."""
KNOWN_OPS = {OP_DESCRIBE, *CHUNK_OPS, *ENCODED_OPS, *GPU_OPS}
READY, DONE = b"R", b"D"
STATUS_OK, STATUS_REFUSED = 0, 1
_HEADER = struct.Struct("!BqqHH")
_U16, _U32 = struct.Struct("!H"), struct.Struct("!I")
CHUNK_INDEX = _U32
"""What precedes each chunk of op 2; CHUNKS_END ends the stream."""
CHUNKS_END = 0xFFFFFFFF
MAX_TEXT = 16 * 2**20
"""Largest description or error text accepted (a manifest of a few thousand tensors)."""


class TransferInfo(BaseModel):
    """What a receiver needs before pulling: the manifest, how the buffer is chunked, and
    a checksum per chunk plus one over the whole buffer (bit-exact result)."""

    model_config = ConfigDict(extra="forbid")
    manifest: Manifest
    chunk_bytes: int
    chunk_checksums: list[int]
    """xxh3_64 of each chunk."""
    buffer_checksum: int
    """`combined_checksum(chunk_checksums)`: one value for the whole buffer that a receiver
    checks without reading the buffer a second time."""

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.manifest.total_bytes)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_checksums)


@dataclass(frozen=True)
class PullSource:
    """Where a receiver pulls a version from, and the grant it shows: what every request
    of a pull carries, whichever process (`receiver`, `receive_pool`) sends it."""

    host: str
    port: int
    worker_id: str
    token: str
    tls: bool = False
    """The publisher speaks TLS (`manager.transfer.tls`)."""
    ca_file: str | None = None
    """What its certificate is verified against (None: the system's trust store)."""


class TransferError(RuntimeError):
    """A pull failed (refused, cut, corrupted); the receiver's old weights are untouched."""


class PartialPull(TransferError):
    """A raw pull that failed after some chunks had checked out: `got` names them (they
    lie in the receiver's buffer), so the next source is asked only for the rest."""

    def __init__(self, message: str, got: list[int]) -> None:
        super().__init__(message)
        self.got = got


class WireVersionError(ValueError):
    """The other side speaks another version of this wire (the publisher says so in its
    refusal, which every version frames the same way)."""


def checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def chunk_checksums(buffer: memoryview, chunk_bytes: int) -> list[int]:
    return [checksum(buffer[i : i + chunk_bytes]) for i in range(0, len(buffer), chunk_bytes)]


def combined_checksum(chunk_sums: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(c.to_bytes(8, "big") for c in chunk_sums))


def transfer_token(key: bytes, worker_id: str, version: int) -> str:
    return hmac.new(key, f"{worker_id}\0{version}".encode(), hashlib.sha256).hexdigest()


def relay_key(key: bytes, relay_id: str) -> bytes:
    """The key a relaying worker checks its receivers' tokens with: derived from the
    publisher's by whoever holds that (the manager), so a relay learns a key that opens
    only itself, never the publisher's."""
    return hmac.new(key, f"relay\0{relay_id}".encode(), hashlib.sha256).digest()


def encode_request(
    op: int,
    version: int,
    worker_id: str,
    token: str,
    stream: int = 0,
    num_streams: int = 1,
    base: int = -1,
    wanted: bytes = b"",
) -> bytes:
    """`wanted`: op 8's chunk bitmap (`wanted_bitmap`)."""
    worker, tok = worker_id.encode(), token.encode()
    parts = [MAGIC, _HEADER.pack(op, version, base, stream, num_streams), _U16.pack(len(worker)), worker]
    parts += [_U16.pack(len(tok)), tok]
    if op == OP_SOME:
        parts += [_U32.pack(len(wanted)), wanted]
    return b"".join(parts)


def wanted_bitmap(indices: Iterable[int], num_chunks: int) -> bytes:
    bits = bytearray(-(-num_chunks // 8))
    for i in indices:
        bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def wanted_chunks(bitmap: bytes, num_chunks: int) -> list[int]:
    """The chunks a bitmap names, in order; ValueError for a bitmap of another size."""
    if len(bitmap) != -(-num_chunks // 8):
        raise ValueError(f"a {len(bitmap)}-byte chunk bitmap for a version of {num_chunks} chunks")
    return [i for i in range(num_chunks) if bitmap[i // 8] >> (i % 8) & 1]


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; TimeoutError past `deadline` (monotonic), however the bytes trickle in.

    Without a deadline on a socket set up by `kernel_timeouts`, each call waits in the
    kernel for the whole rest of `view` (MSG_WAITALL): one system call and one release of
    the GIL per piece, where a Python-timeout socket polls and wakes per arriving segment."""
    got = 0
    waitall = deadline is None and sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket)
    flags = socket.MSG_WAITALL if waitall else 0  # TLS records are read whole by OpenSSL
    while got < len(view):
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {got} of {len(view)} bytes")
            sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], 0, flags)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
            raise TimeoutError(f"no data for the socket's timeout after {got} of {len(view)} bytes") from None
        if n == 0:
            raise TransferError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking, with the idle timeout enforced by the kernel (SO_RCVTIMEO,
    SO_SNDTIMEO) rather than by Python, which polls before every send and recv. Bulk
    transfers then move a whole piece per system call; a peer that stalls for `seconds`
    still ends the call with TimeoutError (recv) or an OSError (send). A TLS socket keeps
    Python's timeout: OpenSSL reads a kernel timeout as 'want read', not as a timeout."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


@dataclass(frozen=True)
class Request:
    op: int
    version: int
    base: int
    stream: int
    num_streams: int
    worker_id: str
    token: str
    wanted: bytes = b""
    """op 8: the bitmap of the chunks asked for."""


def read_request(sock: socket.socket, timeout_s: float | None = None) -> Request:
    """Raises ValueError on anything that is not a well-formed request, TransferError if
    the sender hangs up first, and TimeoutError if the whole request takes longer than
    `timeout_s` (a per-read timeout never fires on a client sending a byte at a time)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    magic = recv_exact(sock, len(MAGIC), deadline)
    if magic != MAGIC:
        if magic[:4] == MAGIC[:4]:
            theirs = magic[:5].decode(errors="replace")
            raise WireVersionError(
                f"weight-transfer wire {theirs}, this side speaks {MAGIC[:5].decode()}: "
                "upgrade the older of the worker and the trainer"
            )
        raise ValueError("not a polyrl weight-transfer request")
    op, version, base, stream, num_streams = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
    worker = recv_exact(sock, _U16.unpack(recv_exact(sock, 2, deadline))[0], deadline).decode()
    token = recv_exact(sock, _U16.unpack(recv_exact(sock, 2, deadline))[0], deadline).decode()
    if op not in KNOWN_OPS or num_streams < 1 or stream >= num_streams:
        raise ValueError(f"bad request header (op {op}, stream {stream} of {num_streams})")
    wanted = b""
    if op == OP_SOME:
        (length,) = _U32.unpack(recv_exact(sock, 4, deadline))
        if length > MAX_TEXT:
            raise ValueError(f"a chunk bitmap of {length} bytes")
        wanted = recv_exact(sock, length, deadline)
    return Request(op, version, base, stream, num_streams, worker, token, wanted)


def send_text(sock: socket.socket, status: int, text: bytes) -> None:
    sock.sendall(bytes([status]) + _U32.pack(len(text)) + text)


def read_text(sock: socket.socket) -> bytes:
    """The len:u32 | text that follows a status byte (a description or an error)."""
    (length,) = _U32.unpack(recv_exact(sock, 4))
    if length > MAX_TEXT:
        raise TransferError(f"reply of {length} bytes is over the {MAX_TEXT}-byte limit")
    return recv_exact(sock, length)


def connect(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the publisher (TLS, its certificate verified, with `tls`);
    TransferError when it cannot be reached or its certificate does not verify."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise TransferError(f"cannot reach the publisher at {host}:{port}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=host)
    except (OSError, ValueError) as e:  # ssl.SSLError (a bad certificate) is an OSError
        sock.close()
        raise TransferError(f"TLS with the publisher at {host}:{port} failed: {e}") from None


def read_reply_text(sock: socket.socket) -> tuple[int, bytes]:
    status = recv_exact(sock, 1)[0]
    return status, read_text(sock)


class Offer(BaseModel):
    """A device path's reply to a pull (NCCL, CUDA IPC): the version's manifest, plus
    what that path needs to move it."""

    model_config = ConfigDict(extra="forbid")
    manifest: Manifest


OfferT = TypeVar("OfferT", bound=Offer)


def read_offer(sock: socket.socket, kind: type[OfferT], version: int, path: str) -> OfferT:
    """The publisher's offer of `version` over `path`; TransferError if it refused, sent
    something malformed, or offered another version."""
    status, text = read_reply_text(sock)
    if status != STATUS_OK:
        raise TransferError(f"publisher refused v{version} over {path}: {text.decode(errors='replace')}")
    try:
        offer = kind.model_validate_json(text)
    except ValidationError as e:
        raise TransferError(f"bad {path} offer for v{version}: {e.errors()[0]['msg']}") from None
    if offer.manifest.version != version:
        raise TransferError(f"asked for v{version}, offered v{offer.manifest.version}")
    return offer
