"""The manager's sync hooks. `PublisherSync`, for the TCP data plane: a worker that needs version v is told
to pull it from the trainer's WeightPublisher, with a token granted for that worker and
version; when it answers, the manager marks it synced and routes to it again.

It also picks the path: a worker whose last reply placed it on the trainer's host (same
boot id), while the trainer holds v on its GPU (`WeightPublisher.device`) and
`transfer.gpu_paths` is on, is told to use `cuda_ipc` (same GPU) or `nccl` (another GPU);
everyone else, and every worker's first pull, uses TCP. A worker that had to fall back
to TCP stays on TCP (logged once).

The hook runs as its own task, so a slow or dead worker never holds anything up; a
failed pull is retried with backoff, then logged (the worker stays `syncing` until the
next version is published). It returns the version the worker reports, and the manager
marks the worker synced. `DiskSync` does the same through a shared directory.

In the manager's own process the publisher is the trainer's, known only by what the
trainer told the manager (`PublisherEndpoint`): `EndpointPublisher` stands in for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import httpx

from polyrl.manager.manager import RolloutManager
from polyrl.manager.registry import WorkerRecord
from polyrl.manager.relay_plan import relay_chains
from polyrl.protocol.manager_api import PublisherEndpoint
from polyrl.protocol.worker_api import (
    RelayGrant,
    RelaySource,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromPublisherRequest,
    UpdateWeightsResponse,
)
from polyrl.transfer.identity import DeviceIdentity, WeightPath
from polyrl.transfer.wire import relay_key, transfer_token

if TYPE_CHECKING:
    import torch

log = logging.getLogger("polyrl.manager")


class DeviceView(Protocol):
    identity: DeviceIdentity

    def holds(self, version: int) -> bool: ...


class PublisherView(Protocol):
    """What the sync needs of a publisher: the in-process `WeightPublisher`, or an
    `EndpointPublisher` made from what the trainer told the manager."""

    addresses: list[tuple[str, int]]
    tls: bool
    key: bytes
    """What relays' keys derive from (`wire.relay_key`)."""

    @property
    def device(self) -> DeviceView | None: ...

    def grant(self, worker_id: str, version: int) -> str: ...


class EndpointDevice:
    """The versions the trainer holds on its GPU, as its publish messages said."""

    def __init__(self, identity: DeviceIdentity) -> None:
        self.identity = identity
        self.version: int | None = None

    def holds(self, version: int) -> bool:
        return version == self.version


class EndpointPublisher:
    """The trainer's publisher seen from the manager's process."""

    def __init__(self, endpoint: PublisherEndpoint) -> None:
        self.addresses = [(host, port) for host, port in endpoint.groups]
        self.key = bytes.fromhex(endpoint.key)
        self.tls = endpoint.tls
        self.device: EndpointDevice | None = None
        if endpoint.device_host_id is not None:
            self.device = EndpointDevice(
                DeviceIdentity(host_id=endpoint.device_host_id, gpu_uuid=endpoint.device_gpu_uuid)
            )

    def grant(self, worker_id: str, version: int) -> str:
        return transfer_token(self.key, worker_id, version)

    def published(self, version: int, on_device: bool) -> None:
        if self.device is not None and on_device:
            self.device.version = version


