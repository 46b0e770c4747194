"""How the manager runs one generation call on a worker (the trainer's `local` one too):
SGLang's streaming `/generate` over HTTP.

A call yields deltas (what is new for a sample since its previous delta) and raises one
of four errors, which decide what the manager does next:

* `WorkerUnreachable`: connection refused/reset, stream cut, nothing for
  `stall_timeout_s` -> the worker is gone, all its work migrates (counts as a failure);
* `WorkerFailed`: the worker answered with an error -> this call's samples retry
  elsewhere (counts as a failure), the worker stays;
* `WorkerBusy`: 429 (full) or 503 (draining) -> retry elsewhere, no failure counted;
* `RequestRefused`: 400/422, the request itself is invalid -> the batch fails at once,
  since every worker would refuse it the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from polyrl.httpapi import CHECKSUM_HEADER, checksum
from polyrl.manager.registry import WorkerRecord
from polyrl.protocol.routes import decode_routes, rows_through
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import GenerateRequest, GenerateResponse
from polyrl.tls import async_http_client


class WorkerUnreachable(Exception):
    pass


class WorkerFailed(Exception):
    pass


class WorkerBusy(Exception):
    pass


class RequestRefused(Exception):
    pass


@dataclass(frozen=True)
class GenerationCall:
    """One /generate call: some samples of one group, on one worker. A migrated sample
    goes with its tokens so far appended to the prompt and only its remaining budget."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    """The batch's, for this call: `n` is the samples in it (a group may be split over
    several calls), sample j uses `seed` + j, and `max_new_tokens` is the budget left (the
    batch's less what the samples already have)."""


class Delta(NamedTuple):
    """What one sample of a call produced since its previous delta."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] = []
    """Per token, when asked for: the most likely (token id, log-prob)."""
    routes: np.ndarray | None = None
    """When asked for: the experts of positions `routes_start`.. ([rows, width] int32)."""
    routes_start: int = 0
    """The absolute position (in the worker's prompt + tokens) of the first row of `routes`."""


# ------------------------------------------------------------------------------ remote (HTTP)


def generate_body(call: GenerationCall, incremental: bool, stream_interval_s: float = 0.0) -> bytes:
    """The worker's `/generate` request for a call, as JSON: only the fields set here go
    on the wire (a plain SGLang server refuses polyrl's extensions)."""
    request = GenerateRequest(
        rid=call.rid, input_ids=call.input_ids, stream=True, return_logprob=True, sampling_params=call.sampling
    )
    if call.sampling.top_logprobs:  # SGLang's request-level field
        request.top_logprobs_num = call.sampling.top_logprobs
    if call.sampling.return_routed_experts:  # SGLang's request-level field too
        request.return_routed_experts = True
    if incremental:  # polyrl's extensions
        request.incremental_stream = True
        if stream_interval_s:
            request.stream_interval_s = stream_interval_s
    return request.model_dump_json(exclude_unset=True).encode()


def parse_chunk(data: str | bytes, seen: dict[int, int], incremental: bool) -> Delta:
    """One SSE chunk of /generate (its JSON) as a delta. `seen` counts each sample's tokens
    so far: a cumulative snapshot (SGLang's format) is cut past them; an incremental chunk
    must continue exactly where the last one ended."""
    try:
        chunk = GenerateResponse.model_validate_json(data)
    except ValidationError as e:
        error = _error_of(data)
        if error is not None:
            raise WorkerFailed(f"worker reported: {error}") from None
        raise WorkerFailed(
            f"unreadable stream chunk ({e.error_count()} errors: {e.errors()[0]['msg']} "
            f"at {'.'.join(map(str, e.errors()[0]['loc']))})"
        ) from None
    meta = chunk.meta_info
    tokens = chunk.output_ids
    logprobs = [entry[0] for entry in meta.output_token_logprobs or ()]
    versions = meta.output_token_weight_versions
    if versions is None:  # a plain SGLang server: one version for the whole response
        versions = [meta.weight_version] * len(tokens)
    top = [[(tok, lp) for lp, tok, _ in position] for position in meta.output_top_logprobs or ()]
    finish_type = meta.finish_reason.type if meta.finish_reason else None
    index, total = chunk.index or 0, meta.completion_tokens
    if not len(tokens) == len(logprobs) == len(versions) or (top and len(top) != len(tokens)):
        raise WorkerFailed(
            f"chunk has {len(tokens)} tokens, {len(logprobs)} log-probs, {len(versions)} versions, "
            f"{len(top)} top log-probs"
        )
    before = seen.get(index, 0)
    if not incremental:
        if len(tokens) < before:
            raise WorkerFailed(f"snapshot of sample {index} shrank from {before} to {len(tokens)} tokens")
        tokens, logprobs, versions, top = tokens[before:], logprobs[before:], versions[before:], top[before:]
    elif total != before + len(tokens):
        raise WorkerFailed(f"sample {index}: chunk of {len(tokens)} tokens after {before} claims a total of {total}")
    seen[index] = before + len(tokens)
    routes, routes_start = None, 0
    if meta.routed_experts is not None:  # incremental: rows new since the last chunk; a snapshot: all
        routes_start = rows_through(meta.prompt_tokens, before)
        end = rows_through(meta.prompt_tokens, before + len(tokens))
        try:
            if incremental:
                routes = decode_routes(meta.routed_experts, end - routes_start)
            else:
                routes = decode_routes(meta.routed_experts, end)[routes_start:]
        except ValueError as e:
            raise WorkerFailed(f"sample {index}: routed experts: {e}") from None
    return Delta(index, tokens, logprobs, versions, finish_type, top, routes, routes_start)


def _error_of(data: str | bytes) -> str | None:
    """The message of an error chunk (`{"error": ...}`, as the worker streams a failure)."""
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or "error" not in payload:
        return None
    error = payload["error"]
    return str(error.get("message", error) if isinstance(error, dict) else error)


def _error_message(response: httpx.Response, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        text = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        text = body[:300].decode(errors="replace")
    return f"HTTP {response.status_code}: {text}"


def _error_type(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return ""


class RemoteBackend:
    """Streaming /generate calls through one shared httpx client.

    The read timeout is the stall detector: a worker that sends nothing for
    `stall_timeout_s` (frozen, partitioned) raises WorkerUnreachable. Closing the stream
    (task cancelled) makes the worker abort the request.

    The HTTP side of a call runs in a task of its own that is never cancelled: httpcore
    leaks the connection, an open socket, when a cancellation lands while it connects,
    sends, or cleans up after an error (encode/httpx#3782, encode/httpcore#1093), and the
    manager cancels calls whenever a worker goes. A cancelled `stream` tells that task to
    stop; it does at the next line it reads (a silent worker: at the stall timeout)."""

    def __init__(
        self,
        connect_timeout_s: float,
        stall_timeout_s: float,
        token: str | None = None,
        stream_interval_s: float = 0.0,
        ca_file: str | None = None,
    ) -> None:
        """`ca_file`: what https workers' certificates are verified against."""
        self.stream_interval_s = stream_interval_s
        timeout = httpx.Timeout(connect=connect_timeout_s, read=stall_timeout_s, write=connect_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        headers = {"Authorization": f"Bearer {token}"} if token else {}  # workers share the manager's token
        self.http = async_http_client(ca_file, timeout=timeout, limits=limits, headers=headers)
        self._exchanges: set[asyncio.Task[None]] = set()

    async def stream(self, worker: WorkerRecord, call: GenerationCall) -> AsyncIterator[list[Delta]]:
        done = False
        incremental = worker.incremental_stream  # a polyrl worker: checksums both ways
        seen: dict[int, int] = {}
        body = generate_body(call, incremental, self.stream_interval_s)
        headers = {"content-type": "application/json"} | ({CHECKSUM_HEADER: checksum(body)} if incremental else {})
        expected: str | None = None
        lines: asyncio.Queue[str | Exception | None] = asyncio.Queue()
        stop = asyncio.Event()
        exchange = asyncio.ensure_future(self._exchange(f"{worker.url}/generate", body, headers, lines, stop))
        self._exchanges.add(exchange)
        exchange.add_done_callback(self._exchanges.discard)
        try:
            while (line := await lines.get()) is not None:
                if isinstance(line, Exception):
                    raise line
                if line.startswith(": xxh3 "):
                    expected = line[7:].strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                if incremental and expected != checksum(data.encode()):
                    raise WorkerFailed("stream chunk does not match its checksum (damaged in transit)")
                expected = None
                yield [parse_chunk(data, seen, incremental)]
        finally:
            stop.set()
        if not done:
            raise WorkerUnreachable("stream ended without [DONE]")

    async def _exchange(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        lines: asyncio.Queue[str | Exception | None],
        stop: asyncio.Event,
    ) -> None:
        """POST and read the response's lines into `lines` (an error instead, then None)
        until it ends or `stop` is set."""
        # One connection per call: httpcore's pool checks every idle connection (a poll()
        # each) whenever a request comes or goes, and kept-alive streams made the load
        # test three times slower than opening a connection per call.
        headers = headers | {"connection": "close"}
        try:
            async with self.http.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code != 200:
                    _raise_for_status(response, await response.aread())
                async for line in response.aiter_lines():
                    if stop.is_set():
                        return
                    lines.put_nowait(line)
        except httpx.TimeoutException as e:
            lines.put_nowait(WorkerUnreachable(f"no response for {type(e).__name__}"))
        except (httpx.TransportError, httpx.StreamError) as e:
            lines.put_nowait(WorkerUnreachable(f"{type(e).__name__}: {e}"))
        except Exception as e:  # the status errors above, or a bug: the caller raises it
            lines.put_nowait(e)
        finally:
            lines.put_nowait(None)

    async def get(self, worker: WorkerRecord, path: str, timeout_s: float) -> httpx.Response:
        return await self.http.get(f"{worker.url}{path}", timeout=timeout_s)

    async def post_json(self, worker: WorkerRecord, path: str, message: BaseModel, timeout_s: float) -> httpx.Response:
        headers = {"content-type": "application/json"}
        return await self.http.post(
            f"{worker.url}{path}", content=message.model_dump_json(), headers=headers, timeout=timeout_s
        )

    async def aclose(self) -> None:
        for exchange in self._exchanges:  # shutting down: a leaked connection no longer matters
            exchange.cancel()
        await asyncio.gather(*self._exchanges, return_exceptions=True)
        await self.http.aclose()


def _raise_for_status(response: httpx.Response, body: bytes) -> None:
    message = _error_message(response, body)
    if response.status_code in (429, 503):
        raise WorkerBusy(message)
    if response.status_code == 400 and _error_type(body) == "corrupt_request":
        raise WorkerFailed(message)  # the network's fault, not the request's: retry elsewhere
    if response.status_code in (400, 413, 422):
        raise RequestRefused(message)
    raise WorkerFailed(message)
