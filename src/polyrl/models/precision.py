"""Mixed precision: master weights stay float32; `model.dtype` is the compute dtype.

Training bf16 weights in place loses small updates entirely (a 1e-6 step on a 0.02 weight
rounds away) and fp16 Adam states overflow, so low precision lives only in autocast.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
