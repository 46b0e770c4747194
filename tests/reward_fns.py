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


def one_plus_length(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1 + length / 100: every score this function gives is >= 1, so a 0.0 in a run's metrics
    came from somewhere else. If $POLYRL_TEST_CRASH_ONCE names a file that does not exist
    yet, the first call creates it and ends its worker (a crash the pool must retry). While
    the file $POLYRL_TEST_HOLD names exists, a call creates that name + ".held" and waits
    (up to 60 s): the step that needs the score stays in progress until the test lets go."""
    marker = os.environ.get("POLYRL_TEST_CRASH_ONCE")
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            os._exit(3)
        except FileExistsError:
            pass
    hold = os.environ.get("POLYRL_TEST_HOLD")
    if hold and os.path.exists(hold):
        open(hold + ".held", "w").close()  # noqa: SIM115 - an empty marker
        deadline = time.monotonic() + 60
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.01)
    return [1.0 + len(c) / 100 for c in completions]


def constant(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Every completion alike: no group has a reward spread (`algo.filter_groups` at its cap)."""
    return [0.5] * len(completions)