class PublisherSync:
    def __init__(
        self,
        manager: RolloutManager,
        publisher: PublisherView,
        advertise_host: str | None = None,
        retries: int = 3,
        pull_timeout_s: float = 120.0,
        codec: str = "auto",
        advertise_port: int | None = None,
    ) -> None:
        self.manager, self.publisher, self.codec = manager, publisher, codec
        if advertise_port is not None and len(publisher.addresses) > 1:
            raise ValueError("advertise_port names a relay for one publisher group, not several")
        self.groups: list[tuple[str, int]] = [
            (advertise_host or host, advertise_port or port) for host, port in publisher.addresses
        ]
        """Where workers connect, per publisher group: the publisher itself, or a relay (NAT, a fault proxy)."""
        self.group_of: dict[str, int] = {}
        """The group each worker pulls from (kept while it is registered)."""
        self.retries, self.pull_timeout_s = retries, pull_timeout_s
        self.last_message: dict[str, str] = {}
        """What each worker said about its last pull (codec, bytes, seconds)."""
        self.devices: dict[str, DeviceIdentity] = {}
        """Where each worker's engine is, as it said in its last reply."""
        self.tcp_only: set[str] = set()
        """Workers whose GPU path failed."""

    def path_for(self, worker_id: str, version: int) -> WeightPath:
        here, there = self.publisher.device, self.devices.get(worker_id)
        if not self.manager.cfg.transfer.gpu_paths or here is None or there is None or worker_id in self.tcp_only:
            return "tcp"
        if there.host_id != here.identity.host_id or not here.holds(version):
            return "tcp"
        if there.gpu_uuid is not None and there.gpu_uuid == here.identity.gpu_uuid:
            return "cuda_ipc"
        # NCCL between two GPUs; between two CPUs the same code runs gloo (tests)
        return "nccl" if (there.gpu_uuid is None) == (here.identity.gpu_uuid is None) else "tcp"

    async def __call__(self, record: WorkerRecord, version: int) -> int | None:
        path = self.path_for(record.worker_id, version)
        host, port = self.groups[self.group_for(record.worker_id)]
        body = UpdateWeightsFromPublisherRequest(
            host=host,
            port=port,
            weight_version=version,
            token=self.publisher.grant(record.worker_id, version),
            worker_id=record.worker_id,
            num_streams=self.manager.cfg.transfer.streams_per_group,
            timeout_s=self.pull_timeout_s,
            codec=self.codec,
            tls=self.publisher.tls,
        )
        if path != "tcp":  # unset otherwise: an SGLang-style worker without the field still works
            body.path = path
        if self.manager.cfg.swap_policy is not None:
            body.swap_policy = self.manager.cfg.swap_policy
        if path == "tcp":
            relays, grant = self.relays_for(record, version)
            if grant is not None:  # unset otherwise, as `path`
                body.relays, body.relay_grant = relays, grant
        reply = await tell_worker(
            self.manager,
            record,
            version,
            "/update_weights_from_publisher",
            body,
            self.pull_timeout_s + 10,
            self.retries,
        )
        if reply is None:
            return None
        self._note(record.worker_id, path, reply)
        log.debug("worker %s pulled v%d: %s", record.worker_id, version, reply.message)
        return reply.weight_version

    def relays_for(self, record: WorkerRecord, version: int) -> tuple[list[RelaySource], RelayGrant | None]:
        """With `transfer.relay_fan_out`: the relays `record` pulls `version` from, its
        parent first (`manager/relay_plan.py`), and the grant for its own relay. The tree
        is over the workers with a relay that pull over TCP, in the order they joined;
        one without a relay, or pulling int8 (lossy: never served on), gets neither."""
        transfer = self.manager.cfg.transfer
        if transfer.relay_fan_out is None or record.relay_port is None or record.is_local or self.codec == "int8":
            return [], None
        key = self.publisher.key

        def in_tree(r: WorkerRecord) -> bool:
            return r is record or (
                r.relay_port is not None
                and not r.is_local
                and r.state in ("syncing", "active")
                and self.path_for(r.worker_id, version) == "tcp"
            )

        order = sorted((r for r in self.manager.registry if in_tree(r)), key=lambda r: (r.joined_at, r.worker_id))
        by_id = {r.worker_id: r for r in order}
        chain = relay_chains(list(by_id), transfer.relay_fan_out)[record.worker_id]
        relays = []
        for relay_id in chain:
            url = urlsplit(by_id[relay_id].url)
            token = transfer_token(relay_key(key, relay_id), record.worker_id, version)
            port = by_id[relay_id].relay_port
            relays.append(RelaySource(host=url.hostname or "", port=port, token=token, tls=url.scheme == "https"))
        grant = RelayGrant(key=relay_key(key, record.worker_id).hex(), max_send_gbps=transfer.max_send_gbps)
        return relays, grant

    def group_for(self, worker_id: str) -> int:
        """The worker's publisher group: on its first pull, the one with the fewest
        registered workers (ties: the lowest); it keeps it while registered."""
        group = self.group_of.get(worker_id)
        if group is None:
            registered = {r.worker_id for r in self.manager.registry}
            self.group_of = {w: g for w, g in self.group_of.items() if w in registered}
            load = [0] * len(self.groups)
            for g in self.group_of.values():
                load[g] += 1
            group = self.group_of[worker_id] = min(range(len(load)), key=load.__getitem__)
            if len(self.groups) > 1:
                log.info(
                    "worker %s pulls weights from publisher group %d (%s:%d)", worker_id, group, *self.groups[group]
                )
        return group

    def _note(self, worker_id: str, asked: WeightPath, reply: UpdateWeightsResponse) -> None:
        self.last_message[worker_id] = reply.message
        if reply.device is not None:
            self.devices[worker_id] = reply.device
        else:
            self.devices.pop(worker_id, None)  # an older worker: TCP only
        if asked != "tcp" and reply.path not in (asked, None):
            self.tcp_only.add(worker_id)
            log.warning(
                "worker %s could not use %s (%s); it pulls over TCP from now on", worker_id, asked, reply.message
            )


