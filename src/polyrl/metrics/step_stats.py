"""Rollout and throughput statistics of one step, under veRL's metric names."""

from __future__ import annotations

import numpy as np
import torch

from polyrl.protocol.samples import Group


def rollout_metrics(groups: list[Group], max_new_tokens: int) -> dict[str, float]:
    """None of these for a step without a group (`algo.filter_groups` at its cap)."""
    if not groups:
        return {}
    lengths = np.array([len(s.completion_ids) for g in groups for s in g.samples], dtype=float)
    rewards = np.array([r for g in groups for r in (g.rewards or [])], dtype=float)
    prompt_lengths = np.array([len(g.prompt.prompt_ids) for g in groups], dtype=float)
    solved = [max(g.rewards) > min(g.rewards) for g in groups if g.rewards]
    return {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/max": float(rewards.max()),
        "critic/score/min": float(rewards.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).mean()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "training/mixed_reward_group_ratio": float(np.mean(solved)) if solved else 0.0,
    }


def version_lag_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """How many versions behind the learner (`version`) the step's tokens were sampled, and
    the share of samples whose tokens came from more than one version."""
    lags = np.array([version - v for g in groups for s in g.samples for v in s.weight_versions], dtype=float)
    if not lags.size:
        return {}
    samples = [s for g in groups for s in g.samples if s.weight_versions]
    spanning = sum(len(set(s.weight_versions)) > 1 for s in samples)
    return {
        "rollout/version_lag/mean": float(lags.mean()),
        "rollout/version_lag/max": float(lags.max()),
        "rollout/multi_version_ratio": spanning / len(samples),
    }


def num_tokens(groups: list[Group]) -> int:
    """Prompt + completion tokens the step processed (veRL counts both)."""
    return sum(
        len(g.prompt.prompt_ids) * len(g.samples) + sum(len(s.completion_ids) for s in g.samples) for g in groups
    )


def cost_metrics(
    total_tokens: int, step_s: float, trainer_usd_per_hour: float, worker_usd_per_hour: list[float]
) -> dict[str, float]:
    """What the step cost at the configured prices: the trainer plus every worker alive
    at the step's end (registering, syncing and draining ones included: they are paid)."""
    usd_per_hour = trainer_usd_per_hour + sum(worker_usd_per_hour)
    usd = usd_per_hour * step_s / 3600
    return {
        "cost/usd_per_hour": usd_per_hour,
        "cost/usd_per_step": usd,
        "cost/tokens_per_usd": total_tokens / usd if usd > 0 else 0.0,
    }


def perf_metrics(total_tokens: int, step_s: float, world_size: int) -> dict[str, float]:
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_s,
        "perf/throughput": total_tokens / step_s / world_size,
        "perf/throughput_all_gpus": total_tokens / step_s,
    }


def cuda_memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory since the last call, and allocator retries (each one frees the cache
    and synchronises: a step that needs them is near the memory limit and slow)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    out = {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        "perf/alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }
    torch.cuda.reset_peak_memory_stats(device)
    return out
