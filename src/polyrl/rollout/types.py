"""What a rollout produces: a group of `n` samples for one prompt.

These records are the contract between every rollout source (the local engine today, the
manager's streamed results later) and the learner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Prompt:
    """One prompt as the learner sees it: its text, token ids and dataset columns."""

    index: int  # position in the prompt stream (the data cursor)
    text: str
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # e.g. {"answer": "42"}


@dataclass
class Sample:
    """One completion. `logprobs[i]` is the behaviour log-prob of `completion_ids[i]` under
    softmax(logits / temperature), before any top-p/top-k truncation (see README)."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_versions: list[int]  # version of the weights that produced each token
    workers: list[str] = field(default_factory=list)
    gen_time_s: float = 0.0

    def __post_init__(self) -> None:
        assert len(self.completion_ids) == len(self.logprobs) == len(self.weight_versions)


@dataclass
class Group:
    """The `n` samples of one prompt; rewards are filled in by the learner's scorer."""

    prompt: Prompt
    samples: list[Sample]
    rewards: list[float] | None = None
