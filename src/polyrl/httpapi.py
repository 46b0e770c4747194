"""What the worker's and the manager's HTTP APIs share: one error body, readable 422s,
bearer-token checks and request-body limits.

Every error leaves as OpenAI's `{"error": {"message", "type", "param", "code"}}` with a
real status code, so a client needs one parser for both services, and the `openai`
client reads the OpenAI-compatible endpoints' errors as it reads OpenAI's own.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import xxhash
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None = None
    """The request field at fault, when one is (OpenAI's field)."""
    code: str | None = None
    """A machine-readable reason, e.g. `model_not_found` (OpenAI's field)."""


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


class ApiError(Exception):
    """An HTTP error with a client-facing message, rendered as the common error body."""

    def __init__(
        self, status_code: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type = status_code, message, type_
        self.param, self.code = param, code


def validation_message(err: RequestValidationError) -> str:
    """'sampling_params.top_k: unknown field' style, one clause per error."""
    clauses = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p != "body")
        msg = "unknown field" if e["type"] == "extra_forbidden" else str(e["msg"])
        msg = msg.removeprefix("Value error, ")
        if e["type"] == "json_invalid":
            msg, loc = f"invalid JSON: {e.get('ctx', {}).get('error', msg)}", ""
        elif e["type"] == "model_attributes_type" and not loc:  # also a non-JSON content type
            msg = "the body must be a JSON object (Content-Type: application/json)"
        clauses.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(clauses)


def error_handlers(extra: dict[type[Exception], tuple[int, str]] | None = None) -> dict[Any, Callable[..., Any]]:
    """FastAPI exception handlers: ApiError, HTTP errors, 422s, and `extra` (exception
    type -> (status, error type), message = str(exc))."""

    def handler(status: int, type_: str, text: Callable[[Any], str] = str) -> Callable[..., Any]:
        async def handle(_: Request, exc: Any) -> JSONResponse:
            return JSONResponse(error_body(text(exc), type_), status_code=status)

        return handle

    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status_code)

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, ...
        return JSONResponse(error_body(str(exc.detail), "http_error"), status_code=exc.status_code)

    handlers: dict[Any, Callable[..., Any]] = {
        ApiError: api_error,
        HTTPException: http_error,
        _BodyTooLarge: handler(413, "too_large", lambda exc: exc.detail),  # a chunked body, caught mid-read
        RequestValidationError: handler(422, "invalid_request", validation_message),
    }
    for exc_type, (status, type_) in (extra or {}).items():
        handlers[exc_type] = handler(status, type_)
    return handlers


def check_bearer(request: Request, token: str | None) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <token>` (constant-time
    comparison). No configured token means the endpoint is open (loopback-only setups)."""
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token", "unauthorized")


class BodyLimit:
    """ASGI middleware: refuse request bodies over a size limit with 413, before a handler
    reads them. `limit_for(path)` gives the limit of each route; both a declared
    Content-Length and the bytes actually received are checked (chunked bodies have none)."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]) -> None:
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _too_large(limit, send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:  # raised outside FastAPI's handlers (they render it themselves)
            await _too_large(limit, send)


class _BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body reader passes it on instead of turning it into
    a 400 'error parsing the body'."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over the {limit}-byte limit")


async def _too_large(limit: int, send: Send) -> None:
    response = JSONResponse(error_body(f"request body over the {limit}-byte limit", "too_large"), status_code=413)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


# ------------------------------------------------------------------------ body checksums

CHECKSUM_HEADER = "x-polyrl-xxh3"
"""A request body's xxh3-64 (hex), sent by the manager with every /generate call."""


def checksum(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class ChecksumGuard:
    """ASGI middleware: a request that carries CHECKSUM_HEADER is refused with 400
    `corrupt_request` unless its body hashes to it. TCP's 16-bit checksum lets rare
    corruptions through; one that still parses would change a prompt's tokens silently,
    and one that does not would read as the client's own mistake (422). The caller
    retries a `corrupt_request` elsewhere. Bodies are already size-limited upstream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        expected = None
        if scope["type"] == "http":
            name = CHECKSUM_HEADER.encode()
            expected = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)
        if expected is None:
            await self.app(scope, receive, send)
            return
        parts, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(parts)
        if checksum(body) != expected.strip().lower():
            response = JSONResponse(
                error_body("request body does not match its checksum (damaged in transit)", "corrupt_request"),
                status_code=400,
            )
            await response(scope, _no_receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, so a
    client hanging up mid-stream aborts its request at once, not at garbage collection.
    The worker's SGLang stream and the OpenAI endpoints both answer with it."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
