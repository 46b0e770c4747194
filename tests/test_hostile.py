"""Hostile input at every boundary: the manager's and the worker's HTTP APIs and the
weight data plane (request header, version description, encoded payloads).

Whatever a buggy or malicious peer sends must get a clear refusal (a 4xx with the
common error body over HTTP; the module's own error type on the data plane), must change
nothing, and must leave the service serving the next honest client. Hypothesis draws
three kinds of bodies per endpoint: arbitrary JSON, arbitrary bytes, and a valid body
with one thing broken (a field of the wrong type or out of range, removed, or unknown),
which is what a peer of another version or a fuzzer sends. Random draws seldom pair one
given field with one given edge value, so each endpoint also gets a sweep: every field
of its valid body replaced in turn by each of EDGE_VALUES. Plain tests cover tokens,
address ranges, oversized and chunked bodies, replayed and forged transfer tokens,
descriptions and chunks, and clients that send one byte at a time.

HTTP fuzzing goes through `httpx.ASGITransport` (no socket, and the peer address can be
anything); body limits and slow clients are also checked against real uvicorn servers.
Tests whose docstring starts with "Regression:" failed before the fix they name.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import select
import socket
import socketserver
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from test_manager import AUTH, TOKEN, fast_cfg, wait_active
from test_transfer import CHUNK, assert_same, source, weights
from test_worker import CONTEXT, InProcessWorker, _tiny, _wait_until, greedy

from chaos_harness.harness import free_port
from polyrl.engine.types import SampleResult
from polyrl.httpapi import ErrorDetail
from polyrl.inference.protocol import ChatCompletionRequest, CompletionRequest, VllmGenerateRequest
from polyrl.manager.fleet import FleetStatus
from polyrl.manager.main import ManagerThread
from polyrl.manager.manager import RolloutManager
from polyrl.manager.server import create_app as manager_app
from polyrl.models.tiny import add_chat_template
from polyrl.protocol.manager_api import BatchRequest, Heartbeat, PublishVersion, RegisterRequest, WorkerList
from polyrl.protocol.worker_api import GenerateRequest, UpdateWeightsFromPublisherRequest
from polyrl.transfer.compress import decode_zstd, encode_zstd
from polyrl.transfer.delta import apply_delta, encode_delta
from polyrl.transfer.manifest import flatten, unflatten
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.quantize import decode_int8, encode_int8
from polyrl.transfer.receiver import parse_description, pull
from polyrl.transfer.wire import (
    CHUNK_INDEX,
    CHUNKS_END,
    ENCODED_OPS,
    KNOWN_OPS,
    OP_CHUNKS,
    OP_DESCRIBE,
    STATUS_OK,
    PullSource,
    TransferError,
    TransferInfo,
    chunk_checksums,
    combined_checksum,
    encode_request,
    read_reply_text,
    read_request,
    send_text,
)
from polyrl.worker.server import create_app as worker_app

T = TypeVar("T")

FUZZ = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
FUZZ_PARSERS = settings(FUZZ, max_examples=200)  # no server behind them: cheap examples
JSON_TYPE = {"content-type": "application/json"}
MAX_FUZZ_TOKENS = 8
"""Valid /generate bodies run with at most this many new tokens: what is fuzzed is the
refusals, not the engine's speed."""


# ------------------------------------------------------------------------------ strategies

EDGE_VALUES = [
    2**63,
    10**400,
    -(10**400),
    -1,
    0,
    1e-40,
    1e308,
    float("inf"),
    float("nan"),
    "",
    "x" * 3000,
    "\x00\u00e9\U0001f600",
    None,
    True,
    [],
    {},
]
"""What a field of a valid body is replaced with: another type, out of range, or beyond
int64 and beyond what a float holds (fine for Python's int, not for what the value meets
later: a tensor, a float, a metrics exporter)."""
LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
"""Arbitrary JSON, NaN and Infinity included (Python's json writes them; strict parsers refuse them)."""
HOSTILE = st.one_of(st.sampled_from(EDGE_VALUES), JSON)


def _slots(value: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a JSON value: the places where one thing can be broken."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    slots: list[tuple[Any, Any]] = []
    for key, child in children:
        slots.append((value, key))
        slots.extend(_slots(child))
    return slots


@st.composite
def almost_valid(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """`valid` with one thing wrong: a value replaced (another type, out of range, huge),
    a field or list item removed, or an unknown field added."""
    body = copy.deepcopy(valid)
    container, key = draw(st.sampled_from(_slots(body)))
    how = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
    if how == "replace":
        container[key] = draw(HOSTILE)
    elif how == "remove":
        del container[key]
    else:
        target = container if isinstance(container, dict) else body
        target[draw(st.text(min_size=1, max_size=8))] = draw(HOSTILE)
    return body


def edge_sweep(valid: dict[str, Any]) -> Iterator[Any]:
    """`valid` with each field in turn (nested ones and list items too) replaced by each
    of EDGE_VALUES: the systematic part of the fuzz, where random draws are too sparse to
    rely on (one field of twenty times one value of twenty)."""
    for i in range(len(_slots(valid))):
        for value in EDGE_VALUES:
            body = copy.deepcopy(valid)
            container, key = _slots(body)[i]
            container[key] = value
            yield body


def bodies(valid: dict[str, Any], tame: Callable[[Any], Any] = lambda body: body) -> st.SearchStrategy[bytes]:
    """Request bodies for an endpoint whose valid body looks like `valid`; `tame` keeps
    the valid ones cheap to serve."""
    near = almost_valid(valid)
    as_json = st.one_of(JSON, near, near, near).map(lambda v: json.dumps(tame(v)).encode())
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64))


CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json", "text/plain", "", "multipart/form-data; boundary=x"]
)


# --------------------------------------------------------------------------------- helpers


