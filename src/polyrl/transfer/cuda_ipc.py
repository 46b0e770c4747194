"""CUDA IPC path: a worker whose engine is on the trainer's own GPU copies the version
straight out of the trainer's device buffer (one device-to-device copy, no second GPU),
or keeps it mapped as its weights (a lease: the single-copy local engine).

The trainer shares its flat buffer (`transfer/device.py`) with torch's own
`torch.multiprocessing.reductions.reduce_tensor`: a cudaIpcMemHandle of the allocation,
plus torch's cross-process reference counter and the event that orders the reader after
the writer. The handle goes to the worker over the publisher's authenticated control
channel as JSON, not pickle (a worker unpickling what a socket sends would run whatever
it is told). The worker maps it (`rebuild_cuda_tensor`), loads the version into its
engine, synchronizes, drops the mapping and answers DONE. The publisher's handler holds
its own reference to the buffer until then, so a version published meanwhile never
frees memory that a worker is still reading.

**Leases (single copy).** A worker whose engine can decode from the buffer itself answers
HOLD instead of DONE (when the offer allows it): its parameters become views of the
trainer's buffer, and the trainer's GPU holds one bf16 copy of the weights fewer. The
trainer then writes each next version into the same buffer, in place, and the socket
stays open as the lease that makes this safe:

    trainer -> worker   WRITE v      (about to write v into the buffer)
    worker  -> trainer  PAUSED       (its engine is between steps, its device work done)
    trainer -> worker   WRITTEN      (v is in the buffer: the engine serves it now)
    worker  -> trainer  SERVING
    trainer -> worker   RETIRED      (instead of WRITTEN, or at any time: this buffer is
                                      never written again; keep reading it until you move)
    worker  -> trainer  DONE         (instead of PAUSED, or at any time: not reading it)

The trainer writes in place only after every lease on the buffer said PAUSED; a lease
that says nothing in time makes it retire the buffer and write a new one instead (the
old one stays mapped, unchanged, for whoever still reads it). A worker that loses the
connection while PAUSED cannot know how much was written, and stops its engine.
"""

from __future__ import annotations

import base64
import logging
import socket
import struct
import time

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from polyrl.transfer.manifest import Manifest
from polyrl.transfer.wire import (
    DONE,
    OP_IPC,
    STATUS_OK,
    Offer,
    PullSource,
    TransferError,
    connect,
    encode_request,
    read_offer,
    recv_exact,
    send_text,
)

log = logging.getLogger("polyrl.transfer")

HOLD, PAUSED, SERVING = b"H", b"P", b"S"
"""The worker's lease messages (and DONE: not reading the buffer)."""
WRITE, WRITTEN, RETIRED = b"W", b"V", b"X"
"""The trainer's lease messages; WRITE is followed by the version (8 bytes)."""
_VERSION = struct.Struct("!q")


class IpcHandle(BaseModel):
    """`reduce_tensor`'s arguments for a 1-D uint8 CUDA tensor, bytes in base64."""

    model_config = ConfigDict(extra="forbid")
    numel: int = Field(ge=0)
    tensor_offset: int = Field(ge=0)
    storage_handle: str
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str
    ref_counter_offset: int = Field(ge=0)
    event_handle: str | None
    event_sync_required: bool


class IpcOffer(Offer):
    gpu_uuid: str
    """The GPU the buffer is on: a worker on another GPU refuses the offer."""
    handle: IpcHandle
    lease: bool = False
    """The worker may answer HOLD and keep the buffer as its weights (single copy)."""


def share(buffer: torch.Tensor) -> IpcHandle:
    """A handle to `buffer` (1-D uint8 on CUDA) that another process on its GPU can open."""
    assert buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
    _, args = reduce_tensor(buffer)
    _, size, _, offset, _, _, _, handle, size_bytes, offset_bytes, _, counter, counter_offset, event, event_sync = args
    return IpcHandle(
        numel=size[0],
        tensor_offset=offset,
        storage_handle=_b64(handle),
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=_b64(counter),
        ref_counter_offset=counter_offset,
        event_handle=None if event is None else _b64(event),
        event_sync_required=event_sync,
    )


def open_shared(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """Map a shared buffer into this process, on `device` (this process's index of the
    GPU the buffer is on). Dropping every reference to the result releases the mapping."""
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([handle.numel]),
        (1,),
        handle.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device.index,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        None if handle.event_handle is None else base64.b64decode(handle.event_handle),
        handle.event_sync_required,
    )


def serve_ipc(
    sock: socket.socket,
    buffer: torch.Tensor,
    manifest: Manifest,
    gpu_uuid: str,
    timeout_s: float,
    lease: bool = False,
) -> Lease | None:
    """Publisher side: send a handle to `buffer`, then keep `buffer` alive until the
    worker says DONE (or `timeout_s` passes). With `lease`, the worker may answer HOLD
    instead: the returned Lease then owns a duplicate of `sock`. Failures are logged."""
    try:
        offer = IpcOffer(manifest=manifest, gpu_uuid=gpu_uuid, handle=share(buffer), lease=lease)
        send_text(sock, STATUS_OK, offer.model_dump_json().encode())
        answer = recv_exact(sock, 1, time.monotonic() + timeout_s)
        if lease and answer == HOLD:
            return Lease(sock.dup(), timeout_s)
        if answer != DONE:
            raise TransferError("the worker did not say DONE")
    except (OSError, RuntimeError) as e:  # TransferError, TimeoutError, CUDA errors
        log.warning("cuda_ipc transfer of v%d ended badly: %s: %s", manifest.version, type(e).__name__, e)
    return None


