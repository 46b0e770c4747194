"""The manager's HTTP API over one RolloutManager.

Mutating endpoints need the bearer token; reading the fleet needs it too, or the
read-only `manager.read_token` (page.py); registrations must come from an allowed
address range; bodies are size-limited (control messages to 64 KiB). A refused or
malformed request gets a 4xx naming the reason and changes nothing.

    POST /v1/workers/register            RegisterRequest -> RegisterResponse
    GET  /v1/workers/register            {} if a registration would be taken (token, address): a worker asks first
    POST /v1/workers/{id}/heartbeat      Heartbeat (404: unknown, register again)
    POST /v1/workers/{id}/leave          LeaveRequest
    GET  /v1/workers                     WorkerList (with the latest local window and sync times)
    GET  /v1/fleet                       FleetStatus: workers, counters, event timeline, throughput history
    GET  /                               the operator page (HTML; bearer header or ?token=)
    POST /v1/batches                     BatchRequest -> NDJSON GroupResult lines + BatchEnd
    POST /v1/publisher                   PublisherEndpoint: where workers pull weights from
    POST /v1/weights/version             PublishVersion
    POST /v1/learner_started             the trainer's learner started on the step: the local window closes
    POST /v1/learner_waiting             the trainer's learner waits for groups: the `idle` window opens
    POST /v1/fleet/decisions             FleetDecision: the trainer's autoscaler changed the fleet's size
    POST /v1/groups/due                  DueGroupsRequest -> DueGroups: unfinished groups with tokens that old
    POST /v1/completions/versions        VersionsQuery -> VersionsReply: the weight versions of completions
                                         served below or by a worker, by token ids (completions.py)
    GET  /health (open), GET /metrics (reader's token)
    GET  /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /generate (vLLM's form):
                                         OpenAI/vLLM-compatible, served by the fleet (`inference.py`)
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from polyrl.httpapi import ApiError, BodyLimit, check_bearer, error_handlers
from polyrl.inference.protocol import VllmGenerateRequest
from polyrl.inference.routes import InferenceRoutes
from polyrl.manager.completions import completion_versions
from polyrl.manager.fleet import FleetStatus, fleet_status
from polyrl.manager.inference import ManagerBackend
from polyrl.manager.manager import RolloutManager
from polyrl.manager.metrics import CONTENT_TYPE
from polyrl.manager.page import Readers
from polyrl.manager.weight_sync import EndpointPublisher, PublisherSync
from polyrl.protocol.completions import VersionsQuery, VersionsReply
from polyrl.protocol.manager_api import (
    BatchEnd,
    BatchError,
    BatchRequest,
    DueGroups,
    DueGroupsRequest,
    FleetDecision,
    Heartbeat,
    LearnerWaiting,
    LeaveRequest,
    PublisherEndpoint,
    PublishVersion,
    RegisterRequest,
    RegisterResponse,
    WorkerList,
)

CONTROL_BODY_LIMIT = 64 * 1024
NOT_VLLM = (
    "the manager's /generate takes vLLM's form (prompt: {\"prompt_token_ids\": [...]}, n, max_tokens, "
    "temperature, logprobs); SGLang's form goes to a worker, and batches of prompts to /v1/batches"
)


def _line(model: Any) -> bytes:
    return model.model_dump_json().encode() + b"\n"


class _BatchStream(StreamingResponse):
    """Closes the batch when the response ends, however it ends: a client hanging up
    cancels the rest at once, even before the first line (a generator that never started
    would not run its own cleanup)."""

    media_type = "application/x-ndjson"

    def __init__(self, lines: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(lines, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _Handlers:
    def __init__(self, manager: RolloutManager, allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
        self.manager, self.allowed = manager, allowed
        self.publisher: EndpointPublisher | None = None
        self.publisher_sync: PublisherSync | None = None

    def _check_peer(self, request: Request) -> None:
        host = request.client.host if request.client else ""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ApiError(403, f"cannot tell the sender's address ({host!r})", "forbidden") from None
        if not any(address in network for network in self.allowed):
            raise ApiError(403, f"{host} is outside manager.allowed_worker_cidrs", "forbidden")

    async def register(self, body: RegisterRequest, request: Request) -> RegisterResponse:
        self._check_peer(request)
        return self.manager.register(body)

    async def may_register(self, request: Request) -> dict[str, Any]:
        """`polyrl worker` asks before it loads its engine: a refusal costs it a second, not a model's load."""
        self._check_peer(request)
        return {}

    async def heartbeat(self, worker_id: str, body: Heartbeat) -> dict[str, Any]:
        if not self.manager.heartbeat(worker_id, body):
            raise ApiError(404, f"unknown worker {worker_id!r}; register again", "unknown_worker")
        return {}

    async def leave(self, worker_id: str, body: LeaveRequest) -> dict[str, Any]:
        if not self.manager.leave(worker_id, body.reason):
            raise ApiError(404, f"unknown worker {worker_id!r}", "unknown_worker")
        return {}

    async def workers(self) -> WorkerList:
        return self.manager.worker_list()

    async def fleet(self) -> FleetStatus:
        return fleet_status(self.manager)

    async def publish(self, body: PublishVersion) -> dict[str, Any]:
        if self.publisher is not None:
            self.publisher.published(body.version, body.on_device)
        try:
            self.manager.publish_version(body.version)
        except ValueError as e:
            raise ApiError(409, str(e), "version_conflict") from None
        return {"latest_weight_version": body.version}

    async def set_publisher(self, body: PublisherEndpoint) -> dict[str, Any]:
        """Workers pull from this publisher from now on (it replaces the last one)."""
        hooks = self.manager.sync_hooks
        if self.publisher_sync is not None and self.publisher_sync in hooks:
            hooks.remove(self.publisher_sync)
        self.publisher = EndpointPublisher(body)
        self.publisher_sync = PublisherSync(self.manager, self.publisher, codec=self.manager.cfg.transfer.codec)
        hooks.append(self.publisher_sync)
        return {}

    async def learner_started(self) -> dict[str, Any]:
        self.manager.learner_started()
        return {}

    async def fleet_decision(self, body: FleetDecision) -> dict[str, Any]:
        """The trainer's autoscaler decided; kept for the operator page (it already logged it)."""
        self.manager.decisions.append(body.model_copy(update={"t": time.time()}))
        return {}

    async def learner_waiting(self, body: LearnerWaiting) -> dict[str, Any]:
        self.manager.learner_waiting(body.prompt_ids)
        return {}

    async def due_groups(self, body: DueGroupsRequest) -> DueGroups:
        return DueGroups(prompt_ids=self.manager.due_groups(body.max_floor_version))

    async def batches(self, body: BatchRequest) -> Response:
        try:
            batch = self.manager.submit(body)
        except RuntimeError as e:
            raise ApiError(503, str(e), "shutting_down") from None

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for group in self.manager.results(batch):
                    yield _line(group)
                yield _line(
                    BatchEnd(
                        batch_id=batch.batch_id,
                        num_groups=len(batch.groups),
                        num_migrated=batch.num_migrated,
                        elapsed_s=round(time.monotonic() - batch.submitted_at, 6),
                    )
                )
            except BatchError as e:
                yield _line(e.failure)

        return _BatchStream(lines(), on_close=lambda: self.manager.close_batch(batch))

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "latest_weight_version": self.manager.registry.latest_version}

    async def metrics(self) -> Response:
        return Response(self.manager.metrics.render(), media_type=CONTENT_TYPE)