class LoopThread:
    """An event loop in a daemon thread, for in-process ASGI calls from synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class AsgiClient:
    """Requests straight into an app, on the loop that owns its state; `peer` is the
    address the app sees the request come from."""

    def __init__(
        self,
        app: Any,
        run: Callable[[Coroutine[Any, Any, httpx.Response]], httpx.Response],
        peer: tuple[str, int] = ("127.0.0.1", 1234),
    ) -> None:
        transport = httpx.ASGITransport(app=app, client=peer)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://asgi", timeout=60)
        self.run = run

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.client.request(method, path, **kwargs))

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)


def assert_clear(response: httpx.Response) -> None:
    """2xx, or a 4xx that says why in the common error body; never a 5xx."""
    assert response.status_code < 500, f"HTTP {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400 and response.request.method != "HEAD":  # HEAD answers carry no body
        detail = ErrorDetail.model_validate(response.json()["error"])
        assert detail.message and detail.type, response.text


class Dripper(threading.Thread):
    """Sends `data` over a raw socket one byte every `interval_s` until done or stopped;
    notes when the peer closed the connection and what it sent back."""

    def __init__(self, address: tuple[str, int], data: bytes, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.address, self.data, self.interval_s = address, data, interval_s
        self.stopped = threading.Event()
        self.num_sent = 0
        self.received = b""
        self.closed_after_s: float | None = None
        self.start()

    def run(self) -> None:
        start = time.monotonic()
        with socket.create_connection(self.address, timeout=5) as sock:
            for byte in self.data:
                if self.stopped.is_set():
                    return
                try:
                    sock.sendall(bytes([byte]))
                    self.num_sent += 1
                    readable, _, _ = select.select([sock], [], [], self.interval_s)
                    chunk = sock.recv(65536) if readable else None
                except OSError:
                    chunk = b""
                if chunk == b"":
                    self.closed_after_s = time.monotonic() - start
                    return
                self.received += chunk or b""

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


# --------------------------------------------------------------------------------- manager

REGISTRATION = {
    "protocol_version": 1,
    "worker_id": "fz-1",
    "url": "http://127.0.0.1:9",
    "model_path": "m",
    "weight_version": 0,
    "max_num_seqs": 4,
    "max_model_len": 64,
    "capabilities": ["incremental_stream"],
    "usd_per_hour": 1.5,
}
HEARTBEAT = {"state": "active", "weight_version": 0, "num_running": 1, "num_waiting": 0, "gen_throughput": 2.5}
BATCH = {
    "prompts": [{"id": "p0", "input_ids": [5, 6], "seed": 1}, {"id": "p1", "input_ids": [7]}],
    "sampling": {
        "n": 2,
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "seed": 3,
    },
    "min_weight_version": 0,
    "deadline_s": 0.1,
}
GHOST = RegisterRequest(
    worker_id="ghost", url="http://127.0.0.1:10", model_path="m", weight_version=0, max_num_seqs=4, max_model_len=64
)


def hostile_manager(**overrides: Any) -> ManagerThread:
    cfg = fast_cfg(**({"allowed_worker_cidrs": ["127.0.0.0/8"], "batch_deadline_s": 0.1} | overrides))
    return ManagerThread(cfg)


def manager_client(mt: ManagerThread, peer: tuple[str, int] = ("127.0.0.1", 1234)) -> AsgiClient:
    return AsgiClient(manager_app(mt.manager), mt.run, peer)


def manager_state(mt: ManagerThread) -> tuple[Any, ...]:
    """What a refused request must not change: the workers, the latest version, batches."""

    def snapshot(m: RolloutManager) -> tuple[Any, ...]:
        records = sorted(
            (
                r.worker_id,
                r.url,
                r.state,
                r.weight_version,
                r.max_num_seqs,
                r.num_running,
                r.num_waiting,
                r.gen_throughput,
                r.inflight,
                r.usd_per_hour,
            )
            for r in m.registry
        )
        return m.registry.latest_version, records, sorted(m.batches), len(m.pending)

    return mt.call(snapshot, mt.manager)


def reset_ghost(m: RolloutManager) -> None:
    """A fresh active worker record with nothing behind it, for heartbeats and leaves to
    refer to (no batch is open, so nothing dials it)."""
    old = m.registry.get("ghost")
    if old is not None:
        m.registry.remove(old, "reset")
    m.registry.ready(m.registry.add(GHOST, "ghost"))


def assert_manager_serves(client: AsgiClient) -> None:
    metrics, workers = client.get("/metrics", headers=AUTH), client.get("/v1/workers", headers=AUTH)
    assert metrics.status_code == 200, metrics.text[:300]
    WorkerList.model_validate_json(workers.content)  # also: what it says can be read back
    FleetStatus.model_validate_json(client.get("/v1/fleet", headers=AUTH).content)


def _tame_batch(body: Any) -> Any:
    """A batch that would be accepted gets a short deadline (nobody serves it)."""
    try:
        BatchRequest.model_validate(body)
    except ValidationError:
        return body
    return body | {"deadline_s": 0.02}


def _check_register(mt: ManagerThread, sent: bytes, response: httpx.Response) -> None:
    worker_id = RegisterRequest.model_validate_json(sent).worker_id
    assert response.json()["worker_id"] == worker_id
    assert mt.call(mt.manager.registry.get, worker_id) is not None
    mt.call(mt.manager.leave, worker_id, "fuzz")  # back to the empty registry


def _check_heartbeat(mt: ManagerThread, sent: bytes, response: httpx.Response) -> None:
    beat = Heartbeat.model_validate_json(sent)
    record = mt.call(mt.manager.registry.get, "ghost")
    assert (record.num_running, record.num_waiting, record.gen_throughput) == (
        beat.num_running,
        beat.num_waiting,
        beat.gen_throughput,
    )
    mt.call(mt.manager.placement.pick, 0, time.monotonic())  # placing work reads the reported load


def _check_batch(mt: ManagerThread, sent: bytes, response: httpx.Response) -> None:
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines and lines[-1]["type"] in ("end", "error"), response.text
    assert mt.call(lambda: not mt.manager.batches and not mt.manager.pending)


def _check_publish(mt: ManagerThread, sent: bytes, response: httpx.Response) -> None:
    assert mt.call(lambda: mt.manager.registry.latest_version) == PublishVersion.model_validate_json(sent).version


MANAGER_POSTS = {
    "register": ("/v1/workers/register", REGISTRATION, lambda body: body, _check_register),
    "heartbeat": ("/v1/workers/ghost/heartbeat", HEARTBEAT, lambda body: body, _check_heartbeat),
    "leave": ("/v1/workers/ghost/leave", {"reason": "done"}, lambda body: body, lambda *_: None),
    "batches": ("/v1/batches", BATCH, _tame_batch, _check_batch),
    "publish": ("/v1/weights/version", {"version": 3}, lambda body: body, _check_publish),
}


@pytest.mark.parametrize("endpoint", list(MANAGER_POSTS))
def test_manager_endpoint_fuzz(endpoint: str) -> None:
    """Every body gets 2xx or a clear 4xx; a refusal changes nothing; an acceptance does
    exactly what it says; the API answers after each one."""
    path, valid, tame, check_accepted = MANAGER_POSTS[endpoint]
    # The monitor ticks every heartbeat_timeout_s / 4: short, it ends the fuzzed batches
    # (nobody serves them) at once; the ghost of heartbeats and leaves needs a long one.
    timeout_s = 0.04 if endpoint == "batches" else 3600.0
    with hostile_manager(heartbeat_timeout_s=timeout_s) as mt, socket.create_server(("127.0.0.1", 0)) as silent:
        # registered workers point at a socket that never answers: they stay `registering`
        # until the check (a refused connection would drop them at once)
        valid = valid | {"url": f"http://127.0.0.1:{silent.getsockname()[1]}"} if endpoint == "register" else valid
        client = manager_client(mt)
        uses_ghost = "ghost" in path

        def check(body: bytes, content_type: str) -> None:
            if uses_ghost:
                mt.call(reset_ghost, mt.manager)
            before = manager_state(mt)
            response = client.post(path, content=body, headers=AUTH | {"content-type": content_type})
            assert_clear(response)
            if response.status_code >= 400:
                assert manager_state(mt) == before, response.text
            else:
                check_accepted(mt, body, response)
            assert_manager_serves(client)

        for edge in edge_sweep(valid):
            check(json.dumps(tame(edge)).encode(), "application/json")
        FUZZ(given(body=bodies(valid, tame), content_type=CONTENT_TYPES)(check))()


@pytest.mark.parametrize("target", ["manager", "worker"])
def test_any_path_and_method_gets_a_clear_answer(target: str, request: pytest.FixtureRequest) -> None:
    """Reads with junk queries and bodies, unknown paths and wrong methods: 2xx or a
    clear 4xx, and nothing changes (POST /shutdown, the one unauthenticated call that
    drains the worker, is left out)."""
    known = {
        "manager": [
            "/",
            "/v1/fleet",
            "/v1/workers",
            "/health",
            "/metrics",
            "/v1/batches",
            "/v1/workers/register",
            "/v1/weights/version",
        ],
        "worker": ["/health", "/health_generate", "/get_server_info", "/get_model_info", "/generate", "/shutdown"],
    }[target]
    printable = st.characters(min_codepoint=33, max_codepoint=0x2FF, exclude_characters="\x7f")  # no controls: httpx
    paths = st.one_of(st.sampled_from(known), st.text(printable, max_size=20).map(lambda s: "/" + s.lstrip("/")))
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    queries = st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)
    if target == "manager":
        mt = hostile_manager().start()
        client, state = manager_client(mt), lambda: manager_state(mt)
    else:
        worker: InProcessWorker = request.getfixturevalue("worker")
        loop = LoopThread()
        client, state = AsgiClient(worker_app(worker.state), loop.run), lambda: worker_state(worker)
    try:

        @FUZZ
        @given(path=paths, method=methods, query=queries, body=st.binary(max_size=32))
        def check(path: str, method: str, query: dict[str, str], body: bytes) -> None:
            assume(not (path == "/shutdown" and method == "POST"))
            mutating = method == "POST" and path in known  # would be a valid call without the junk
            before = state()
            response = client.request(method, path, params=query, content=body or None)
            assert_clear(response)
            if response.status_code >= 400 or not mutating:
                assert state() == before

        check()
    finally:
        if target == "manager":
            mt.stop()
        else:
            loop.close()


# ------------------------------------------------------------------------ manager security

MUTATING = [
    ("/v1/workers/register", REGISTRATION),
    ("/v1/workers/ghost/heartbeat", HEARTBEAT),
    ("/v1/workers/ghost/leave", {"reason": "done"}),
    ("/v1/batches", BATCH),
    ("/v1/weights/version", {"version": 3}),
]
BAD_AUTH = [
    pytest.param({}, id="missing"),
    pytest.param({"Authorization": "Bearer wrong"}, id="wrong"),
    pytest.param({"Authorization": f"Basic {TOKEN}"}, id="wrong-scheme"),
    pytest.param({"Authorization": TOKEN}, id="no-scheme"),
    pytest.param({"Authorization": "Bearer"}, id="empty"),
    pytest.param({"Authorization": f"Bearer {TOKEN[:-1]}"}, id="prefix"),
    pytest.param({"Authorization": f"Bearer {TOKEN}x"}, id="longer"),
]


@pytest.fixture(scope="module")
def ghost_manager() -> Iterator[ManagerThread]:
    with hostile_manager(heartbeat_timeout_s=3600.0) as mt:
        yield mt


@pytest.mark.parametrize("auth", BAD_AUTH)
@pytest.mark.parametrize(("path", "body"), MUTATING, ids=[p.split("/")[-1] for p, _ in MUTATING])
def test_mutating_manager_endpoints_need_the_token(
    ghost_manager: ManagerThread, path: str, body: dict[str, Any], auth: dict[str, str]
) -> None:
    mt = ghost_manager
    mt.call(reset_ghost, mt.manager)
    client = manager_client(mt)
    before = manager_state(mt)
    response = client.post(path, json=body, headers=auth)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "unauthorized"
    assert manager_state(mt) == before


def test_the_token_opens_every_mutating_endpoint() -> None:
    """The control of the 401s above: the same calls with the token pass (the scheme's
    case does not matter)."""
    with hostile_manager(heartbeat_timeout_s=0.4) as mt:
        client = manager_client(mt)
        for (path, body), scheme in zip(MUTATING, ["Bearer", "bearer", "BEARER", "Bearer", "Bearer"], strict=True):
            mt.call(reset_ghost, mt.manager)
            response = client.post(path, json=body, headers={"Authorization": f"{scheme} {TOKEN}"})
            assert response.status_code == 200, (path, response.text)
        assert mt.call(lambda: mt.manager.registry.latest_version) == 3


READS = ["/", "/v1/fleet", "/v1/workers", "/metrics"]
"""What shows the fleet (worker URLs, load): a reader's token only (issue 26)."""


