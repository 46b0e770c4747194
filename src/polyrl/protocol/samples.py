"""What a rollout produces: a group of `n` samples for one prompt.

These records are the contract between every rollout source (the trainer's engine, the
manager's streamed groups, Atropos) and the learner, and the data sources make the
prompts; so they live in the vocabulary, not in rollout/. The sources' own interface is
`polyrl.rollout.source.Rollout`, which builds on these and on the step's stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polyrl.protocol.version import WeightVersion
from polyrl.protocol.worker_api import FinishReason

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Prompt:
    """One prompt as the learner sees it: its text, token ids and dataset columns."""

    index: int  # position in the prompt stream (the data cursor)
    text: str
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # e.g. {"answer": "42"}
    max_new_tokens: int | None = None
    """This prompt's own generation budget (`data.max_new_tokens_key`); None: the run's."""

    def budget(self, cap: int) -> int:
        """Tokens each of this prompt's samples may generate under the run's cap."""
        return cap if self.max_new_tokens is None else min(self.max_new_tokens, cap)


@dataclass
class Sample:
    """One completion. `logprobs[i]` is the behaviour log-prob of `completion_ids[i]` under
    softmax(logits / temperature), before any top-p/top-k truncation (see README)."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_versions: list[WeightVersion]  # version of the weights that produced each token
    workers: list[str] = field(default_factory=list)
    """The engines that produced the tokens, in order (more than one: it migrated)."""
    worker_tokens: list[int] = field(default_factory=list)
    """Tokens produced by each of `workers` (empty: all of them by the first)."""
    gen_time_s: float = 0.0
    has_logprobs: bool = True
    """False when the producer sent no behaviour log-probs (an Atropos group without
    `inference_logprobs`): `logprobs` are placeholders and the learner uses its own."""
    prompt_ids: list[int] | None = None
    """This sample's own context, when it differs from the group's prompt (Atropos groups
    may hold a different context per sequence)."""
    loss_mask: list[bool] | None = None
    """Per completion token: trained on (None: every token). Atropos masks may leave
    tokens inside the completion untrained, e.g. a tool's output between two turns."""
    advantages: list[float] | None = None
    """Per completion token, given by the producer (an Atropos environment's own
    advantages); None: the learner's group advantage."""
    call_rewards: list[float] | None = None
    """An agent episode's reward per call, when its function gave one (they sum to the
    episode's reward); `algo.adv_estimator = "turn_grpo"` trains each call on its own."""
    routed_experts: np.ndarray | None = None
    """Mixture-of-experts models, when asked for (`algo.router_replay = "R3"`): the experts
    each position of prompt + completion but the last went through in the engine,
    [positions, moe_layers * k] int32 (`polyrl.protocol.routes`)."""

    def __post_init__(self) -> None:
        assert len(self.completion_ids) == len(self.logprobs) == len(self.weight_versions)
        for per_token in (self.loss_mask, self.advantages):
            assert per_token is None or len(per_token) == len(self.completion_ids)


@dataclass
class Group:
    """The `n` samples of one prompt; rewards are filled in by the learner's scorer."""

    prompt: Prompt
    samples: list[Sample]
    rewards: list[float] | None = None
    """Filled in by the learner's scorer, or given with the group (Atropos scores)."""
    zero_advantage: list[bool] | None = None
    """Per sample: its advantage is forced to 0 (Atropos's `set_advantage_to_zero`)."""