def _vllm_generate(inference: InferenceRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        """vLLM's /generate only: SGLang's form is a worker's (the fleet's is /v1/batches)."""
        raw = await request.body()
        try:
            body = VllmGenerateRequest.model_validate_json(raw)
        except ValidationError as e:
            if b'"prompt"' not in raw:
                raise ApiError(422, NOT_VLLM, "invalid_request") from None
            raise RequestValidationError(e.errors()) from None
        return await inference.vllm_generate(body, request)

    return generate


def create_app(manager: RolloutManager) -> FastAPI:
    cfg = manager.cfg
    allowed = [ipaddress.ip_network(c, strict=False) for c in cfg.allowed_worker_cidrs]
    h = _Handlers(manager, allowed)
    inference = InferenceRoutes(ManagerBackend(manager), manager.completions)

    async def versions(body: VersionsQuery) -> VersionsReply:
        return VersionsReply(versions=await completion_versions(manager, body.keys))

    app = FastAPI(title="polyrl manager", exception_handlers=error_handlers())

    # a dependency: checked before the body is validated. async: FastAPI runs a plain
    # function in its threadpool, and every heartbeat would wait for a thread there
    async def authorized(request: Request) -> None:
        check_bearer(request, cfg.token)

    readers = Readers(cfg)

    async def may_read(request: Request) -> None:
        readers.check(request)

    async def page(request: Request) -> HTMLResponse:
        return readers.page(request)

    auth, read = [Depends(authorized)], [Depends(may_read)]
    app.get("/", include_in_schema=False)(page)
    app.get("/v1/fleet", dependencies=read)(h.fleet)
    app.post("/v1/workers/register", dependencies=auth)(h.register)
    app.get("/v1/workers/register", dependencies=auth)(h.may_register)
    app.post("/v1/workers/{worker_id}/heartbeat", dependencies=auth)(h.heartbeat)
    app.post("/v1/workers/{worker_id}/leave", dependencies=auth)(h.leave)
    app.get("/v1/workers", dependencies=read)(h.workers)
    app.post("/v1/batches", dependencies=auth)(h.batches)
    app.post("/v1/weights/version", dependencies=auth)(h.publish)
    app.post("/v1/publisher", dependencies=auth)(h.set_publisher)
    app.post("/v1/learner_started", dependencies=auth)(h.learner_started)
    app.post("/v1/fleet/decisions", dependencies=auth)(h.fleet_decision)
    app.post("/v1/learner_waiting", dependencies=auth)(h.learner_waiting)
    app.post("/v1/groups/due", dependencies=auth)(h.due_groups)
    app.post("/v1/completions/versions", dependencies=auth)(versions)
    app.get("/health")(h.health)
    app.get("/metrics", dependencies=read)(h.metrics)
    app.get("/v1/models", dependencies=auth)(inference.models)
    app.post("/v1/completions", dependencies=auth)(inference.completions)
    app.post("/v1/chat/completions", dependencies=auth)(inference.chat)
    app.post("/generate", dependencies=auth)(_vllm_generate(inference))

    def limit_for(path: str) -> int:
        control = ("/v1/workers", "/v1/weights", "/v1/publisher", "/v1/learner_", "/v1/groups", "/v1/fleet/")
        return CONTROL_BODY_LIMIT if path.startswith(control) else cfg.max_body_bytes

    app.add_middleware(BodyLimit, limit_for=limit_for)
    return app