class DiskSync:
    """The portable fallback (the Atropos seed's checkpoint mode): the trainer writes each
    version as a safetensors directory on a filesystem the workers share, and a worker
    that needs it loads it with `/update_weights_from_disk`."""

    def __init__(
        self, manager: RolloutManager, root: str | Path, retries: int = 3, load_timeout_s: float = 300.0
    ) -> None:
        self.manager, self.root = manager, Path(root)
        self.retries, self.load_timeout_s = retries, load_timeout_s
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def save(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write `version` (call before `publish_version`); written to a temporary name
        first, so a worker never reads half a file."""
        from safetensors.torch import save_file  # the trainer's side; the manager has no torch

        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"))
        tmp.rename(final)
        return final

    async def __call__(self, record: WorkerRecord, version: int) -> int | None:
        body = UpdateWeightsFromDiskRequest(model_path=str(self.path(version).resolve()), weight_version=version)
        reply = await tell_worker(
            self.manager, record, version, "/update_weights_from_disk", body, self.load_timeout_s, self.retries
        )
        if reply is None:
            return None
        log.debug("worker %s loaded v%d from %s", record.worker_id, version, body.model_path)
        return reply.weight_version


async def tell_worker(
    manager: RolloutManager,
    record: WorkerRecord,
    version: int,
    endpoint: str,
    body: UpdateWeightsFromPublisherRequest | UpdateWeightsFromDiskRequest,
    timeout_s: float,
    retries: int,
) -> UpdateWeightsResponse | None:
    """POST `body` (the fields set in it) to the worker's weight-update `endpoint`,
    retrying with backoff; on success return its reply (it names the version the worker
    now serves). None:
    it left, a newer version superseded this one, it is unreachable (declared gone), or
    every try failed (logged; its next heartbeat asks again, so a worker is never left
    syncing for good)."""
    why = ""
    content = body.model_dump_json(exclude_unset=True).encode()
    headers = {"content-type": "application/json"}
    for attempt in range(retries + 1):
        if record.state == "gone" or version < manager.registry.latest_version:
            return None
        try:
            response = await manager.remote.http.post(
                f"{record.url}{endpoint}", content=content, headers=headers, timeout=timeout_s
            )
            if response.status_code == 200:
                reply = UpdateWeightsResponse.model_validate_json(response.content)
                if reply.weight_version is None:
                    raise ValueError("the reply names no weight_version")  # a failed try
                return reply
            why = f"HTTP {response.status_code}: {response.text[:300]}"
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
            # refused or cut: the process is gone (a kill -9 mid-sync); do not wait for
            # its heartbeats to stop before moving on
            manager.worker_unreachable(record, f"weight update: {type(e).__name__}: {e}")
            return None
        except (httpx.HTTPError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            why = f"{type(e).__name__}: {e}"
        if attempt < retries:
            await asyncio.sleep(min(2.0**attempt, 10.0))
    log.warning(
        "worker %s did not get v%d via %s after %d tries: %s", record.worker_id, version, endpoint, retries + 1, why
    )
    record.sync_requested = min(record.sync_requested, version - 1)
    return None