@pytest.mark.parametrize("auth", BAD_AUTH)
@pytest.mark.parametrize("path", READS)
def test_reading_the_fleet_needs_a_token(ghost_manager: ManagerThread, path: str, auth: dict[str, str]) -> None:
    mt = ghost_manager
    mt.call(reset_ghost, mt.manager)
    response = manager_client(mt).get(path, headers=auth)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "unauthorized"
    assert GHOST.url not in response.text


def test_the_page_asks_a_browser_for_the_token(ghost_manager: ManagerThread) -> None:
    """A browser (Accept: text/html) without the token gets a form, not the page; a wrong
    `?token=` is refused as a wrong header is; the right one, either way, opens it."""
    mt = ghost_manager
    mt.call(reset_ghost, mt.manager)
    client, html = manager_client(mt), {"Accept": "text/html"}
    for query in ["", "?token=", "?token=wrong", f"?token={TOKEN[:-1]}", f"?token={TOKEN}x", f"?tok={TOKEN}"]:
        response = client.get(f"/{query}", headers=html)
        assert response.status_code == 401, query
        assert "<form" in response.text and "/v1/fleet" not in response.text and GHOST.url not in response.text
    for response in (client.get(f"/?token={TOKEN}", headers=html), client.get("/", headers=AUTH | html)):
        assert response.status_code == 200 and "v1/fleet" in response.text
        assert "default-src 'none'" in response.headers["content-security-policy"]  # no external assets
    assert client.get("/v1/fleet", params={"token": TOKEN}).status_code == 401  # the data: bearer header only


def test_the_read_token_reads_but_cannot_act() -> None:
    with hostile_manager(read_token="reader-token", heartbeat_timeout_s=3600.0) as mt:
        mt.call(reset_ghost, mt.manager)
        client, reader = manager_client(mt), {"Authorization": "Bearer reader-token"}
        for path in READS:
            assert client.get(path, headers=reader).status_code == 200, path
            assert client.get(path, headers=AUTH).status_code == 200, path
        assert "ghost" in client.get("/v1/fleet", headers=reader).text
        before = manager_state(mt)
        for path, body in MUTATING:
            assert client.post(path, json=body, headers=reader).status_code == 401, path
        assert manager_state(mt) == before


