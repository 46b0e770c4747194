"""The worker's weight receiver: pull a version from the trainer's publisher and swap it
into the engine.

Two host buffers take turns: the current version's (the base of the next delta pull)
and a spare one the next pull lands in, so a pull allocates nothing after the first
two. The engine keeps serving the old weights until the new buffer is complete and
verified; a failed pull changes nothing.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from polyrl.engine.async_engine import AsyncEngine
from polyrl.transfer.manifest import unflatten
from polyrl.transfer.receiver import Pulled, PullSource, pull

log = logging.getLogger(__name__)


SLOW_BELOW_BYTES_PER_S = 250e6
"""`auto` encodes pulls (a delta when it holds a base, else zstd) only when raw pulls ran
slower than this (about 2 Gbit/s): encoding and decoding cost CPU time per GB
(BENCHMARKS.md), which only a slow link repays."""


class WeightReceiver:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._base: tuple[int, torch.Tensor] | None = None
        self._spare: torch.Tensor | None = None
        self._raw_bytes_per_s: float | None = None
        self._lock = asyncio.Lock()

    def _plan(self, codec: str) -> tuple[bool, str]:
        """(ask for a delta against the current version, codec of a whole pull)."""
        if codec == "auto":
            slow = self._raw_bytes_per_s is not None and self._raw_bytes_per_s < SLOW_BELOW_BYTES_PER_S
            return slow, "zstd" if slow else "raw"
        return codec == "delta", "raw" if codec == "delta" else codec

    async def sync(
        self, source: PullSource, version: int, num_streams: int, timeout_s: float, codec: str = "auto"
    ) -> Pulled | None:
        """Pull `version` and load it; None if the engine already serves it or a newer one.
        Raises TransferError (the engine keeps its weights) or RequestError (the version
        does not fit the model)."""
        async with self._lock:  # one sync at a time; a second caller waits, then no-ops
            if self.engine.engine.weight_version >= version:
                return None
            base = self._base
            delta, whole = self._plan(codec)
            pulled = await asyncio.to_thread(
                pull, source, version, num_streams=num_streams, timeout_s=timeout_s, into=self._spare,
                base=base if delta else None, codec=whole,
            )  # fmt: skip
            if pulled.codec == "raw":
                self._raw_bytes_per_s = pulled.bytes_per_s
            await self.engine.update_weights(unflatten(pulled.buffer, pulled.manifest), version)
            if pulled.lossy:  # the exact base stays; this buffer is only the next pull's landing place
                log.warning("serving v%d as a LOSSY int8 copy (transfer.codec = int8)", version)
                self._spare = pulled.buffer
                return pulled
            if base is not None and base[1].data_ptr() != pulled.buffer.data_ptr():
                self._spare = base[1]  # the old base is free now: the next pull lands there
            self._base = (version, pulled.buffer)
            return pulled
