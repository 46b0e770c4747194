"""Weight versions held in the trainer's GPU memory, for workers on the same host.

The TCP path snapshots each version into host memory. A worker on the trainer's host is
served from a device copy instead, over NCCL (`transfer/nccl.py`, another GPU) or CUDA
IPC (`transfer/cuda_ipc.py`, the same GPU). The copy is one flat buffer with the TCP
path's layout (a `Manifest`), not the live parameters or a tensor-by-tensor send:
* the trainer keeps training while workers pull, as with the host snapshot;
* NCCL moves it in one broadcast (~3 ms for 1.2 GB over NVLink, DESIGN.md), where ~300
  per-tensor calls would each pay a launch and run far below the link's bandwidth;
* one CUDA IPC handle covers the whole version, and the worker loads it with the same
  `unflatten` + `engine.update_weights` as a TCP pull.
The cost is one more copy of the weights on the trainer's GPU per held version (1.2 GB
for Qwen3-0.6B in bf16), which is why one version is held by default.

A CPU "device" works the same way with gloo instead of NCCL: that is how CI tests the
NCCL path.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping

import torch

from polyrl.transfer.cuda_ipc import serve_ipc
from polyrl.transfer.identity import DeviceIdentity, host_id
from polyrl.transfer.manifest import ALIGN_BYTES, Manifest, TensorEntry
from polyrl.transfer.nccl import NcclSender
from polyrl.transfer.wire import OP_NCCL, STATUS_REFUSED, Request, send_text

log = logging.getLogger("polyrl.transfer")


def gpu_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_identity(device: torch.device) -> DeviceIdentity:
    return DeviceIdentity(host_id=host_id(), gpu_uuid=gpu_uuid(device))


def flatten_on(
    state_dict: Mapping[str, torch.Tensor], version: int, device: torch.device
) -> tuple[torch.Tensor, Manifest]:
    """Pack tensors into one uint8 buffer on `device` (the layout of `manifest.flatten`);
    device-to-device copies when the tensors are already there."""
    entries, offset = [], 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(
                name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    manifest = Manifest(version=version, total_bytes=offset, tensors=entries)  # refuses unknown dtypes
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for entry, t in zip(entries, state_dict.values()):
        buffer[entry.offset : entry.offset + entry.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer, manifest


class DeviceVersions:
    """The newest `keep_versions` versions as flat buffers on `device`, served to same-host
    workers through the publisher's control channel (`WeightPublisher.device`), after the
    same per-worker, per-version token check as a TCP pull."""

    def __init__(self, device: torch.device | str, keep_versions: int = 1, timeout_s: float = 30.0) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep_versions, self.timeout_s = keep_versions, timeout_s
        self.identity = local_identity(self.device)
        self.nccl = NcclSender(timeout_s)
        self._held: dict[int, tuple[torch.Tensor, Manifest]] = {}
        self._lock = threading.Lock()

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Manifest:
        """Snapshot `state_dict` on the device as `version`. Waits for the copies (the
        buffer is read from other threads and processes right after), on this thread's
        stream only: a device-wide sync would also wait for a pair's broadcast to a worker
        that is dying, until its timeout."""
        buffer, manifest = flatten_on(state_dict, version, self.device)
        if buffer.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        with self._lock:
            self._held[version] = (buffer, manifest)
            for old in sorted(self._held)[: -self.keep_versions]:
                del self._held[old]  # a transfer still reading it holds its own reference
        if buffer.is_cuda:
            torch.cuda.ipc_collect()  # frees old versions that IPC readers have released
        return manifest

    def holds(self, version: int) -> bool:
        with self._lock:
            return version in self._held

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def serve(self, sock: socket.socket, req: Request) -> None:
        """One NCCL or CUDA IPC request whose token the publisher has checked."""
        with self._lock:
            held = self._held.get(req.version)
        if held is None:
            send_text(
                sock,
                STATUS_REFUSED,
                f"version {req.version} is not held on the device (held: {self.versions})".encode(),
            )
        elif req.op == OP_NCCL:
            self.nccl.serve(sock, req, *held)
        elif not held[0].is_cuda:
            send_text(sock, STATUS_REFUSED, b"cuda_ipc needs the version on a GPU")
        else:
            serve_ipc(sock, *held, self.identity.gpu_uuid or "", self.timeout_s)

    def close(self) -> None:
        self.nccl.close()
        with self._lock:
            self._held.clear()
