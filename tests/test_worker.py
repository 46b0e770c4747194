"""The rollout worker: wire builders without a server, the HTTP API over a real engine on a
tiny model (uvicorn in a thread, port 0), the manager client against mock transports, and
the process lifecycle (SIGTERM drain, manager refusal, manager outage) in subprocesses
talking to a fake manager defined here."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from chaos_harness.harness import chaos_manager_config
from polyrl.config import EngineConfig, TinyModelConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest, SampleDelta, SampleResult
from polyrl.httpapi import checksum, error_body
from polyrl.manager.main import ManagerThread
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.manager_api import Heartbeat, RegisterRequest
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import GenerateRequest
from polyrl.worker import manager_client
from polyrl.worker.manager_client import ManagerClient, ManagerRejected, ManagerSession, ManagerUnreachable
from polyrl.worker.protocol import engine_request, sample_response, sse_event, text_token_ids
from polyrl.worker.server import create_app
from polyrl.worker.state import WorkerState
from polyrl.worker.stream import Coalesced

HTTP_TIMEOUT_S = 60.0  # generous: the CPU is shared with other work
CONTEXT = 2048
LONG = 1500  # max_new_tokens of requests that must still be running when we act on them
EOS = 2


# ------------------------------------------------------------------------------- fixtures


def _tiny(path: Path, seed: int = 0, hidden_size: int = 64) -> Path:
    cfg = TinyModelConfig(hidden_size=hidden_size, intermediate_size=128, max_position_embeddings=CONTEXT, seed=seed)
    return save_tiny_model(path, cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("worker_model"))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as `model_dir`, other random weights."""
    return _tiny(tmp_path_factory.mktemp("worker_model_b"), seed=1)


