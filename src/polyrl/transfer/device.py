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
for Qwen3-0.6B in bf16), which is why one version is held by default. The local worker
on the same GPU pays nothing more: it decodes from this buffer in place (single copy,
`DeviceVersions` below), where it used to hold a copy of its own.

A CPU "device" works the same way with gloo instead of NCCL: that is how CI tests the
NCCL path.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from polyrl.transfer.cuda_ipc import Lease, serve_ipc
from polyrl.transfer.identity import DeviceIdentity, host_id
from polyrl.transfer.manifest import ALIGN_BYTES, Manifest, TensorEntry, unflatten
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


def stored_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """What `t` is stored as in a version published with `dtype`: floating tensors cast
    to it when given, the rest (a LoRA version's spec) as they are."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def device_layout(state_dict: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None) -> Manifest:
    """The flat layout of `state_dict` (that of `manifest.flatten`), its floating tensors
    as `dtype` when given."""
    entries, offset = [], 0
    for name, t in state_dict.items():
        target = stored_dtype(t, dtype)
        nbytes = t.numel() * target.itemsize
        entries.append(
            TensorEntry(
                name=name, dtype=str(target).removeprefix("torch."), shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return Manifest(version=version, total_bytes=offset, tensors=entries)  # refuses unknown dtypes


def layout_key(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> tuple:
    """What decides the layout (names, shapes, dtypes), cheap to compare per version."""
    return tuple((name, t.shape, stored_dtype(t, dtype)) for name, t in state_dict.items())


LARGE_TENSOR = 16 << 20
"""Elements from which a tensor is cast and copied by a kernel of its own (see
`write_flat`). On an H200: 1M sent most of Qwen3-0.6B's tensors one by one again (its
write 1.1 -> 2.4 ms); 64M left Qwen3-8B's MLP matrices in the slower multi-tensor copy
(13.6 ms against 11.9 at 16M)."""


def write_flat(views: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast) each tensor into its view of the flat buffer. The small tensors go
    in one multi-tensor copy per pair of dtypes: a Qwen3-0.6B version is 311 tensors, and
    a cast-and-copy kernel for each took 3.6 ms of the 4.8 ms from publish to the
    single-copy engine serving it (H200), most of it launches. A large tensor gets a
    kernel of its own: the multi-tensor cast ran at 3.48 TB/s on Qwen3-8B's, a `copy_`
    each at 3.97, and this split at 4.12 (14.1, 12.4 and 11.9 ms for 49 GB read and
    written)."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for name, t in state_dict.items():
            if t.numel() >= LARGE_TENSOR:
                views[name].copy_(t.detach())
                continue
            dst, src = groups.setdefault((views[name].dtype, t.dtype), ([], []))
            dst.append(views[name])
            src.append(t.detach())
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)


def flatten_on(
    state_dict: Mapping[str, torch.Tensor], version: int, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, Manifest]:
    """Pack tensors into one uint8 buffer on `device` (the layout of `manifest.flatten`),
    floating ones cast to `dtype` when given."""
    manifest = device_layout(state_dict, version, dtype)
    buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    write_flat(unflatten(buffer, manifest), state_dict)
    return buffer, manifest


@dataclass(eq=False)
class _Held:
    buffer: torch.Tensor
    manifest: Manifest
    key: tuple
    """`layout_key` of the version: a next version with the same key fits in place."""
    views: dict[str, torch.Tensor]
    readers: int = 0
    """Transfers reading the buffer now (NCCL broadcasts, CUDA IPC copies)."""
    leases: list[Lease] = field(default_factory=list)
    """Workers whose engines decode from the buffer itself (single copy)."""
    retired: bool = False
    """Never written in place again (a lease failed): the next version gets a new buffer."""

    def retire(self) -> None:
        self.retired = True
        for lease in self.leases:
            lease.retire()
        self.leases = []


class DeviceVersions:
    """The newest `keep_versions` versions as flat buffers on `device`, served to same-host
    workers through the publisher's control channel (`WeightPublisher.device`), after the
    same per-worker, per-version token check as a TCP pull.

    With `single_copy` (and one version kept), a worker on the same GPU may keep the
    buffer as its engine's weights (a lease, `transfer/cuda_ipc.py`). Each next version
    is then written into the same buffer, in place, while that engine is paused between
    two steps, so the trainer's GPU holds one bf16 copy of the weights, not two."""

    def __init__(
        self,
        device: torch.device | str,
        keep_versions: int = 1,
        timeout_s: float = 30.0,
        single_copy: bool = True,
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep_versions, self.timeout_s = keep_versions, timeout_s
        self.single_copy = single_copy and keep_versions == 1
        self.identity = local_identity(self.device)
        self.nccl = NcclSender(timeout_s)
        self._held: dict[int, _Held] = {}
        self._cv = threading.Condition()
        self.last_write: dict[str, float] = {}
        """How the last in-place write went (seconds): `pause_s`, `write_s`, `serving_s`."""

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None
    ) -> Manifest:
        """Snapshot `state_dict` on the device as `version` (floating tensors as `dtype`
        when given). Waits for the copies (the buffer is read from other threads and
        processes right after), on this thread's stream only: a device-wide sync would
        also wait for a pair's broadcast to a worker that is dying, until its timeout.
        With leases on the newest buffer, the version is written into it in place, and
        the leasing engines serve it when this returns."""
        key = layout_key(state_dict, dtype)
        with self._cv:
            newest = self._held[max(self._held)] if self._held else None
        if newest is not None and newest.leases and self._write_in_place(newest, key, version, state_dict):
            return newest.manifest
        manifest = device_layout(state_dict, version, dtype)
        buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
        views = unflatten(buffer, manifest)
        write_flat(views, state_dict)
        if buffer.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        with self._cv:
            self._held[version] = _Held(buffer, manifest, key, views)
            for old in sorted(self._held)[: -self.keep_versions]:
                self._held.pop(old).retire()  # a transfer still reading it holds its own reference
        if buffer.is_cuda:
            torch.cuda.ipc_collect()  # frees old versions that IPC readers have released
        return manifest

    def _write_in_place(self, held: _Held, key: tuple, version: int, state_dict: Mapping[str, torch.Tensor]) -> bool:
        """Write `version` into `held`'s buffer once no transfer reads it and every lease
        paused its engine; False (and `held` retired) when that cannot be done safely."""
        manifest = held.manifest.model_copy(update={"version": version})
        t0 = time.monotonic()
        with self._cv:
            if held.retired or key != held.key:
                held.retire()
                return False
            del self._held[held.manifest.version]  # refused to new transfers while it changes
            drained = self._cv.wait_for(lambda: held.readers == 0, self.timeout_s)
        if not drained:
            log.warning(
                "v%d: a transfer still reads the buffer after %.0f s; writing a new one", version, self.timeout_s
            )
            return self._give_up(held)
        paused = []
        for lease in list(held.leases):
            answer = lease.pause(manifest.version)
            if answer == "paused":
                paused.append(lease)
            elif answer == "gone":
                held.leases.remove(lease)
                lease.close()
            else:
                log.warning("v%d: a worker reading the weights in place did not pause; writing a new buffer", version)
                return self._give_up(held)  # RETIRED resumes the paused ones on the old, untouched weights
        t1 = time.monotonic()
        write_flat(held.views, state_dict)
        if held.buffer.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        t2 = time.monotonic()
        held.manifest = manifest
        for lease in paused:
            if not lease.written():  # it may still read: never write this buffer again
                log.warning(
                    "v%d: a worker reading the weights in place did not confirm; its buffer retires", manifest.version
                )
                held.retired = True
        with self._cv:
            self._held[manifest.version] = held
        self.last_write = {"pause_s": t1 - t0, "write_s": t2 - t1, "serving_s": time.monotonic() - t2}
        return True

    def _give_up(self, held: _Held) -> bool:
        """An in-place write that cannot be made safely: `held` is served again as it was,
        retired (never written again, its leases told so); the caller writes a new buffer."""
        with self._cv:
            self._held[held.manifest.version] = held
        held.retire()
        return False

    def holds(self, version: int) -> bool:
        with self._cv:
            return version in self._held

    @property
    def versions(self) -> list[int]:
        with self._cv:
            return sorted(self._held)

    def views(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of a held version, as views of its buffer (KeyError if not held)."""
        with self._cv:
            return dict(self._held[version].views)

    @property
    def num_leases(self) -> int:
        with self._cv:
            return sum(len(h.leases) for h in self._held.values())

    def serve(self, sock: socket.socket, req: Request) -> None:
        """One NCCL or CUDA IPC request whose token the publisher has checked."""
        with self._cv:
            held = self._held.get(req.version)
            if held is not None:
                held.readers += 1
        if held is None:
            send_text(
                sock,
                STATUS_REFUSED,
                f"version {req.version} is not held on the device (held: {self.versions})".encode(),
            )
            return
        try:
            if req.op == OP_NCCL:
                self.nccl.serve(sock, req, held.buffer, held.manifest)
            elif not held.buffer.is_cuda:
                send_text(sock, STATUS_REFUSED, b"cuda_ipc needs the version on a GPU")
            else:
                lease = serve_ipc(
                    sock,
                    held.buffer,
                    held.manifest,
                    self.identity.gpu_uuid or "",
                    self.timeout_s,
                    lease=self.single_copy and not held.retired,
                )
                if lease is not None:
                    self._add_lease(held, lease, req.worker_id)
        finally:
            with self._cv:
                held.readers -= 1
                self._cv.notify_all()

    def _add_lease(self, held: _Held, lease: Lease, worker_id: str) -> None:
        """Called while the serve still counts as a reader: an in-place write waiting for
        the readers to finish then finds this lease too, and pauses it first."""
        with self._cv:
            live = not held.retired
            if live:
                held.leases.append(lease)
        if live:
            log.info("worker %s reads v%d in place from this GPU (single copy)", worker_id, held.manifest.version)
        else:  # a newer version went into a new buffer meanwhile: this one is never written again
            lease.retire()

    def close(self) -> None:
        self.nccl.close()
        with self._cv:
            for held in self._held.values():
                held.retire()
            self._held.clear()
