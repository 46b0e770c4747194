"""Shared memory for weight buffers that two processes read or write: a memfd.

A memfd has no name in /dev/shm, so nothing is left behind when its processes die, even
by kill -9, and it is not bounded by /dev/shm's size (64 MB in a default Docker
container). Another process maps it from its file descriptor (passed with SCM_RIGHTS).
"""

from __future__ import annotations

import logging
import mmap
import os
from contextlib import suppress

import torch

log = logging.getLogger("polyrl.transfer")


class SharedBuffer:
    """`nbytes` of shared memory, as a uint8 tensor here; pinned (cudaHostRegister) when
    asked and CUDA is there, so copies to and from the GPU run at full PCIe speed."""

    def __init__(self, name: str, nbytes: int, pin: bool = False) -> None:
        size = max(nbytes, 1)  # an empty mapping is an error
        self.fd = os.memfd_create(name)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = pin and _host_register(self.tensor)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        with suppress(BufferError):  # a tensor made from it is still alive: the GC unmaps it
            self._map.close()
        os.close(self.fd)
        self.fd = -1


def _host_register(buffer: torch.Tensor) -> bool:
    if not torch.cuda.is_available():
        return False
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if code != 0:
        log.warning(
            "could not pin %d bytes of shared memory (CUDA error %d): copies to the GPU run slower",
            buffer.numel(),
            code,
        )
    return code == 0