@pytest.mark.parametrize(
    ("peer", "needle"),
    [
        (("10.9.9.9", 1), "10.9.9.9 is outside manager.allowed_worker_cidrs"),
        (("::1", 1), "::1 is outside"),
        (("128.0.0.1", 1), "outside"),
        (("not-an-address", 1), "cannot tell the sender's address"),
    ],
)
def test_registration_from_outside_the_allowed_ranges_is_forbidden(
    ghost_manager: ManagerThread, peer: tuple[str, int], needle: str
) -> None:
    mt = ghost_manager
    before = manager_state(mt)
    response = manager_client(mt, peer).post("/v1/workers/register", json=REGISTRATION, headers=AUTH)
    assert response.status_code == 403 and response.json()["error"]["type"] == "forbidden"
    assert needle in response.json()["error"]["message"]
    assert manager_state(mt) == before
    inside = manager_client(mt, ("127.0.0.9", 1)).post("/v1/workers/register", json=REGISTRATION, headers=AUTH)
    assert inside.status_code == 200  # the range is 127.0.0.0/8, not just 127.0.0.1
    mt.call(mt.manager.leave, "fz-1", "cleanup")


async def _chunked(data: bytes, piece: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), piece):
        yield data[i : i + piece]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_bodies_get_413_and_change_nothing(chunked: bool, worker: InProcessWorker) -> None:
    """Regression: a chunked body over the limit was refused as type "http_error", a
    declared one as "too_large" (one error type now), and the worker had no limit."""
    big = json.dumps(BATCH | {"prompts": [{"id": f"p{i}", "input_ids": [5] * 50} for i in range(40)]}).encode()
    assert len(big) > 5000
    cases: list[tuple[AsgiClient, str, bytes, Callable[[], Any]]] = []
    mt = hostile_manager(max_body_bytes=4096).start()
    loop = LoopThread()
    try:
        manager = manager_client(mt)
        cases.append((manager, "/v1/batches", big, lambda: manager_state(mt)))
        registration = json.dumps(REGISTRATION | {"model_path": "m" * 70_000}).encode()  # control messages: 64 KiB
        cases.append((manager, "/v1/workers/register", registration, lambda: manager_state(mt)))
        small_worker = AsgiClient(worker_app(worker.state, max_body_bytes=4096), loop.run)
        prompt = json.dumps(greedy(2) | {"input_ids": [5] * 2000}).encode()
        cases.append((small_worker, "/generate", prompt, lambda: worker_state(worker)))
        for client, path, body, state in cases:
            before = state()
            content = _chunked(body) if chunked else body
            response = client.post(path, content=content, headers=AUTH | JSON_TYPE)
            assert response.status_code == 413, (path, response.text)
            assert response.json()["error"]["type"] == "too_large", (path, response.text)
            assert "byte limit" in response.json()["error"]["message"]
            assert state() == before
    finally:
        mt.stop()
        loop.close()


def _raw_request(url: str, head: bytes, timeout_s: float = 5) -> bytes:
    """Send `head` (request line and headers, no body) and read the reply until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and b"}" in reply:
                break
        return reply


def test_declared_oversize_is_refused_before_the_body_arrives(worker: InProcessWorker) -> None:
    """Over a real server: a Content-Length of a gigabyte is answered 413 at once; the
    client never has to send it. The worker's default limit applies (16 MiB)."""
    with hostile_manager() as mt:
        for url, path in ((mt.url, "/v1/batches"), (worker.http.url, "/generate")):
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
            ).encode()
            reply = _raw_request(url, head)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert b'"too_large"' in reply
        assert httpx.get(f"{mt.url}/health", timeout=5).status_code == 200


def test_manager_refuses_integers_beyond_int64(ghost_manager: ManagerThread) -> None:
    """Regression: `int` fields took any size. A published version of 400 digits made
    every GET /metrics a 500 from then on, and a heartbeat reporting that many running
    sequences made the dispatcher crash when it computed the worker's load."""
    mt = ghost_manager
    mt.call(reset_ghost, mt.manager)
    client = manager_client(mt)
    huge = 10**400
    cases = [
        ("/v1/weights/version", {"version": huge}),
        ("/v1/weights/version", {"version": 2**63}),
        ("/v1/workers/ghost/heartbeat", HEARTBEAT | {"num_running": huge}),
        ("/v1/workers/ghost/heartbeat", HEARTBEAT | {"weight_version": huge}),
        ("/v1/workers/register", REGISTRATION | {"max_num_seqs": huge}),
        ("/v1/batches", BATCH | {"sampling": BATCH["sampling"] | {"top_k": 2**63}}),
        ("/v1/batches", BATCH | {"prompts": [{"id": "p", "input_ids": [huge]}]}),
    ]
    before = manager_state(mt)
    for path, body in cases:
        response = client.post(path, json=body, headers=AUTH)
        assert response.status_code == 422, (path, response.text)
        assert_clear(response)
    assert manager_state(mt) == before
    assert_manager_serves(client)
    assert mt.call(mt.manager.placement.pick, 0, time.monotonic())[0].worker_id == "ghost"


def test_manager_refuses_non_finite_floats(ghost_manager: ManagerThread) -> None:
    """Regression: Infinity passed as a throughput, temperature or deadline; /v1/workers
    then wrote the throughput as null, which no client could read back."""
    mt = ghost_manager
    mt.call(reset_ghost, mt.manager)
    client = manager_client(mt)
    before = manager_state(mt)
    for path, body in [
        ("/v1/workers/ghost/heartbeat", json.dumps(HEARTBEAT | {"gen_throughput": float("inf")})),
        ("/v1/workers/ghost/heartbeat", json.dumps(HEARTBEAT | {"gen_throughput": float("nan")})),
        ("/v1/batches", json.dumps(BATCH | {"sampling": BATCH["sampling"] | {"temperature": float("inf")}})),
        ("/v1/batches", json.dumps(BATCH | {"deadline_s": float("inf")})),
        ("/v1/workers/register", json.dumps(REGISTRATION | {"usd_per_hour": float("inf")})),
    ]:
        response = client.post(path, content=body, headers=AUTH | JSON_TYPE)
        assert response.status_code == 422, (path, body, response.text)
    assert manager_state(mt) == before
    assert_manager_serves(client)


# ---------------------------------------------------------------------------------- worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessWorker]:
    with InProcessWorker(add_chat_template(_tiny(tmp_path_factory.mktemp("hostile_model")))) as w:
        yield w


