"""What goes into the engine and what comes out of it.

Log-prob definition (shared with the learner, see README "Log-probs"): the log-prob of a
sampled token is log softmax(logits / temperature) at that position, *before* top-p/top-k
truncation; with temperature 0 (greedy) it is log softmax(logits). The learner recomputes
exactly this quantity, so the importance ratio compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import FinishReason

if TYPE_CHECKING:  # the manager imports this module, and no torch
    import torch


class RequestError(ValueError):
    """A request the engine refuses (bad ids, too long, bad sampling values); the message
    is meant for the client."""


class EngineFullError(RuntimeError):
    """Too many requests are queued; the client should retry later (HTTP 429)."""


@dataclass(frozen=True)
class EngineRequest:
    """`input_ids` is the prompt, or for a resumed request the prompt followed by the tokens
    already generated elsewhere (with `max_new_tokens` reduced by their number)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class SampleDelta:
    """What one step added to one sample: tokens appended since the last delta, and the
    finish reason once the sample is done. Consumers concatenate deltas."""

    rid: str
    index: int  # sample index within the request, 0..n-1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None  # the stop token that ended the sample, if any
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """With `top_logprobs` k > 0: per token, the k most likely (token id, log-prob), best first."""
    routed_experts: torch.Tensor | None = None
    """With `return_routed_experts`: [positions, moe_layers, k] int16, the experts of the
    positions that produced this delta's tokens and of none before them (the first delta
    also carries the prompt's); concatenated over deltas, position p of prompt + completion
    for every p but the last token's, which no step has fed yet."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SampleResult:
    """A sample accumulated from its deltas."""

    rid: str
    index: int
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """The deltas' routes ([positions, moe_layers, k] each), when asked for."""

    def routes_between(self, first: int, end: int) -> torch.Tensor:
        """Rows first .. end - 1 of the routes so far, joining only the deltas they span (a
        stream sends each chunk's new rows: joining them all each time grows as n^2)."""
        import torch  # a worker's, which has it (see TYPE_CHECKING above)

        parts, offset = [], 0
        for chunk in self.routed_experts:
            lo, hi = max(first - offset, 0), min(end - offset, len(chunk))
            if lo < hi:
                parts.append(chunk[lo:hi])
            offset += len(chunk)
        return torch.cat(parts) if parts else self.routed_experts[0][:0]

    def add(self, delta: SampleDelta) -> None:
        assert delta.rid == self.rid and delta.index == self.index
        if delta.routed_experts is not None:
            self.routed_experts.append(delta.routed_experts)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top_logprobs += delta.top_logprobs
        self.weight_versions += delta.weight_versions
        if delta.finish_reason is not None:
            self.finish_reason, self.matched_stop = delta.finish_reason, delta.matched_stop


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    weight_version: int
    num_free_blocks: int
    num_total_blocks: int
    gen_throughput: float  # generated tokens/s over the recent window
    num_generated_tokens: int  # since start
    num_preemptions: int = 0
    """Running sequences whose KV blocks were taken back since start (each recomputes its
    prompt and tokens when readmitted): a KV cache too small for the batch."""
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted with a prefix-cache lookup, since start."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose KV the cache held (vLLM's prefix cache hit rate is
    hits / queries)."""
    num_steps: int = 0
    """Forward steps since start."""
    num_prefill_steps: int = 0
    """Of those, the steps that computed prompt tokens (a prefill chunk, a moved sample's
    re-prefill): on CUDA they run eagerly, outside the captured decode graphs and the
    overlap, so a worker fed one arrival at a time pays them on many steps."""
    num_prompt_tokens: int = 0
    """Prompt tokens computed since start (prefix-cache hits excluded; vLLM's
    `prompt_tokens_total` counts the hits too)."""
