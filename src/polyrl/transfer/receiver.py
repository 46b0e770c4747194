"""The worker's side of the weight data plane: pull a version into a preallocated
buffer over parallel TCP streams, verify it, and only then hand it to the engine.

Every chunk is checked against its xxh3 checksum as it lands, and the whole buffer
against the version's checksum at the end, so what the engine loads is bit-exact or
nothing: any failure raises TransferError and the engine keeps its current weights.
Encoded pulls (a delta, zstd) are checked the same way after decoding. The one exception
is the opt-in lossy int8 codec: its payload is checked, and the result is marked lossy.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pydantic import ValidationError

from polyrl.tls import client_context
from polyrl.transfer.compress import decode_zstd
from polyrl.transfer.delta import apply_delta
from polyrl.transfer.manifest import Manifest
from polyrl.transfer.pull_proc import Chunks, Job, run, spare_cores_for_checking
from polyrl.transfer.quantize import decode_int8
from polyrl.transfer.receive_pool import MIN_POOL_BYTES, ReceiverPool
from polyrl.transfer.wire import (
    ENCODED_OPS,
    OP_CHUNKS,
    OP_DELTA,
    OP_DESCRIBE,
    OP_INT8,
    OP_SOME,
    OP_ZSTD,
    STATUS_OK,
    PartialPull,
    PullSource,
    TransferError,
    TransferInfo,
    checksum,
    combined_checksum,
    connect,
    encode_request,
    kernel_timeouts,
    read_reply_text,
    read_text,
    recv_exact,
    recv_into_exact,
    wanted_bitmap,
)

log = logging.getLogger("polyrl.transfer")


@dataclass
class Pulled:
    buffer: torch.Tensor
    manifest: Manifest
    seconds: float
    codec: str = "raw"
    """raw, delta (against the base the receiver held), zstd or int8."""
    wire_bytes: int = 0
    lossy: bool = False
    """int8: the buffer approximates the published version (never a delta base)."""
    source: str = ""
    """host:port the version came from (the last source of a pull that failed over)."""
    in_place: bool = False
    """cuda_ipc: the engine reads the trainer's buffer itself (single copy), no copy made."""

    @property
    def bytes_per_s(self) -> float:
        return self.manifest.total_bytes / max(self.seconds, 1e-9)


def describe(source: PullSource, version: int, timeout_s: float = 30.0) -> TransferInfo:
    try:
        with _connect(source, timeout_s) as sock:
            sock.sendall(encode_request(OP_DESCRIBE, version, source.worker_id, source.token))
            status, text = read_reply_text(sock)
    except OSError as e:  # reset, timed out; a TLS publisher resets a plaintext request
        hint = "" if source.tls else " (a TLS publisher? manager.transfer.tls)"
        raise TransferError(
            f"describing v{version} at {source.host}:{source.port} failed: {type(e).__name__}: {e}{hint}"
        ) from None
    if status != STATUS_OK:
        raise TransferError(f"{source.host}:{source.port} refused v{version}: {text.decode(errors='replace')}")
    return parse_description(text, version)