@pytest.fixture(scope="module")
def worker_client(worker: InProcessWorker) -> Iterator[AsgiClient]:
    loop = LoopThread()
    yield AsgiClient(worker_app(worker.state), loop.run)
    loop.close()


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic s3cret", "Bearer "])
def test_a_worker_with_a_token_acts_only_for_its_holder(auth: str | None, worker: InProcessWorker) -> None:
    """Without the token nobody may make the worker generate, abort, load weights (from any
    path or host) or shut down; reading its state stays open."""
    loop = LoopThread()
    worker.state.token = "s3cret"
    try:
        client = AsgiClient(worker_app(worker.state), loop.run)
        before = worker_state(worker)
        headers = {"Authorization": auth} if auth else {}
        for path, body in [
            ("/generate", GENERATE),
            ("/abort_request", {"abort_all": True}),
            ("/update_weights_from_disk", FROM_DISK),
            ("/update_weights_from_publisher", FROM_PUBLISHER),
            ("/shutdown", {}),
        ]:
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "unauthorized", path
        assert worker_state(worker) == before
        for path in ("/health", "/get_server_info", "/get_model_info"):
            assert client.get(path).status_code == 200
        ok = client.post("/generate", json=GENERATE, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        worker.state.token = None
        loop.close()


def worker_state(w: InProcessWorker) -> tuple[Any, ...]:
    return w.state.weight_version, w.state.lifecycle, w.state.num_open_generates, w.engine.num_in_flight


GENERATE = {
    "input_ids": [1, 5, 6, 7],
    "rid": "fz",
    "return_logprob": True,
    "stream": False,
    "incremental_stream": False,
    "sampling_params": {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "n": 2,
        "seed": 3,
        "skip_special_tokens": True,
    },
}
FROM_DISK = {
    "model_path": "/nonexistent/polyrl-model",
    "weight_version": 5,
    "load_format": "auto",
    "abort_all_requests": False,
}
FROM_PUBLISHER = {
    "host": "127.0.0.1",
    "port": 9,
    "weight_version": 5,
    "token": "t",
    "worker_id": "w-test",
    "num_streams": 2,
    "timeout_s": 1.0,
    "codec": "raw",
}


def _tame_generate(body: Any) -> Any:
    try:
        request = GenerateRequest.model_validate(body)
    except ValidationError:
        return body
    wanted = request.sampling_params.max_new_tokens
    if MAX_FUZZ_TOKENS < wanted < CONTEXT:  # beyond the context it is refused: keep that
        body["sampling_params"] = dict(body.get("sampling_params", {}), max_new_tokens=MAX_FUZZ_TOKENS)
    return body


def _tame_publisher(body: Any) -> Any:
    """A pull that would start goes to a closed local port, quickly refused."""
    try:
        UpdateWeightsFromPublisherRequest.model_validate(body)
    except ValidationError:
        return body
    return body | {"host": "127.0.0.1", "port": free_port(), "timeout_s": 1.0}


WORKER_POSTS = {
    "generate": ("/generate", GENERATE, _tame_generate),
    "abort_request": ("/abort_request", {"rid": "nothing-running"}, lambda body: body),
    "update_weights_from_disk": ("/update_weights_from_disk", FROM_DISK, lambda body: body),
    "update_weights_from_publisher": ("/update_weights_from_publisher", FROM_PUBLISHER, _tame_publisher),
}


@pytest.mark.parametrize("endpoint", list(WORKER_POSTS))
def test_worker_endpoint_fuzz(endpoint: str, worker: InProcessWorker, worker_client: AsgiClient) -> None:
    """Every body gets 2xx or a clear 4xx; the weights, the lifecycle and the engine are
    as before each one; the engine still gives the same greedy answer afterwards."""
    path, valid, tame = WORKER_POSTS[endpoint]
    reference = worker_client.post("/generate", json=greedy(6)).json()["output_ids"]
    before = worker_state(worker)

    def check(body: bytes, content_type: str) -> None:
        response = worker_client.post(path, content=body, headers={"content-type": content_type})
        assert_clear(response)
        assert worker_state(worker) == before

    for edge in edge_sweep(valid):
        check(json.dumps(tame(edge)).encode(), "application/json")
    FUZZ(given(body=bodies(valid, tame), content_type=CONTENT_TYPES)(check))()
    assert worker_client.post("/generate", json=greedy(6)).json()["output_ids"] == reference
    assert worker_client.get("/health_generate").status_code == 200


@pytest.mark.parametrize(
    ("sampling", "needle", "status"),
    [
        ({"top_k": 2**63}, "top_k", 422),
        ({"top_k": 10**30}, "top_k", 422),
        ({"temperature": 1e-40}, "temperature", 400),
        ({"temperature": 1e999}, "temperature", 422),
    ],
)
def test_worker_refuses_sampling_values_the_engine_cannot_run(
    worker: InProcessWorker, worker_client: AsgiClient, sampling: dict[str, Any], needle: str, status: int
) -> None:
    """Regression: top_k >= 2**63 passed validation and overflowed the engine's int64
    tensor, killing the engine loop (every later request: 503 engine_dead); a temperature
    of 1e-40 made logits / temperature overflow, and the NaN log-probs a 500. Values out
    of `SamplingParams`' bounds are refused as it is parsed (422), the rest by the engine
    (400)."""
    body = GenerateRequest.model_validate(greedy(3, return_logprob=True)).model_dump()
    body["sampling_params"] |= sampling
    content = json.dumps(body).replace("Infinity", "1e999").encode()  # 1e999: a JSON number that parses to inf
    response = worker_client.post("/generate", content=content, headers=JSON_TYPE)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]
    assert worker_client.post("/generate", json=greedy(3)).status_code == 200


