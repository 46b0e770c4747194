"""A weight version as one flat byte buffer plus a manifest saying where each tensor is.

This is the unit the transfer layer moves over the network (DESIGN.md, "Weight data
plane"); the engine loads it through `unflatten`, which returns views into the buffer,
so no tensor is copied twice on the receiving side.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from polyrl.transfer.schema import ALIGN_BYTES, ITEMSIZES, Manifest, TensorEntry, numel

__all__ = ["ALIGN_BYTES", "Manifest", "TensorEntry", "flatten", "layout", "unflatten"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)
}
assert _DTYPES.keys() == ITEMSIZES.keys()


_THREADED_COPY_BYTES = 4 << 20
"""Host tensors from this size up are copied by torch's threads (worth it for a large
tensor on an idle host); smaller ones by one memcpy each."""


def flatten(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    pin_memory: bool | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Manifest]:
    """Pack tensors into one uint8 CPU buffer. Returns (buffer, manifest).

    `pin_memory` (default: when any tensor is on CUDA) makes the device-to-host copies
    run at full PCIe speed. `out`: a buffer to reuse when it has the right size and
    pinning (a pinned allocation costs far more than the copy into it)."""
    manifest = layout(state_dict, version)
    entries, offset = manifest.tensors, manifest.total_bytes
    if pin_memory is None:
        pin_memory = any(t.is_cuda for t in state_dict.values())
    fits = out is not None and out.dtype == torch.uint8 and out.numel() == offset and out.is_pinned() == pin_memory
    buffer = out if fits else torch.empty(offset, dtype=torch.uint8, pin_memory=pin_memory)
    host = buffer.numpy()
    for entry, t in zip(entries, state_dict.values()):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if not flat.is_cuda and entry.nbytes < _THREADED_COPY_BYTES:
            # a plain memcpy: torch's copy_ runs each tensor through its thread pool, whose
            # threads spin and wait on a busy host (a 20 MB LoRA version of 392 tensors took
            # 20 ms to 1 s that way on 2 loaded cores, 5 ms like this)
            host[entry.offset : entry.offset + entry.nbytes] = flat.numpy()
            continue
        # device -> pinned host: asynchronous DMA, all tensors queued, one wait at the end
        buffer[entry.offset : entry.offset + entry.nbytes].copy_(flat, non_blocking=pin_memory)
    if pin_memory and any(t.is_cuda for t in state_dict.values()):
        torch.cuda.current_stream().synchronize()  # not the device: an NCCL send may be running there
    return buffer, manifest


def layout(state_dict: Mapping[str, torch.Tensor], version: int) -> Manifest:
    """Where `flatten` puts each tensor, without copying anything (to size a buffer first)."""
    entries, offset = [], 0
    for name, t in state_dict.items():
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(
                name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return Manifest(version=version, total_bytes=offset, tensors=entries)


def unflatten(buffer: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Views into `buffer` (uint8, 1-D), one per manifest entry."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < manifest.total_bytes:
        raise ValueError(f"buffer must be 1-D uint8 of at least {manifest.total_bytes} bytes")
    out = {}
    for e in manifest.tensors:
        dtype = _DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(f"{e.name}: unknown dtype {e.dtype!r}")
        if e.offset + e.nbytes > manifest.total_bytes or e.nbytes != dtype.itemsize * numel(e.shape):
            raise ValueError(f"{e.name}: entry does not fit its shape or the buffer")
        out[e.name] = buffer[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)
    return out
