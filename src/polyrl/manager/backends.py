"""How the manager runs generation calls on a worker (the trainer's `local` one too):
SGLang's streaming `/generate` over HTTP. The calls placed on a polyrl worker at once
share one batched request (`BatchedCalls`), each still read as a stream of its own with
errors of its own; a lone call, or any call to another server, is a request of its own.

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
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from polyrl.httpapi import CHECKSUM_HEADER, checksum
from polyrl.manager.registry import WorkerRecord
from polyrl.protocol.routes import decode_routes, rows_through
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import AbortRequest, GenerateBatchRequest, GenerateRequest, GenerateResponse
from polyrl.tls import async_http_client

log = logging.getLogger("polyrl.manager")

MAX_CALLS_PER_REQUEST = 256
"""Calls in one batched request to a worker (a worker runs `engine.max_num_seqs`
sequences at once; the rest wait in its queue either way)."""

MAX_TOKENS_PER_REQUEST = 500_000
"""Prompt tokens in one batched request: its JSON stays well under the worker's body
limit (`MAX_BODY_BYTES`, 16 MiB), which would refuse every call in it."""

ABORT_TIMEOUT_S = 10.0
"""For `/abort_request`, sent when one call of a batched request is cancelled."""


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


def generate_batch_body(calls: list[GenerationCall], stream_interval_s: float = 0.0) -> bytes:
    """A polyrl worker's batched `/generate` (`GenerateBatchRequest`) for `calls`, which
    share their request-level fields (`batch_key`): one exchange for all of them."""
    first = calls[0].sampling
    request = GenerateBatchRequest(
        rid=[c.rid for c in calls],
        input_ids=[c.input_ids for c in calls],
        sampling_params=[c.sampling for c in calls],
        stream=True,
        return_logprob=True,
        incremental_stream=True,
    )
    if first.top_logprobs:
        request.top_logprobs_num = first.top_logprobs
    if first.return_routed_experts:
        request.return_routed_experts = True
    if stream_interval_s:
        request.stream_interval_s = stream_interval_s
    return request.model_dump_json(exclude_unset=True).encode()


def _requests_of(ks: list[int], calls: list[GenerationCall]) -> list[list[int]]:
    """`ks` (indices into `calls`) cut into requests of at most `MAX_CALLS_PER_REQUEST`
    calls and `MAX_TOKENS_PER_REQUEST` prompt tokens (a long call goes alone)."""
    parts: list[list[int]] = []
    tokens = 0
    for k in ks:
        size = len(calls[k].input_ids)
        if not parts or len(parts[-1]) == MAX_CALLS_PER_REQUEST or tokens + size > MAX_TOKENS_PER_REQUEST:
            parts.append([])
            tokens = 0
        parts[-1].append(k)
        tokens += size
    return parts


def batch_key(call: GenerationCall) -> tuple[int, bool]:
    """What calls must share to go in one batched request: its request-level fields."""
    return call.sampling.top_logprobs, call.sampling.return_routed_experts


def parse_chunk(data: str | bytes, seen: dict[int, int], incremental: bool) -> Delta:
    """One SSE chunk of /generate (its JSON) as a delta. `seen` counts each sample's tokens
    so far: a cumulative snapshot (SGLang's format) is cut past them; an incremental chunk
    must continue exactly where the last one ended."""
    chunk = read_chunk(data)
    return chunk_delta(chunk, chunk.index or 0, seen, incremental)


def read_chunk(data: str | bytes) -> GenerateResponse:
    """A stream chunk's JSON; an error chunk, or one that does not parse, raises
    WorkerFailed."""
    try:
        return GenerateResponse.model_validate_json(data)
    except ValidationError as e:
        error = _error_of(data)
        if error is not None:
            raise WorkerFailed(f"worker reported: {error}") from None
        raise WorkerFailed(
            f"unreadable stream chunk ({e.error_count()} errors: {e.errors()[0]['msg']} "
            f"at {'.'.join(map(str, e.errors()[0]['loc']))})"
        ) from None


def chunk_delta(chunk: GenerateResponse, index: int, seen: dict[int, int], incremental: bool) -> Delta:
    """A parsed chunk as the delta of sample `index` of its call (see `parse_chunk`)."""
    meta = chunk.meta_info
    tokens = chunk.output_ids
    logprobs = [entry[0] for entry in meta.output_token_logprobs or ()]
    versions = meta.output_token_weight_versions
    if versions is None:  # a plain SGLang server: one version for the whole response
        versions = [meta.weight_version] * len(tokens)
    top = [[(tok, lp) for lp, tok, _ in position] for position in meta.output_top_logprobs or ()]
    finish_type = meta.finish_reason.type if meta.finish_reason else None
    total = meta.completion_tokens
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


_END = object()


class CallStream:
    """One call's deltas out of a batched request (`BatchedCalls`). Closing it before its
    call has ended aborts that call on the worker (by its rid); the request goes on for
    the others. A class, not a generator: closing works even before the first read."""

    def __init__(self, owner: BatchedCalls, k: int) -> None:
        self._owner, self._k = owner, k
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False

    def put(self, item: Any) -> None:
        self._items.put_nowait(item)

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> list[Delta]:
        if self.closed:
            raise StopAsyncIteration
        item = await self._items.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._owner.leave(self._k)

    async def aclose(self) -> None:
        self.close()


class BatchedCalls:
    """Several calls to one polyrl worker as one batched `/generate`
    (`GenerateBatchRequest`), read by one task that hands each call its own deltas.

    The worker numbers samples across the request, call after call; each call's stream
    ends as soon as its samples have all finished (its worker slots come back then, not
    when the whole request ends). A refusal naming a call's rid is that call's error; a
    failure of the exchange (the worker gone, a bad chunk, the stall timeout) is every
    open call's. When the last reader leaves, the exchange stops."""

    def __init__(self, backend: RemoteBackend, worker: WorkerRecord, calls: list[GenerationCall]) -> None:
        self.backend, self.worker, self.calls = backend, worker, calls
        self.streams = [CallStream(self, k) for k in range(len(calls))]
        self._where = [(k, j) for k, call in enumerate(calls) for j in range(call.sampling.n)]
        """Wire index -> (call, its sample)."""
        self._by_rid = {call.rid: k for k, call in enumerate(calls)}
        self._seen: list[dict[int, int]] = [{} for _ in calls]
        self._unfinished = [set(range(call.sampling.n)) for call in calls]
        self._ended: set[int] = set()
        """Calls whose stream has had its end (finished, refused, or the exchange's end)."""
        self._left: set[int] = set()
        """Calls whose reader has gone."""
        body = generate_batch_body(calls, backend.stream_interval_s)
        backend.num_calls += len(calls)
        self._reader = backend._track(self._read(backend.events(worker, body, incremental=True)))

    async def _read(self, events: AsyncIterator[str]) -> None:
        error: Exception | None = None
        try:
            async with contextlib.aclosing(events):
                async for data in events:
                    self._route(data)
        except (WorkerUnreachable, WorkerFailed, WorkerBusy, RequestRefused) as e:
            error = e
        except Exception as e:  # a bug here must not lose the calls: each retries elsewhere
            log.exception("batched request to %s failed unexpectedly", self.worker.worker_id)
            error = WorkerFailed(f"internal error: {type(e).__name__}: {e}")
        for k in range(len(self.calls)):  # [DONE] (no error): what is unfinished is handed back
            self._end(k, error)

    def _route(self, data: str) -> None:
        try:
            chunk = read_chunk(data)
        except WorkerFailed:
            refusal = _call_refusal(data)
            if refusal is None or refusal[0] not in self._by_rid:
                raise
            self._end(self._by_rid[refusal[0]], refusal[1])
            return
        index = chunk.index or 0
        if not 0 <= index < len(self._where):
            raise WorkerFailed(f"worker sent sample index {index} of {len(self._where)}")
        k, j = self._where[index]
        if chunk.meta_info.id != self.calls[k].rid:
            raise WorkerFailed(f"sample {index} is call {self.calls[k].rid!r}'s, not {chunk.meta_info.id!r}")
        if k in self._ended:
            return  # refused or left: its samples are settled already
        delta = chunk_delta(chunk, j, self._seen[k], incremental=True)
        self.streams[k].put([delta])
        if delta.finish_reason is not None:
            self._unfinished[k].discard(j)
            if not self._unfinished[k]:
                self._end(k, None)

    def _end(self, k: int, error: Exception | None) -> None:
        if k not in self._ended:
            self._ended.add(k)
            self.streams[k].put(_END if error is None else error)

    def leave(self, k: int) -> None:
        """Call k's reader has gone: abort the call on the worker if it still runs there,
        or stop the whole exchange if no reader is left."""
        self._left.add(k)
        running = k not in self._ended
        self._ended.add(k)
        if self._reader.done():
            return
        if len(self._left) == len(self.calls):
            self._reader.cancel()  # the exchange stops; the worker aborts what is left
        elif running:
            self.backend.abort(self.worker, self.calls[k].rid)


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
        batch_calls: bool = True,
    ) -> None:
        """`ca_file`: what https workers' certificates are verified against; `batch_calls`:
        see `streams`."""
        self.stream_interval_s, self.batch_calls = stream_interval_s, batch_calls
        timeout = httpx.Timeout(connect=connect_timeout_s, read=stall_timeout_s, write=connect_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        headers = {"Authorization": f"Bearer {token}"} if token else {}  # workers share the manager's token
        self.http = async_http_client(ca_file, timeout=timeout, limits=limits, headers=headers)
        self._exchanges: set[asyncio.Task[None]] = set()
        self.num_requests = 0
        self.num_calls = 0
        """`/generate` requests sent, and the calls they carried (calls / requests: how
        well calls share requests)."""

    def streams(self, worker: WorkerRecord, calls: list[GenerationCall]) -> list[AsyncIterator[list[Delta]]]:
        """One stream of deltas per call, in order. A worker that takes batched requests
        and streams incrementally (a polyrl worker: its `batched_generate` and
        `incremental_stream` capabilities) gets the calls that share their request-level
        fields (`batch_key`) as batched requests (`_requests_of`); any other server
        (SGLang's), a lone call, or every call with `batch_calls` off, one request per
        call."""
        if len(calls) == 1 or not (worker.batched_generate and worker.incremental_stream) or not self.batch_calls:
            return [self.stream(worker, call) for call in calls]
        by_key: dict[tuple[int, bool], list[int]] = {}
        for k, call in enumerate(calls):
            by_key.setdefault(batch_key(call), []).append(k)
        streams: list[AsyncIterator[list[Delta]]] = [None] * len(calls)  # type: ignore[list-item]
        for ks in by_key.values():
            for part in _requests_of(ks, calls):
                if len(part) == 1:
                    streams[part[0]] = self.stream(worker, calls[part[0]])
                    continue
                batched = BatchedCalls(self, worker, [calls[k] for k in part])
                for k, stream in zip(part, batched.streams, strict=True):
                    streams[k] = stream
        return streams

    async def stream(self, worker: WorkerRecord, call: GenerationCall) -> AsyncIterator[list[Delta]]:
        """One call as one request."""
        incremental = worker.incremental_stream  # a polyrl worker: checksums both ways
        self.num_calls += 1
        seen: dict[int, int] = {}
        body = generate_body(call, incremental, self.stream_interval_s)
        async with contextlib.aclosing(self.events(worker, body, incremental)) as events:
            async for data in events:
                yield [parse_chunk(data, seen, incremental)]

    async def events(self, worker: WorkerRecord, body: bytes, incremental: bool) -> AsyncIterator[str]:
        """POST `body` to the worker's /generate and yield each event's data until
        [DONE] (each checked against its checksum when `incremental`). Raises the call
        errors; a stream that ends without [DONE] is WorkerUnreachable. Closing it makes
        the exchange stop (the worker sees the connection close and aborts)."""
        headers = {"content-type": "application/json"} | ({CHECKSUM_HEADER: checksum(body)} if incremental else {})
        expected: str | None = None
        lines: asyncio.Queue[str | Exception | None] = asyncio.Queue()
        stop = asyncio.Event()
        self.num_requests += 1
        self._track(self._exchange(f"{worker.url}/generate", body, headers, lines, stop))
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
                    return
                if incremental and expected != checksum(data.encode()):
                    raise WorkerFailed("stream chunk does not match its checksum (damaged in transit)")
                expected = None
                yield data
        finally:
            stop.set()
        raise WorkerUnreachable("stream ended without [DONE]")

    def abort(self, worker: WorkerRecord, rid: str) -> None:
        """Ask the worker to abort request `rid` (one call of a batched request whose other
        calls go on), in the background: a worker that does not answer finishes the call
        for nobody, which costs it work but loses nothing."""
        self._track(self._abort(worker, rid))

    async def _abort(self, worker: WorkerRecord, rid: str) -> None:
        try:
            response = await self.post_json(worker, "/abort_request", AbortRequest(rid=rid), ABORT_TIMEOUT_S)
            if response.status_code != 200:
                log.debug("abort of %s on %s: HTTP %d", rid, worker.worker_id, response.status_code)
        except httpx.HTTPError as e:
            log.debug("abort of %s on %s failed: %s: %s", rid, worker.worker_id, type(e).__name__, e)

    def _track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coro` as a task that only `aclose` cancels (see the class docstring)."""
        task = asyncio.ensure_future(coro)
        self._exchanges.add(task)
        task.add_done_callback(self._exchanges.discard)
        return task

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
    if response.status_code == 400 and _error_type(body) == "corrupt_request":
        raise WorkerFailed(message)  # the network's fault, not the request's: retry elsewhere
    raise _status_error(response.status_code, message)


def _status_error(status: int, message: str) -> Exception:
    """The call's error for a worker's refusal with this HTTP status (see the module's
    docstring)."""
    if status in (429, 503):
        return WorkerBusy(message)
    if status in (400, 413, 422):
        return RequestRefused(message)
    return WorkerFailed(message)


def _call_refusal(data: str) -> tuple[str, Exception] | None:
    """A batched stream's error event for one of its prompts (`{"error": {..., "code"},
    "rid"}`): (its rid, the call's error); None for any other chunk."""
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("rid"), str) or "error" not in payload:
        return None
    error = payload["error"] if isinstance(payload["error"], dict) else {"message": str(payload["error"])}
    try:
        status = int(error.get("code") or 500)
    except ValueError:
        status = 500
    return payload["rid"], _status_error(status, f"HTTP {status}: {error.get('message', '')}")
