"""Prometheus metrics of one manager, in a registry of its own (several managers, e.g.
in tests, never collide). Counters are bumped where events happen; gauges are read
from the manager's state at scrape time, so they cannot drift from it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from polyrl.manager.batch import Batch, WorkUnit
    from polyrl.manager.registry import Registry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Gauged(Protocol):
    """What the gauges read of the manager (a `RolloutManager`) at scrape time: declared
    here so the metrics, which the manager holds, do not import it back."""

    registry: Registry
    batches: dict[str, Batch]
    pending: deque[WorkUnit]


class _StateCollector(Collector):
    def __init__(self, manager: Gauged) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        m = self.manager
        workers = GaugeMetricFamily("polyrl_manager_workers", "Workers by lifecycle state", labels=["state"])
        for state, count in m.registry.counts().items():
            workers.add_metric([state], count)
        yield workers
        yield GaugeMetricFamily(
            "polyrl_manager_inflight_samples", "Samples running on workers", value=sum(r.inflight for r in m.registry)
        )
        yield GaugeMetricFamily(
            "polyrl_manager_waiting_samples",
            "Samples waiting for a worker",
            value=sum(len(u.samples) for u in m.pending),
        )
        yield GaugeMetricFamily("polyrl_manager_open_batches", "Batches in progress", value=len(m.batches))
        yield GaugeMetricFamily(
            "polyrl_manager_latest_weight_version", "Latest published weight version", value=m.registry.latest_version
        )
        throughput = GaugeMetricFamily(
            "polyrl_manager_worker_gen_throughput", "Generated tokens/s reported by each worker", labels=["worker"]
        )
        for record in m.registry:
            throughput.add_metric([record.worker_id], record.gen_throughput)
        yield throughput


class ManagerMetrics:
    def __init__(self, manager: Gauged) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Counter("polyrl_manager_batches", "Finished batches by outcome", ["outcome"], registry=r)
        self.samples = Counter("polyrl_manager_samples", "Finished samples", registry=r)
        self.tokens = Counter("polyrl_manager_generated_tokens", "Tokens received from workers", registry=r)
        self.migrations = Counter(
            "polyrl_manager_migrations", "Samples moved to another worker, by cause", ["cause"], registry=r
        )
        self.lost_samples = Counter(
            "polyrl_manager_lost_samples", "Unfinished samples of failed batches (deadline, retry budget)", registry=r
        )
        self.num_migrations = 0
        """Both causes of `migrations` together, read on every /v1/workers."""
        self.worker_events = Counter(
            "polyrl_manager_worker_events", "Worker registrations, failures, leaves", ["event"], registry=r
        )
        r.register(_StateCollector(manager))

    def migrated(self, cause: str, num: int) -> None:
        self.migrations.labels(cause).inc(num)
        self.num_migrations += num

    def render(self) -> bytes:
        return generate_latest(self.registry)
