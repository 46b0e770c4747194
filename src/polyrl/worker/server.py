"""The worker's HTTP API over one AsyncEngine: app factory and thin handlers.

All state lives in one `WorkerState` (`state.py`), built by the caller and handed to
`create_app`; the handlers translate HTTP to engine calls and back through the pure
builders in `protocol.py`. The OpenAI- and vLLM-compatible endpoints are
`polyrl.inference`'s, over this worker's engine (`inference.py`). Errors always come
back as `{"error": {"message", "type", "param", "code"}}` with a real status: 422
invalid body, 413 body over MAX_BODY_BYTES, 400 refused by the engine, 429 engine full,
503 draining (or the engine loop died).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from polyrl.engine.async_engine import EngineDeadError, RequestStream
from polyrl.engine.lora import base_fingerprint, pack, read_adapter_dir, spec_of_dir
from polyrl.engine.types import (
    EngineFullError,
    EngineRequest,
    RequestError,
    SampleDelta,
    SampleResult,
)
from polyrl.httpapi import ApiError, BodyLimit, ChecksumGuard, EventStream, check_bearer, error_body, error_handlers
from polyrl.inference.protocol import VllmGenerateRequest
from polyrl.inference.routes import InferenceRoutes
from polyrl.protocol.completions import VersionsQuery, VersionsReply
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import (
    AbortRequest,
    AbortResponse,
    GenerateBatchRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    ModelInfo,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromPublisherRequest,
    UpdateWeightsResponse,
)
from polyrl.transfer.wire import PullSource, TransferError
from polyrl.worker.inference import WorkerBackend
from polyrl.worker.protocol import SSE_DONE, WireSamples, engine_request, sample_response, sse_event, text_token_ids
from polyrl.worker.state import WorkerState
from polyrl.worker.stream import Coalesced, coalesce

log = logging.getLogger(__name__)

NEITHER_DIALECT = (
    "a /generate body has either SGLang's form (input_ids or text, sampling_params) or vLLM's "
    '(prompt: {"prompt_token_ids": [...]}, n, max_tokens, temperature, logprobs)'
)

BATCHED_IDS = re.compile(rb'"input_ids"\s*:\s*\[\s*\[')
"""SGLang's batched form: `input_ids` a list of lists."""