class ThreadedServer:
    """uvicorn serving `app` from a background thread on a free port."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class InProcessWorker:
    """A real engine + the worker app, served in a thread; `client` talks to it."""

    def __init__(self, model_path: Path, **engine_kwargs: Any) -> None:
        from transformers import AutoTokenizer

        cfg = EngineConfig(**({"max_num_seqs": 8} | engine_kwargs))
        self.engine = AsyncEngine(Engine.from_pretrained(str(model_path), cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.state = WorkerState(
            self.engine,
            model_path=str(model_path),
            worker_id="w-test",
            tokenizer=self.tokenizer,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
        )
        self.http = ThreadedServer(create_app(self.state))
        self.client = httpx.Client(base_url=self.http.url, timeout=HTTP_TIMEOUT_S)

    def __enter__(self) -> InProcessWorker:
        self.engine.start()
        self.http.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.abort_all()
        self.client.close()
        self.http.__exit__()
        self.engine.shutdown()

    def info(self) -> dict[str, Any]:
        return self.client.get("/get_server_info").json()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not predicate(info := self.info()):
            assert time.monotonic() < deadline, f"condition not reached; server info: {info}"
            time.sleep(0.05)
        return info


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[InProcessWorker]:
    with InProcessWorker(model_dir) as w:
        yield w


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0} | extra.pop("sampling", {})
    return {"input_ids": [1, 5, 6, 7], "sampling_params": sampling} | extra


def long_request(rid: str, stream: bool = False) -> dict[str, Any]:
    return greedy(LONG, rid=rid, stream=stream, sampling={"ignore_eos": True})


def read_sse(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """Parsed `data:` events of an SSE response; "[DONE]" comes as the string. An
    `: xxh3 <hex>` comment (incremental streams) must hash the data line after it."""
    expected = None
    for line in response.iter_lines():
        if not line:
            continue
        if line.startswith(": xxh3 "):
            expected = line.removeprefix(": xxh3 ")
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        if expected is not None:
            assert checksum(payload.encode()) == expected
            expected = None
        yield payload if payload == "[DONE]" else json.loads(payload)


@contextmanager
def engine_waits_once_running(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, rid: str, at: int = 1
) -> Iterator[threading.Event]:
    """`engine` takes no step once `rid` runs with `at` tokens, until the event yielded is
    set (on leaving at the latest); commands (adds, aborts) still run meanwhile, as between
    a slow engine's steps. A test then acts on a request that is certain to be still
    running: on a starved machine (CI, once) a request of `LONG` tokens had run to its end
    before the test looked at it."""
    step = engine.step
    go_on = threading.Event()

    def step_when_told() -> list[SampleDelta]:
        held = any(s.rid == rid and s.num_generated >= at for s in engine.scheduler.running)
        if held and not go_on.wait(timeout=0.01):
            return []  # no step this time: the engine thread goes back to its commands
        return step()

    monkeypatch.setattr(engine, "step", step_when_told)
    try:
        yield go_on
    finally:
        go_on.set()
        monkeypatch.setattr(engine, "step", step)


# ------------------------------------------------------------------ builders, no server


def test_sample_response_shapes_and_stop_trim() -> None:
    result = SampleResult("r1", 2, prompt_tokens=4)
    result.add(SampleDelta("r1", 2, [7, 8], [-0.5, -0.25], [3, 4]))
    result.add(SampleDelta("r1", 2, [EOS], [-0.1], [4], finish_reason="stop", matched_stop=EOS))
    assert text_token_ids(result) == [7, 8]
    full = sample_response(result, "xy", return_logprob=True, current_version=9, with_index=True)
    assert full == {
        "text": "xy",
        "output_ids": [7, 8, EOS],
        "index": 2,
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "stop", "matched": EOS},
            "prompt_tokens": 4,
            "completion_tokens": 3,
            "weight_version": 4,
            "output_token_weight_versions": [3, 4, 4],
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None], [-0.1, EOS, None]],
        },
    }
    plain = sample_response(result, "xy", return_logprob=False, current_version=9, with_index=False)
    assert "index" not in plain and "output_token_logprobs" not in plain["meta_info"]
    running = sample_response(SampleResult("r2", 0, 1), "", return_logprob=False, current_version=9, with_index=False)
    assert running["meta_info"]["finish_reason"] is None and running["meta_info"]["weight_version"] == 9
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


def test_generate_request_validation() -> None:
    req = GenerateRequest.model_validate({"input_ids": [1], "sampling_params": {"top_k": -1, "sampling_seed": 5}})
    sampling = engine_request(req, [1]).sampling
    assert (sampling.top_k, sampling.seed, sampling.max_new_tokens) == (0, 5, 128)
    assert len(engine_request(req, [1]).rid) == 32  # a uuid4 hex when the client sends none
    for bad, needle in [
        ({"input_ids": [[1, 2], [3]]}, "list of lists"),  # `GenerateBatchRequest`'s
        ({"text": ["a", "b"]}, "one request per text"),
        ({"input_ids": [1], "text": "a"}, "exactly one"),
        ({}, "exactly one"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "extra"),
    ]:
        with pytest.raises(ValidationError, match=needle):
            GenerateRequest.model_validate(bad)


def test_coalesce_merges_what_arrived_and_closes_the_source() -> None:
    closed = []

    async def source() -> Any:
        try:
            yield [0]
            await asyncio.sleep(0.02)
            for i in (1, 2, 3):  # three engine steps while the consumer is busy
                yield [i]
            await asyncio.sleep(10)  # still running when the consumer goes away
            yield [4]
        finally:
            closed.append(True)

    async def main() -> list[list[int]]:
        batches = []
        stream = Coalesced(source())
        batches.append(await anext(stream))
        await asyncio.sleep(0.1)  # meanwhile the source produced 1, 2, 3
        batches.append(await anext(stream))
        await stream.aclose()  # a client that goes away
        return batches

    assert asyncio.run(main()) == [[0], [1, 2, 3]]
    assert closed == [True]


# ---------------------------------------------------------------------- HTTP, in process


def test_generate_text_input(worker: InProcessWorker) -> None:
    r = worker.client.post(
        "/generate", json={"text": "abc>", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(worker.tokenizer("abc>")["input_ids"]) == 5  # <bos> + 4 chars
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_weight_versions"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == 0
    trimmed = out["output_ids"][:-1] if meta["finish_reason"]["type"] == "stop" else out["output_ids"]
    assert out["text"] == worker.tokenizer.decode(trimmed)


def test_stream_final_chunk_equals_non_stream(worker: InProcessWorker) -> None:
    body = greedy(12, rid="same", sampling={"ignore_eos": True}, return_logprob=True)
    expected = worker.client.post("/generate", json=body).json()
    with worker.client.stream("POST", "/generate", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(read_sse(r))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    chunks: list[dict[str, Any]] = events[:-1]  # type: ignore[assignment]
    for earlier, later in zip(chunks, chunks[1:]):  # cumulative snapshots
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.pop("index") == 0
    assert final["output_ids"] == expected["output_ids"] and len(final["output_ids"]) == 12
    streamed_lps = [lp for lp, _, _ in final["meta_info"].pop("output_token_logprobs")]
    expected_lps = [lp for lp, _, _ in expected["meta_info"].pop("output_token_logprobs")]
    assert streamed_lps == pytest.approx(expected_lps, abs=1e-5)  # batching may change the last bits
    assert final == expected


def test_incremental_stream_chunks_add_up_to_the_full_answer(worker: InProcessWorker) -> None:
    body = {
        "input_ids": [1, 5],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 9, "n": 2, "seed": 3, "ignore_eos": True},
    }
    expected = {r["index"]: r for r in worker.client.post("/generate", json=body).json()}
    with worker.client.stream("POST", "/generate", json=body | {"stream": True, "incremental_stream": True}) as r:
        events = list(read_sse(r))
    assert events[-1] == "[DONE]"
    joined: dict[int, dict[str, list[Any]]] = {0: {"ids": [], "lps": [], "vs": []}, 1: {"ids": [], "lps": [], "vs": []}}
    for chunk in events[:-1]:
        acc, meta = joined[chunk["index"]], chunk["meta_info"]
        acc["ids"] += chunk["output_ids"]
        acc["lps"] += [lp for lp, _, _ in meta["output_token_logprobs"]]
        acc["vs"] += meta["output_token_weight_versions"]
        assert meta["completion_tokens"] == len(acc["ids"])  # the running total
    assert sum(len(c["output_ids"]) for c in events[:-1]) == 18  # nothing sent twice
    for i, acc in joined.items():
        assert acc["ids"] == expected[i]["output_ids"]
        want = [lp for lp, _, _ in expected[i]["meta_info"]["output_token_logprobs"]]
        assert acc["lps"] == pytest.approx(want, abs=1e-5)
        assert acc["vs"] == [0] * 9


def test_stream_interval_sends_fewer_bigger_chunks(worker: InProcessWorker) -> None:
    """With `stream_interval_s` a chunk covers every engine step since the last one: the
    same tokens arrive, in about elapsed / interval chunks instead of one per step."""
    body = {
        "input_ids": [1, 5],
        "sampling_params": {"max_new_tokens": 120, "seed": 3, "ignore_eos": True},
        "stream": True,
        "incremental_stream": True,
    }

    def chunks(interval_s: float) -> tuple[list[dict[str, Any]], float]:
        worker.state.stream_interval_s = interval_s
        t0 = time.monotonic()
        try:
            with worker.client.stream("POST", "/generate", json=body) as r:
                events = list(read_sse(r))
        finally:
            worker.state.stream_interval_s = 0.0
        assert events[-1] == "[DONE]"
        return events[:-1], time.monotonic() - t0

    every_step, _ = chunks(0.0)
    spaced, elapsed = chunks(0.1)
    ids = lambda events: [t for e in events for t in e["output_ids"]]  # noqa: E731
    assert ids(spaced) == ids(every_step) and len(ids(spaced)) == 120
    assert len(spaced) <= elapsed / 0.1 + 2, (len(spaced), elapsed)
    assert len(spaced) < len(every_step) / 2, (len(spaced), len(every_step))


def test_request_stream_interval_spaces_chunks_but_not_the_finish(worker: InProcessWorker) -> None:
    """The manager's `stream_interval_s` (in the request) applies like the worker's own;
    a sample that finishes is sent at once, not at the end of the interval."""
    body = {
        "input_ids": [1, 5],
        "sampling_params": {"max_new_tokens": 40, "seed": 3, "ignore_eos": True, "n": 2},
        "stream": True,
        "incremental_stream": True,
        "stream_interval_s": 5.0,
    }
    t0 = time.monotonic()
    with worker.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        events = list(read_sse(r))
    elapsed = time.monotonic() - t0
    assert events[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = events[:-1]  # type: ignore[assignment]
    assert elapsed < 4.0, elapsed  # not held until the 5 s interval ends
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert sum(len(c["output_ids"]) for c in mine) == 40
        assert len(mine) <= 3, len(mine)  # the first step, maybe a finish of the other sample, its own finish
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_n_samples_with_logprobs(worker: InProcessWorker) -> None:
    body = {"input_ids": [1, 5], "return_logprob": True, "sampling_params": {"max_new_tokens": 5, "n": 3, "seed": 11}}
    r = worker.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    samples = r.json()
    assert [s["index"] for s in samples] == [0, 1, 2]
    assert len({s["meta_info"]["id"] for s in samples}) == 1
    for s in samples:
        logprobs = s["meta_info"]["output_token_logprobs"]
        assert len(logprobs) == s["meta_info"]["completion_tokens"] == len(s["output_ids"])
        assert [tok for _, tok, _ in logprobs] == s["output_ids"]
        assert all(lp <= 0 and text is None for lp, _, text in logprobs)
    again = worker.client.post("/generate", json=body).json()
    assert [s["output_ids"] for s in again] == [s["output_ids"] for s in samples]  # seeded


BAD_REQUESTS = [
    pytest.param(b'{"input_ids": [1, 2', 422, "invalid JSON", id="invalid-json"),
    pytest.param({"input_ids": [1, 2], "foo": 1}, 422, "foo: unknown field", id="unknown-field"),
    pytest.param(
        greedy(4, sampling={"temprature": 0.5}), 422, "sampling_params.temprature: unknown field", id="unknown-nested"
    ),
    pytest.param({"input_ids": "1 2 3"}, 422, "input_ids", id="wrong-type"),
    pytest.param(
        greedy(4, sampling={"temperature": "hot"}), 422, "sampling_params.temperature", id="wrong-type-nested"
    ),
    pytest.param(greedy(0), 422, "max_new_tokens", id="max-new-tokens-zero"),
    pytest.param(greedy(CONTEXT), 400, "exceeds the context length", id="beyond-context"),
    pytest.param({"input_ids": [1, 10_000]}, 400, "outside the vocabulary", id="id-outside-vocab"),
    pytest.param({"input_ids": []}, 400, "empty", id="empty-prompt"),
    pytest.param({"text": ["ab", "cd"]}, 422, "one request per text", id="batched-text"),
    pytest.param({"input_ids": [[1, 2], [3, 4]], "rid": ["a", "a"]}, 422, "distinct ids", id="batched-same-rid"),
    pytest.param({"input_ids": [[1, 2], []]}, 400, "empty", id="batched-empty-prompt"),
    pytest.param({"input_ids": [1], "text": "a"}, 422, "exactly one of input_ids and text", id="both-inputs"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_REQUESTS)
def test_bad_request_is_refused_and_the_next_one_served(
    worker: InProcessWorker, body: Any, status: int, needle: str
) -> None:
    if isinstance(body, bytes):
        r = worker.client.post("/generate", content=body, headers={"content-type": "application/json"})
    else:
        r = worker.client.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    ok = worker.client.post("/generate", json=greedy(2))
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1


def test_abort_request_returns_partial_stream(worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine_waits_once_running(worker.engine.engine, monkeypatch, "to-abort") as go_on:
        with worker.client.stream("POST", "/generate", json=long_request("to-abort", stream=True)) as r:
            events = read_sse(r)
            first = next(events)
            assert isinstance(first, dict) and first["meta_info"]["finish_reason"] is None
            aborted = worker.client.post("/abort_request", json={"rid": "to-abort"})
            go_on.set()
            assert aborted.status_code == 200 and aborted.json() == {"num_aborted": 1}
            rest = list(events)
    assert rest[-1] == "[DONE]"
    final = rest[-2] if len(rest) > 1 else first
    assert final["meta_info"]["finish_reason"] == {"type": "abort", "matched": None}
    assert 0 < final["meta_info"]["completion_tokens"] < LONG
    assert worker.client.post("/abort_request", json={"rid": "to-abort"}).json() == {"num_aborted": 0}
    assert worker.client.post("/abort_request", json={}).status_code == 422


def _batch(*prompts: tuple[list[int], int], stream: bool = True, **extra: Any) -> dict[str, Any]:
    """A batched /generate of (input_ids, n) prompts, seeded, each with its own rid."""
    return {
        "input_ids": [ids for ids, _ in prompts],
        "rid": [f"b{k}" for k in range(len(prompts))],
        "sampling_params": [{"max_new_tokens": 6, "n": n, "sampling_seed": 7 + k} for k, (_, n) in enumerate(prompts)],
        "return_logprob": True,
        "stream": stream,
        "incremental_stream": stream,
    } | extra


def _alone(worker: InProcessWorker, ids: list[int], n: int, seed: int) -> list[list[int]]:
    """The prompt's samples as a request of its own."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "n": n, "sampling_seed": seed}}
    reply = worker.client.post("/generate", json=body).json()
    return [s["output_ids"] for s in (reply if isinstance(reply, list) else [reply])]


