"""What one step's generation did, for the step's metrics (any rollout mode)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import WorkerList
from polyrl.protocol.samples import Group

log = logging.getLogger("polyrl.rollout")


@dataclass
class RolloutStats:
    """What one step's generation took, for the step's metrics."""

    gen_s: float = 0.0
    """Submission to the last group."""
    first_group_s: float = 0.0
    num_requested: int = 0
    num_received: int = 0
    num_migrated: int = 0
    """Samples that moved between workers at least once (failure, hand-back, window close)."""
    num_local: int = 0
    """Samples with tokens from the trainer's own engine."""
    tokens_by_worker: Counter[str] = field(default_factory=Counter)
    window_s: float | None = None
    window_closed_by: str = ""
    weight_sync_s: float | None = None
    """From publishing the step's version to the slowest remote worker serving it."""
    fleet_idle_s: float | None = None
    """Seconds the remote workers had none of our samples to run (summed over workers)."""
    num_lost_workers: int | None = None
    """Workers the manager lost without notice (kill -9, crash, cut off) since the run
    started: `fleet/lost_workers`."""
    num_unversioned_groups: int | None = None
    """Atropos: the step's groups whose tokens' weight versions the manager could not
    tell, booked under the learner's version (`rollout/unversioned_groups`)."""
    num_failed_groups: int | None = None
    """Agent episodes: the step's groups dropped because an episode raised
    (`rollout/agent_failed_groups`)."""
    num_cancelled: int = 0
    """Samples of a batch closed before its end (`algo.filter_groups` had enough groups):
    not lost, not wanted."""

    def add(self, other: RolloutStats, cut: bool) -> None:
        """Book another batch of the same step (a round of `algo.filter_groups`) into these;
        `cut`: it was closed early, so what it did not deliver was cancelled."""
        self.num_requested += other.num_requested
        self.num_received += other.num_received
        self.num_cancelled += other.num_cancelled + (other.num_requested - other.num_received if cut else 0)
        self.num_migrated += other.num_migrated
        self.num_local += other.num_local
        self.tokens_by_worker.update(other.tokens_by_worker)
        self.gen_s += other.gen_s
        self.first_group_s = self.first_group_s or other.first_group_s
        if other.fleet_idle_s is not None:
            self.fleet_idle_s = (self.fleet_idle_s or 0.0) + other.fleet_idle_s
        self.window_s, self.window_closed_by = (
            self.window_s or other.window_s,
            self.window_closed_by or other.window_closed_by,
        )
        self.weight_sync_s = self.weight_sync_s if self.weight_sync_s is not None else other.weight_sync_s
        self.num_lost_workers = other.num_lost_workers if other.num_lost_workers is not None else self.num_lost_workers

    def count(self, group: Group) -> None:
        """Book a received group: its samples, where their tokens came from."""
        for s in group.samples:
            for worker, num in zip(s.workers, s.worker_tokens or [len(s.completion_ids)]):
                self.tokens_by_worker[worker] += num
            self.num_migrated += len(s.workers) > 1
            self.num_local += LOCAL_WORKER_ID in s.workers
        self.num_received += len(group.samples)

    def metrics(self) -> dict[str, float]:
        out = {
            "rollout/samples_requested": float(self.num_requested),
            "rollout/samples_received": float(self.num_received),
            "rollout/samples_lost": float(self.num_requested - self.num_received - self.num_cancelled),
            "rollout/samples_cancelled": float(self.num_cancelled),
            "rollout/migrated_samples": float(self.num_migrated),
            "rollout/local_samples": float(self.num_local),
            "timing_s/first_group": self.first_group_s,
        }
        remote = {w: n for w, n in self.tokens_by_worker.items() if w != LOCAL_WORKER_ID}
        if remote and self.gen_s > 0:
            out["perf/tokens_per_s_per_worker"] = sum(remote.values()) / self.gen_s / len(remote)
        if self.window_s is not None:
            out["timing_s/local_window"] = self.window_s
        if self.weight_sync_s is not None:
            out["timing_s/weight_sync"] = self.weight_sync_s
        if self.fleet_idle_s is not None:
            out["rollout/fleet_idle_s"] = self.fleet_idle_s
        if self.num_lost_workers is not None:
            out["fleet/lost_workers"] = float(self.num_lost_workers)
        if self.num_failed_groups is not None:
            out["rollout/agent_failed_groups"] = float(self.num_failed_groups)
        if self.num_unversioned_groups is not None:
            out["rollout/unversioned_groups"] = float(self.num_unversioned_groups)
        return out


class LostWorkers:
    """The workers the manager lost without notice, between two looks at the fleet: one
    log line each (a kill -9 showed in the manager's log only) and the run's count."""

    def __init__(self, seen: int = 0) -> None:
        self.num_lost = 0
        self._seen = seen
        """The manager's count at the last look (it counts from 0 again after a restart)."""

    def since_last(self, fleet: WorkerList) -> int:
        now = fleet.num_lost_workers
        new = now - self._seen if now >= self._seen else now  # a restarted manager counts from 0
        self._seen = now
        for lost in fleet.lost_workers[-new:] if new else []:
            log.warning(
                "worker %s lost (%s); its %d samples in flight continue on other workers",
                lost.worker_id,
                lost.why,
                lost.num_samples,
            )
        if new > len(fleet.lost_workers):
            log.warning("%d more workers lost (see the manager's log)", new - len(fleet.lost_workers))
        self.num_lost += new
        return new


class FleetIdle:
    """The remote workers' idle seconds between two looks at the fleet (`WorkerList`
    carries each worker's running total since it registered)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def since_last(self, fleet: WorkerList) -> float:
        now = {w.worker_id: w.idle_s for w in fleet.workers if w.worker_id != LOCAL_WORKER_ID}
        idle = sum(total - self._last.get(worker, 0.0) for worker, total in now.items())
        self._last = now
        return max(0.0, idle)
