"""Pure builders: samples as they grow (`Choice`) and the JSON that OpenAI's and vLLM's
clients parse. No server here, so all of it is tested without one.

A `Choice` accumulates one sample's deltas and applies the stop strings: the engine only
stops on token ids, so a stop string is found in the decoded text, the sample is cut at
the shortest token prefix whose text contains it, and its text ends just before it
(OpenAI's convention; finish reason "stop"). Streaming releases text as it becomes
final: while a sample runs, its last `holdback` tokens (enough to hold a stop string that
is still being completed) and any trailing partial character stay back.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from polyrl.engine.types import SampleDelta

FinishReason = str


@dataclass
class Choice:
    index: int
    stops: list[str]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, when asked for: the k most likely (token id, log-prob)."""
    weight_versions: list[int] = field(default_factory=list)
    """Per token: the weight version that generated it (not rendered: booked for the
    trainer, `inference/versions.py`)."""
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None
    """The stop token (EOS or a stop_token_id) that ended the sample: generated and
    counted, but not part of the text (as in vLLM)."""
    text: str | None = None
    """The final text, once finished."""
    sent_tokens: int = 0
    sent_chars: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_ids(self) -> list[int]:
        return self.token_ids[:-1] if self.matched_stop_token is not None else self.token_ids

    def add(self, delta: SampleDelta, tokenizer: Any) -> None:
        """Append a delta; on finish, or when a stop string appears, fix the final text."""
        if self.done:
            return  # a sample cut at a stop string: the engine's further tokens are dropped
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top_logprobs += delta.top_logprobs
        self.weight_versions += delta.weight_versions
        # the stop token that ends a sample is not text a stop string could match ("<eos>")
        ids = self.token_ids[:-1] if delta.matched_stop is not None else self.token_ids
        if self.stops and delta.token_ids and self._cut_at_stop(tokenizer, ids):
            return
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.matched_stop_token = delta.matched_stop
            self.text = tokenizer.decode(self.text_ids, skip_special_tokens=False)

    def _cut_at_stop(self, tokenizer: Any, ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        stop = next(s for s in self.stops if text.find(s) == cut)
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in tokenizer.decode(ids[:mid], skip_special_tokens=False):
                hi = mid
            else:
                lo = mid + 1
        del self.token_ids[lo:], self.logprobs[lo:], self.top_logprobs[lo:], self.weight_versions[lo:]
        self.finish_reason, self.matched_stop_token, self.text = "stop", None, text[:cut]
        return True

    def release(self, tokenizer: Any) -> tuple[str, range]:
        """What a stream may send now: new text, and the new tokens (indices into
        `token_ids`) whose log-probs go with it."""
        if self.done:
            assert self.text is not None
            text, num_tokens = self.text, len(self.text_ids)
        else:
            holdback = max((len(s) for s in self.stops), default=0)
            num_tokens = max(self.sent_tokens, len(self.token_ids) - holdback)
            text = tokenizer.decode(self.token_ids[:num_tokens], skip_special_tokens=False).rstrip("\ufffd")
            if len(text) < self.sent_chars:  # a decode that changed its mind: wait for more
                return "", range(self.sent_tokens, self.sent_tokens)
        new_text, tokens = text[self.sent_chars :], range(self.sent_tokens, num_tokens)
        self.sent_chars, self.sent_tokens = max(self.sent_chars, len(text)), num_tokens
        return new_text, tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _token_strings(tokenizer: Any, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def _alternatives(tokenizer: Any, choice: Choice, i: int) -> list[tuple[str, float]]:
    if not choice.top_logprobs:
        return []
    return [(tokenizer.decode([t], skip_special_tokens=False), lp) for t, lp in choice.top_logprobs[i]]


def completion_logprobs(tokenizer: Any, choice: Choice, tokens: range, text_start: int) -> dict[str, Any]:
    """The legacy completions format: parallel lists, `text_offset` into the completion;
    `top_logprobs` holds the k alternatives and the sampled token (as vLLM's)."""
    ids = [choice.token_ids[i] for i in tokens]
    strings = _token_strings(tokenizer, ids)
    lps = [choice.logprobs[i] for i in tokens]
    offsets, at = [], text_start
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = [dict(_alternatives(tokenizer, choice, i)) | {s: lp} for i, s, lp in zip(tokens, strings, lps, strict=True)]
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, choice: Choice, tokens: range) -> dict[str, Any]:
    content = []
    for i in tokens:
        s = tokenizer.decode([choice.token_ids[i]], skip_special_tokens=False)
        top = [{"token": a, "logprob": lp, "bytes": list(a.encode())} for a, lp in _alternatives(tokenizer, choice, i)]
        content.append({"token": s, "logprob": choice.logprobs[i], "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def completion_response(
    rid: str, model: str, tokenizer: Any, prompt_tokens: int, choices: list[Choice], logprobs: int | None
) -> dict[str, Any]:
    out = []
    for c in choices:
        text, tokens = c.release(tokenizer)
        lp = completion_logprobs(tokenizer, c, tokens, 0) if logprobs is not None else None
        out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, choices),
    }


