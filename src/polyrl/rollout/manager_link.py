"""The trainer's side of the manager's HTTP API: control calls, and batches read by an
I/O thread each.

The trainer's process receives only finished groups (one NDJSON line each) and sends a
few control messages per step, so reading the fleet's work costs it a few hundred
nanoseconds of CPU per generated token (`benchmarks/ingest_interference.py`), not the
per-chunk parsing of a manager in its own interpreter.

Control calls are retried while the manager cannot be reached, for up to `retry_s`
(they are idempotent: publishing the same version again, closing a closed window); then
`ManagerUnreachable` lets the caller restart the manager.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import httpx
from pydantic import BaseModel

from polyrl.config import ConfigError
from polyrl.manager.client import BatchClient
from polyrl.protocol.completions import MAX_KEYS, VersionRuns, VersionsQuery, VersionsReply
from polyrl.protocol.manager_api import (
    BatchError,
    BatchFailed,
    BatchRequest,
    DueGroups,
    DueGroupsRequest,
    FleetDecision,
    GroupResult,
    LearnerWaiting,
    PublisherEndpoint,
    PublishVersion,
    WorkerList,
)
from polyrl.protocol.version import WeightVersion
from polyrl.tls import certificate_error, http_client

RETRY_S = 10.0
"""How long a control call keeps trying an unreachable manager."""


class ManagerUnreachable(RuntimeError):
    pass


class ManagerLink:
    def __init__(
        self, url: str, token: str, timeout_s: float = 10.0, retry_s: float = RETRY_S, ca_file: str | None = None
    ) -> None:
        """`ca_file`: what an https manager's certificate is verified against."""
        self.url, self.token, self.retry_s, self.ca_file = url.rstrip("/"), token, retry_s, ca_file
        headers = {"Authorization": f"Bearer {token}"}
        self.http = http_client(ca_file, base_url=self.url, headers=headers, timeout=timeout_s)
        self.batches = BatchClient(self.url, token, connect_retries=0, ca_file=ca_file)

    def set_publisher(self, endpoint: PublisherEndpoint) -> None:
        self._post("/v1/publisher", endpoint)

    def publish_version(self, version: WeightVersion, on_device: bool) -> None:
        self._post("/v1/weights/version", PublishVersion(version=version, on_device=on_device))

    def learner_started(self) -> None:
        self._post("/v1/learner_started", None)

    def learner_waiting(self, prompt_ids: list[str]) -> None:
        self._post("/v1/learner_waiting", LearnerWaiting(prompt_ids=prompt_ids))

    def fleet_decision(self, decision: FleetDecision) -> None:
        self._post("/v1/fleet/decisions", decision)

    def due_groups(self, max_floor_version: int) -> list[str]:
        response = self._call("POST", "/v1/groups/due", DueGroupsRequest(max_floor_version=max_floor_version))
        return DueGroups.model_validate_json(response.content).prompt_ids

    def completion_versions(self, keys: list[str]) -> list[VersionRuns | None] | None:
        """The versions of the completions served under `keys` (`protocol/completions.py`);
        None: this manager predates the endpoint. Asked MAX_KEYS at a time."""
        out: list[VersionRuns | None] = []
        for at in range(0, len(keys), MAX_KEYS):
            query = VersionsQuery(keys=keys[at : at + MAX_KEYS])
            try:
                response = self._call("POST", "/v1/completions/versions", query)
            except httpx.HTTPStatusError as e:
                if e.response.status_code == 404:
                    return None
                raise
            out += VersionsReply.model_validate_json(response.content).versions
        return out

    def workers(self) -> WorkerList:
        return WorkerList.model_validate_json(self._call("GET", "/v1/workers", None).content)

    def _post(self, path: str, message: BaseModel | None) -> None:
        self._call("POST", path, message)

    def _call(self, method: str, path: str, message: BaseModel | None) -> httpx.Response:
        body = message.model_dump(mode="json") if message is not None else None
        deadline = time.monotonic() + self.retry_s
        delay_s = 0.1
        while True:
            try:
                response = self.http.request(method, path, json=body)
            except httpx.TransportError as e:
                if certificate_error(e) is not None:  # no retry or restart mends it
                    raise ConfigError(
                        f"config error: manager {self.url}: {certificate_error(e)} (manager.tls.ca_file)"
                    ) from None
                if time.monotonic() + delay_s > deadline:
                    raise ManagerUnreachable(f"manager {self.url}: {type(e).__name__}: {e}") from None
                time.sleep(delay_s)
                delay_s = min(2 * delay_s, 2.0)
                continue
            if response.status_code >= 500:  # shutting down or not up yet: like unreachable
                raise ManagerUnreachable(f"manager {self.url}: HTTP {response.status_code}: {response.text[:200]}")
            response.raise_for_status()
            return response

    def open_batch(self, request: BatchRequest) -> BatchStream:
        return BatchStream(self.batches, request)

    def close(self) -> None:
        self.http.close()
        self.batches.close()  # ends the batch threads' reads


class BatchStream:
    """One batch's groups, read from the manager by a thread of its own (I/O only), so the
    batch is submitted now and its groups queue while the learner works."""

    _END = object()

    def __init__(self, client: BatchClient, request: BatchRequest) -> None:
        self.request = request
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client,), name="polyrl-batch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """No more groups wanted: the reader hangs up when the next one arrives, and the
        manager cancels the rest of the batch (its workers abort their samples)."""
        self._closed.set()

    def _read(self, client: BatchClient) -> None:
        lines = client.generate(self.request)
        try:
            for group in lines:
                if self._closed.is_set():
                    break
                self._queue.put(group)
            self._queue.put(self._END)
        except BatchError as e:
            self._queue.put(e)
        except Exception as e:  # the HTTP client closed under us, or a bug: the reader raises it
            self._queue.put(
                BatchError(BatchFailed(batch_id="", kind="disconnected", message=f"{type(e).__name__}: {e}"))
            )
        finally:
            lines.close()  # leaves the HTTP stream: a batch closed early is cancelled

    def __iter__(self) -> Iterator[GroupResult]:
        """The groups in completion order; raises BatchError when the batch fails or the
        connection to the manager is lost."""
        while (item := self._queue.get()) is not self._END:
            if isinstance(item, BatchError):
                raise item
            assert isinstance(item, GroupResult)
            yield item