ENGINE_ERRORS: dict[type[Exception], tuple[int, str]] = {
    RequestError: (400, "invalid_request"),
    EngineFullError: (429, "engine_full"),
    EngineDeadError: (503, "engine_dead"),
}
"""The engine's refusals as HTTP: status and error type."""

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body (413 above it, before it is read): a prompt of a million tokens
fits, as JSON ids or as text."""


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path` (HF sharded or single-file layout)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


# -------------------------------------------------------------------------------- handlers


class _Handlers:
    """The endpoints, as methods over one WorkerState (registered by `create_app`)."""

    def __init__(self, state: WorkerState, inference: InferenceRoutes) -> None:
        self.state, self.inference = state, inference

    async def dispatch_generate(self, request: Request) -> Response:
        """`/generate` speaks two dialects, told apart by the body: vLLM's has `prompt`
        (`{"prompt_token_ids": [...]}`), SGLang's has `input_ids` or `text` (and
        `input_ids` as a list of lists is SGLang's batched form)."""
        raw = await request.body()
        parsed = None  # the manager's SGLang calls, the hot path, are parsed once, below
        if b'"prompt"' in raw or (b'"input_ids"' not in raw and b'"text"' not in raw):
            try:
                parsed = json.loads(raw)
            except ValueError:
                pass  # the SGLang model's parser names the JSON error
        try:
            if isinstance(parsed, dict) and "prompt" in parsed:
                return await self.inference.vllm_generate(VllmGenerateRequest.model_validate(parsed), request)
            if isinstance(parsed, dict) and not {"input_ids", "text"} & parsed.keys():
                raise ApiError(422, NEITHER_DIALECT, "invalid_request")
            batch = GenerateBatchRequest.model_validate_json(raw) if BATCHED_IDS.search(raw) else None
            body = GenerateRequest.model_validate_json(raw) if batch is None else None
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if batch is not None:
            return await self.generate_batch(batch, request)
        assert body is not None
        return await self.generate(body, request)

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        st = self.state
        st.require_active()
        return await self._serve(body, [engine_request(body, st.prompt_ids(body))], request, batched=False)

    async def generate_batch(self, body: GenerateBatchRequest, request: Request) -> Response:
        self.state.require_active()
        wanted = [engine_request(prompt, prompt.input_ids or []) for prompt in body.prompts()]
        return await self._serve(body, wanted, request, batched=True)

    async def _serve(
        self, body: GenerateRequest | GenerateBatchRequest, wanted: list[EngineRequest], request: Request, batched: bool
    ) -> Response:
        """Run `wanted` on the engine and answer with their samples (a stream, or one
        reply). Refusals (400/429) come before any output; in a stream, a refused prompt
        of several becomes an error event naming its rid and the others run."""
        st = self.state
        admitted, refused = st.engine.admit(wanted)
        st.num_open_generates += 1
        stream: Coalesced[SampleDelta] | None = None
        is_streaming = False  # once True, the event generator owns the streams and the count
        try:
            refused |= await admitted.start()
            first_refusal = next((refused[r.rid] for r in wanted if r.rid in refused), None)
            if first_refusal is not None and (len(refused) == len(wanted) or not body.stream):
                raise first_refusal  # nothing runs, or a reply with no place to say what was refused
            samples = WireSamples(wanted, {r.rid for r in wanted} - refused.keys())
            stream = coalesce(admitted)
            if body.stream:
                errors = [
                    _refusal_event(r.rid, refused[r.rid], body.incremental_stream) for r in wanted if r.rid in refused
                ]
                events = self._events(body, samples, errors, stream, admitted)
                is_streaming = True
                return EventStream(events, headers={"Cache-Control": "no-cache"})
            if not await _consume_unless_disconnected(request, stream, samples):
                return Response(status_code=499)  # nobody is listening; the request was aborted
            return JSONResponse(self._final_json(body, samples, batched))
        finally:
            if not is_streaming:
                st.num_open_generates -= 1
                if stream is not None:
                    await stream.aclose()
                admitted.close()

    async def _events(
        self,
        body: GenerateRequest | GenerateBatchRequest,
        samples: WireSamples,
        errors: list[bytes],
        stream: Coalesced[SampleDelta],
        admitted: RequestStream,
    ) -> AsyncIterator[bytes]:
        sent: dict[int, int] = {}  # tokens already streamed per sample (incremental mode)
        interval_s = max(self.state.stream_interval_s, body.stream_interval_s)
        try:
            if errors:
                yield b"".join(errors)
            while True:
                try:
                    batch = await anext(stream, None)
                except Exception as e:  # the status line is sent: report in the stream, as SGLang does
                    log.warning("stream %s failed: %s: %s", next(iter(samples.offsets)), type(e).__name__, e)
                    yield sse_event(error_body(f"{type(e).__name__}: {e}", "engine_error"), body.incremental_stream)
                    break
                if batch is None:
                    break
                chunks = []
                for i in sorted(samples.apply(batch)):
                    result = samples.results[i]
                    start = sent.get(i, 0)
                    chunks.append(sse_event(self._chunk_json(body, result, start, i), body.incremental_stream))
                    if body.incremental_stream:
                        sent[i] = len(result.token_ids)
                yield b"".join(chunks)
                if interval_s:  # `stream` coalesces what arrives meanwhile; a finish ends the wait
                    await stream.wait(interval_s)
            yield SSE_DONE
        finally:
            self.state.num_open_generates -= 1
            await stream.aclose()
            admitted.close()

    def _chunk_json(
        self, body: GenerateRequest | GenerateBatchRequest, result: SampleResult, start: int, index: int
    ) -> dict[str, Any]:
        if not body.incremental_stream:
            return self._sample_json(body, result, True, index)
        # the new tokens' text, decoded on their own: cheap, but a character split across
        # two chunks decodes as replacement characters (join output_ids for exact text)
        text_ids = text_token_ids(result)[start:]
        text = self.state.tokenizer.decode(text_ids, skip_special_tokens=False) if self.state.tokenizer else ""
        return sample_response(
            result,
            text,
            return_logprob=body.return_logprob,
            current_version=self.state.weight_version,
            with_index=True,
            start=start,
            index=index,
        )

    def _sample_json(
        self, body: GenerateRequest | GenerateBatchRequest, result: SampleResult, with_index: bool, index: int
    ) -> dict[str, Any]:
        return sample_response(
            result,
            self.state.decode(result),
            return_logprob=body.return_logprob,
            current_version=self.state.weight_version,
            with_index=with_index,
            index=index,
        )

    def _final_json(self, body: GenerateRequest | GenerateBatchRequest, samples: WireSamples, batched: bool) -> Any:
        results = sorted(samples.results.items())
        if len(results) == 1 and not batched:
            return self._sample_json(body, results[0][1], False, 0)
        return [self._sample_json(body, result, True, i) for i, result in results]

    async def health(self) -> dict[str, Any]:
        return {}

    async def health_generate(self) -> dict[str, Any]:
        """A one-token greedy generation through the engine: proves the loop is alive."""
        self.state.require_active()
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
        request = EngineRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[0], sampling=sampling)
        try:
            await asyncio.wait_for(_run_to_end(self.state.engine.generate(request)), self.state.health_timeout_s)
        except (TimeoutError, RequestError, EngineFullError, EngineDeadError) as e:
            raise ApiError(503, f"engine is not generating: {type(e).__name__}: {e}", "unhealthy") from None
        return {}

    async def abort_request(self, body: AbortRequest) -> AbortResponse:
        engine = self.state.engine
        num_aborted = engine.abort_all() if body.abort_all else int(engine.abort(body.rid))
        return AbortResponse(num_aborted=num_aborted)

    async def get_server_info(self) -> ServerInfo:
        return self.state.server_info()

    async def get_model_info(self) -> ModelInfo:
        return ModelInfo(model_path=self.state.model_path)

    async def update_weights_from_disk(self, body: UpdateWeightsFromDiskRequest) -> Response:
        st = self.state
        version = body.weight_version if body.weight_version is not None else st.weight_version + 1
        try:
            weights = await asyncio.to_thread(load_safetensors_dir, body.model_path)
            if body.abort_all_requests:
                st.engine.abort_all()
            await st.engine.update_weights(weights, version)
        except (OSError, ValueError, SafetensorError) as e:  # RequestError is a ValueError
            message = f"weights not updated: {e}"
            content = UpdateWeightsResponse(success=False, message=message).model_dump()
            return JSONResponse(content | error_body(message, "invalid_request"), status_code=400)
        log.debug("weights version %d loaded from %s", version, body.model_path)  # the engine logs the swap
        message = f"loaded {len(weights)} tensors from {body.model_path}"
        ok = UpdateWeightsResponse(success=True, message=message, weight_version=version)
        return JSONResponse(ok.model_dump())

    async def load_lora_adapter(self, body: LoadLoraAdapterRequest) -> Response:
        """Read a PEFT adapter directory and serve it merged as the next version. An adapter
        for another base, rank or target modules is refused (400) and nothing changes."""
        st = self.state
        version = body.weight_version if body.weight_version is not None else st.weight_version + 1
        try:
            config, pairs = await asyncio.to_thread(read_adapter_dir, body.lora_path)
            spec = spec_of_dir(config, pairs, base_fingerprint(st.engine.engine.model.config), st.model_path)
            await st.engine.update_weights(pack(spec, pairs), version)
        except RequestError as e:  # AdapterError included
            message = f"adapter {body.lora_name!r} not loaded: {e}"
            log.warning("%s (still serving v%d)", message, st.weight_version)
            content = UpdateWeightsResponse(success=False, message=message).model_dump()
            return JSONResponse(content | error_body(message, "invalid_request"), status_code=400)
        st.lora_name = body.lora_name
        log.info("LoRA adapter %r (r=%d) from %s serving as v%d", body.lora_name, spec.rank, body.lora_path, version)
        message = f"Success: LoRA adapter {body.lora_name!r} added successfully ({len(pairs)} modules, r={spec.rank})"
        return JSONResponse(UpdateWeightsResponse(success=True, message=message, weight_version=version).model_dump())

    async def update_weights_from_publisher(self, body: UpdateWeightsFromPublisherRequest) -> Response:
        st = self.state
        source = PullSource(body.host, body.port, body.worker_id, body.token, body.tls, st.ca_file)
        relays = [PullSource(r.host, r.port, body.worker_id, r.token, r.tls, st.ca_file) for r in body.relays]
        if body.relay_grant is not None and st.relay is not None:
            st.relay.grant(bytes.fromhex(body.relay_grant.key), body.relay_grant.max_send_gbps)
        receiver = st.weight_receiver
        t0 = time.perf_counter()
        try:
            pulled = await receiver.sync(
                source,
                body.weight_version,
                body.num_streams,
                body.timeout_s,
                body.codec,
                body.path,
                body.swap_policy,
                relays,
            )
        except (TransferError, RequestError) as e:
            message = f"weights not updated: {e}"
            content = UpdateWeightsResponse(success=False, message=message, device=receiver.identity).model_dump()
            return JSONResponse(content | error_body(message, "transfer_failed"), status_code=400)
        version, path = self.state.weight_version, None
        if pulled is None:
            message = f"already serving v{version}"
        else:
            path = pulled.codec if pulled.codec in ("nccl", "cuda_ipc") else "tcp"
            lossy = ", LOSSY" if pulled.lossy else (", read in place" if pulled.in_place else "")
            fallback = f" ({receiver.fallback})" if receiver.fallback else ""
            origin = f" from {pulled.source}" if pulled.source else ""
            message = (
                f"pulled {pulled.manifest.total_bytes} bytes{origin} ({pulled.codec}{lossy}, "
                f"{pulled.wire_bytes} on the wire) "
                f"in {pulled.seconds:.3f}s, serving it {time.perf_counter() - t0:.3f}s after the request{fallback}"
            )
        reply = UpdateWeightsResponse(
            success=True, message=message, weight_version=version, path=path, device=receiver.identity
        )
        return JSONResponse(reply.model_dump())

    async def shutdown(self) -> dict[str, Any]:
        self.state.request_shutdown("POST /shutdown")
        return {"state": "draining"}


