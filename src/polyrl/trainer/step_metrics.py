"""One training step's metrics, from what the step did (`StreamResult`), its timings
(`Timer`) and where its groups came from (the rollout, the fully asynchronous feed, the
launched fleet). The formulas for each family are in `polyrl.metrics.step_stats`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from polyrl.config import RunConfig
from polyrl.cpu_threads import process_threads
from polyrl.launch.fleet import Fleet
from polyrl.metrics.step_stats import (
    cost_metrics,
    cuda_memory_metrics,
    num_tokens,
    perf_metrics,
    rollout_metrics,
    version_lag_metrics,
)
from polyrl.protocol.samples import Group
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.feed import AsyncFeed
from polyrl.rollout.source import Rollout
from polyrl.trainer.stream import StreamResult


class Timer:
    """Collects named wall-clock spans: `with timer("gen"): ...`."""

    def __init__(self) -> None:
        self.spans: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans[name] = self.spans.get(name, 0.0) + time.perf_counter() - t0


def average_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the mini-batches that report it."""
    keys = {k for row in rows for k in row}
    return {k: float(np.mean([row[k] for row in rows if k in row])) for k in sorted(keys)}


def step_metrics(
    *,
    cfg: RunConfig,
    groups: list[Group],
    result: StreamResult,
    timings: dict[str, float],
    rollout: Rollout,
    feed: AsyncFeed | None,
    fleet: Fleet | None,
    world_size: int,
    device: torch.device,
    weight_version: WeightVersion,
    budget: int | None = None,
) -> dict[str, float]:
    """`timings` has the whole step's span as "step"; `device` is the learner's;
    `weight_version` the one the step published; `budget` the step's generation budget
    (default: `rollout.max_new_tokens`)."""
    step_s = timings["step"]
    metrics = average_metrics(result.train_metrics)
    metrics.update(rollout_metrics(groups, budget or cfg.rollout.max_new_tokens))
    if result.version is not None:
        metrics.update(version_lag_metrics(groups, result.version))
    total_tokens = num_tokens(groups)
    metrics.update(perf_metrics(total_tokens, step_s, world_size=world_size))
    metrics.update(cuda_memory_metrics(device))
    if device.type == "cpu":
        metrics["perf/cpu_threads"] = float(process_threads().threads)
    stats = feed.step.stats if feed is not None else rollout.stats
    metrics.update(stats.metrics())
    if feed is not None:
        metrics.update(feed.step.metrics())
    metrics.update({f"timing_s/{k}": v for k, v in timings.items() if k != "step"})
    metrics["timing_s/gen"] = stats.gen_s
    metrics["timing_s/learner_idle"] = result.wait_s + timings.get("learner_idle", 0.0)  # (colocated: generating)
    metrics["timing_s/reward"] = result.reward_wait_s
    metrics["timing_s/update_actor"] = result.update_s
    metrics["training/num_rollout_instances"] = float(len(stats.tokens_by_worker) or rollout.num_instances)
    prices: list[float] = []
    if cfg.rollout.mode != "local":
        default = cfg.cost.worker_usd_per_hour
        prices = [w.usd_per_hour if w.usd_per_hour is not None else default for w in rollout.workers()]
        metrics["training/num_workers"] = float(len(prices))
        if stats.fleet_idle_s is not None and prices:
            metrics["rollout/fleet_idle_ratio"] = min(1.0, stats.fleet_idle_s / (step_s * len(prices)))
    trainer_usd = cfg.cost.trainer_usd_per_hour * world_size  # one price per trainer GPU
    metrics.update(cost_metrics(total_tokens, step_s, trainer_usd, prices))
    if fleet is not None:
        events = fleet.events
        metrics.update(
            {
                "fleet/launched": float(events.launched),
                "fleet/retired": float(events.retired),
                "fleet/killed": float(events.killed),
            }
        )
    metrics["training/filtered_groups"] = float(result.num_filtered_groups)
    if cfg.algo.overlong_filter:
        metrics["training/overlong_filtered_samples"] = float(result.num_overlong_filtered)
    metrics["reward/failed_samples"] = float(result.num_failed_samples)
    metrics["training/weight_version"] = float(weight_version)
    return metrics
