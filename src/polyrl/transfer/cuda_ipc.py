"""CUDA IPC path: a worker whose engine is on the trainer's own GPU copies the version
straight out of the trainer's device buffer (one device-to-device copy, no second GPU).

The trainer shares its flat buffer (`transfer/device.py`) with torch's own
`torch.multiprocessing.reductions.reduce_tensor`: a cudaIpcMemHandle of the allocation,
plus torch's cross-process reference counter and the event that orders the reader after
the writer. The handle goes to the worker over the publisher's authenticated control
channel as JSON, not pickle (a worker unpickling what a socket sends would run whatever
it is told). The worker maps it (`rebuild_cuda_tensor`), loads the version into its
engine, synchronizes, drops the mapping and answers DONE. The publisher's handler holds
its own reference to the buffer until then, so a version published meanwhile never
frees memory that a worker is still reading.
"""

from __future__ import annotations

import base64
import logging
import socket
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


def serve_ipc(sock: socket.socket, buffer: torch.Tensor, manifest: Manifest, gpu_uuid: str, timeout_s: float) -> None:
    """Publisher side: send a handle to `buffer`, then keep `buffer` alive until the
    worker says DONE (or `timeout_s` passes). Failures are logged."""
    try:
        offer = IpcOffer(manifest=manifest, gpu_uuid=gpu_uuid, handle=share(buffer))
        send_text(sock, STATUS_OK, offer.model_dump_json().encode())
        if recv_exact(sock, 1, time.monotonic() + timeout_s) != DONE:
            raise TransferError("the worker did not say DONE")
    except (OSError, RuntimeError) as e:  # TransferError, TimeoutError, CUDA errors
        log.warning("cuda_ipc transfer of v%d ended badly: %s: %s", manifest.version, type(e).__name__, e)


class IpcVersion:
    """A version mapped from the trainer's GPU, read-only, until `close`."""

    def __init__(self, sock: socket.socket, buffer: torch.Tensor, manifest: Manifest) -> None:
        self.sock, self.buffer, self.manifest = sock, buffer, manifest

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
        return cls(sock, buffer, offer.manifest)

    def close(self) -> None:
        """Drop the mapping (the caller has synchronized after reading it) and tell the
        publisher it may free the buffer."""
        del self.buffer
        try:
            self.sock.sendall(DONE)
        except OSError as e:
            log.debug("could not tell the publisher DONE: %s", e)
        finally:
            self.sock.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