def chat_response(
    rid: str, model: str, tokenizer: Any, prompt_tokens: int, choices: list[Choice], logprobs: bool
) -> dict[str, Any]:
    out = []
    for c in choices:
        text, tokens = c.release(tokenizer)
        out.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(tokenizer, c, tokens) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, choices),
    }


def completion_chunk(
    rid: str, model: str, created: int, tokenizer: Any, c: Choice, logprobs: int | None
) -> dict[str, Any] | None:
    """The stream chunk for what `c` may release now; None if nothing is new."""
    start = c.sent_chars
    text, tokens = c.release(tokenizer)
    finish = c.finish_reason if c.done else None
    if not text and not tokens and finish is None:
        return None
    lp = completion_logprobs(tokenizer, c, tokens, start) if logprobs is not None else None
    choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, model: str, created: int, tokenizer: Any, c: Choice, logprobs: bool) -> dict[str, Any] | None:
    text, tokens = c.release(tokenizer)
    finish = c.finish_reason if c.done else None
    if not text and not tokens and finish is None:
        return None
    choice = {
        "index": c.index,
        "delta": {"content": text} if text else {},
        "logprobs": chat_logprobs(tokenizer, c, tokens) if logprobs else None,
        "finish_reason": finish,
    }
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def chat_role_chunk(rid: str, model: str, created: int, index: int) -> dict[str, Any]:
    """OpenAI opens each streamed choice with the assistant role and empty content."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    rid: str, obj: str, model: str, created: int, prompt_tokens: int, choices: list[Choice]
) -> dict[str, Any]:
    """The last chunk with `stream_options.include_usage`: no choices, the usage."""
    counts = usage(prompt_tokens, choices)
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": counts}


def vllm_response(tokenizer: Any, prompt_ids: list[int], choices: list[Choice], with_logprobs: bool) -> dict[str, Any]:
    """vLLM's /generate answer (its api_server's shape, which atroposlib parses): per
    sample the text, finish reason, token ids (the stop token included, as the engine
    generated them), and per token `[{token_id: logprob}]`, the sampled token first."""
    for c in choices:
        c.release(tokenizer)
    response: dict[str, Any] = {
        "text": [c.text for c in choices],
        "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False) if tokenizer is not None else "",
        "finish_reasons": [c.finish_reason for c in choices],
    }
    if with_logprobs:
        response["logprobs"] = [[[_vllm_position(c, i)] for i in range(len(c.token_ids))] for c in choices]
        response["prompt_token_ids"] = prompt_ids
        response["token_ids"] = [c.token_ids for c in choices]
    return response


def _vllm_position(choice: Choice, i: int) -> dict[str, float]:
    """`{token_id: logprob}` of one position: the sampled token first (atroposlib reads
    the first key as the token), then the alternatives."""
    position = {str(choice.token_ids[i]): choice.logprobs[i]}
    for t, lp in choice.top_logprobs[i] if choice.top_logprobs else ():
        position.setdefault(str(t), lp)
    return position
