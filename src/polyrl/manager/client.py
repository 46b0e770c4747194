"""The trainer's side of the batch API: submit a BatchRequest, read groups as they finish
(`BatchClient`; `AsyncBatchClient` for the agent episodes' calls, many at once on one
event loop).

Only a connection that never opened is retried (the batch cannot have started); a
stream cut halfway raises BatchError(kind="disconnected"), since resubmitting would
generate every finished group again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
from pydantic import TypeAdapter, ValidationError

from polyrl.protocol.manager_api import BatchEnd, BatchError, BatchFailed, BatchRequest, GroupResult
from polyrl.tls import async_http_client, http_client

_Line = TypeAdapter(GroupResult | BatchEnd | BatchFailed)


def _http_args(url: str, token: str | None, connect_timeout_s: float, pool_timeout_s: float | None) -> dict:
    """Both clients' base URL, bearer token and timeouts. No read timeout: groups may be
    minutes apart, and the manager's batch deadline ends a stuck batch with an error line."""
    return {
        "base_url": url.rstrip("/"),
        "headers": {"Authorization": f"Bearer {token}"} if token else {},
        "timeout": httpx.Timeout(connect=connect_timeout_s, read=None, write=connect_timeout_s, pool=pool_timeout_s),
    }


class BatchClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        connect_timeout_s: float = 10.0,
        connect_retries: int = 3,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.http = http_client(
            ca_file, **_http_args(url, token, connect_timeout_s, connect_timeout_s), transport=transport
        )
        self.connect_retries = connect_retries

    def generate(self, request: BatchRequest) -> Iterator[GroupResult]:
        """Groups in completion order; raises BatchError when the batch fails or the
        stream is cut, httpx.HTTPStatusError-like BatchError(invalid_request) when refused."""
        body = request.model_dump(mode="json")
        for attempt in range(self.connect_retries + 1):
            try:
                with self.http.stream("POST", "/v1/batches", json=body) as response:
                    if response.status_code != 200:
                        response.read()
                        raise BatchError(_refused(response))
                    yield from _read_lines(response)
                    return
            except httpx.ConnectError:
                if attempt == self.connect_retries:
                    raise
                time.sleep(0.5 * 2**attempt)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBatchClient:
    """`BatchClient` on an event loop; the same retry rule (a connection that never opened)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        connect_timeout_s: float = 10.0,
        connect_retries: int = 3,
        ca_file: str | None = None,
        max_connections: int = 256,
    ) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # no pool timeout: the episodes' calls wait their turn for one of the connections
        self.http = async_http_client(ca_file, **_http_args(url, token, connect_timeout_s, None), limits=limits)
        self.connect_retries = connect_retries

    async def generate(self, request: BatchRequest) -> AsyncIterator[GroupResult]:
        """The batch's groups in completion order; raises BatchError as `BatchClient`."""
        body = request.model_dump(mode="json")
        for attempt in range(self.connect_retries + 1):
            try:
                async with self.http.stream("POST", "/v1/batches", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise BatchError(_refused(response))
                    async for group in _read_lines_async(response):
                        yield group
                    return
            except httpx.ConnectError as e:  # (only before the first line: the batch never started)
                if attempt == self.connect_retries:
                    raise BatchError(_failed("disconnected", f"cannot reach the manager: {e}")) from None
                await asyncio.sleep(0.5 * 2**attempt)

    async def close(self) -> None:
        await self.http.aclose()


async def _read_lines_async(response: httpx.Response) -> AsyncIterator[GroupResult]:
    try:
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            item = _parse(line)
            if item is None:
                return
            yield item
    except httpx.TransportError as e:
        raise BatchError(_failed("disconnected", f"stream from the manager cut: {type(e).__name__}: {e}")) from None
    raise BatchError(_failed("disconnected", "stream from the manager ended before the batch did"))


def _parse(line: str) -> GroupResult | None:
    """A group; None at the batch's end; raises BatchError for a failure or a bad line."""
    try:
        item = _Line.validate_json(line)
    except ValidationError as e:
        raise BatchError(_failed("disconnected", f"unreadable line from the manager: {e}")) from None
    if isinstance(item, BatchFailed):
        raise BatchError(item)
    return None if isinstance(item, BatchEnd) else item


def _read_lines(response: httpx.Response) -> Iterator[GroupResult]:
    try:
        for line in response.iter_lines():
            if not line.strip():
                continue
            item = _parse(line)
            if item is None:
                return
            yield item
    except httpx.TransportError as e:
        raise BatchError(_failed("disconnected", f"stream from the manager cut: {type(e).__name__}: {e}")) from None
    raise BatchError(_failed("disconnected", "stream from the manager ended before the batch did"))


def _failed(kind: str, message: str) -> BatchFailed:
    return BatchFailed(batch_id="", kind=kind, message=message)  # type: ignore[arg-type]


def _refused(response: httpx.Response) -> BatchFailed:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    kind = "shutdown" if response.status_code == 503 else "invalid_request"
    return _failed(kind, f"manager refused the batch: HTTP {response.status_code}: {message}")
