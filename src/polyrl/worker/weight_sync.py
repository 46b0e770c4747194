"""The worker's weight receiver: pull a version from the trainer's publisher and swap it
into the engine.

Over TCP, two host buffers take turns: the current version's (the base of the next delta
pull) and a spare one the next pull lands in, so a pull allocates nothing after the first
two. With the engine on CUDA they are pinned, so the copy into the engine runs at full
PCIe speed (~55 GB/s on an H200 host, against a fraction of that from pageable memory).
For a large version they are shared memory that receiver processes pull the streams
into (`transfer/receive_pool.py`), so receiving is not bound by this interpreter's GIL.

On the trainer's host the manager may ask for a GPU path instead (`path`): `nccl` (the
trainer's GPU broadcasts into a buffer on ours) or `cuda_ipc` (our engine is on the
trainer's GPU and copies straight out of its buffer). Any failure there falls back to
TCP in the same call, logged once per path.

Over `cuda_ipc`, when the trainer offers it, the engine keeps no copy at all: its
parameters become views of the trainer's buffer (single copy), and a thread of ours
follows the lease on which the trainer announces each in-place write of the next
version (`transfer/cuda_ipc.py`). The engine pauses between two steps for the write and
serves the new version as soon as it is in; the manager's own sync request then finds
it already served.

Whichever path, the engine keeps serving the old weights until the new version is
complete, and a failed pull changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from functools import cached_property

import torch

from polyrl.config import SwapPolicy
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.types import RequestError, SampleDelta
from polyrl.transfer.cuda_ipc import HeldVersion, IpcVersion
from polyrl.transfer.device import local_identity
from polyrl.transfer.identity import DeviceIdentity, WeightPath
from polyrl.transfer.manifest import unflatten
from polyrl.transfer.nccl import NcclReceiver
from polyrl.transfer.receive_pool import MIN_POOL_BYTES, ReceiverPool
from polyrl.transfer.receiver import Pulled, describe, pull
from polyrl.transfer.relay import Relay
from polyrl.transfer.wire import PullSource, TransferError

log = logging.getLogger(__name__)

SLOW_BELOW_BYTES_PER_S = 250e6
"""`auto` encodes pulls (a delta when it holds a base, else zstd) only when raw pulls ran
slower than this (about 2 Gbit/s): encoding and decoding cost CPU time per GB
(BENCHMARKS.md), which only a slow link repays."""


STAGE_ON_DEVICE_BYTES = 256 * 2**20
"""Versions up to this size are copied to a CUDA engine's device in one piece (`_staged`)."""