def parse_description(text: bytes, version: int) -> TransferInfo:
    """A DESCRIBE reply as the TransferInfo of `version`; TransferError on anything else
    (the manifest checks its own entries: see `Manifest`)."""
    try:
        info = TransferInfo.model_validate_json(text)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise TransferError(f"bad description of v{version}: {where}: {error['msg']}") from None
    total, chunk = info.manifest.total_bytes, info.chunk_bytes
    if chunk <= 0 or info.num_chunks != -(-total // chunk) or info.manifest.version != version:
        raise TransferError(f"bad description of v{version}: {info.num_chunks} chunks of {chunk} for {total} bytes")
    return info


class PullWatcher(Protocol):
    """Told how a pull goes (a relaying worker serves the chunks on as they check out)."""

    def started(self, info: TransferInfo, buffer: torch.Tensor) -> None:
        """The version's description, and the buffer its chunks land in."""

    def checked(self, index: int) -> None:
        """Chunk `index` lies in the buffer, checked (called from the receiving threads)."""


def pull(
    source: PullSource,
    version: int,
    num_streams: int = 4,
    timeout_s: float = 30.0,
    into: torch.Tensor | None = None,
    base: tuple[int, torch.Tensor] | None = None,
    codec: str = "raw",
    pool: ReceiverPool | None = None,
    fallbacks: Sequence[PullSource] = (),
    watcher: PullWatcher | None = None,
) -> Pulled:
    """Fetch `version` over `num_streams` connections; raises TransferError.

    `into`: a uint8 CPU buffer to reuse (e.g. the one of the version before last), which
    saves allocating and first-touching the pages; it is used when large enough.
    `base`: (version, buffer) the receiver holds; the publisher then sends only the
    words that changed, when it still holds that version (else `codec` follows).
    `codec`: raw (parallel streams), zstd (one compressed payload) or int8 (LOSSY).
    `pool`: receiver processes that pull the raw streams when `into` is one of their
    LandingBuffers' tensors and the version is large (`transfer/receive_pool.py`).
    `fallbacks`: where to go on when `source` (a relaying worker) cannot be reached or
    fails mid-pull, in order (the publisher last): the chunks already checked are kept,
    and the next source is asked only for the rest (op 8 of `wire.py`).
    `watcher`: told the buffer, then each chunk as it checks out."""
    if codec not in ("raw", "zstd", "int8"):
        raise ValueError(f"unknown codec {codec!r} (raw, zstd, int8)")
    t0 = time.perf_counter()
    sources = [source, *fallbacks]
    info, at = _describe_first(sources, version, timeout_s)
    total = info.manifest.total_bytes
    usable = into is not None and into.dtype == torch.uint8 and into.dim() == 1 and into.numel() >= total
    if usable and not into.is_cuda and (base is None or into.data_ptr() != base[1].data_ptr()):  # type: ignore[union-attr]
        buffer = into[:total]  # type: ignore[index]
    else:
        try:
            buffer = torch.empty(total, dtype=torch.uint8)
        except RuntimeError as e:  # the description claims more than this host has
            raise TransferError(f"cannot allocate {total} bytes for v{version}: {e}") from None
    if watcher is not None:
        watcher.started(info, buffer)
    pulled = None
    if base is not None and base[1].numel() == total:
        pulled = _pull_delta(sources[at], info, base, buffer, timeout_s)
    if pulled is None and codec != "raw":
        pulled = _pull_whole(sources[at], info, OP_ZSTD if codec == "zstd" else OP_INT8, buffer, timeout_s)
    if pulled is not None:
        pulled.seconds = time.perf_counter() - t0
        pulled.source = f"{sources[at].host}:{sources[at].port}"
        if watcher is not None and not pulled.lossy:
            for index in range(info.num_chunks):
                watcher.checked(index)
        log.info(
            "pulled v%d as %s%s from %s: %.1f MB on the wire for %.1f MB in %.2fs",
            version,
            pulled.codec,
            " (LOSSY)" if pulled.lossy else "",
            pulled.source,
            pulled.wire_bytes / 1e6,
            total / 1e6,
            pulled.seconds,
        )
        return pulled
    have: set[int] = set()
    failures: list[str] = []
    for i, src in enumerate(sources[at:], start=at):
        missing = [c for c in range(info.num_chunks) if c not in have]
        try:
            if i > at:
                _same_version(info, describe(src, version, timeout_s), src)
            got = _pull_chunks(src, info, missing, buffer, num_streams, timeout_s, pool, watcher)
        except TransferError as e:
            kept = e.got if isinstance(e, PartialPull) else []
            have.update(kept)
            failures.append(f"{src.host}:{src.port}: {e}")
            if i + 1 < len(sources):
                nxt = sources[i + 1]
                log.warning(
                    "pull of v%d from %s:%d failed with %d of %d chunks checked (%s); the rest from %s:%d",
                    version,
                    src.host,
                    src.port,
                    len(have),
                    info.num_chunks,
                    e,
                    nxt.host,
                    nxt.port,
                )
            continue
        if sorted(got) != missing:
            raise TransferError(
                f"pull of v{version}: {src.host}:{src.port} sent {len(got)} chunks, {len(set(got))} distinct, "
                f"of the {len(missing)} asked for"
            )
        have.update(got)
        break
    if len(have) < info.num_chunks:
        raise TransferError(f"pull of v{version} failed: {'; '.join(failures)}")
    if combined_checksum(info.chunk_checksums) != info.buffer_checksum:  # each chunk matched its own
        raise TransferError(f"v{version}: the chunk checksums do not add up to the version's checksum")
    pulled = Pulled(buffer, info.manifest, time.perf_counter() - t0, "raw", total, source=f"{src.host}:{src.port}")
    log.info(
        "pulled v%d from %s: %.1f MB in %.2fs over %d streams%s",
        version,
        pulled.source,
        info.manifest.total_bytes / 1e6,
        pulled.seconds,
        num_streams,
        f" ({len(failures)} sources failed on the way)" if failures else "",
    )
    return pulled


def _describe_first(sources: list[PullSource], version: int, timeout_s: float) -> tuple[TransferInfo, int]:
    """The description from the first source that gives one, and that source's index."""
    failures = []
    for i, src in enumerate(sources):
        try:
            return describe(src, version, timeout_s), i
        except TransferError as e:
            failures.append(str(e))
            if i + 1 < len(sources):
                log.warning("%s; trying %s:%d", e, sources[i + 1].host, sources[i + 1].port)
    raise TransferError("; ".join(failures))


def _same_version(info: TransferInfo, theirs: TransferInfo, source: PullSource) -> None:
    """A fallback must serve the very bytes the first source described."""
    if theirs.chunk_bytes != info.chunk_bytes or theirs.chunk_checksums != info.chunk_checksums:
        raise TransferError(f"{source.host}:{source.port} describes another v{info.manifest.version}")


def _pull_chunks(
    source: PullSource,
    info: TransferInfo,
    missing: list[int],
    buffer: torch.Tensor,
    num_streams: int,
    timeout_s: float,
    pool: ReceiverPool | None,
    watcher: PullWatcher | None,
) -> list[int]:
    """The `missing` chunks from `source` into `buffer`; PartialPull or TransferError."""
    version, every = info.manifest.version, len(missing) == info.num_chunks
    num_streams = max(1, min(num_streams, len(missing)))
    pull_id = secrets.randbits(63)  # names this pull's streams to the publisher, which deals them its chunks
    op, wanted = (OP_CHUNKS, b"") if every else (OP_SOME, wanted_bitmap(missing, info.num_chunks))
    requests = [
        encode_request(op, version, source.worker_id, source.token, i, num_streams, base=pull_id, wanted=wanted)
        for i in range(num_streams)
    ]
    chunks = Chunks(info.chunk_bytes, info.manifest.total_bytes, info.chunk_checksums)
    # a watched pull runs on threads here: the watcher hears of each chunk as it checks out
    landing = None
    if pool is not None and watcher is None and info.manifest.total_bytes >= MIN_POOL_BYTES:
        landing = pool.landing_of(buffer)
    checked = watcher.checked if watcher is not None else None
    try:
        if landing is not None:
            return pool.receive(source, requests, chunks, landing, timeout_s)  # type: ignore[union-attr]
        return _pull_streams(source, requests, chunks, buffer, timeout_s, checked)
    except PartialPull as e:
        raise PartialPull(f"pull of v{version} failed: {e}", e.got) from None
    except TransferError as e:
        raise TransferError(f"pull of v{version} failed: {e}") from None


def _pull_streams(
    source: PullSource,
    requests: list[bytes],
    chunks: Chunks,
    buffer: torch.Tensor,
    timeout_s: float,
    checked: Callable[[int], None] | None = None,
) -> list[int]:
    """The streams on threads of this process (`transfer/pull_proc.py` runs them)."""
    job = Job(
        0,
        False,
        source.host,
        source.port,
        timeout_s,
        requests,
        chunks,
        spare_cores_for_checking(len(requests)),
        source.tls,
        source.ca_file,
    )
    error, got = run(job, memoryview(buffer.numpy()).cast("B"), checked)
    if error is not None:
        raise PartialPull(error, got)
    return got


def _pull_delta(
    source: PullSource, info: TransferInfo, base: tuple[int, torch.Tensor], out: torch.Tensor, timeout_s: float
) -> Pulled | None:
    """None when the publisher cannot make the delta (it no longer holds the base), or when
    the delta, whose own checksum held, does not give the version: our copy of the base is
    not the publisher's (a trainer that restarted from a checkpoint publishes its version
    numbers again with other weights, and workers that outlived it hold the old ones).
    The caller then pulls the version whole."""
    payload = _pull_payload(source, info, OP_DELTA, timeout_s, base=base[0])
    if payload is None:
        return None
    try:
        apply_delta(base[1].numpy(), payload, out.numpy())
    except ValueError as e:
        raise TransferError(f"v{info.manifest.version}: bad delta from v{base[0]}: {e}") from None
    try:
        _verify(info, out, f"the delta from v{base[0]}")
    except TransferError as e:
        log.warning("%s: our v%d is not the publisher's; pulling v%d whole", e, base[0], info.manifest.version)
        return None
    return Pulled(out, info.manifest, 0.0, "delta", len(payload))


def _pull_whole(source: PullSource, info: TransferInfo, op: int, out: torch.Tensor, timeout_s: float) -> Pulled:
    """The whole version as one zstd or int8 payload, decoded into `out`."""
    version, name = info.manifest.version, ENCODED_OPS[op]
    payload = _pull_payload(source, info, op, timeout_s)
    if payload is None:
        raise TransferError(f"publisher has no {name} payload of v{version}")
    try:
        if op == OP_ZSTD:
            decode_zstd(payload, out.numpy())
        else:
            decode_int8(payload, info.manifest, out)
    except ValueError as e:
        raise TransferError(f"v{version}: bad {name} payload: {e}") from None
    if op == OP_ZSTD:
        _verify(info, out, "zstd decoding")
    return Pulled(out, info.manifest, 0.0, name, len(payload), lossy=op == OP_INT8)


def _pull_payload(
    source: PullSource, info: TransferInfo, op: int, timeout_s: float, base: int = -1
) -> bytearray | None:
    """The payload of an encoded op, its checksum verified; None when the publisher
    cannot make it (a delta whose base it no longer holds)."""
    version = info.manifest.version
    with _connect(source, timeout_s) as sock:
        sock.sendall(encode_request(op, version, source.worker_id, source.token, base=base))
        status = recv_exact(sock, 1)[0]
        if status != STATUS_OK:
            text = read_text(sock).decode(errors="replace")
            if op == OP_DELTA and text.startswith("no delta"):
                log.info("no delta for v%d from v%d (%s): pulling it whole", version, base, text)
                return None
            raise TransferError(f"publisher refused v{version}: {text}")
        length = int.from_bytes(recv_exact(sock, 8), "big")
        expected = int.from_bytes(recv_exact(sock, 8), "big")
        if length > 2 * info.manifest.total_bytes + 2**20:
            raise TransferError(
                f"v{version}: a {length}-byte {ENCODED_OPS[op]} payload for a {info.manifest.total_bytes}-byte version"
            )
        payload = bytearray(length)
        recv_into_exact(sock, memoryview(payload))
    if checksum(payload) != expected:
        raise TransferError(f"v{version}: the {ENCODED_OPS[op]} payload failed its checksum")
    return payload


def _verify(info: TransferInfo, out: torch.Tensor, what: str) -> None:
    """The decoded buffer must be exactly the published version, chunk by chunk."""
    view = memoryview(out.numpy()).cast("B")
    for index in range(info.num_chunks):
        start, end = info.chunk_range(index)
        if checksum(view[start:end]) != info.chunk_checksums[index]:
            raise TransferError(f"v{info.manifest.version}: {what} gives a wrong chunk {index}")


def _connect(source: PullSource, timeout_s: float) -> socket.socket:
    sock = connect(source.host, source.port, timeout_s, client_context(source.ca_file) if source.tls else None)
    kernel_timeouts(sock, timeout_s)
    return sock
