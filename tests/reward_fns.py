"""Reward functions for the RewardPool tests. They live in an importable module because the
pool's "spawn" workers import them by path (pytest puts this directory on sys.path, and spawn
children inherit the parent's sys.path)."""

from __future__ import annotations

import os
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


def hang_when_told(prompts: list[str], completions: list[str], hang: list[str], **_) -> list[float]:
    """`length_reward`, but while the file `hang[0]` exists a call first writes its worker's
    pid to `hang[0] + ".pid"` and waits a second there: time for a test to signal the worker."""
    if os.path.exists(hang[0]):
        with open(hang[0] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(hang[0] + ".tmp", hang[0] + ".pid")
        time.sleep(1.0)
    return length_reward(prompts, completions)


def kill_own_worker(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Ends its worker process at once, as a crash or the out-of-memory killer would."""
    os._exit(3)
