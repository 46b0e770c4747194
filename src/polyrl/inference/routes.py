"""The OpenAI- and vLLM-compatible endpoints, written once over a backend that generates
tokens: a worker's engine (`worker/inference.py`) or the manager's fleet
(`manager/inference.py`).

    GET  /v1/models
    POST /v1/completions         CompletionRequest     (stream: SSE ending `data: [DONE]`)
    POST /v1/chat/completions    ChatCompletionRequest (idem)
    POST /generate               VllmGenerateRequest   (vLLM's form; the app dispatches)

A request becomes one prompt's token ids and the engine's `SamplingParams` here; the
backend streams `SampleDelta`s back; `render.py` turns them into each dialect's JSON.
Refusals are 4xx in OpenAI's error shape, raised before any output is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from polyrl.engine.types import SampleDelta
from polyrl.httpapi import ApiError, EventStream, error_body
from polyrl.inference import render
from polyrl.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SampledRequest,
    VllmGenerateRequest,
    unsupported_field,
)
from polyrl.inference.render import Choice
from polyrl.inference.versions import VersionBook
from polyrl.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
BAD = "invalid_request_error"


@dataclass(frozen=True)
class Served:
    """What a backend serves right now."""

    model_names: list[str]
    """The first is the name `/v1/models` lists; requests may use any of them."""
    tokenizer: Any | None
    max_model_len: int
    max_n: int
    max_top_logprobs: int
    """Alternatives per token this backend can report (0: only the sampled token's)."""

    def check_model(self, model: str) -> str:
        if model not in self.model_names:
            raise ApiError(
                404,
                f"model {model!r} is not served here; served: {self.model_names[0]!r}",
                BAD,
                "model",
                "model_not_found",
            )
        return self.model_names[0]

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send token ids to /generate", BAD, None, "no_tokenizer")
        return self.tokenizer


class InferenceBackend(Protocol):
    async def served(self) -> Served:
        """Raise ApiError (503) when nothing can serve."""

    def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[list[SampleDelta]]:
        """The request's deltas until all its samples finish; refusals raise ApiError
        (or the app's mapped errors) before the first yield. Closing it early aborts
        the rest."""


def model_names(model_path: str) -> list[str]:
    """A model is served under its path as given (vLLM's default name) and its
    directory's name."""
    names = [model_path]
    base = Path(model_path.rstrip("/")).name
    if base and base != model_path:
        names.append(base)
    return names


class _NoText:
    """Stands in for a missing tokenizer on /generate: token ids still work, text is empty."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# ------------------------------------------------------------------------ one generation


class Generation:
    """One request's samples as they grow; ends (and aborts what runs) once every
    sample is finished, by the engine or by a stop string. Finished, its samples are
    booked with their weight versions in `book` (if any)."""

    def __init__(
        self,
        stream: AsyncIterator[list[SampleDelta]],
        tokenizer: Any,
        n: int,
        stops: list[str],
        prompt_ids: list[int] | None = None,
        book: VersionBook | None = None,
    ) -> None:
        self.stream, self.tokenizer = stream, tokenizer
        self.choices = [Choice(i, stops) for i in range(n)]
        self.prompt_ids, self.book = prompt_ids or [], book

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def apply(self, deltas: list[SampleDelta]) -> list[int]:
        """Add deltas; the indices of the choices they touched, in order."""
        touched: list[int] = []
        for d in deltas:
            self.choices[d.index].add(d, self.tokenizer)
            if d.index not in touched:
                touched.append(d.index)
        return sorted(touched)

    async def updates(self) -> AsyncIterator[list[int]]:
        try:
            while not self.done:
                deltas = await anext(self.stream, None)
                if deltas is None:
                    break
                yield self.apply(deltas)
        finally:
            await self.aclose()
        if not self.done:  # the backend ended without finishing a sample: a bug there
            raise RuntimeError("generation ended with unfinished samples")
        if self.book is not None:
            for c in self.choices:
                self.book.record(self.prompt_ids, c.token_ids, c.weight_versions)

    async def run(self, request: Request) -> bool:
        """Consume to the end; False if the client hung up first (the rest is aborted)."""

        async def consume() -> None:
            async for _ in self.updates():
                pass

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (consumer, watcher):
                task.cancel()
            # let a cancelled consumer finish closing the stream (the engine's abort, the
            # batch's cancel) before anyone else touches it
            await asyncio.wait({consumer, watcher})
        if consumer.cancelled():
            return False
        consumer.result()  # re-raise a refusal or failure from the backend
        return True

    async def aclose(self) -> None:
        aclose = getattr(self.stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _started(
    backend: InferenceBackend,
    prompt_ids: list[int],
    sampling: SamplingParams,
    tokenizer: Any,
    stops: list[str],
    book: VersionBook | None,
) -> Generation:
    """Start generating; refusals raise here, before any response is sent."""
    stream = backend.generate(prompt_ids, sampling)
    first = await anext(stream, None)
    generation = Generation(stream, tokenizer, sampling.n, stops, prompt_ids, book)
    if first is not None:
        generation.apply(first)
    return generation


# ---------------------------------------------------------------------------- handlers


class InferenceRoutes:
    def __init__(self, backend: InferenceBackend, book: VersionBook | None = None) -> None:
        """`book`: where finished completions are booked with their weight versions (the
        manager's, which the trainer asks about Atropos groups; None: not booked)."""
        self.backend, self.book = backend, book

    async def models(self) -> dict[str, Any]:
        served = await self.backend.served()
        name = served.model_names[0]
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "polyrl",
            "root": name,
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def _checks(
        self, served: Served, body: SampledRequest, prompt_ids: list[int], budget: int | None
    ) -> SamplingParams:
        field = body.unsupported()
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this server", BAD, field, "unsupported_parameter")
        return self._sampling(served, body, prompt_ids, budget)

    def _sampling(self, served: Served, body: Any, prompt_ids: list[int], budget: int | None) -> SamplingParams:
        if body.n > served.max_n:
            raise ApiError(400, f"n is {body.n}; this server allows at most {served.max_n}", BAD, "n", "n_too_large")
        if body.num_top_logprobs > served.max_top_logprobs:
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise ApiError(
                400,
                f"{param} asks for {body.num_top_logprobs} alternatives per token; this server gives "
                f"at most {served.max_top_logprobs}",
                BAD,
                param,
                "unsupported_parameter",
            )
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", BAD, "prompt", "empty_prompt")
        room = served.max_model_len - len(prompt_ids)
        if room < 1 or (budget is not None and budget > room):
            asked = f" + max_tokens {budget}" if budget is not None else ""
            raise ApiError(
                400,
                f"the prompt has {len(prompt_ids)} tokens{asked}; the context is {served.max_model_len} tokens",
                BAD,
                "max_tokens" if room >= 1 else "prompt",
                "context_length_exceeded",
            )
        return body.to_sampling(budget if budget is not None else room)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        served = await self.backend.served()
        model = served.check_model(body.model)
        tokenizer = served.need_tokenizer()
        prompt_ids = body.prompt if isinstance(body.prompt, list) else list(tokenizer(body.prompt)["input_ids"])
        sampling = self._checks(served, body, prompt_ids, body.max_tokens)  # type: ignore[arg-type]
        generation = await _started(self.backend, prompt_ids, sampling, tokenizer, body.stop, self.book)  # type: ignore[arg-type]
        rid = render.new_id("cmpl")
        if body.stream:
            events = self._completion_events(generation, rid, model, body, len(prompt_ids))
            return EventStream(events, headers={"Cache-Control": "no-cache"})
        if not await generation.run(request):
            return Response(status_code=499)
        response = render.completion_response(rid, model, tokenizer, len(prompt_ids), generation.choices, body.logprobs)
        return JSONResponse(response)

    async def _completion_events(
        self, generation: Generation, rid: str, model: str, body: CompletionRequest, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunks(indices: list[int]) -> bytes:
            tokenizer, choices = generation.tokenizer, generation.choices
            built = (
                render.completion_chunk(rid, model, created, tokenizer, choices[i], body.logprobs) for i in indices
            )
            return b"".join(_event(c) for c in built if c is not None)

        async for event in _sse(generation, chunks):
            yield event
        if body.include_usage:
            yield _event(render.usage_chunk(rid, "text_completion", model, created, prompt_tokens, generation.choices))
        yield SSE_DONE

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        served = await self.backend.served()
        model = served.check_model(body.model)
        tokenizer = served.need_tokenizer()
        prompt_ids = _chat_prompt_ids(tokenizer, body)
        sampling = self._checks(served, body, prompt_ids, body.token_budget)
        generation = await _started(self.backend, prompt_ids, sampling, tokenizer, body.stop, self.book)
        rid = render.new_id("chatcmpl")
        if body.stream:
            events = self._chat_events(generation, rid, model, body, len(prompt_ids))
            return EventStream(events, headers={"Cache-Control": "no-cache"})
        if not await generation.run(request):
            return Response(status_code=499)
        response = render.chat_response(rid, model, tokenizer, len(prompt_ids), generation.choices, body.logprobs)
        return JSONResponse(response)

    async def _chat_events(
        self, generation: Generation, rid: str, model: str, body: ChatCompletionRequest, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        yield b"".join(_event(render.chat_role_chunk(rid, model, created, c.index)) for c in generation.choices)

        def chunks(indices: list[int]) -> bytes:
            tokenizer, choices = generation.tokenizer, generation.choices
            built = (render.chat_chunk(rid, model, created, tokenizer, choices[i], body.logprobs) for i in indices)
            return b"".join(_event(c) for c in built if c is not None)

        async for event in _sse(generation, chunks):
            yield event
        if body.include_usage:
            obj = "chat.completion.chunk"
            yield _event(render.usage_chunk(rid, obj, model, created, prompt_tokens, generation.choices))
        yield SSE_DONE

    async def vllm_generate(self, body: VllmGenerateRequest, request: Request) -> Response:
        served = await self.backend.served()
        tokenizer = served.tokenizer
        if isinstance(body.prompt, str):
            prompt_ids = list(served.need_tokenizer()(body.prompt)["input_ids"]) if body.prompt else []
        else:
            prompt_ids = body.prompt.prompt_token_ids
        if body.stop and tokenizer is None:
            served.need_tokenizer()
        field = unsupported_field(body.model_dump(exclude_none=True))
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this server", BAD, field, "unsupported_parameter")
        sampling = self._sampling(served, body, prompt_ids, body.max_tokens)
        tokenizer = tokenizer if tokenizer is not None else _NoText()
        generation = await _started(self.backend, prompt_ids, sampling, tokenizer, body.stop, self.book)
        if not await generation.run(request):
            return Response(status_code=499)
        return JSONResponse(render.vllm_response(tokenizer, prompt_ids, generation.choices, body.logprobs is not None))


async def _sse(generation: Generation, chunks: Any) -> AsyncIterator[bytes]:
    """The chunks of every update; an error after the status line is sent goes into the
    stream (OpenAI's clients raise it), then the stream ends normally."""
    try:
        first = [c.index for c in generation.choices if c.token_ids or c.done]
        if first:
            yield chunks(first)
        async for touched in generation.updates():
            data = chunks(touched)
            if data:
                yield data
    except ApiError as e:
        yield _event(error_body(e.message, e.type, e.param, e.code))
    except Exception as e:  # noqa: BLE001 - reported to the client, which is still listening
        log.warning("stream failed: %s: %s", type(e).__name__, e)
        yield _event(error_body(f"{type(e).__name__}: {e}", "server_error"))
    finally:
        await generation.aclose()


def _chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(
            400, "the served tokenizer has no chat template: use /v1/completions", BAD, "messages", "no_chat_template"
        )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    opens_turn = body.add_generation_prompt and not body.continue_final_message
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=opens_turn,
            continue_final_message=body.continue_final_message,
        )
    except Exception as e:  # noqa: BLE001 - jinja's and the tokenizer's errors alike are the messages' fault
        raise ApiError(
            400, f"messages do not fit the chat template: {type(e).__name__}: {e}", BAD, "messages", "invalid_messages"
        ) from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