def test_batched_generate_numbers_samples_across_prompts_and_equals_separate_requests(
    worker: InProcessWorker,
) -> None:
    """SGLang's batched form: sample j of prompt k is index n_0 + .. + n_(k-1) + j, its
    meta id is prompt k's rid, and each prompt samples what it would alone (same seed)."""
    prompts = [([1, 5, 6], 2), ([1, 9], 1), ([1, 7, 7, 7], 3)]
    streamed: dict[int, list[int]] = {}
    ids_of: dict[int, str] = {}
    with worker.client.stream("POST", "/generate", json=_batch(*prompts)) as r:
        assert r.status_code == 200
        events = list(read_sse(r))
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        assert isinstance(e, dict)
        streamed.setdefault(e["index"], []).extend(e["output_ids"])
        ids_of[e["index"]] = e["meta_info"]["id"]
    assert sorted(streamed) == list(range(6))
    assert [ids_of[i] for i in range(6)] == ["b0", "b0", "b1", "b2", "b2", "b2"]
    expected = [s for k, (ids, n) in enumerate(prompts) for s in _alone(worker, ids, n, 7 + k)]
    assert [streamed[i] for i in range(6)] == expected
    reply = worker.client.post("/generate", json=_batch(*prompts, stream=False)).json()
    assert [(s["index"], s["meta_info"]["id"]) for s in reply] == [(i, ids_of[i]) for i in range(6)]
    assert [s["output_ids"] for s in reply] == expected


