"""The manager's sync hook for the TCP data plane: a worker that needs version v is told
to pull it from the trainer's WeightPublisher, with a token granted for that worker and
version; when it answers, the manager marks it synced and routes to it again.

The hook runs as its own task, so a slow or dead worker never holds anything up; a
failed pull is retried with backoff, then logged (the worker stays `syncing` until the
next version is published).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from polyrl.manager.manager import RolloutManager
from polyrl.manager.registry import WorkerRecord
from polyrl.transfer.publisher import WeightPublisher

log = logging.getLogger("polyrl.manager")


class PublisherSync:
    def __init__(
        self,
        manager: RolloutManager,
        publisher: WeightPublisher,
        advertise_host: str | None = None,
        retries: int = 3,
        pull_timeout_s: float = 120.0,
        codec: str = "auto",
    ) -> None:
        self.manager, self.publisher, self.codec = manager, publisher, codec
        self.host = advertise_host or publisher.address[0]
        self.retries, self.pull_timeout_s = retries, pull_timeout_s
        self.last_message: dict[str, str] = {}
        """What each worker said about its last pull (codec, bytes, seconds)."""

    async def __call__(self, record: WorkerRecord, version: int) -> None:
        if record.is_local:
            return
        body = {
            "host": self.host,
            "port": self.publisher.address[1],
            "weight_version": version,
            "token": self.publisher.grant(record.worker_id, version),
            "worker_id": record.worker_id,
            "num_streams": self.manager.cfg.transfer.streams_per_group,
            "timeout_s": self.pull_timeout_s,
            "codec": self.codec,
        }
        why = ""
        for attempt in range(self.retries + 1):
            if record.state == "gone" or version < self.manager.registry.latest_version:
                return  # the worker left, or a newer version superseded this one
            try:
                response = await self.manager.remote.http.post(
                    f"{record.url}/update_weights_from_publisher", json=body, timeout=self.pull_timeout_s + 10
                )
                if response.status_code == 200:
                    reply = response.json()
                    self.last_message[record.worker_id] = reply.get("message", "")
                    self.manager.mark_synced(record.worker_id, int(reply["weight_version"]))
                    log.info("worker %s pulled v%d: %s", record.worker_id, version, reply.get("message", ""))
                    return
                why = f"HTTP {response.status_code}: {response.text[:300]}"
            except (httpx.HTTPError, ValueError, KeyError) as e:
                why = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(min(2.0**attempt, 10.0))
        log.warning("worker %s could not pull v%d after %d tries: %s", record.worker_id, version, self.retries + 1, why)