def test_worker_refuses_a_huge_n_before_allocating_for_it(
    worker_client: AsgiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: /generate built one result object per requested sample before the
    engine refused n, so n = 10**7 held the event loop (no other client answered) for
    ~20 s before its 400, and a larger n exhausted memory."""
    import polyrl.worker.protocol as protocol_module  # `WireSamples` builds the results

    made: list[int] = []

    def counting(*args: Any) -> Any:
        made.append(1)
        return SampleResult(*args)

    monkeypatch.setattr(protocol_module, "SampleResult", counting)
    response = worker_client.post("/generate", json=greedy(2, sampling={"n": 4000}))  # > the engine's max_num_seqs
    assert response.status_code == 400 and "n must be in" in response.json()["error"]["message"]
    response = worker_client.post("/generate", json=greedy(2, sampling={"n": 10**6}))  # > any group
    assert response.status_code == 422 and "sampling_params.n" in response.json()["error"]["message"]
    assert made == []
    assert worker_client.post("/generate", json=greedy(2, sampling={"n": 3})).status_code == 200
    assert len(made) == 3


# ----------------------------------------------------------------- data plane: parsers fuzz


@st.composite
def forged_requests(draw: st.DrawFn) -> bytes:
    """A well-formed request with some bytes overwritten, cut short, or a length field
    claiming far more than follows."""
    data = bytearray(encode_request(draw(st.sampled_from([OP_DESCRIBE, OP_CHUNKS, *ENCODED_OPS])), 1, "w1", "ab" * 32))
    how = draw(st.sampled_from(["overwrite", "truncate", "long-field"]))
    if how == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        patch = draw(st.binary(min_size=1, max_size=8))
        data[at : at + len(patch)] = patch
    elif how == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    else:
        worker_len_at = 6 + 21  # MAGIC, then op:u8 version:i64 base:i64 stream:u16 num_streams:u16
        data[worker_len_at : worker_len_at + 2] = b"\xff\xff"
    return bytes(data)


@FUZZ_PARSERS
@given(data=st.one_of(st.binary(max_size=120), forged_requests()))
def test_request_parser_refuses_garbage_cleanly(data: bytes) -> None:
    """The publisher's side: whatever arrives, read_request returns a request it can
    serve, or raises ValueError (malformed) or TransferError (the peer hung up early)."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        try:
            req = read_request(b, timeout_s=5)
        except (ValueError, TransferError):
            return
    assert req.op in KNOWN_OPS and 0 <= req.stream < req.num_streams


@FUZZ_PARSERS
@given(data=st.binary(max_size=64))
def test_reply_parser_refuses_garbage_cleanly(data: bytes) -> None:
    """The receiver's side: a reply's length field is checked before anything is
    allocated for it (a forged 4 GiB length is refused, not awaited)."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        try:
            status, text = read_reply_text(b)
        except TransferError:
            return
    assert 0 <= status <= 255 and len(text) == int.from_bytes(data[1:5], "big")


def _description(version: int = 1) -> tuple[dict[str, Any], torch.Tensor]:
    """A true description of `weights()` as `version`, and the buffer it describes."""
    buffer, manifest = flatten(weights(), version)
    sums = chunk_checksums(memoryview(buffer.numpy()).cast("B"), CHUNK)
    info = TransferInfo(
        manifest=manifest, chunk_bytes=CHUNK, chunk_checksums=sums, buffer_checksum=combined_checksum(sums)
    )
    return info.model_dump(), buffer


@FUZZ_PARSERS
@given(
    text=st.one_of(
        st.binary(max_size=80),
        JSON.map(lambda v: json.dumps(v).encode()),
        almost_valid(_description()[0]).map(lambda v: json.dumps(v).encode()),
    )
)
def test_description_parser_refuses_garbage_cleanly(text: bytes) -> None:
    """A version description either raises TransferError or describes a buffer that every
    one of its tensors fits in, so loading it cannot fail halfway (checked on a meta
    tensor: a forged size allocates nothing)."""
    try:
        info = parse_description(text, 1)
    except TransferError:
        return
    buffer = torch.empty(info.manifest.total_bytes, dtype=torch.uint8, device="meta")
    views = unflatten(buffer, info.manifest)
    assert sorted(views) == sorted(t.name for t in info.manifest.tensors)


_BASE, _MANIFEST = flatten(weights(), 1)
_NEW, _ = flatten(weights(2), 2)
_PAYLOADS = {
    "delta": encode_delta(_BASE.numpy(), _NEW.numpy()),
    "zstd": encode_zstd(_NEW.numpy(), 2),
    "int8": encode_int8(_NEW, _MANIFEST),
}


@st.composite
def forged_payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    """(codec, payload): a real payload with its header overwritten or cut, or garbage."""
    codec = draw(st.sampled_from(sorted(_PAYLOADS)))
    data = bytearray(_PAYLOADS[codec])
    how = draw(st.sampled_from(["overwrite", "truncate", "garbage"]))
    if how == "garbage":
        return codec, draw(st.binary(max_size=100))
    if how == "truncate":
        return codec, bytes(data[: draw(st.integers(0, len(data) - 1))])
    at = draw(st.integers(0, 40))  # the headers: magic, sizes, counts
    edges = st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff", b"\x01"])  # length fields at their extremes
    patch = draw(edges | st.binary(min_size=1, max_size=8))
    data[at : at + len(patch)] = patch
    return codec, bytes(data)


@FUZZ_PARSERS
@given(forged=forged_payloads())
def test_payload_decoders_refuse_garbage_cleanly(forged: tuple[str, bytes]) -> None:
    """delta, zstd and int8 payloads: ValueError on anything that does not decode to the
    right size, and no allocation sized by a forged header field."""
    codec, payload = forged
    out = torch.empty_like(_NEW)
    tracemalloc.start()
    try:
        if codec == "delta":
            apply_delta(_BASE.numpy(), payload, out.numpy())
        elif codec == "zstd":
            decode_zstd(payload, out.numpy())
        else:
            decode_int8(payload, _MANIFEST, out)
    except ValueError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 * _NEW.numel() + 2**20, f"{peak} bytes allocated for a {_NEW.numel()}-byte buffer"


def test_delta_with_a_forged_count_is_refused_without_allocating() -> None:
    """Regression: the number of changed words came from the header unchecked and sized
    the decompression buffer: MemoryError (or an OverflowError) instead of ValueError,
    or gigabytes allocated where the host had them."""
    import struct

    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False)  # no size in the frame: the header's count rules
    gaps, values = frame.compress(b"\x01\x00\x00\x00"), frame.compress(b"\x05\x00")
    base = np.zeros(4096, np.uint8)
    for count in (2**33, 2**40, 2**61):
        payload = struct.pack("!4sQQQQ", b"PRD1", 2048, count, len(gaps), len(values)) + gaps + values
        with pytest.raises(ValueError, match="changed words"):
            apply_delta(base, payload, np.empty_like(base))


# ------------------------------------------------------------ data plane: live publisher


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=2, handshake_timeout_s=0.5) as pub:
        yield pub


def test_token_replayed_after_its_version_is_retired(publisher: WeightPublisher) -> None:
    """A token is good for one worker and one version while that version is held; replayed
    later, or forged to look like one, it is refused and the next honest pull works."""
    for v in (1, 2):
        publisher.publish(weights(v), v)
    old = source(publisher, 1)
    pull(old, 1)
    publisher.publish(weights(3), 3)  # keep_versions=2: v1 is retired
    with pytest.raises(TransferError, match=r"version 1 is not held"):
        pull(old, 1)
    for version in (2, 3):  # the old token for a held version
        with pytest.raises(TransferError, match="bad transfer token"):
            pull(PullSource(*publisher.address, "w1", old.token), version)
    forged = PullSource(*publisher.address, "w1", "0" * len(old.token))
    with pytest.raises(TransferError, match="bad transfer token"):
        pull(forged, 3)
    got = pull(source(publisher, 3), 3, num_streams=3)
    assert_same(unflatten(got.buffer, got.manifest), weights(3))


def test_forged_request_headers_end_the_connection_and_nothing_else(publisher: WeightPublisher) -> None:
    """Regression: a request cut short (its worker-id length promising 65535 bytes that
    never come) raised TransferError out of the publisher's handler, which socketserver
    printed as a traceback; now every malformed request ends its own connection quietly,
    and the publisher process serves on."""
    publisher.publish(weights(), 1)
    good = encode_request(OP_DESCRIBE, 1, "w1", publisher.grant("w1", 1))
    forged = [
        b"GET / HTTP/1.1\r\n\r\n",  # not our protocol
        good[:6] + bytes([9]) + good[7:],  # unknown op
        good[:27] + b"\xff\xff" + b"w1",  # worker id length 65535, then the sender hangs up
        encode_request(OP_CHUNKS, 1, "w1", publisher.grant("w1", 1), stream=3, num_streams=2),
        encode_request(OP_CHUNKS, 1, "w1", publisher.grant("w1", 1), stream=0, num_streams=0),
        good[:6] + b"\xfe" * 30,  # absurd version and stream counts, then a cut
    ]
    pid = publisher.pid
    for data in forged:
        with socket.create_connection(publisher.address, timeout=5) as sock:
            sock.sendall(data)
            try:
                sock.shutdown(socket.SHUT_WR)
                reply = sock.recv(65536)
            except OSError:  # the publisher refused and closed first: no reply at all
                reply = b""
            assert not reply.startswith(bytes([STATUS_OK])), data
    assert publisher.pid == pid and publisher.restarts == 0
    got = pull(source(publisher, 1), 1, num_streams=2)
    assert_same(unflatten(got.buffer, got.manifest), weights())


class _Forger(socketserver.ThreadingTCPServer):
    """A publisher that answers DESCRIBE with `description` and serves the chunks of
    `chunks_of` (another version's buffer: replayed chunks)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, description: bytes, chunks_of: memoryview | None = None) -> None:
        self.description, self.chunks_of = description, chunks_of
        super().__init__(("127.0.0.1", 0), _ForgerHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __exit__(self, *exc: object) -> None:  # socketserver's own only closes the socket
        self.shutdown()
        self.server_close()


class _ForgerHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Forger = self.server  # type: ignore[assignment]
        req = read_request(self.request)
        if req.op == OP_DESCRIBE:
            send_text(self.request, STATUS_OK, server.description)
            return
        assert server.chunks_of is not None
        self.request.sendall(bytes([STATUS_OK]))
        info = json.loads(server.description)
        size = info["chunk_bytes"]
        for index in range(req.stream, len(info["chunk_checksums"]), req.num_streams):  # a fixed deal
            self.request.sendall(CHUNK_INDEX.pack(index) + server.chunks_of[index * size : (index + 1) * size])
        self.request.sendall(CHUNK_INDEX.pack(CHUNKS_END))


def _set(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """Set fields of a description, addressed like `manifest.tensors.0.shape`."""

    def mutate(info: dict[str, Any]) -> None:
        for path, value in changes.items():
            *parents, last = path.split("__")
            target: Any = info
            for part in parents:
                target = target[int(part)] if part.isdigit() else target[part]
            target[int(last) if last.isdigit() else last] = value

    return mutate


@contextlib.contextmanager
def forger_of(mutate: Callable[[dict[str, Any]], None]) -> Iterator[int]:
    """A publisher serving a forged description of v1 but the true chunks (so a forgery
    that passed the description would load); yields its port."""
    info, buffer = _description()
    mutate(info)
    with _Forger(json.dumps(info).encode(), chunks_of=memoryview(buffer.numpy()).cast("B")) as evil:
        yield evil.server_address[1]


FORGED_DESCRIPTIONS = [
    pytest.param(_set(manifest__total_bytes=-5, chunk_checksums=[]), id="negative-size"),
    pytest.param(_set(manifest__total_bytes=2**50, chunk_bytes=2**50, chunk_checksums=[1]), id="petabyte"),
    pytest.param(_set(manifest__total_bytes=10**30, chunk_bytes=10**30, chunk_checksums=[1]), id="beyond-int64"),
    pytest.param(_set(manifest__tensors__0__shape=[-64, -33]), id="negative-shape"),
    pytest.param(_set(manifest__tensors__1__offset=-64), id="negative-offset"),
    pytest.param(_set(manifest__tensors__1__offset=4225), id="unaligned-offset"),
    pytest.param(_set(manifest__tensors__2__dtype="complex128"), id="unknown-dtype"),
    pytest.param(_set(manifest__tensors__2__name="a.weight"), id="duplicate-name"),
    pytest.param(_set(manifest__tensors__0__nbytes=10**9), id="entry-past-the-end"),
]


@pytest.mark.parametrize("mutate", FORGED_DESCRIPTIONS)
def test_forged_descriptions_are_transfer_errors(mutate: Callable[[dict[str, Any]], None]) -> None:
    """Regression: a description whose manifest was negative, misaligned, or bigger than
    memory reached torch (RuntimeError) or the loader (ValueError) instead of ending the
    pull with TransferError; the worker answered those with a 500."""
    with forger_of(mutate) as port, pytest.raises(TransferError, match="description|allocate"):
        pull(PullSource("127.0.0.1", port, "w1", "t"), 1, num_streams=2)


def test_replayed_chunks_of_another_version_are_rejected(publisher: WeightPublisher) -> None:
    """A publisher (or a man in the middle) that sends v1's bytes under v2's description:
    every chunk is checked as it lands."""
    publisher.publish(weights(1), 1)
    info = publisher.publish(weights(2), 2)
    old = pull(source(publisher, 1), 1).buffer
    evil = _Forger(info.model_dump_json().encode(), chunks_of=memoryview(old.numpy()).cast("B"))
    with evil, pytest.raises(TransferError, match="chunk 0 .* failed its checksum"):
        pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "t"), 2, num_streams=1)
    got = pull(source(publisher, 2), 2)
    assert_same(unflatten(got.buffer, got.manifest), weights(2))


@pytest.mark.parametrize("mutate", FORGED_DESCRIPTIONS)
def test_worker_refuses_forged_weights_and_keeps_its_own(
    worker: InProcessWorker, worker_client: AsgiClient, mutate: Callable[[dict[str, Any]], None]
) -> None:
    """The same forgeries sent to a worker: a 400 naming the transfer, and its weights as
    they were (before the fixes, several were 500s)."""
    with forger_of(mutate) as port:
        body = FROM_PUBLISHER | {"port": port, "weight_version": 1}
        response = worker_client.post("/update_weights_from_publisher", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "transfer_failed" and response.json()["success"] is False
    assert worker.state.weight_version == 0


# ----------------------------------------------------------------------- slow-drip clients


def test_publisher_closes_a_silent_connection() -> None:
    """A connection that never sends its request is closed after the handshake timeout
    (before: after the 30 s per-read timeout meant for data)."""
    with WeightPublisher(handshake_timeout_s=0.5) as pub, socket.create_connection(pub.address) as sock:
        sock.settimeout(10)
        start = time.monotonic()
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - start < 5


def test_publisher_drops_a_dripping_client_and_serves_others(publisher: WeightPublisher) -> None:
    """Regression: the publisher's timeout was per read, so a client sending its request
    one byte every 0.1 s held its connection (and a thread) for as long as it liked; now
    the whole request must arrive within the handshake timeout."""
    publisher.publish(weights(), 1)
    request = encode_request(OP_DESCRIBE, 1, "w1", publisher.grant("w1", 1))
    drip = Dripper(publisher.address, request, interval_s=0.1)  # ~10 s for the whole request
    try:
        got = pull(source(publisher, 1), 1, num_streams=2)  # meanwhile, an honest pull
        assert_same(unflatten(got.buffer, got.manifest), weights())
        _wait_until(lambda: drip.closed_after_s is not None, 5, "the publisher to drop the dripping client")
        assert drip.received == b"" and drip.num_sent < len(request)
    finally:
        drip.stop()


def _drip_http(url: str, path: str, body: bytes, num_clients: int) -> list[Dripper]:
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    drips = [Dripper((host, int(port)), request, interval_s=0.2) for _ in range(num_clients)]
    _wait_until(lambda: all(d.num_sent >= 3 for d in drips), 10, "the drips to start")
    return drips


def test_dripping_clients_do_not_hold_up_the_manager() -> None:
    """20 clients each sending a request one byte every 0.2 s: the manager's other
    clients are served at once meanwhile, and nothing the drips asked for happens.

    uvicorn bounds neither the time a request may take to arrive (its keep-alive timeout
    only runs between requests) nor the number of connections doing that: one async
    server is not held up by slow clients, but enough of them would use up its file
    descriptors. The services bound both (`polyrl.serving.GuardedProtocol`; the drips
    here stay within `http.header_timeout_s`): tests/test_tls.py checks they are closed."""
    with hostile_manager() as mt:
        drips = _drip_http(mt.url, "/v1/weights/version", b'{"version": 7}', num_clients=20)
        try:
            start = time.monotonic()
            assert httpx.get(f"{mt.url}/health", timeout=5).status_code == 200
            published = httpx.post(f"{mt.url}/v1/weights/version", json={"version": 1}, headers=AUTH, timeout=5)
            assert published.status_code == 200
            assert time.monotonic() - start < 3
            assert all(d.closed_after_s is None for d in drips)  # all still open meanwhile, or this proves nothing
        finally:
            for d in drips:
                d.stop()
        assert mt.call(lambda: mt.manager.registry.latest_version) == 1


def test_dripping_clients_do_not_hold_up_the_worker(worker: InProcessWorker) -> None:
    """The same on the worker: 10 dripping /generate calls, and an honest one is served."""
    drips = _drip_http(worker.http.url, "/generate", json.dumps(greedy(2)).encode(), num_clients=10)
    try:
        start = time.monotonic()
        response = worker.client.post("/generate", json=greedy(3))
        assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] >= 1
        assert time.monotonic() - start < 5
    finally:
        for d in drips:
            d.stop()
    assert worker_state(worker)[2:] == (0, 0)


# ------------------------------------------------- OpenAI- and vLLM-compatible endpoints


def inference_posts(model: str) -> dict[str, tuple[str, dict[str, Any], type[BaseModel]]]:
    """Valid bodies of the OpenAI/vLLM endpoints, every field they take set."""
    completion = {
        "model": model,
        "prompt": "1+2=",
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "seed": 3,
        "stop": ["="],
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": False,
    }
    chat = {
        "model": model,
        "messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2"}],
        "max_completion_tokens": 4,
        "n": 2,
        "temperature": 0.7,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": "x",
        "seed": 1,
        "stream": False,
    }
    vllm = {
        "prompt": {"prompt_token_ids": [1, 5, 6]},
        "logprobs": 0,
        "n": 2,
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "min_p": 0.05,
        "seed": 5,
        "stop": ["1"],
    }
    return {
        "completions": ("/v1/completions", completion, CompletionRequest),
        "chat": ("/v1/chat/completions", chat, ChatCompletionRequest),
        "vllm_generate": ("/generate", vllm, VllmGenerateRequest),
    }