def test_a_refused_prompt_of_a_batched_stream_is_an_error_event_and_the_others_run(worker: InProcessWorker) -> None:
    body = _batch(([1, 5, 6], 1), ([1, 10_000], 1), ([1, 9], 2))
    with worker.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = list(read_sse(r))
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["rid"] == "b1" and errors[0]["error"]["code"] == "400"
    assert "outside the vocabulary" in errors[0]["error"]["message"]
    finished = {
        e["index"] for e in events if isinstance(e, dict) and "error" not in e and e["meta_info"]["finish_reason"]
    }
    assert finished == {0, 2, 3}  # prompt 1 keeps its number (1) and gets none
    everything_refused = _batch(([1, 10_000], 1), ([], 1))
    r = worker.client.post("/generate", json=everything_refused)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = worker.client.post("/generate", json=_batch(([1, 5], 1), ([1, 10_000], 1), stream=False))
    assert r.status_code == 400  # a plain reply has no place for one prompt's refusal
    worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)


def test_abort_stops_one_prompt_of_a_batched_request(worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    body = _batch(([1, 5, 6], 1), ([1, 9], 1))
    body["sampling_params"] = [
        {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0.0},
        {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0},
    ]
    finish: dict[int, str] = {}
    tokens: dict[int, int] = {}
    with engine_waits_once_running(worker.engine.engine, monkeypatch, "b0") as go_on:
        with worker.client.stream("POST", "/generate", json=body) as r:
            for e in read_sse(r):
                if e == "[DONE]":
                    break
                assert isinstance(e, dict)
                tokens[e["index"]] = tokens.get(e["index"], 0) + len(e["output_ids"])
                if e["index"] == 0 and "aborted" not in finish:
                    finish["aborted"] = "asked"
                    assert worker.client.post("/abort_request", json={"rid": "b0"}).json() == {"num_aborted": 1}
                    go_on.set()
                if e["meta_info"]["finish_reason"]:
                    finish[e["index"]] = e["meta_info"]["finish_reason"]["type"]
    assert finish[0] == "abort" and tokens[0] < LONG
    assert finish[1] == "length" and tokens[1] == 40  # the other prompt ran to its end


def test_client_disconnect_aborts(worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)
    before = worker.info()["num_generated_tokens"]
    with engine_waits_once_running(worker.engine.engine, monkeypatch, "gone-stream") as go_on:
        with worker.client.stream("POST", "/generate", json=long_request("gone-stream", stream=True)) as r:
            next(read_sse(r))  # running; now hang up
            held = worker.info()
            go_on.set()
    assert held["num_running_reqs"] == 1 and 0 < held["kv_cache_usage"] <= 1  # its blocks were held
    with httpx.Client(base_url=worker.http.url, timeout=httpx.Timeout(5.0, read=1.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json=long_request("gone-plain"))
    info = worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)
    assert info["num_generated_tokens"] - before < 2 * LONG  # both stopped early
    assert info["num_prompt_tokens"] > 0 and 0 < info["num_prefill_steps"] < info["num_steps"]


def test_info_health_and_model_info(worker: InProcessWorker, model_dir: Path) -> None:
    assert worker.client.get("/health").status_code == 200
    assert worker.client.get("/health_generate").status_code == 200
    assert worker.client.get("/get_model_info").json() == {"model_path": str(model_dir), "is_generation": True}
    info = worker.info()
    assert info["worker_id"] == "w-test" and info["state"] == "active" and info["max_model_len"] == CONTEXT
    assert info["model_path"] == str(model_dir) and info["weight_version"] == 0
    assert info["max_total_num_tokens"] > 0 and info["gen_throughput"] >= 0
    assert 0 <= info["kv_cache_usage"] <= 1
    assert 0 <= info["num_prefill_steps"] <= info["num_steps"] and info["num_prompt_tokens"] >= 0
    assert {"num_running_reqs", "num_queued_reqs"} <= info.keys()
    assert worker.client.get("/no_such_endpoint").json()["error"]["type"] == "http_error"


def test_engine_full_gives_429(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        InProcessWorker(model_dir, max_num_seqs=1, max_queued_requests=1) as w,
        engine_waits_once_running(w.engine.engine, monkeypatch, "a"),  # "a" runs and "b" waits until both are aborted
    ):
        results: dict[str, httpx.Response] = {}

        def post(rid: str) -> None:
            results[rid] = w.client.post("/generate", json=long_request(rid))

        threads = [threading.Thread(target=post, args=(rid,)) for rid in ("a", "b")]
        threads[0].start()
        w.wait_for(lambda i: i["num_running_reqs"] == 1)
        threads[1].start()
        w.wait_for(lambda i: i["num_queued_reqs"] == 1)
        full = w.client.post("/generate", json=greedy(2))
        assert full.status_code == 429 and full.json()["error"]["type"] == "engine_full"
        assert w.client.post("/abort_request", json={"abort_all": True}).json()["num_aborted"] == 2
        for t in threads:
            t.join(timeout=HTTP_TIMEOUT_S)
        assert {r.json()["meta_info"]["finish_reason"]["type"] for r in results.values()} == {"abort"}
        assert w.client.post("/generate", json=greedy(2)).status_code == 200


def _engine_greedy(path: Path, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference: the engine itself, stepped synchronously on `path`'s weights."""
    engine = Engine.from_pretrained(str(path), EngineConfig(max_num_seqs=1))
    engine.add_request(
        EngineRequest("ref", input_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    )
    result = SampleResult("ref", 0, len(input_ids))
    while engine.has_work:
        for delta in engine.step():
            result.add(delta)
    return result.token_ids, result.logprobs


def _tokens_and_logprobs(response: httpx.Response) -> tuple[list[int], list[float]]:
    out = response.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def test_update_weights_from_disk(model_dir: Path, other_model_dir: Path, tmp_path: Path) -> None:
    # Random tiny models often agree on greedy tokens; their log-probs tell them apart.
    body = greedy(8, sampling={"ignore_eos": True}, return_logprob=True)
    with InProcessWorker(model_dir) as w:
        before = _tokens_and_logprobs(w.client.post("/generate", json=body))
        r = w.client.post("/update_weights_from_disk", json={"model_path": str(other_model_dir), "load_format": "auto"})
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == 1
        response = w.client.post("/generate", json=body)
        tokens, logprobs = _tokens_and_logprobs(response)
        ref_tokens, ref_logprobs = _engine_greedy(other_model_dir, body["input_ids"], 8)
        assert tokens == ref_tokens and logprobs == pytest.approx(ref_logprobs, abs=1e-5)
        assert logprobs != pytest.approx(before[1], abs=1e-3)
        meta = response.json()["meta_info"]
        assert meta["weight_version"] == 1 and set(meta["output_token_weight_versions"]) == {1}
        r = w.client.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": 7})
        assert r.json()["weight_version"] == 7 and w.info()["weight_version"] == 7
        restored = _tokens_and_logprobs(w.client.post("/generate", json=body))
        assert restored[0] == before[0] and restored[1] == pytest.approx(before[1], abs=1e-5)
        for bad_path, needle in [(tmp_path / "missing", "not a directory"), (tmp_path, "no *.safetensors")]:
            r = w.client.post("/update_weights_from_disk", json={"model_path": str(bad_path)})
            assert r.status_code == 400 and r.json()["success"] is False and needle in r.json()["message"]
        narrow = _tiny(tmp_path / "narrow", hidden_size=32)
        r = w.client.post("/update_weights_from_disk", json={"model_path": str(narrow)})
        assert r.status_code == 400 and "shape mismatch" in r.json()["message"]
        assert w.info()["weight_version"] == 7


def test_shutdown_endpoint_drains(model_dir: Path) -> None:
    with InProcessWorker(model_dir) as w:
        assert w.client.post("/shutdown").status_code == 200
        assert w.state.shutdown_requested.is_set() and w.info()["state"] == "draining"
        refused = w.client.post("/generate", json=greedy(2))
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
        assert w.client.get("/health_generate").status_code == 503
        assert w.client.get("/health").status_code == 200


# ------------------------------------------------------------------------------------ CLI


def test_cli_worker_config(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from polyrl.cli import build_parser, main, worker_config

    toml = tmp_path / "worker.toml"
    toml.write_text(f'[model]\npath = "{tmp_path}"\n[worker]\nport = 1234\ntoken = "from-file"\n')
    args = build_parser().parse_args(
        ["worker", "--config", str(toml), "--model", str(model_dir), "--port", "0", "--token", "123", "worker.port=9"]
    )
    cfg = worker_config(args)
    assert (cfg.model.path, cfg.worker.port, cfg.worker.token) == (str(model_dir), 0, "123")  # flags win
    assert main(["worker", "--port", "0"]) == 2
    assert "polyrl tiny-model --out DIR" in capsys.readouterr().err
    assert main(["worker", "--model", str(tmp_path / "missing")]) == 2
    assert main(["worker", "--model", str(model_dir), "worker.nope=1"]) == 2
    assert "worker.nope: unknown key" in capsys.readouterr().err


# ------------------------------------------------------------- manager client, mock network


def _registration() -> RegisterRequest:
    return RegisterRequest(
        worker_id="w1", url="http://w1:1", model_path="m", weight_version=0, max_num_seqs=4, max_model_len=64
    )


def _beat() -> Heartbeat:
    return Heartbeat(state="active", weight_version=0, num_running=0, num_waiting=0, gen_throughput=0.0)


def _session(handler: Callable[[httpx.Request], httpx.Response]) -> ManagerSession:
    client = ManagerClient("http://manager", "tok", 1.0, transport=httpx.MockTransport(handler))
    return ManagerSession(client, _registration, _beat, interval_s=0.01, max_backoff_s=0.01)


def test_manager_register_retries_transient_then_succeeds() -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503)
        return httpx.Response(200, json={"worker_id": "w1-renamed", "heartbeat_interval_s": 0.5})

    session = _session(handler)
    reply = asyncio.run(session.register())
    assert reply.worker_id == session.worker_id == "w1-renamed" and session.interval_s == 0.5
    assert len(calls) == 3 and calls[-1].headers["authorization"] == "Bearer tok"
    assert json.loads(calls[-1].content) == _registration().model_dump()


@pytest.mark.parametrize("status", [401, 403, 422])
def test_manager_refusal_is_fatal(status: int) -> None:
    session = _session(lambda request: httpx.Response(status, text="nope"))
    with pytest.raises(ManagerRejected, match=f"HTTP {status}"):
        asyncio.run(session.register())


def test_manager_heartbeat_404_reregisters_and_outage_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    paths: list[str] = []
    replies = iter([200, 404, 200, "down", "down", "down", 200])

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"worker_id": "w1"})
        reply = next(replies)
        if reply == "down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(reply)

    async def main() -> None:
        session = _session(handler)
        await session.register()
        for _ in range(7):
            await session.beat_once()

    with caplog.at_level(logging.INFO, logger="polyrl.worker.manager_client"):
        asyncio.run(main())
    assert paths.count("/v1/workers/register") == 2  # once at start, once after the 404
    assert paths.count("/v1/workers/w1/heartbeat") == 7
    assert sum("cannot reach the manager at http://manager" in m for m in caplog.messages) == 1
    assert sum("reachable again" in m for m in caplog.messages) == 1


def test_manager_outage_is_logged_periodically_then_given_up(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_client, "RETRY_LOG_INTERVAL_S", 0.1)
    calls: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    session = _session(refuse)
    session.give_up_after_s = 0.5
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="polyrl.worker.manager_client"), pytest.raises(ManagerUnreachable) as err:
        asyncio.run(session.register())
    assert 0.5 <= time.monotonic() - t0 < 2
    assert "http://manager was unreachable for" in str(err.value) and "Connection refused" in str(err.value)
    said = [m for m in caplog.messages if "cannot reach the manager at http://manager" in m]
    assert said[0].endswith("Connection refused; retrying (giving up after 0.5s)")
    assert 3 <= len(said) <= 7 < len(calls)  # every 0.1 s, not on every one of the tries


