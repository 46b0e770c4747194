"""The operator's view of the fleet: what the live page (`GET /`), `polyrl status` and
`GET /v1/fleet` show.

Two bounded logs feed it. `EventLog` (`events.py`) keeps the workers' lifecycle
transitions (joined, syncing, active, draining, gone), written where the registry changes
a state, so the page can draw a timeline without having watched from the start.
`History` keeps the fleet's throughput and price every few seconds, sampled by the
manager's monitor, so a page opened late still sees the curve. Both are capped: a
manager runs for days and syncs every worker every step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from polyrl.manager.events import WorkerEvent
from polyrl.protocol.manager_api import FleetDecision, LocalWindowReport, WorkerState

if TYPE_CHECKING:
    from polyrl.manager.batch import Batch, WorkUnit
    from polyrl.manager.metrics import ManagerMetrics
    from polyrl.manager.registry import Registry, WorkerRecord
    from polyrl.manager.window import LocalWindow

HISTORY_INTERVAL_S = 2.0
MAX_HISTORY = 1800
"""An hour at HISTORY_INTERVAL_S."""
MAX_DECISIONS = 100
"""The autoscaler's latest decisions kept for the page (it decides every few steps)."""


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HistoryPoint(_View):
    t: float
    """Unix time."""
    tokens_per_s: float
    """Generated tokens/s summed over the workers that serve (their own reports)."""
    usd_per_hour: float | None
    """Summed over the serving workers that declared a price; None when none did."""
    num_workers: int


class FleetWorker(_View):
    worker_id: str
    url: str
    host: str
    device: str | None
    node: str | None = None
    instance_type: str | None = None
    state: WorkerState
    weight_version: int
    tokens_per_s: float
    usd_per_hour: float | None
    uptime_s: float
    num_inflight: int
    """This manager's samples on the worker now."""
    num_running: int
    """Sequences the worker runs, ours and other clients' (its last heartbeat)."""
    num_failures: int
    last_heartbeat_age_s: float
    is_local: bool
    pid: int | None = None
    log_path: str | None = None
    """Where to find the process on its node."""


class FleetStatus(_View):
    """`GET /v1/fleet`: one snapshot for the operator page and `polyrl status`."""

    now: float
    started_at: float
    latest_weight_version: int
    """The trainer publishes version v after step v, so this is also the step."""
    num_open_batches: int
    num_inflight_samples: int
    num_waiting_samples: int
    num_migrations: int
    """Samples moved to another worker (failures and hand-backs) since the start."""
    num_lost_samples: int
    """Samples of batches that failed (deadline, retry budget): zero in a healthy run."""
    num_generated_tokens: int
    workers: list[FleetWorker]
    events: list[WorkerEvent]
    history: list[HistoryPoint]
    last_window: LocalWindowReport | None = None
    decisions: list[FleetDecision] = []
    """The trainer's autoscaler's latest decisions, oldest first."""


class History:
    """Fleet throughput and price, one point per HISTORY_INTERVAL_S at most."""

    def __init__(self, interval_s: float = HISTORY_INTERVAL_S, maxlen: int = MAX_HISTORY) -> None:
        self.interval_s = interval_s
        self.points: deque[HistoryPoint] = deque(maxlen=maxlen)

    def maybe_sample(self, records: list[WorkerRecord]) -> None:
        now = time.time()
        if self.points and now - self.points[-1].t < self.interval_s:
            return
        serving = [r for r in records if r.state in ("active", "draining")]
        prices = [r.usd_per_hour for r in serving if r.usd_per_hour is not None]
        self.points.append(
            HistoryPoint(
                t=now,
                tokens_per_s=round(sum(r.gen_throughput for r in serving), 3),
                usd_per_hour=round(sum(prices), 6) if prices else None,
                num_workers=len(serving),
            )
        )


def _worker(record: WorkerRecord, now_unix: float, now: float) -> FleetWorker:
    return FleetWorker(
        worker_id=record.worker_id,
        url=record.url,
        host=urlsplit(record.url).hostname or "",
        device=record.device,
        node=record.node,
        instance_type=record.instance_type,
        state=record.state,
        weight_version=record.weight_version,
        tokens_per_s=record.gen_throughput,
        usd_per_hour=record.usd_per_hour,
        uptime_s=round(max(0.0, now_unix - record.joined_at), 3),
        num_inflight=record.inflight,
        num_running=record.num_running,
        num_failures=record.num_failures,
        last_heartbeat_age_s=round(now - record.last_seen, 3),
        is_local=record.is_local,
        pid=record.pid,
        log_path=record.log_path,
    )


class Observed(Protocol):
    """What `fleet_status` reads of the manager (a `RolloutManager`): declared here so this
    view does not import the manager that builds it."""

    started_at: float
    registry: Registry
    metrics: ManagerMetrics
    history: History
    decisions: deque[FleetDecision]
    window: LocalWindow
    batches: dict[str, Batch]
    pending: deque[WorkUnit]


def fleet_status(manager: Observed) -> FleetStatus:
    now_unix, now = time.time(), time.monotonic()
    counters = manager.metrics.registry
    return FleetStatus(
        now=now_unix,
        started_at=manager.started_at,
        latest_weight_version=manager.registry.latest_version,
        num_open_batches=len(manager.batches),
        num_inflight_samples=sum(r.inflight for r in manager.registry),
        num_waiting_samples=sum(len(u.samples) for u in manager.pending),
        num_migrations=manager.metrics.num_migrations,
        num_lost_samples=int(counters.get_sample_value("polyrl_manager_lost_samples_total") or 0),
        num_generated_tokens=int(counters.get_sample_value("polyrl_manager_generated_tokens_total") or 0),
        workers=[_worker(r, now_unix, now) for r in manager.registry],
        events=list(manager.registry.events.events),
        history=list(manager.history.points),
        last_window=manager.window.last,
        decisions=list(manager.decisions),
    )