def _tame_inference(model_type: type[BaseModel]) -> Callable[[Any], Any]:
    """A body that would be served gets at most MAX_FUZZ_TOKENS new tokens (a missing
    budget means the rest of the context: ~2000 tokens)."""

    def tame(body: Any) -> Any:
        try:
            model_type.model_validate(body)
        except ValidationError:
            return body
        budget = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(budget, int) or MAX_FUZZ_TOKENS < budget < CONTEXT:
            body = {k: v for k, v in body.items() if k != "max_completion_tokens"} | {"max_tokens": MAX_FUZZ_TOKENS}
        return body

    return tame


def _fuzz_inference(
    client: AsgiClient, endpoint: str, model: str, headers: dict[str, str], idle: Callable[[], bool]
) -> None:
    path, valid, model_type = inference_posts(model)[endpoint]
    tame = _tame_inference(model_type)

    def check(body: bytes, content_type: str) -> None:
        response = client.post(path, content=body, headers=headers | {"content-type": content_type})
        assert_clear(response)
        if response.status_code == 200 and b"text/event-stream" in response.headers.get("content-type", "").encode():
            assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, response.text[-500:]
        # nothing left behind, in a moment: the manager's call task gives its worker's slots
        # back in a done-callback, a few loop turns after the reply's last byte
        _wait_until(idle, 10, "nothing left running")

    for edge in edge_sweep(valid):
        check(json.dumps(tame(edge)).encode(), "application/json")
    FUZZ(given(body=bodies(valid, tame), content_type=CONTENT_TYPES)(check))()
    ok = client.post(path, json=tame(valid), headers=headers)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("endpoint", ["completions", "chat", "vllm_generate"])
