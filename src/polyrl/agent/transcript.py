"""One episode as the learner will see it: a single token sequence, grown call by call.

An agent episode is many engine calls, but GRPO trains on it as one sequence: the first
call's prompt, then, in order, every reply the engine sampled (trained on, with its
behaviour log-probs and the weight version of each token) and the tokens the
environment added between two replies (tool results, the next user message, the chat
template's glue: masked out of the loss). Each call's prompt is exactly this sequence so
far, so the engine saw the very tokens the learner trains on: nothing the model produced
is ever tokenized again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.protocol.samples import Sample
from polyrl.protocol.version import WeightVersion
from polyrl.protocol.worker_api import FinishReason


@dataclass
class Transcript:
    """The growing token sequence of one episode."""

    prompt_ids: list[int] = field(default_factory=list)
    """The first call's prompt: the context the episode starts from."""
    ids: list[int] = field(default_factory=list)
    """Everything after the prompt: replies and the environment's tokens, interleaved."""
    sampled: list[bool] = field(default_factory=list)
    """Per token of `ids`: the engine sampled it (trained on) or the environment added it."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[WeightVersion | None] = field(default_factory=list)
    """Per token of `ids`: the weights that sampled it (None for the environment's tokens
    until the next reply: they are context for it, and take its first token's version)."""
    workers: list[str] = field(default_factory=list)
    worker_tokens: list[int] = field(default_factory=list)
    num_calls: int = 0
    finish_reason: FinishReason = "stop"
    """The last reply's."""

    @property
    def context(self) -> list[int]:
        """The next call's prompt: every token so far."""
        return self.prompt_ids + self.ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_context(self, token_ids: list[int]) -> None:
        """Tokens the environment adds before the next call (the first call: the prompt)."""
        if self.num_calls == 0:
            self.prompt_ids += token_ids
            return
        self.ids += token_ids
        self.sampled += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [None] * len(token_ids)

    def add_reply(self, reply: Sample) -> None:
        """A call's reply (one sample, its stop token included, as the engine returns it);
        the environment tokens before it take its first token's version."""
        if reply.completion_ids:
            first = reply.weight_versions[0]
            self.versions = [first if v is None else v for v in self.versions]
        self.ids += reply.completion_ids
        self.sampled += [True] * len(reply.completion_ids)
        self.logprobs += reply.logprobs
        self.versions += reply.weight_versions
        for worker, num in zip(reply.workers, reply.worker_tokens or [len(reply.completion_ids)], strict=False):
            if self.workers and self.workers[-1] == worker:
                self.worker_tokens[-1] += num
            else:
                self.workers.append(worker)
                self.worker_tokens.append(num)
        self.num_calls += 1
        self.finish_reason = reply.finish_reason

    def to_sample(self) -> Sample:
        """The episode as one sample: the prompt, then everything up to the last reply's
        last token (environment tokens after it were never seen by the model)."""
        end = len(self.sampled)
        while end and not self.sampled[end - 1]:
            end -= 1
        versions = self.versions[:end]
        last = next((v for v in reversed(versions) if v is not None), 0)
        return Sample(
            completion_ids=self.ids[:end],
            logprobs=self.logprobs[:end],
            finish_reason=self.finish_reason,
            weight_versions=[last if v is None else v for v in versions],
            workers=list(self.workers),
            worker_tokens=list(self.worker_tokens),
            prompt_ids=list(self.prompt_ids),
            loss_mask=None if all(self.sampled[:end]) else self.sampled[:end],
        )