# ------------------------------------------------------------------- subprocess lifecycle


class FakeManager:
    """Records what workers send; answers register with a short heartbeat interval."""

    def __init__(self, reject_status: int | None = None) -> None:
        self.calls: list[tuple[str, str | None, dict[str, Any]]] = []
        self.reject_status = reject_status
        app = FastAPI()
        app.get("/v1/workers/register")(lambda: {})  # what `polyrl worker` asks before it loads its engine
        app.post("/v1/workers/register")(self._register)
        app.post("/v1/workers/{worker_id}/heartbeat")(self._record)
        app.post("/v1/workers/{worker_id}/leave")(self._record)
        self.http = ThreadedServer(app)

    async def _register(self, request: Request) -> JSONResponse:
        body = await self._record(request)
        if self.reject_status is not None:
            return JSONResponse(error_body("bad token", "unauthorized"), status_code=self.reject_status)
        return JSONResponse({"worker_id": body["worker_id"], "heartbeat_interval_s": 0.2})

    async def _record(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.calls.append((request.url.path.rsplit("/", 1)[-1], request.headers.get("authorization"), body))
        return body

    def seen(self, kind: str) -> list[dict[str, Any]]:
        return [body for k, _, body in self.calls if k == kind]


HELD_ENGINE = """
import os, runpy, time
from polyrl.engine.engine import Engine

step, hold_at, hold_while = Engine.step, int(os.environ["POLYRL_TEST_HOLD_AT"]), os.environ["POLYRL_TEST_HOLD_WHILE"]


def step_unless_held(self):
    s = self.scheduler
    held = s.running and not s.can_admit() and min(seq.num_generated for seq in s.running) >= hold_at
    if held and (not hold_while or os.path.exists(hold_while)):
        time.sleep(0.01)
        return []  # no step: the engine thread goes back to its commands (an abort ends the hold)
    return step(self)


Engine.step = step_unless_held
runpy.run_module("polyrl.cli", run_name="__main__")
"""
"""`python -c HELD_ENGINE worker ...`: `polyrl worker`, its engine held (`WorkerProcess`'s `hold_at`)."""


def held_env(hold_at: int, hold_while: Path | None) -> dict[str, str]:
    """The environment HELD_ENGINE reads its hold from (no `hold_while`: held for good)."""
    return {"POLYRL_TEST_HOLD_AT": str(hold_at), "POLYRL_TEST_HOLD_WHILE": str(hold_while or "")}


def hold_launched_worker(monkeypatch: pytest.MonkeyPatch, worker_id: str, hold_at: int, hold_while: Path) -> None:
    """The run's launched worker `worker_id` (the fleet's `polyrl worker`, started by a
    `train` in this process) runs HELD_ENGINE: while `hold_while` exists, its engine takes
    no step once every running sample has `hold_at` tokens, as `WorkerProcess`'s hold."""
    from polyrl.launch import fleet

    command = fleet.worker_command

    def held(model_dir, manager_url, launched_id, engine, overrides):
        cmd = command(model_dir, manager_url, launched_id, engine, overrides)
        if launched_id == worker_id:
            at = cmd.index("-m")
            cmd[at : at + 2] = ["-c", HELD_ENGINE]
        return cmd

    monkeypatch.setattr(fleet, "worker_command", held)
    for name, value in held_env(hold_at, hold_while).items():
        monkeypatch.setenv(name, value)  # the fleet's workers inherit this process's environment


class WorkerProcess:
    """`polyrl worker` in a subprocess; stdout+stderr lines are collected by a thread.
    With `hold_at`, its engine takes no step once every running sample has that many
    tokens and no waiting one can join them (it still admits requests and runs aborts),
    and with `hold_while` only while that file exists: a test then acts on samples
    certain to be unfinished, however slow the machine (a worker process runs on while a
    starved test process waits for a core)."""

    def __init__(self, model_dir: Path, *args: str, hold_at: int | None = None, hold_while: Path | None = None) -> None:
        # argparse wants the dotted overrides after every flag: callers pass them last.
        cmd = [
            sys.executable,
            *(["-m", "polyrl.cli"] if hold_at is None else ["-c", HELD_ENGINE]),
            "worker",
            "--model",
            str(model_dir),
            "--port",
            "0",
            *args,
            "engine.max_num_seqs=4",
        ]
        env = os.environ | {"POLYRL_TOKEN": ""}
        if hold_at is not None:
            env |= held_env(hold_at, hold_while)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_ready(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "worker died:\n" + "".join(self.output)
                continue
            if " serving on " in line:
                return line.split(" serving on ")[1].strip()
        raise AssertionError("worker not ready:\n" + "".join(self.output))

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """Cleanup after a failed test: never leave a worker running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def text(self) -> str:
        return "".join(self.output)


def _wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _stream_into(url: str, body: dict[str, Any], events: list[Any], token: str = "") -> Callable[[], None]:
    def run() -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with (
            httpx.Client(timeout=HTTP_TIMEOUT_S, headers=headers) as c,
            c.stream("POST", f"{url}/generate", json=body) as r,
        ):
            events.extend(read_sse(r))

    return run


def _post_into(url: str, body: dict[str, Any], responses: list[httpx.Response], token: str = "") -> Callable[[], None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return lambda: responses.append(httpx.post(f"{url}/generate", json=body, headers=headers, timeout=HTTP_TIMEOUT_S))


@pytest.mark.slow
def test_sigterm_drains_hands_back_partial_results_and_leaves(model_dir: Path) -> None:
    manager = FakeManager()
    with manager.http:
        worker = WorkerProcess(
            model_dir,
            "--manager",
            manager.http.url,
            "--token",
            "s3cret",
            "--worker-id",
            "spot-1",
            "worker.drain_timeout_s=2.0",
            hold_at=1,  # both requests are still running when the drain ends, however late the signal
        )
        try:
            url = worker.wait_ready()
            _wait_until(lambda: bool(manager.seen("heartbeat")), 30, "a heartbeat")
            streamed: list[Any] = []
            plain: list[httpx.Response] = []
            # a worker with a manager's token wants it from anyone who makes it act
            assert httpx.post(f"{url}/generate", json=greedy(2), timeout=10).status_code == 401
            assert httpx.post(f"{url}/shutdown", timeout=10).status_code == 401
            threads = [
                _in_thread(_stream_into(url, long_request("s", stream=True), streamed, token="s3cret")),
                _in_thread(_post_into(url, long_request("p"), plain, token="s3cret")),
            ]
            _wait_until(lambda: bool(streamed) and _info(url)["num_running_reqs"] == 2, 60, "both requests running")
            signalled = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            _wait_until(lambda: _info(url)["state"] == "draining", 10, "the draining state")
            refused = httpx.post(
                f"{url}/generate", json=greedy(2), headers={"Authorization": "Bearer s3cret"}, timeout=10
            )
            exit_code = worker.wait_exit(timeout_s=60)
            elapsed_s = time.monotonic() - signalled
        finally:
            worker.kill()
    for thread in threads:
        thread.join(timeout=10)
    assert exit_code == 0, worker.text
    assert elapsed_s < 15, worker.text  # 2 s of drain, then abort, flush, leave
    assert refused.status_code == 503
    assert streamed[-1] == "[DONE]"
    for final in (streamed[-2], plain[0].json()):  # the hand-back: partial tokens, finish "abort"
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < final["meta_info"]["completion_tokens"] < LONG
    assert plain[0].status_code == 200
    [register] = manager.seen("register")
    assert register["worker_id"] == "spot-1" and register["url"] == url and register["protocol_version"] == 1
    assert register["max_model_len"] == CONTEXT and register["max_num_seqs"] == 4
    states = [beat["state"] for beat in manager.seen("heartbeat")]
    assert states[0] == "active" and "draining" in states
    assert [leave["reason"] for leave in manager.seen("leave")] == ["shutdown"]
    assert {auth for _, auth, _ in manager.calls} == {"Bearer s3cret"}


def test_manager_refusal_stops_the_worker(model_dir: Path) -> None:
    """A refusal at registration (the token checked before the engine loaded, then changed)."""
    manager = FakeManager(reject_status=401)
    with manager.http:
        worker = WorkerProcess(model_dir, "--manager", manager.http.url, "--token", "wrong")
        exit_code = worker.wait_exit(timeout_s=120)
    assert exit_code != 0, worker.text
    said = f"the manager at {manager.http.url} refused the registration: bad token (HTTP 401); check worker.token"
    assert said in worker.text, worker.text
    assert len(manager.seen("register")) == 1  # a refusal is not retried


HEAVY = ("torch", "transformers")
"""What `polyrl worker` imports to load its engine: seconds of imports, before minutes of loading."""


def _run_worker_unloaded(model_dir: Path, url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`polyrl worker --manager URL ...` run to its end, output to pipes, and the errors on
    stderr; asserts it never imported the engine's libraries nor said `serving on`."""
    command = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "polyrl.cli",
        "worker",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--manager",
        url,
        *args,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=os.environ | {"POLYRL_TOKEN": ""})
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert not [m for m in imported if m.split(".")[0] in HEAVY], "the engine's imports came first"
    assert "serving on" not in proc.stdout, proc.stdout
    return proc, errors


def test_a_wrong_token_is_one_line_before_the_worker_loads_anything(model_dir: Path) -> None:
    """`polyrl worker --manager URL --token WRONG` (issue 38): the manager is asked first,
    so the refusal comes before the engine's imports, its loading and `serving on`, as one
    line with the manager's message (not its JSON body) and exit code 2."""
    with ManagerThread(chaos_manager_config()) as mt:
        proc, errors = _run_worker_unloaded(model_dir, mt.url, "--token", "wrong")
        assert not mt.worker_list().workers
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + "\n".join(errors)
    assert errors == [
        f"config error: the manager at {mt.url} refused the worker: missing or wrong bearer token (HTTP 401); "
        "check worker.token / POLYRL_TOKEN"
    ]


@pytest.mark.slow
def test_worker_survives_the_manager_going_away(model_dir: Path) -> None:
    manager = FakeManager()
    manager.http.__enter__()
    worker = WorkerProcess(model_dir, "--manager", manager.http.url, "--token", "t")
    try:
        url = worker.wait_ready()
        _wait_until(lambda: bool(manager.seen("heartbeat")), 30, "a heartbeat")
        manager.http.__exit__()  # the manager process dies
        _wait_until(lambda: "cannot reach the manager" in worker.text, 30, "the worker to notice")
        time.sleep(1.5)  # then several heartbeat intervals (0.2 s) without a manager
        assert worker.proc.poll() is None, worker.text
        auth = {"Authorization": "Bearer t"}
        assert httpx.post(f"{url}/generate", json=greedy(3), headers=auth, timeout=HTTP_TIMEOUT_S).status_code == 200
        assert worker.text.count("cannot reach the manager") == 1, worker.text  # one line per outage, not per beat
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.wait_exit(timeout_s=30) == 0, worker.text
    finally:
        worker.kill()
        manager.http.__exit__()


def test_wrong_manager_url_is_said_and_given_up_on(model_dir: Path) -> None:
    """A worker pointed at nothing says so at once, and with worker.manager_timeout_s gives
    up with one line and exit code 1, before it loads its engine (issue 38). Its output
    goes to a pipe, as a launched worker's goes to RUN_DIR/workers/<id>.log: one plain
    line per event, nothing wrapped or padded."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
        proc, errors = _run_worker_unloaded(model_dir, url, "--token", "t", "worker.manager_timeout_s=2")
    assert proc.returncode == 1 and errors == [], proc.stdout + "\n".join(errors)
    said, gave_up = proc.stdout.splitlines()
    assert f"cannot reach the manager at {url}: ConnectError" in said and "retrying (giving up after 2s)" in said
    assert re.search(rf"the manager at {url} was unreachable for [2-9]s \(worker.manager_timeout_s=2\)", gave_up)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR polyrl\.worker\.manager_client: gave up", gave_up)
    assert said == said.rstrip() and gave_up == gave_up.rstrip(), "padded lines"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(worker: InProcessWorker) -> None:
    """The second request with the same 40-token prompt reuses two full blocks of 16
    (`engine.enable_prefix_caching`), counted in the server info."""
    worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)
    body = {"input_ids": list(range(3, 43)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    first = worker.client.post("/generate", json=body | {"rid": "cache-1"}).json()
    before = worker.info()
    second = worker.client.post("/generate", json=body | {"rid": "cache-2"}).json()
    after = worker.info()
    assert second["output_ids"] == first["output_ids"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 40