def test_worker_inference_endpoint_fuzz(endpoint: str, worker: InProcessWorker, worker_client: AsgiClient) -> None:
    """Every body gets 2xx or a clear 4xx (a stream ends with [DONE], no error in it);
    nothing is left running; a valid request is served afterwards."""
    before = worker_state(worker)
    _fuzz_inference(worker_client, endpoint, worker.state.model_path, {}, lambda: worker_state(worker) == before)


@pytest.fixture(scope="module")
def inference_manager(worker: InProcessWorker) -> Iterator[ManagerThread]:
    """A manager whose one worker is the module's in-process worker, registered by hand
    (no heartbeats: the timeout is long)."""
    with hostile_manager(heartbeat_timeout_s=3600.0, batch_deadline_s=60, inference_wait_s=2.0) as mt:
        info = worker.info()
        registration = RegisterRequest(
            worker_id="w-fuzz",
            url=worker.http.url,
            model_path=worker.state.model_path,
            weight_version=0,
            max_num_seqs=info["max_num_seqs"],
            max_model_len=info["max_model_len"],
        )
        response = manager_client(mt).post("/v1/workers/register", json=registration.model_dump(), headers=AUTH)
        assert response.status_code == 200, response.text
        wait_active(mt, "w-fuzz")
        yield mt


@pytest.mark.parametrize("endpoint", ["completions", "chat", "vllm_generate"])
def test_manager_inference_endpoint_fuzz(endpoint: str, inference_manager: ManagerThread) -> None:
    """The same through the manager: no 5xx, no batch or placement left behind."""
    mt = inference_manager
    model = mt.call(lambda: mt.manager.registry.get("w-fuzz").model_path)

    def idle() -> bool:
        m = mt.manager
        return mt.call(lambda: not m.batches and not m.pending and m.registry.get("w-fuzz").inflight == 0)

    _fuzz_inference(manager_client(mt), endpoint, model, AUTH, idle)
