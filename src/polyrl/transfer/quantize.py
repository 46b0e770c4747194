"""Lossy int8 transfer of a weight version (opt-in: `transfer.codec = "int8"`).

Each 2-D floating-point tensor (the matmul weights: nearly all the bytes) travels as int8
with one float32 scale per output row (absmax / 127, symmetric); everything else
travels as it is. The receiver dequantizes into the version's own layout and dtypes, so
the engine loads it like any other buffer, but the result is NOT the published weights:
each entry is off by up to half a step of its row's scale, plus the rounding back to its
own dtype (for bf16, up to half a step more at the row's largest entries; the benchmark
measured 0.93 steps at worst on Qwen3-0.6B shapes). The worker logs that it
serves a lossy copy and never uses it as the base of a delta. It suits throughput
experiments over slow links, not runs whose log-probs must match the trainer's.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from polyrl.transfer.manifest import Manifest, unflatten

_HEADER = struct.Struct("!4sQ")
_MAGIC = b"PRQ1"


def _quantized(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.dtype.is_floating_point and t.shape[1] > 0


def encode_int8(buffer: torch.Tensor, manifest: Manifest) -> bytes:
    """`buffer`, `manifest`: a flattened version (`manifest.flatten`)."""
    parts = []
    for t in unflatten(buffer, manifest).values():
        if _quantized(t):
            rows = t.float()
            scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
            q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            parts += [scale.numpy().tobytes(), q.numpy().tobytes()]
        else:
            parts.append(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    body = b"".join(parts)
    return _HEADER.pack(_MAGIC, len(body)) + body


def decode_int8(payload: bytes | memoryview, manifest: Manifest, out: torch.Tensor) -> None:
    """Dequantize into `out` (uint8, at least `manifest.total_bytes`). Raises ValueError
    on a payload that does not fit the manifest."""
    view = memoryview(payload)
    if len(view) < _HEADER.size:
        raise ValueError("int8 payload too short")
    magic, size = _HEADER.unpack_from(view)
    if magic != _MAGIC or size != len(view) - _HEADER.size:
        raise ValueError("int8 payload length does not match its header")
    pos = _HEADER.size
    for t in unflatten(out, manifest).values():
        need = t.shape[0] * 4 + t.numel() if _quantized(t) else t.numel() * t.element_size()
        if pos + need > len(view):
            raise ValueError("int8 payload is shorter than the manifest needs")
        if _quantized(t):
            scale = torch.from_numpy(np.frombuffer(view, np.float32, t.shape[0], pos).copy())
            q = torch.from_numpy(np.frombuffer(view, np.int8, t.numel(), pos + t.shape[0] * 4).copy())
            t.copy_((q.view(t.shape).float() * scale[:, None]).to(t.dtype))
        else:
            t.view(-1).view(torch.uint8).copy_(torch.from_numpy(np.frombuffer(view, np.uint8, need, pos).copy()))
        pos += need
    if pos != len(view):
        raise ValueError("int8 payload is longer than the manifest needs")