class Lease:
    """Publisher side of one worker's lease on a buffer (see the module's docstring)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.timeout_s = sock, timeout_s
        self.sock.settimeout(None)

    def pause(self, version: int) -> str:
        """Ask the worker to stop reading before `version` is written: "paused", "gone"
        (it no longer reads the buffer: DONE, or the connection ended) or "silent" (no
        answer in time, or a wrong one: the buffer must not be written)."""
        try:
            self.sock.sendall(WRITE + _VERSION.pack(version))
            answer = recv_exact(self.sock, 1, time.monotonic() + self.timeout_s)
        except TimeoutError:
            return "silent"
        except (OSError, TransferError):  # reset or closed: the worker let go or died
            return "gone"
        return {PAUSED: "paused", DONE: "gone"}.get(answer, "silent")

    def written(self) -> bool:
        """The version is in the buffer; True once the worker serves it."""
        try:
            self.sock.sendall(WRITTEN)
            return recv_exact(self.sock, 1, time.monotonic() + self.timeout_s) == SERVING
        except (OSError, TransferError):
            return False

    def retire(self) -> None:
        """The buffer will never be written again; end the lease."""
        try:
            self.sock.sendall(RETIRED)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class IpcVersion:
    """A version mapped from the trainer's GPU, read-only, until `close`."""

    def __init__(self, sock: socket.socket, buffer: torch.Tensor, manifest: Manifest, lease: bool = False) -> None:
        self.sock: socket.socket | None = sock
        self.buffer, self.manifest = buffer, manifest
        self.lease = lease
        """The publisher lets this worker keep the buffer as its weights (`hold`)."""

    @classmethod
    def open(
        cls, source: PullSource, version: int, device: torch.device, gpu_uuid: str, timeout_s: float = 30.0
    ) -> IpcVersion:
        """Ask for `version` and map it; TransferError if refused, or if it is on another
        GPU than this worker's (`gpu_uuid`)."""
        sock = connect(source.host, source.port, timeout_s)
        try:
            sock.sendall(encode_request(OP_IPC, version, source.worker_id, source.token))
            offer = read_offer(sock, IpcOffer, version, "cuda_ipc")
            if offer.gpu_uuid != gpu_uuid:
                raise TransferError(f"offered v{version} on GPU {offer.gpu_uuid}; want it on {gpu_uuid}")
            if offer.handle.numel < offer.manifest.total_bytes:
                raise TransferError(f"v{version}: the shared buffer is smaller than its manifest")
            buffer = open_shared(offer.handle, device)
        except BaseException:
            sock.close()
            raise
        return cls(sock, buffer, offer.manifest, offer.lease)

    def hold(self, timeout_s: float = 60.0) -> HeldVersion:
        """Keep the buffer as this worker's weights (after pointing the engine at it): the
        socket becomes the worker's side of the lease."""
        self.sock.sendall(HOLD)
        held = HeldVersion(self.sock, self.buffer, self.manifest, timeout_s)
        self.buffer, self.sock = torch.empty(0, dtype=torch.uint8), None  # `close` is a no-op from now
        return held

    def close(self) -> None:
        """Drop the mapping (the caller has synchronized after reading it) and tell the
        publisher it may free the buffer."""
        if self.sock is None:  # held: the lease owns the socket and the mapping
            return
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            self.sock.sendall(DONE)
        except OSError as e:
            log.debug("could not tell the publisher DONE: %s", e)
        finally:
            self.sock.close()


class HeldVersion:
    """Worker side of a lease: the trainer's buffer, mapped and read as the engine's
    weights, and the socket the trainer announces each in-place write on."""

    def __init__(self, sock: socket.socket, buffer: torch.Tensor, manifest: Manifest, timeout_s: float) -> None:
        self.sock, self.buffer, self.manifest, self.timeout_s = sock, buffer, manifest, timeout_s
        self.sock.settimeout(None)
        self.released = False

    def next_write(self) -> int | None:
        """Block until the trainer announces a write: its version; None when the lease
        ended (RETIRED, the connection closed, or `release` was called)."""
        try:
            if recv_exact(self.sock, 1) != WRITE:
                return None
            return _VERSION.unpack(recv_exact(self.sock, _VERSION.size, time.monotonic() + self.timeout_s))[0]
        except (OSError, TransferError):
            return None

    def paused(self) -> bool:
        """Say the engine no longer reads the buffer, then wait: True when the new
        version is written, False when the trainer retired the buffer instead (it is
        unchanged). TransferError when the trainer went silent or away: the buffer may
        be half written."""
        try:
            self.sock.sendall(PAUSED)
        except OSError:  # the trainer gave up on us and closed: its RETIRED may still be there to read
            pass
        try:
            answer = recv_exact(self.sock, 1, time.monotonic() + self.timeout_s)
        except (OSError, TransferError) as e:
            raise TransferError(f"the trainer went away while writing into our weights: {e}") from None
        if answer not in (WRITTEN, RETIRED):
            raise TransferError(f"unexpected lease message {answer!r}")
        return answer == WRITTEN

    def serving(self) -> None:
        try:
            self.sock.sendall(SERVING)
        except OSError as e:
            log.debug("could not tell the trainer SERVING: %s", e)

    def release(self) -> None:
        """This worker no longer reads the buffer (it synchronized after its last read):
        say DONE, end the lease and drop the mapping."""
        if self.released:
            return
        self.released = True
        try:
            self.sock.sendall(DONE)
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in next_write
        except OSError:
            pass
        self.sock.close()
        self.buffer = torch.empty(0, dtype=torch.uint8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
