"""Synthetic verifiable tasks a tiny model can learn with RL in minutes on a CPU.

A task is a deterministic prompt generator (record `i` depends only on the seed and `i`,
so the data cursor is just an integer) plus a reward function in the TRL convention.
Rewards live at module level so the reward process pool can import them by path.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Record = dict[str, str]


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], Record]
    reward: str  # import path of the reward function
    description: str


def _digit_sum(rng: random.Random) -> Record:
    a, b = rng.randrange(10), rng.randrange(10)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def _copy(rng: random.Random) -> Record:
    word = "".join(rng.choices("abcdef", k=rng.randint(2, 4)))
    return {"prompt": f"{word}>", "answer": word}


def _reverse(rng: random.Random) -> Record:
    word = "".join(rng.choices("abcdef", k=rng.randint(2, 4)))
    return {"prompt": f"{word}|", "answer": word[::-1]}


def _addition(rng: random.Random) -> Record:
    a, b = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def exact_match_reward(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion (cut at end of sequence) is exactly the answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def char_match_reward(
    prompts: list[str], completions: list[str], answer: list[str], finish_reason: list[str] | None = None, **_
) -> list[float]:
    """Partial credit: characters in the right place over the longer of the two strings,
    where stopping counts as one more character (`$`) when `finish_reason` is given.

    Dense credit is what lets a randomly initialised model find the signal at all; scoring
    the stop as its own position rewards ending at the right length independently of the
    content, without which a tiny model never learns to stop.
    """
    reasons = finish_reason or [None] * len(completions)
    scores = []
    for c, a, reason in zip(completions, answer, reasons, strict=True):
        c = c.strip()
        if reason is not None:
            c, a = c + ("$" if reason == "stop" else ""), a + "$"
        hits = sum(x == y for x, y in zip(c, a))
        scores.append(hits / max(len(c), len(a), 1))
    return scores


def repeat_match_reward(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """The share of the completion's characters that continue the answer repeated without
    end ("ab" -> "ababab..."). For responses generated to a set length past their end of
    sequence (`rollout.ignore_eos`), as in a long-tail benchmark: every token is scored,
    so the length is the workload's and all of it is something the model learns."""
    scores = []
    for c, a in zip(completions, answer, strict=True):
        if not c or not a:
            scores.append(0.0)
            continue
        target = a * (len(c) // len(a) + 1)
        scores.append(sum(x == y for x, y in zip(c, target)) / len(c))
    return scores


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("digit_sum", _digit_sum, f"{__name__}:exact_match_reward", "a+b= for digits a, b"),
        Task("copy", _copy, f"{__name__}:char_match_reward", "repeat a 2-4 letter word"),
        Task("reverse", _reverse, f"{__name__}:char_match_reward", "reverse a 2-4 letter word"),
        Task("addition", _addition, f"{__name__}:exact_match_reward", "a+b= for 0 <= a, b < 100"),
    ]
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"data.task: unknown task {name!r}; choose one of {sorted(TASKS)} or 'dataset'") from None


def task_record(task: Task, seed: int, index: int) -> Record:
    # A per-record RNG keeps records independent of how many were drawn before (resume-safe).
    return task.make(random.Random(seed * 1_000_003 + index))