class WeightReceiver:
    def __init__(
        self,
        engine: AsyncEngine,
        pin_memory: bool | None = None,
        receive_processes: int | None = None,
        relay: Relay | None = None,
    ) -> None:
        """`pin_memory`: land TCP pulls in pinned host buffers (default: when the engine is on CUDA).
        `receive_processes`: pull large versions' streams in this many processes (default:
        one per stream, up to the host's cores; 0: threads of this process only).
        `relay`: serves each version on to other workers while it lands, once the manager
        has granted it a key (a watched pull runs its streams on threads of this process)."""
        self.engine = engine
        self.relay = relay
        self._pin_memory = pin_memory
        self._receive_processes = receive_processes
        self._pool: ReceiverPool | None = None
        self.fallback: str | None = None
        """Why the last GPU-path pull went over TCP instead (None: it did not)."""
        self._base: tuple[int, torch.Tensor] | None = None
        self._spare: torch.Tensor | None = None
        self._raw_bytes_per_s: float | None = None
        self._nccl = NcclReceiver()
        self._failed_paths: set[str] = set()
        self._lock = asyncio.Lock()
        self._swap_policy: SwapPolicy | None = None
        """The running sync's (set under the lock)."""

    @cached_property
    def device(self) -> torch.device:
        device = self.engine.engine.device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if device.type == "cuda" and device.index is None
            else device
        )

    @cached_property
    def identity(self) -> DeviceIdentity:
        """Where the engine is (told to the manager, which picks the path from it)."""
        return local_identity(self.device)

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda" if self._pin_memory is None else self._pin_memory

    def _plan(self, codec: str) -> tuple[bool, str]:
        """(ask for a delta against the current version, codec of a whole pull)."""
        if codec == "auto":
            slow = self._raw_bytes_per_s is not None and self._raw_bytes_per_s < SLOW_BELOW_BYTES_PER_S
            return slow, "zstd" if slow else "raw"
        return codec == "delta", "raw" if codec == "delta" else codec

    async def sync(
        self,
        source: PullSource,
        version: int,
        num_streams: int,
        timeout_s: float,
        codec: str = "auto",
        path: WeightPath = "tcp",
        swap_policy: SwapPolicy | None = None,
        relays: Sequence[PullSource] = (),
    ) -> Pulled | None:
        """Pull `version` and load it; None if the engine already serves it or a newer one.
        `pulled.codec` says how it came (raw, delta, zstd, int8, nccl, cuda_ipc). Raises
        TransferError (the engine keeps its weights) or RequestError (the version does
        not fit the model). `swap_policy`: what the load does to running requests (None:
        the engine's own). `relays`: other workers to pull from first, in order (over
        TCP), then `source`."""
        async with self._lock:  # one sync at a time; a second caller waits, then no-ops
            if self.engine.engine.weight_version >= version:
                return None
            self.fallback = None
            self._swap_policy = swap_policy
            if path != "tcp":
                try:
                    return await self._sync_gpu(path, source, version, timeout_s)
                except RequestError:
                    raise
                except (OSError, RuntimeError, ValueError) as e:  # TransferError, CUDA and NCCL errors
                    self._fall_back(path, e)
            return await self._sync_tcp(source, version, num_streams, timeout_s, codec, relays)

    async def _sync_gpu(self, path: WeightPath, source: PullSource, version: int, timeout_s: float) -> Pulled:
        if path == "nccl":
            pulled = await asyncio.to_thread(self._nccl.pull, source, version, self.device, timeout_s)
            await self._load(pulled)
            return pulled
        if self.identity.gpu_uuid is None:
            raise RuntimeError("cuda_ipc needs the engine on a GPU")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        shared = await asyncio.to_thread(
            IpcVersion.open, source, version, self.device, self.identity.gpu_uuid, timeout_s
        )
        try:
            total = shared.manifest.total_bytes
            pulled = Pulled(shared.buffer[:total], shared.manifest, 0.0, "cuda_ipc", total)
            views = unflatten(pulled.buffer, pulled.manifest)
            if shared.lease and self.engine.engine.can_share(views):
                await self._hold(shared, views, version)
                pulled.in_place = True
            else:
                await self._load(pulled)
            pulled.buffer = torch.empty(0, dtype=torch.uint8)  # the caller must not keep the mapping
        finally:
            await asyncio.to_thread(shared.close)  # a no-op once held
        pulled.seconds = loop.time() - t0
        return pulled

    async def _hold(self, shared: IpcVersion, views: dict[str, torch.Tensor], version: int) -> None:
        """Decode from the trainer's buffer in place, and follow its lease from a thread."""
        engine, policy = self.engine.engine, self._swap_policy
        holder: list[HeldVersion] = []

        def point_engine_at_it() -> list[SampleDelta]:
            held = shared.hold()  # the trainer writes nothing before we answer PAUSED
            try:
                deltas = engine.share_weights(views, version, held)
            except BaseException:
                held.release()  # not reading it after all: the trainer must not wait for us
                raise
            holder.append(held)
            return deltas

        await asyncio.wrap_future(self.engine.submit(point_engine_at_it))
        held = holder[0]
        log.info("serving v%d from the trainer's GPU buffer in place (single copy)", version)
        threading.Thread(target=self._follow, args=(held, policy), name="polyrl-weights-lease", daemon=True).start()

    def _follow(self, held: HeldVersion, policy: SwapPolicy | None) -> None:
        """The lease's thread: each version the trainer announces is written while the
        engine is paused between two steps, then served."""
        engine = self.engine.engine

        def take_write(version: int) -> list[SampleDelta] | None:
            if engine.weights_owner is not held:  # the engine moved off this buffer
                held.release()
                return None
            engine.quiesce()
            if not held.paused():
                return None  # retired: the buffer stays as it was
            deltas = engine.update_weights(None, version, policy)
            held.serving()
            return deltas

        while (version := held.next_write()) is not None:
            try:
                self.engine.submit(lambda v=version: take_write(v)).result()
            except TransferError as e:  # the trainer went away mid-write: the weights may be torn
                self.engine.fail(e)
                return
            except Exception as e:  # noqa: BLE001 - the engine cannot serve a version it did not get
                log.exception("the in-place update to v%d failed", version)
                self.engine.fail(e)
                return
        if engine.weights_owner is held:
            log.info(
                "the trainer retired the GPU buffer we read in place; still serving v%d from it", engine.weight_version
            )

    async def _load(self, pulled: Pulled) -> None:
        """Load a version that lies on our device; returns once the copies are done, so its
        buffer may be reused or released."""
        await self.engine.update_weights(
            unflatten(pulled.buffer, pulled.manifest), pulled.manifest.version, self._swap_policy
        )
        if self.device.type == "cuda":
            await asyncio.to_thread(torch.cuda.synchronize, self.device)

    def _fall_back(self, path: str, error: BaseException) -> None:
        self.fallback = f"{path} failed: {type(error).__name__}: {error}"
        if path not in self._failed_paths:
            self._failed_paths.add(path)
            log.warning("weight path %s failed (%s); pulling over TCP instead (logged once)", path, self.fallback)

    async def _sync_tcp(
        self,
        source: PullSource,
        version: int,
        num_streams: int,
        timeout_s: float,
        codec: str,
        relays: Sequence[PullSource] = (),
    ) -> Pulled:
        base, into = self._base, self._spare
        delta, whole = self._plan(codec)
        if relays:
            whole = "raw"  # a version still arriving at a relay is served raw (a delta only once whole there)
        if into is None:
            into = self._spare = await asyncio.to_thread(self._landing, source, version, num_streams, timeout_s)
        relay = self.relay if self.relay is not None and self.relay.key is not None else None
        watcher = relay.watch(version) if relay is not None and whole != "int8" else None
        sources = [*relays, source]
        try:
            pulled = await asyncio.to_thread(
                pull,
                sources[0],
                version,
                num_streams=num_streams,
                timeout_s=timeout_s,
                into=into,
                base=base if delta else None,
                codec=whole,
                pool=self._pool,
                fallbacks=sources[1:],
                watcher=watcher,
            )
        except TransferError as e:
            if relay is not None:
                relay.failed(version, f"its pull failed: {e}")
            raise
        if pulled.codec == "raw":
            self._raw_bytes_per_s = pulled.bytes_per_s
        staged = self._staged(pulled.buffer, pulled.manifest.total_bytes)
        await self.engine.update_weights(unflatten(staged, pulled.manifest), version, self._swap_policy)
        if pulled.lossy:  # the exact base stays; this buffer is only the next pull's landing place
            log.warning("serving v%d as a LOSSY int8 copy (transfer.codec = int8)", version)
            self._spare = pulled.buffer
            return pulled
        if into is not None and into.data_ptr() == pulled.buffer.data_ptr():
            self._spare = None  # it holds the new version now
        if base is not None and base[1].data_ptr() != pulled.buffer.data_ptr():
            self._spare = base[1]  # the old base is free now: the next pull lands there
        self._base = (version, pulled.buffer)
        return pulled

    def _staged(self, buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A small version (a LoRA adapter: hundreds of small tensors) goes to a CUDA
        engine's device in one copy, so the engine reads views of it there instead of
        copying each tensor itself: measured 0.4 ms for the one copy of a 20 MB r = 16
        adapter (Qwen3-0.6B shape, H100), against 3-5 ms for its 392 copies. Large
        versions stay on the host: a second device copy of a whole model would not fit."""
        if self.device.type != "cuda" or nbytes > STAGE_ON_DEVICE_BYTES:
            return buffer
        return buffer[:nbytes].to(self.device)  # synchronous: the host buffer is the next delta's base

    def _landing(self, source: PullSource, version: int, num_streams: int, timeout_s: float) -> torch.Tensor | None:
        """A buffer the size of `version` (made once per buffer: pinning is slow): shared
        with the receiver processes for a large version, else pinned or left to `pull`."""
        total = describe(source, version, timeout_s).manifest.total_bytes
        try:
            if total >= MIN_POOL_BYTES and self._receive_processes != 0:
                if self._pool is None:
                    self._pool = ReceiverPool(self._receive_processes or max(1, min(num_streams, os.cpu_count() or 1)))
                return self._pool.landing(total, self.pin_memory).tensor
            return torch.empty(total, dtype=torch.uint8, pin_memory=True) if self.pin_memory else None
        except (OSError, RuntimeError) as e:  # the description claims more than this host has
            raise TransferError(f"cannot allocate {total} bytes for v{version}: {e}") from None

    def close(self) -> None:
        """Stop the receiver processes and free their landing buffers."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
