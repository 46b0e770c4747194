"""Where a process's weights live, in words the manager can use without importing torch
(it decides between TCP, NCCL and CUDA IPC for each worker)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

WeightPath = Literal["tcp", "nccl", "cuda_ipc"]
"""How a worker gets a version: over the network, or from the trainer's GPU on its host."""


class DeviceIdentity(BaseModel):
    """Where a process's weights live: which host (kernel) and which physical GPU.
    Same host and another GPU: NCCL; the same GPU: CUDA IPC; else TCP."""

    model_config = ConfigDict(extra="forbid")
    host_id: str
    """The kernel's boot id: one value for every process and container on a host, another
    on any other host (/etc/machine-id is often copied into container images)."""
    gpu_uuid: str | None = None
    """The GPU's UUID (`torch.cuda.get_device_properties(i).uuid`; the same whatever
    CUDA_VISIBLE_DEVICES says); None on CPU."""


def host_id() -> str:
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()
