"""How samples are drawn: the one sampling type from the trainer's config to the engine.

The trainer builds one `SamplingParams` from `rollout.*`, sends it inside its batch to the
manager (`BatchRequest.sampling`), the manager sends it to each worker inside SGLang's
`/generate` body (`GenerateRequest.sampling_params`), and the worker hands it to its engine
(`EngineRequest.sampling`). The OpenAI and vLLM request models at the inference edge each
turn into one with one function (`to_sampling`). Only the engine has a second form: the
batched tensors its sampler reads on the device (`engine.sampler.SamplingBatch`).

Names and meanings are vLLM's and SGLang's (`max_new_tokens` is SGLang's name for vLLM's
`max_tokens`). One convention for "off": top_k 0, min_p 0, top_p 1. SGLang spells top_k
off as -1 and the seed as `sampling_seed`; both are read here, and `GenerateRequest`
writes them back in SGLang's spelling, so a real SGLang server reads what a worker does.

Log-probs do not depend on the cuts (top-k, top-p, min-p): a token's log-prob is that of
the temperature-scaled distribution before them (README, "Log-probs").
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOP_LOGPROBS = 20
"""OpenAI's own limit for chat's `top_logprobs`; SGLang and vLLM clients ask for fewer."""

TokenId = Annotated[int, Field(ge=0, lt=2**63)]
"""Whether an id is in the vocabulary is the engine's to say (400); beyond int64 is the wire's."""

SGLANG_IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
"""SGLang fields that only shape detokenisation; accepted and dropped (text is always
decoded the same way)."""


class SamplingParams(BaseModel):
    """Per request: `n` samples, each of up to `max_new_tokens` tokens, drawn from the
    model's distribution at `temperature` restricted to the tokens that pass every cut.
    Sample `i` of a request with `seed` s draws from the random stream of seed s + i, keyed
    by absolute token position, so `n` samples of one request equal `n` requests with
    seeds s, ..., s+n-1, and a sample resumed elsewhere with its seed continues its stream.

    Frozen (it is shared by every sample of a request, and by a batch's every request);
    derive a changed copy with `model_copy(update=...)`. Unknown fields are refused (a
    misspelt parameter silently ignored would change what the trainer learns from)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=1, lt=2**63)
    """The token budget of each sample (SGLang's default 128); kept across migrations."""
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus: the fewest most likely tokens whose probability reaches top_p. 1: off."""
    top_k: int = Field(0, ge=0, lt=2**63)
    """The k most likely tokens. 0: off (-1, SGLang's and vLLM's off, is read as 0)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Tokens at least min_p times as likely as the most likely one. 0: off."""
    stop_token_ids: tuple[TokenId, ...] = Field((), max_length=1024)
    """Besides the model's EOS tokens (unless `ignore_eos`), these end a sample; the stop
    token is the sample's last."""
    ignore_eos: bool = False
    """True: the model's EOS tokens do not end a sample (`stop_token_ids` still do)."""
    n: int = Field(1, ge=1, le=4096)
    """Samples per prompt (the GRPO group size)."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Sample i draws with seed + i. None: a fresh seed per request. In a batch, the seed
    of every prompt that has none of its own (vLLM's meaning)."""
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """> 0: also report this many most likely tokens per position, with their log-probs
    (OpenAI's `top_logprobs`, SGLang's request-level `top_logprobs_num`)."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: also report, for every position the engine computes, the
    experts each MoE layer routed it to (SGLang's request-level `return_routed_experts`;
    routing replay, `algo.router_replay = "R3"`)."""

    @model_validator(mode="before")
    @classmethod
    def _sglang_spelling(cls, data: Any) -> Any:
        """SGLang's spellings: `sampling_seed` for `seed`, -1 for top_k off; its
        detokenisation-only fields are dropped."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in SGLANG_IGNORED}
        if "sampling_seed" in data:
            sampling_seed = data.pop("sampling_seed")
            if data.get("seed") is not None and sampling_seed is not None and data["seed"] != sampling_seed:
                raise ValueError("seed and sampling_seed differ; send one of them")
            if data.get("seed") is None:
                data["seed"] = sampling_seed
        if data.get("top_k") == -1:
            data["top_k"] = 0
        return data

    @property
    def truncates(self) -> bool:
        """Whether any cut is on (the engine's fused sampling path has none)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    def sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` for this: top_k off as -1, the seed as
        `sampling_seed`; `top_logprobs` goes to the request (`top_logprobs_num`), and
        min_p only when on (servers that predate it then read the same body)."""
        out = self.model_dump(
            exclude={"seed", "top_logprobs", "return_routed_experts"} | ({"min_p"} if self.min_p == 0 else set())
        )
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.top_k == 0:
            out["top_k"] = -1
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out
