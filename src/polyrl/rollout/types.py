"""What a rollout produces: a group of `n` samples for one prompt.

These records are the contract between every rollout source (the local engine today, the
manager's streamed results later) and the learner.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from polyrl.manager.protocol import BatchSampling, WorkerInfo
    from polyrl.rollout.stats import RolloutStats

FinishReason = Literal["stop", "length", "abort"]


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


class Rollout(Protocol):
    """Where a step's groups come from: the colocated engine (`LocalRollout`) or the
    manager and its workers (`RemoteRollout`)."""

    shares_weights: bool
    """The engine reads the learner's own parameters: a batch must finish generating
    before the first update."""
    stats: RolloutStats
    """The step's generation, once its batch has been read."""

    @property
    def weight_version(self) -> int: ...

    @property
    def num_instances(self) -> int: ...

    def publish(self, version: int, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Weights `version` (the learner's, or `weights`) for every engine; batches
        submitted from now on are generated with it."""

    def generate(self, prompts: list[Prompt], n: int, sampling: BatchSampling) -> Iterator[Group]:
        """Submit now (`n` samples per prompt, the group size); each prompt's group as soon
        as its last sample is done."""

    def learner_started(self) -> None:
        """The learner is about to take its first update of the step."""

    def workers(self) -> list[WorkerInfo]:
        """The rollout workers now (none colocated)."""

    def close(self) -> None: ...
