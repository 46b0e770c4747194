"""Reward functions for the RewardPool tests. They live in an importable module because the
pool's "spawn" workers import them by path (pytest puts this directory on sys.path, and spawn
children inherit the parent's sys.path)."""

from __future__ import annotations

import time


def length_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Completion length in characters: an easy-to-check deterministic score."""
    return [float(len(c)) for c in completions]


def flaky(prompts: list[str], completions: list[str], mode: list[str], **_) -> list:
    """Scores 1.0 per sample, or misbehaves in the way `mode[0]` asks for."""
    n = len(completions)
    how = mode[0]
    if how == "raise":
        raise RuntimeError("boom")
    if how == "short":
        return [1.0] * (n - 1)
    if how == "nan":
        return [float("nan")] * n
    if how == "text":
        return ["high"] * n
    if how == "sleep":
        time.sleep(60)
    return [1.0] * n
