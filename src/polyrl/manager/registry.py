"""The manager's view of its workers: one record each, and the lifecycle transitions.

`registering -> syncing -> active -> draining -> gone` (DESIGN.md). Every transition is
one log line. A worker serves a batch only while `active` and at the batch's weight
version or newer; `syncing` means it is below the latest version and waits for the
transfer layer (or a heartbeat showing the new version). The trainer's own engine in a
run with no local window is synced only once placement needs it (`local_on_demand`):
until then, behind the latest version, it is on `standby`, not `syncing` (an operator
would otherwise see it "syncing v0" for a whole run).

Pure state, no I/O: the RolloutManager drives it and owns the tasks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from polyrl.manager.events import EventLog
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import Heartbeat, RegisterRequest, WorkerInfo, WorkerState

log = logging.getLogger("polyrl.manager")


@dataclass(eq=False, repr=False)
class WorkerRecord:
    worker_id: str
    url: str
    model_path: str
    max_num_seqs: int
    max_model_len: int
    weight_version: int
    state: WorkerState = "registering"
    joined_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    num_running: int = 0
    num_waiting: int = 0
    gen_throughput: float = 0.0
    external_load: int = 0
    """Sequences on the worker that are not this manager's (other clients)."""
    inflight: int = 0
    """This manager's samples on the worker now."""
    busy_until: float = 0.0
    """After a 429/503 the worker gets no new work until then (monotonic)."""
    num_failures: int = 0
    consecutive_failures: int = 0
    """Failed calls since the last one that ended well: sets the failure back-off."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    is_local: bool = False
    sync_requested: int = -1
    """The newest version the sync hooks were already asked to deliver."""
    incremental_stream: bool = False
    """Speaks polyrl's incremental stream chunks (else: SGLang's cumulative snapshots)."""
    batched_generate: bool = False
    """Takes many calls in one `/generate` (`GenerateBatchRequest`), as polyrl workers do."""
    usd_per_hour: float | None = None
    device: str | None = None
    node: str | None = None
    instance_type: str | None = None
    pid: int | None = None
    log_path: str | None = None
    relay_port: int | None = None
    """Where it serves versions to other workers (None: it does not)."""
    idle_s: float = 0.0
    """Seconds this worker was syncing or active with none of our samples to run, up to
    `_counted_at` (`idle_seconds` adds the running interval): what the fleet's capacity
    waited for work, e.g. the tail of a synchronous step."""
    _counted_at: float = field(default_factory=time.monotonic)

    def __repr__(self) -> str:  # short: task reprs include it (see batch.SampleState)
        return f"<WorkerRecord {self.worker_id} {self.state} v{self.weight_version}>"

    @property
    def is_idle(self) -> bool:
        return self.state in ("syncing", "active") and self.inflight == 0

    def _count_idle(self) -> None:
        """Book the time since the last change; call before changing state or inflight."""
        now = time.monotonic()
        if self.is_idle:
            self.idle_s += now - self._counted_at
        self._counted_at = now

    def idle_seconds(self) -> float:
        return self.idle_s + (time.monotonic() - self._counted_at if self.is_idle else 0.0)

    def add_inflight(self, num: int) -> None:
        self._count_idle()
        self.inflight += num

    def set_state(self, state: WorkerState) -> None:
        self._count_idle()
        self.state = state

    def free_slots(self, cap: int) -> int:
        return min(cap, self.max_num_seqs) - self.inflight

    def load(self) -> float:
        """Fraction of the worker's sequence slots in use, ours and others'."""
        return (self.inflight + self.external_load) / self.max_num_seqs

    def serves(self, version: int, now: float) -> bool:
        return self.state == "active" and self.weight_version >= version and now >= self.busy_until

    def info(self, now: float) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            url=self.url,
            state=self.state,
            weight_version=self.weight_version,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_inflight=self.inflight,
            gen_throughput=self.gen_throughput,
            joined_at=self.joined_at,
            last_heartbeat_age_s=round(now - self.last_seen, 3),
            num_failures=self.num_failures,
            idle_s=round(self.idle_seconds(), 6),
            usd_per_hour=self.usd_per_hour,
            node=self.node,
            instance_type=self.instance_type,
            pid=self.pid,
            log_path=self.log_path,
        )


class Registry:
    """Records by id and the transitions between states (each also goes to `events`,
    the operator page's timeline)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self.latest_version = 0
        self.events = EventLog()
        self.local_on_demand = False
        """The local worker syncs only when placement needs it: behind, it waits on `standby`."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.workers.values()))

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self.workers.get(worker_id)

    def local(self) -> WorkerRecord | None:
        """The trainer's own engine, while it is registered."""
        record = self.workers.get(LOCAL_WORKER_ID)
        return record if record is not None and record.is_local else None

    def alive_remote(self) -> list[WorkerRecord]:
        """Remote workers that serve now or soon (not leaving, not gone)."""
        return [r for r in self if not r.is_local and r.state in ("registering", "syncing", "active")]

    def fleet_synced(self) -> bool:
        """Some remote worker is alive, and every one serves the latest version."""
        alive = self.alive_remote()
        return bool(alive) and all(r.state == "active" for r in alive)

    def add(self, request: RegisterRequest, worker_id: str) -> WorkerRecord:
        record = WorkerRecord(
            worker_id=worker_id,
            url=request.url.rstrip("/"),
            model_path=request.model_path,
            max_num_seqs=request.max_num_seqs,
            max_model_len=request.max_model_len,
            weight_version=request.weight_version,
            incremental_stream="incremental_stream" in request.capabilities,
            batched_generate="batched_generate" in request.capabilities,
            usd_per_hour=request.usd_per_hour,
            device=request.device,
            node=request.node,
            instance_type=request.instance_type,
            pid=request.pid,
            log_path=request.log_path,
            relay_port=request.relay_port,
            is_local=request.local,
        )
        self.workers[worker_id] = record
        self.events.add(worker_id, "registering", f"v{record.weight_version}")
        log.info("worker %s registered from %s (weights v%d)", worker_id, record.url, record.weight_version)
        return record

    def ready(self, record: WorkerRecord) -> None:
        """Passed the readiness check: active if it holds the latest weights, else syncing."""
        log.info("worker %s ready", record.worker_id)
        self._to_version_state(record)

    def heartbeat(self, record: WorkerRecord, beat: Heartbeat) -> None:
        record.last_seen = time.monotonic()
        record.num_running, record.num_waiting = beat.num_running, beat.num_waiting
        record.gen_throughput = beat.gen_throughput
        record.external_load = max(0, beat.num_running + beat.num_waiting - record.inflight)
        if beat.state == "draining" and record.state != "draining":
            log.info("worker %s draining (%d of our samples in flight)", record.worker_id, record.inflight)
            record.set_state("draining")
            self.events.add(record.worker_id, "draining")
        # only forward: a beat sent before a swap may arrive after the transfer layer's
        # mark_synced; a worker that really lost its weights restarts and registers again
        self.set_version(record, max(record.weight_version, beat.weight_version))

    def set_version(self, record: WorkerRecord, version: int) -> None:
        if version != record.weight_version:
            record.weight_version = version
            if record.state in ("standby", "syncing", "active"):
                self._to_version_state(record)

    def publish(self, version: int) -> list[WorkerRecord]:
        """A new latest version; returns the workers that now need to sync."""
        self.latest_version = version
        stale = []
        for record in self:
            if record.state in ("active", "syncing", "standby") and record.weight_version < version:
                if record.state == "active":
                    behind = self._behind(record)
                    record.set_state(behind)
                    self.events.add(record.worker_id, behind, self._behind_detail(record))
                if record.state == "syncing":
                    stale.append(record)
        log.debug("weights v%d published; %d workers to sync", version, len(stale))
        return stale

    def wake_local(self, record: WorkerRecord) -> None:
        """Placement needs the local worker: from now on it syncs like any other."""
        self.local_on_demand = False
        if record.state == "standby":
            self._to_version_state(record)

    def _behind(self, record: WorkerRecord) -> WorkerState:
        return "standby" if record.is_local and self.local_on_demand else "syncing"

    def _behind_detail(self, record: WorkerRecord) -> str:
        if self._behind(record) == "standby":
            return f"v{record.weight_version}, synced when the fleet needs it"
        return f"v{record.weight_version} -> v{self.latest_version}"

    def _to_version_state(self, record: WorkerRecord) -> None:
        current = record.weight_version >= self.latest_version
        behind = self._behind(record)
        if current and record.state != "active":
            # a sync happens every training step: routine, not an operator's event
            if record.state == "syncing":
                log.debug("worker %s synced to v%d", record.worker_id, record.weight_version)
            else:
                log.info("worker %s active", record.worker_id)
            record.set_state("active")
            self.events.add(record.worker_id, "active", f"v{record.weight_version}")
        elif not current and record.state != behind:
            record.set_state(behind)
            self.events.add(record.worker_id, behind, self._behind_detail(record))
            log.info(
                "worker %s %s (has v%d, latest v%d)",
                record.worker_id,
                "on standby" if behind == "standby" else behind,
                record.weight_version,
                self.latest_version,
            )

    def remove(self, record: WorkerRecord, why: str) -> None:
        """The worker is gone; the caller migrates its in-flight work."""
        if self.workers.get(record.worker_id) is record:
            del self.workers[record.worker_id]
        if record.state != "gone":
            record.set_state("gone")
            self.events.add(record.worker_id, "gone", why)
            log.info("worker %s gone (%s)", record.worker_id, why)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("registering", "standby", "syncing", "active", "draining"), 0)
        for record in self:
            counts[record.state] += 1
        return counts
