"""Wire models of the OpenAI- and vLLM-compatible endpoints (worker and manager alike).

Only requests are modelled: responses are built as plain JSON by `render.py`, in the
shapes the `openai` client and atroposlib parse. Every request turns into the one
sampling type, `polyrl.protocol.sampling.SamplingParams`, at this boundary (each model's
`to_sampling`); nothing past here knows which dialect a request came in.

Unlike the SGLang models (`worker/protocol.py`), unknown fields are ignored: OpenAI
clients send fields we have no use for (`user`, `presence_penalty: 0`, vendor
`extra_body`s) and OpenAI-compatible servers accept them. The fields we would have to
honour and cannot (a non-default penalty, `logit_bias`, `echo`, tools) are refused with a
400 naming them, instead of being silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polyrl.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenId

MAX_N = 128
"""Most samples one OpenAI/vLLM request may ask for (a worker allows at most its
`engine.max_num_seqs`, which may be fewer): a GRPO group is 8-64; more is a batch, and
belongs in `/v1/batches`."""
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256


NO_OP_VALUES: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "best_of": 1,
    "echo": False,
    "logit_bias": {},
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "suffix": "",
    "prompt_logprobs": 0,
}
"""Fields we cannot honour, and the value (besides null) at which they change nothing:
sent with any other value, the request is refused naming the field."""


def unsupported_field(fields: dict[str, Any]) -> str | None:
    """The first field in `fields` set to something this server cannot honour, or None."""
    for name, no_op in NO_OP_VALUES.items():
        value = fields.get(name)
        if value is not None and value != no_op:
            return name
    return None


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unsupported(self) -> str | None:
        return unsupported_field(self.model_extra or {})


def _stop_list(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return [] if not value else [value]
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SampledRequest(_Wire):
    """The sampling fields OpenAI's two endpoints share (plus vLLM's `top_k`, `ignore_eos`
    and `stop_token_ids`, which vLLM's OpenAI server accepts too)."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, lt=2**63)
    """At most MAX_N (or the worker's max_num_seqs): checked by the handler, whose 400 says the limit."""
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    """None: 1.0, OpenAI's default. 0: greedy."""
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**63)
    """-1 or 0: off."""
    min_p: float | None = Field(None, ge=0, le=1)
    """vLLM's: tokens at least min_p times as likely as the most likely one. None or 0: off."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field([], max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] = Field([], max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    _stop = field_validator("stop", mode="before")(_stop_list)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        if any(not s or len(s) > MAX_STOP_CHARS for s in value):
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        return value

    @property
    def num_top_logprobs(self) -> int:
        return 0

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            seed=self.seed,
            top_logprobs=self.num_top_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SampledRequest):
    """`POST /v1/completions`: one prompt, as text or as token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, lt=2**63)
    """OpenAI's default is 16; None: the rest of the context."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """k: the sampled token's log-prob and the k most likely alternatives per token."""

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Content parts are joined when all are text; images and audio are refused."""
        if isinstance(value, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in value):
                raise ValueError("only text content parts are supported")
            return "".join(part["text"] for part in value)
        return value


class ChatCompletionRequest(SampledRequest):
    """`POST /v1/chat/completions`: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, lt=2**63)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**63)
    """OpenAI's newer name for `max_tokens`; None for both: the rest of the context."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's extensions: end the prompt after the last message instead of opening an
    assistant turn (for prefilled answers)."""

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class VllmPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_token_ids: list[TokenId] = Field(min_length=1)


class VllmGenerateRequest(BaseModel):
    """vLLM's `POST /generate` as atroposlib's `VLLMServer` sends it: token ids in, per
    sample the token ids and `{token_id: logprob}` per token out. vLLM passes the other
    fields to its `SamplingParams`; these are the ones we can honour (others: 422)."""

    model_config = ConfigDict(extra="forbid")
    prompt: VllmPrompt | str
    n: int = Field(1, ge=1, lt=2**63)
    max_tokens: int | None = Field(16, ge=1, lt=2**63)
    """vLLM's default is 16; None: the rest of the context."""
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, lt=2**63)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field([], max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """None: no log-probs in the answer; k: the sampled token's and k alternatives."""
    stream: Literal[False] = False
    """vLLM's stream of cumulative texts is not served: use /v1/completions with stream."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    """Accepted for vLLM clients; the text is always decoded the same way."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    """Accepted at the values that change nothing (0, 1 for repetition_penalty, null);
    any other value is refused (400) naming the field."""

    _stop = field_validator("stop", mode="before")(_stop_list)

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
            seed=self.seed,
            top_logprobs=self.num_top_logprobs,
        )

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0