def _refusal_event(rid: str, error: Exception, with_checksum: bool) -> bytes:
    """A stream's error event for one refused prompt of a batched request: the error body
    its own request would have had, with its status as `code` and the prompt's `rid`."""
    status, type_ = ENGINE_ERRORS.get(type(error), (400, "invalid_request"))
    return sse_event(error_body(str(error), type_, code=str(status)) | {"rid": rid}, with_checksum)


async def _run_to_end(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def _consume_unless_disconnected(
    request: Request, stream: AsyncIterator[list[SampleDelta]], samples: WireSamples
) -> bool:
    """Accumulate the rest of the stream; False (request aborted) if the client hangs up."""

    async def consume() -> None:
        async for batch in stream:
            samples.apply(batch)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            task.cancel()
    if consumer.cancelled():
        return False
    consumer.result()  # re-raise an engine failure
    return True


# ---------------------------------------------------------------------------------- the app


def create_app(state: WorkerState, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The worker's FastAPI app over `state` (which the caller owns and shuts down)."""
    handlers = error_handlers(ENGINE_ERRORS)
    app = FastAPI(title="polyrl worker", exception_handlers=handlers)
    inference = InferenceRoutes(WorkerBackend(state), state.completions)

    async def completion_versions(body: VersionsQuery) -> VersionsReply:
        return VersionsReply(versions=state.completions.lookup(body.keys))

    h = _Handlers(state, inference)

    async def authorized(request: Request) -> None:  # async: a plain def would wait for a thread-pool slot
        check_bearer(request, state.token)

    auth = [Depends(authorized)]
    app.post("/generate", dependencies=auth)(h.dispatch_generate)
    app.get("/v1/models", dependencies=auth)(inference.models)
    app.post("/v1/completions", dependencies=auth)(inference.completions)
    app.post("/v1/chat/completions", dependencies=auth)(inference.chat)
    app.post("/v1/completions/versions", dependencies=auth)(completion_versions)
    app.get("/health")(h.health)
    app.get("/health_generate")(h.health_generate)
    app.post("/abort_request", dependencies=auth)(h.abort_request)
    app.get("/get_server_info")(h.get_server_info)
    app.get("/get_model_info")(h.get_model_info)
    app.post("/update_weights_from_disk", dependencies=auth)(h.update_weights_from_disk)
    app.post("/update_weights_from_publisher", dependencies=auth)(h.update_weights_from_publisher)
    app.post("/v1/load_lora_adapter", dependencies=auth)(h.load_lora_adapter)  # vLLM's path
    app.post("/load_lora_adapter", dependencies=auth)(h.load_lora_adapter)  # SGLang's
    app.post("/shutdown", dependencies=auth)(h.shutdown)
    app.add_middleware(ChecksumGuard)
    app.add_middleware(BodyLimit, limit_for=lambda path: max_body_bytes)  # added last: runs first
    return app
