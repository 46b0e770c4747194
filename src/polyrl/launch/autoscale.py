"""Autoscaling the launched fleet (`fleet.autoscale`): after each step, decide whether one
worker more or one fewer would give more tokens per dollar (or meet a target step time).

The decision uses what every step already measures: the step's time, its tokens, the
workers' prices, and the seconds the workers sat idle in it (`rollout/fleet_idle_s`,
from the manager). Busy worker-seconds B = n x step - idle is the work the fleet did.
Spread over n' workers it takes B / n'; the rest of the step, step - B / n, is what no
worker can shorten (the learner, the weight sync, the tail of the longest responses).
So, as Amdahl's law has it, a step with n' workers takes

    step(n') = step - B / n + B / n'

and costs (trainer + n' x worker) $/h for the same tokens. The scaler averages the
steps since its last change (the first after a change is left out: it pays the new
worker's start and sync), moves one worker at a time toward the best n' within
[min_workers, max_workers], and only when that is predicted to gain `min_gain`.
Scaling down retires the oldest launched worker (SIGTERM: it drains and hands its
samples back). On Ray the target first goes to the cluster's autoscaler
(`Fleet.request`). Each decision is one log line and the `fleet/autoscale_target` metric.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from polyrl.config import AutoscaleConfig, RunConfig

log = logging.getLogger("polyrl.fleet")


@dataclass(frozen=True)
class StepCost:
    """One step as the scaler reads it."""

    step_s: float
    idle_s: float
    """Worker-seconds idle in the step, all workers together."""
    tokens: float
    workers: int


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str


def predicted_step_s(seen: StepCost, workers: int) -> float:
    """Amdahl's law over the fleet's busy worker-seconds (the module's docstring)."""
    busy = max(0.0, seen.workers * seen.step_s - seen.idle_s)
    serial = max(0.0, seen.step_s - busy / seen.workers)
    return serial + busy / workers


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig, trainer_usd_per_hour: float, worker_usd_per_hour: float) -> None:
        self.cfg = cfg
        self.trainer_usd, self.worker_usd = trainer_usd_per_hour, worker_usd_per_hour
        self.target: int | None = None
        """The fleet size last asked for (None: nothing decided yet)."""
        self._seen: list[StepCost] = []

    def tokens_per_usd(self, seen: StepCost, workers: int) -> float:
        usd = predicted_step_s(seen, workers) * (self.trainer_usd + workers * self.worker_usd) / 3600
        return seen.tokens / usd if usd > 0 else 0.0

    def observe(self, metrics: dict[str, float]) -> Decision | None:
        """A step's metrics; a decision once enough steps at the current size are in."""
        workers = int(metrics.get("training/num_workers", 0))
        if workers < 1 or "rollout/fleet_idle_s" not in metrics:
            self._seen.clear()  # nothing to reason from (no worker, or a manager that does not say)
            return None
        step = StepCost(
            metrics["perf/time_per_step"], metrics["rollout/fleet_idle_s"], metrics["perf/total_num_tokens"], workers
        )
        if self._seen and self._seen[-1].workers != workers:
            self._seen = []  # the fleet changed (a launch came up, a worker left): start over
            return None  # and this first step at the new size pays its start
        self._seen.append(step)
        if len(self._seen) < self.cfg.interval_steps or (self.target is not None and self.target != workers):
            return None  # too few steps, or a change asked for has not happened yet
        seen = StepCost(
            statistics.median(s.step_s for s in self._seen),
            statistics.median(s.idle_s for s in self._seen),
            statistics.median(s.tokens for s in self._seen),
            workers,
        )
        self._seen = []
        return self._decide(seen)

    def _decide(self, seen: StepCost) -> Decision | None:
        cfg, n = self.cfg, seen.workers
        sizes = range(cfg.min_workers, cfg.max_workers + 1)
        if cfg.target_step_s is not None:
            meets = [k for k in sizes if predicted_step_s(seen, k) <= cfg.target_step_s]
            best = min(meets) if meets else cfg.max_workers
            goal = f"step {seen.step_s:.2f} s against a target of {cfg.target_step_s:.2f} s"
            better = best != n
        else:
            best = max(sizes, key=lambda k: self.tokens_per_usd(seen, k))
            now, then = self.tokens_per_usd(seen, n), self.tokens_per_usd(seen, n + (1 if best > n else -1))
            better = best != n and then >= (1 + cfg.min_gain) * now
            goal = f"tokens/$ {now:,.0f} now, {then:,.0f} predicted"
        if n < cfg.min_workers or n > cfg.max_workers:
            better, best = True, min(max(n, cfg.min_workers), cfg.max_workers)
        if not better:
            return None
        target = n + (1 if best > n else -1)
        idle = seen.idle_s / max(seen.workers * seen.step_s, 1e-9)
        reason = (
            f"{n} -> {target} workers: {goal}; step {seen.step_s:.2f} s now, "
            f"{predicted_step_s(seen, target):.2f} s predicted; workers idle {idle:.0%}"
        )
        self.target = target
        log.info("autoscale: %s", reason)
        return Decision(target, reason)


def autoscaler_for(cfg: RunConfig, world_size: int) -> Autoscaler | None:
    """The run's scaler (None when `fleet.autoscale` is off): the trainer's price per GPU
    times its ranks, and the price the launched workers declare."""
    if not cfg.fleet.autoscale.enabled:
        return None
    return Autoscaler(cfg.fleet.autoscale, cfg.cost.trainer_usd_per_hour * world_size, cfg.fleet.usd_per_hour)
