"""The rollout manager: batches through fake workers with injected faults (token-exact
migration, freezes, hand-backs, busy and broken workers, version gating, deadlines),
the security of its API, the local-engine fallback, and real `polyrl worker` processes
killed with SIGKILL or frozen with SIGSTOP mid-batch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from test_worker import ThreadedServer, WorkerProcess, _tiny, _wait_until

from chaos_harness.harness import samples_streaming
from polyrl.config import EngineConfig, ManagerConfig
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest
from polyrl.manager.backends import GenerationCall, generate_body
from polyrl.manager.batch import Batch
from polyrl.manager.client import BatchClient
from polyrl.manager.fleet import fleet_status
from polyrl.manager.main import ManagerThread
from polyrl.protocol.manager_api import BatchError, BatchPrompt, BatchRequest, GroupResult
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.worker_api import GenerateRequest

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fast_cfg(**overrides: Any) -> ManagerConfig:
    base: dict[str, Any] = dict(
        port=0,
        token=TOKEN,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=1.0,
        readiness_timeout_s=10,
        stall_timeout_s=5.0,
        batch_deadline_s=60,
    )
    return ManagerConfig(**(base | overrides))


@pytest.fixture
def manager() -> Iterator[ManagerThread]:
    with ManagerThread(fast_cfg()) as mt:
        yield mt


def test_start_waits_for_a_thread_the_machine_has_not_scheduled_yet() -> None:
    """On a busy machine the loop's thread may start running well after `start` returns
    from `Thread.start`; CI once failed with 'the manager thread is not running'."""
    mt = ManagerThread(fast_cfg())

    def late() -> None:
        time.sleep(0.5)
        mt.loop.run_forever()

    mt.thread = threading.Thread(target=late, daemon=True)
    with mt:
        assert httpx.get(f"{mt.url}/health", timeout=5).status_code == 200
    assert not mt.thread.is_alive()


def batch(num_prompts: int, n: int, max_new_tokens: int, **extra: Any) -> BatchRequest:
    prompts = [BatchPrompt(id=f"p{i}", input_ids=[5 + i, 6, 7], seed=1000 * i) for i in range(num_prompts)]
    return BatchRequest(prompts=prompts, sampling=SamplingParams(n=n, max_new_tokens=max_new_tokens), **extra)


# ------------------------------------------------------------------------------ fake workers


def fake_token(seed: int, position: int) -> int:
    """The fake's deterministic 'model': the token depends on (seed, absolute position)
    only, like the engine's position-keyed sampling, so a migrated sample must come out
    exactly as an uninterrupted one."""
    return 3 + (seed * 31 + position * 17) % 50


def fake_logprob(seed: int, position: int) -> float:
    return -((seed + position) % 7) / 8


def expected_sample(prompt: BatchPrompt, index: int, length: int) -> list[int]:
    start = len(prompt.input_ids)
    seed = (prompt.seed or 0) + index
    return [fake_token(seed, start + t) for t in range(length)]


class FakeWorker:
    """An SGLang-style streaming /generate plus a registration/heartbeat thread.

    `mode` injects a fault after `fault_after` tokens of every stream: "die" (connection
    cut, heartbeats stop), "freeze" (stream and heartbeats stop), "handback" (finish
    "abort", as a draining worker does), "error" (HTTP 500), "busy" (HTTP 429), "refuse"
    (HTTP 400). With `hold_after`, its calls after that many wait for `go_on` before
    their first token."""

    def __init__(
        self,
        manager_url: str,
        worker_id: str,
        *,
        token_delay_s: float = 0.002,
        max_num_seqs: int = 64,
        version: int = 0,
        mode: str = "ok",
        fault_after: int = 3,
        token: str = TOKEN,
        local: bool = False,
        hold_after: int | None = None,
    ) -> None:
        self.manager_url, self.worker_id, self.token = manager_url, worker_id, token
        self.local = local
        self.hold_after, self.go_on = hold_after, threading.Event()
        self.token_delay_s, self.max_num_seqs, self.version = token_delay_s, max_num_seqs, version
        self.mode, self.fault_after = mode, fault_after
        self.calls: list[dict[str, Any]] = []
        self.running = 0
        self.num_done = 0  # calls streamed to their [DONE]
        self.beating = True
        self.frozen = asyncio.Event()  # never set: awaiting it is freezing
        app = FastAPI()
        app.post("/generate")(self.generate)
        app.get("/health_generate")(self.health)
        self.http = ThreadedServer(app)
        self.url = self.http.url
        self.heartbeats = threading.Thread(target=self._membership, daemon=True)

    def __enter__(self) -> FakeWorker:
        self.http.__enter__()
        self.heartbeats.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.beating = False
        self.go_on.set()
        self.http.__exit__(*exc)

    def _membership(self) -> None:
        with httpx.Client(base_url=self.manager_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=5) as c:
            registration = {
                "worker_id": self.worker_id,
                "url": self.url,
                "model_path": "fake",
                "weight_version": self.version,
                "max_num_seqs": self.max_num_seqs,
                "max_model_len": 4096,
                "local": self.local,
            }
            c.post("/v1/workers/register", json=registration).raise_for_status()
            while self.beating:
                beat = {
                    "state": "active",
                    "weight_version": self.version,
                    "num_running": self.running,
                    "num_waiting": 0,
                    "gen_throughput": 0.0,
                }
                c.post(f"/v1/workers/{self.worker_id}/heartbeat", json=beat)
                time.sleep(0.05)

    async def health(self) -> dict[str, Any]:
        return {}

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(body)
        if self.mode == "error":
            return JSONResponse({"error": {"message": "engine exploded", "type": "x"}}, status_code=500)
        if self.mode == "busy":
            return JSONResponse({"error": {"message": "engine full", "type": "engine_full"}}, status_code=429)
        if self.mode == "refuse":
            return JSONResponse({"error": {"message": "token id out of range", "type": "invalid_request"}}, 400)
        sp = body["sampling_params"]
        n, seed, budget, start = sp["n"], sp["sampling_seed"], sp["max_new_tokens"], len(body["input_ids"])
        held = self.hold_after is not None and len(self.calls) > self.hold_after

        async def events() -> Iterator[bytes]:  # type: ignore[misc]
            self.running += n
            try:
                if held:
                    await asyncio.to_thread(self.go_on.wait, 60)
                for t in range(1, budget + 1):
                    if t > self.fault_after and self.mode in ("die", "freeze"):
                        self.beating = False
                        if self.mode == "die":
                            raise RuntimeError("fake worker killed")  # uvicorn cuts the connection
                        await self.frozen.wait()
                    handback = t > self.fault_after and self.mode == "handback"
                    if handback:
                        t -= 1
                    await asyncio.sleep(self.token_delay_s)
                    finish = {"type": "abort"} if handback else ({"type": "length"} if t == budget else None)
                    for j in range(n):
                        tokens = [fake_token(seed + j, start + i) for i in range(t)]
                        chunk = {
                            "text": "",
                            "output_ids": tokens,
                            "index": j,
                            "meta_info": {
                                "id": body["rid"],
                                "finish_reason": finish,
                                "prompt_tokens": start,
                                "completion_tokens": t,
                                "weight_version": self.version,
                                "output_token_weight_versions": [self.version] * t,
                                "output_token_logprobs": [
                                    [fake_logprob(seed + j, start + i), tok, None] for i, tok in enumerate(tokens)
                                ],
                            },
                        }
                        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    if finish is not None:
                        break
                yield b"data: [DONE]\n\n"
                self.num_done += 1
            finally:
                self.running -= n

        return StreamingResponse(events(), media_type="text/event-stream")


class Consumer(threading.Thread):
    """Reads a batch from a background thread; `join_ok` re-raises what it hit."""

    def __init__(self, mt: ManagerThread, request: BatchRequest) -> None:
        super().__init__(daemon=True)
        self.mt, self.request = mt, request
        self.groups: list[GroupResult] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.groups.extend(self.mt.generate(self.request))
        except BaseException as e:  # handed to the test thread
            self.error = e

    def join_ok(self, timeout_s: float) -> list[GroupResult]:
        self.join(timeout_s)
        assert not self.is_alive(), "batch did not finish"
        if self.error is not None:
            raise self.error
        return self.groups


def workers_of(mt: ManagerThread) -> dict[str, dict[str, Any]]:
    return {w.worker_id: w.model_dump() for w in mt.worker_list().workers}


def wait_active(mt: ManagerThread, *ids: str, timeout_s: float = 20) -> None:
    _wait_until(
        lambda: all(workers_of(mt).get(i, {}).get("state") == "active" for i in ids), timeout_s, f"workers {ids} active"
    )


def check_exact(request: BatchRequest, groups: list[GroupResult], version: int = 0) -> None:
    """Every sample has its whole budget, token for token what an uninterrupted run gives."""
    prompts = {p.id: p for p in request.prompts}
    assert sorted(g.prompt_id for g in groups) == sorted(prompts)
    for g in groups:
        prompt = prompts[g.prompt_id]
        budget = request.sampling.max_new_tokens if prompt.max_new_tokens is None else prompt.max_new_tokens
        assert [s.index for s in g.samples] == list(range(request.sampling.n))
        for s in g.samples:
            assert s.output_ids == expected_sample(prompt, s.index, budget)
            start, seed = len(prompt.input_ids), (prompt.seed or 0) + s.index
            assert s.logprobs == [fake_logprob(seed, start + i) for i in range(budget)]
            assert s.weight_versions == [version] * budget
            assert s.finish_reason == "length"
            assert sum(seg.num_tokens for seg in s.segments) == budget


# ----------------------------------------------------------------------------------- batches


def test_generate_body_asks_polyrl_workers_for_the_stream_interval() -> None:
    """The manager's stream interval travels in the body a polyrl worker validates; a
    plain SGLang server (cumulative streams) never sees the extension fields."""
    call = GenerationCall("r1", [1, 2], SamplingParams(max_new_tokens=5, n=2, seed=7))
    body = generate_body(call, incremental=True, stream_interval_s=0.05)
    assert GenerateRequest.model_validate_json(body).stream_interval_s == 0.05
    assert GenerateRequest.model_validate_json(generate_body(call, incremental=True)).stream_interval_s == 0.0
    plain = json.loads(generate_body(call, incremental=False, stream_interval_s=0.05))
    assert "stream_interval_s" not in plain and "incremental_stream" not in plain
    # only what the manager set goes on the wire: SGLang's own defaults stay the worker's
    assert set(plain) == {"rid", "input_ids", "stream", "return_logprob", "sampling_params"}
    assert plain["sampling_params"] == {
        "max_new_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [],
        "ignore_eos": False,
        "n": 2,
        "sampling_seed": 7,
    }


def test_batch_streams_exact_groups_over_http_and_in_process(manager: ManagerThread) -> None:
    with FakeWorker(manager.url, "a"), FakeWorker(manager.url, "b"):
        wait_active(manager, "a", "b")
        request = batch(6, 4, 8)
        with BatchClient(manager.url, token=TOKEN) as client:
            over_http = list(client.generate(request))
        in_process = list(manager.generate(request))
    for groups in (over_http, in_process):
        check_exact(request, groups)
        assert all(s.num_failures == 0 and len(s.segments) == 1 for g in groups for s in g.samples)
    used = {seg.worker for g in over_http for s in g.samples for seg in s.segments}
    assert used == {"a", "b"}  # load spread over both
    metrics = httpx.get(f"{manager.url}/metrics", headers=AUTH).text
    assert 'polyrl_manager_batches_total{outcome="ok"} 2.0' in metrics
    assert "polyrl_manager_samples_total 48.0" in metrics
    assert 'polyrl_manager_workers{state="active"} 2.0' in metrics


def test_groups_come_in_completion_order(manager: ManagerThread) -> None:
    """p0 goes to `slow`, p1 to `fast`; `slow` starts only once `fast` has finished (a
    token delay alone left 0.5 s between them, which a busy machine can eat)."""
    with FakeWorker(manager.url, "slow", token_delay_s=0.05, hold_after=0) as slow:
        wait_active(manager, "slow")  # registered first: equal loads go to it first
        with FakeWorker(manager.url, "fast", token_delay_s=0.001) as fast:
            wait_active(manager, "fast")

            def release_slow() -> None:
                _wait_until(lambda: fast.num_done == 1, 30, "fast's call to end")
                slow.go_on.set()

            threading.Thread(target=release_slow, daemon=True).start()
            order = [(g.prompt_id, g.samples[0].segments[0].worker) for g in manager.generate(batch(2, 1, 10))]
    assert order == [("p1", "fast"), ("p0", "slow")]


def test_killed_worker_mid_stream_migrates_token_exact(manager: ManagerThread) -> None:
    with FakeWorker(manager.url, "dying", mode="die", fault_after=3) as dying:
        wait_active(manager, "dying")
        request = batch(4, 3, 12)
        with FakeWorker(manager.url, "healthy") as healthy:
            wait_active(manager, "healthy")
            groups = list(manager.generate(request))
    check_exact(request, groups)
    resumed = [c for c in healthy.calls if len(c["input_ids"]) > 3]
    assert resumed and all(c["sampling_params"]["max_new_tokens"] == 12 - (len(c["input_ids"]) - 3) for c in resumed)
    moved = [s for g in groups for s in g.samples if len(s.segments) == 2]
    assert moved, "no sample started on the dying worker"
    for s in moved:
        assert [seg.worker for seg in s.segments] == ["dying", "healthy"]
        # the chunk in flight when the connection dropped may be lost: it is regenerated
        assert 1 <= s.segments[0].num_tokens <= 3 and s.num_failures == 1
    assert dying.calls and "dying" not in workers_of(manager)
    fleet = manager.worker_list()  # what a trainer reads of the loss (issue 38: it saw none of it)
    assert fleet.num_lost_workers == 1 and fleet.lost_workers[0].worker_id == "dying"
    assert fleet.lost_workers[0].num_samples >= len(moved) and fleet.num_migrations >= len(moved)
    # the resumed requests carried the prompt + partial tokens and a reduced budget
    assert all(len(c["input_ids"]) == 3 for c in dying.calls)  # only fresh samples went there


def test_prompts_with_their_own_budgets_keep_them_across_a_migration(manager: ManagerThread) -> None:
    """Each prompt's own `max_new_tokens` (a long-tail workload) bounds its samples, also
    after they move to another worker; a prompt's budget may not exceed the batch's."""
    with FakeWorker(manager.url, "dying", mode="die", fault_after=3) as dying:
        wait_active(manager, "dying")
        request = batch(4, 2, 20)
        for prompt, budget in zip(request.prompts, [5, 20, None, 9], strict=True):
            prompt.max_new_tokens = budget
        with FakeWorker(manager.url, "healthy") as healthy:
            wait_active(manager, "healthy")
            groups = list(manager.generate(request))
    check_exact(request, groups)
    assert sorted(len(s.output_ids) for g in groups for s in g.samples) == [5, 5, 9, 9, 20, 20, 20, 20]
    assert any(len(s.segments) == 2 for g in groups for s in g.samples), "nothing migrated"
    assert dying.calls and healthy.calls
    with pytest.raises(ValueError, match="prompt 'p0': max_new_tokens 21 exceeds the batch's 20"):
        BatchRequest(
            prompts=[BatchPrompt(id="p0", input_ids=[1], max_new_tokens=21)],
            sampling=SamplingParams(max_new_tokens=20),
        )


def test_frozen_worker_is_detected_and_its_requests_migrate() -> None:
    with ManagerThread(fast_cfg(heartbeat_timeout_s=1.0, stall_timeout_s=30)) as mt:
        with FakeWorker(mt.url, "frozen", mode="freeze", fault_after=2):
            wait_active(mt, "frozen")
            request = batch(2, 2, 6)
            with FakeWorker(mt.url, "healthy"):
                wait_active(mt, "healthy")
                t0 = time.monotonic()
                groups = list(mt.generate(request))
                elapsed = time.monotonic() - t0
            assert "frozen" not in workers_of(mt)
    check_exact(request, groups)
    assert any(s.segments[0].worker == "frozen" for g in groups for s in g.samples)
    assert elapsed < 10, f"freeze took {elapsed:.1f}s to detect (heartbeat timeout 1s, stall timeout 30s)"


def test_handback_from_draining_worker_is_not_a_failure(manager: ManagerThread) -> None:
    with FakeWorker(manager.url, "drainer", mode="handback", fault_after=4), FakeWorker(manager.url, "b"):
        wait_active(manager, "drainer", "b")
        request = batch(3, 2, 10)
        groups = list(manager.generate(request))
    check_exact(request, groups)
    handed = [s for g in groups for s in g.samples if s.segments[0].worker == "drainer"]
    assert handed and all(s.num_failures == 0 and s.segments[0].num_tokens == 4 for s in handed)


def test_zero_workers_then_one_joins(manager: ManagerThread) -> None:
    request = batch(3, 2, 5)
    consumer = Consumer(manager, request)
    time.sleep(0.5)
    assert not consumer.groups
    with FakeWorker(manager.url, "late"):
        groups = consumer.join_ok(30)
    check_exact(request, groups)


def test_worker_joining_mid_batch_gets_work(manager: ManagerThread) -> None:
    """`first` holds the calls after its first wave until the joiner has work: on a busy
    machine the rest of the batch (0.6 s of `first`'s token delays) could end before the
    joiner was active (a delay of 0.3 s there made it fail)."""
    with FakeWorker(manager.url, "first", max_num_seqs=2, token_delay_s=0.02, hold_after=2) as first:
        wait_active(manager, "first")
        request = batch(8, 1, 10)
        consumer = Consumer(manager, request)
        _wait_until(lambda: len(consumer.groups) >= 1, 20, "first group")
        with FakeWorker(manager.url, "joiner", max_num_seqs=2, token_delay_s=0.02) as joiner:
            _wait_until(lambda: joiner.calls, 20, "the joiner gets the waiting work")
            first.go_on.set()
            groups = consumer.join_ok(30)
    check_exact(request, groups)
    assert any(seg.worker == "joiner" for g in groups for s in g.samples for seg in s.segments)


def test_busy_worker_is_skipped_without_counting_a_failure(manager: ManagerThread) -> None:
    with FakeWorker(manager.url, "busy", mode="busy"), FakeWorker(manager.url, "ok", max_num_seqs=1):
        wait_active(manager, "busy", "ok")
        request = batch(3, 1, 4)
        groups = list(manager.generate(request))
    check_exact(request, groups)
    assert all(s.num_failures == 0 and s.segments[0].worker == "ok" for g in groups for s in g.samples)


def test_retry_budget_ends_the_batch_with_a_clear_error() -> None:
    with ManagerThread(fast_cfg(retry_budget=2)) as mt, FakeWorker(mt.url, "broken", mode="error") as broken:
        wait_active(mt, "broken")
        with pytest.raises(BatchError) as err:
            list(mt.generate(batch(1, 1, 4)))
        assert err.value.kind == "retry_budget"
        assert "3 worker failures" in str(err.value) and "engine exploded" in str(err.value)
        assert len(broken.calls) == 3
        assert not mt.manager.batches and not mt.manager.pending


def test_deadline_ends_a_batch_nobody_can_serve(manager: ManagerThread) -> None:
    t0 = time.monotonic()
    with pytest.raises(BatchError) as err:
        list(manager.generate(batch(2, 2, 4, deadline_s=0.5)))
    assert err.value.kind == "deadline"
    assert "0/2 groups done" in str(err.value) and "0 active" in str(err.value)
    assert time.monotonic() - t0 < 5


def test_version_gating_and_sync_hooks(manager: ManagerThread) -> None:
    needs: list[tuple[str, int]] = []
    manager.add_sync_hook(lambda rec, v: needs.append((rec.worker_id, v)))
    manager.publish_version(1)
    with FakeWorker(manager.url, "old", version=0) as old:
        _wait_until(lambda: workers_of(manager).get("old", {}).get("state") == "syncing", 20, "old syncing")
        assert ("old", 1) in needs
        consumer = Consumer(manager, batch(2, 1, 4))
        time.sleep(0.5)
        assert not old.calls, "a worker below the batch's version got work"
        old.version = 1  # the transfer layer delivered v1; the next heartbeat says so
        groups = consumer.join_ok(20)
        check_exact(batch(2, 1, 4), groups, version=1)
        assert len(old.calls) == 2
        manager.publish_version(2)
        _wait_until(lambda: workers_of(manager)["old"]["state"] == "syncing", 10, "old syncing to v2")
        time.sleep(0.5)  # heartbeats keep coming while the (slow) transfer runs
        assert needs == [("old", 1), ("old", 2)]  # asked once per version, not once per beat
        manager.mark_synced("old", 2)
        time.sleep(0.3)  # heartbeats still say v1: sent before the swap, they must not undo it
        info = workers_of(manager)["old"]
        assert info["state"] == "active" and info["weight_version"] == 2


def test_client_going_away_cancels_the_batch(manager: ManagerThread) -> None:
    with FakeWorker(manager.url, "a", token_delay_s=0.02, max_num_seqs=1) as fake:
        wait_active(manager, "a")
        stream = manager.generate(batch(4, 1, 20))
        next(stream)  # one prompt at a time: the first group, then hang up
        stream.close()
        _wait_until(lambda: fake.running == 0, 10, "fake worker's streams closed")
        assert not manager.manager.batches and not manager.manager.pending


# ---------------------------------------------------------------------------------- security


def test_refusals_change_nothing() -> None:
    with ManagerThread(fast_cfg(allowed_worker_cidrs=["10.0.0.0/8"], max_body_bytes=4096)) as mt:
        url = mt.url
        reg = {
            "worker_id": "x",
            "url": "http://127.0.0.1:9",
            "model_path": "m",
            "weight_version": 0,
            "max_num_seqs": 4,
            "max_model_len": 64,
        }
        cases = [
            (httpx.post(f"{url}/v1/workers/register", json=reg), 401),  # no token
            (httpx.post(f"{url}/v1/workers/register", json=reg, headers={"Authorization": "Bearer nope"}), 401),
            (httpx.post(f"{url}/v1/workers/register", json=reg, headers=AUTH), 403),  # 127.0.0.1 not allowed
            (httpx.post(f"{url}/v1/workers/register", json=reg | {"extra": 1}, headers=AUTH), 422),
            (httpx.post(f"{url}/v1/workers/register", content=b"{not json", headers=AUTH), 422),
            (httpx.post(f"{url}/v1/workers/register", json=reg | {"model_path": "m" * 70000}, headers=AUTH), 413),
            (
                httpx.post(
                    f"{url}/v1/workers/x/heartbeat",
                    json={
                        "state": "active",
                        "weight_version": 0,
                        "num_running": 0,
                        "num_waiting": 0,
                        "gen_throughput": 0,
                    },
                    headers=AUTH,
                ),
                404,
            ),
            (httpx.post(f"{url}/v1/batches", json=batch(1, 1, 4).model_dump(), headers={}), 401),
            (httpx.post(f"{url}/v1/batches", json=batch(400, 1, 4).model_dump(), headers=AUTH), 413),
            (
                httpx.post(f"{url}/v1/batches", json={"prompts": [], "sampling": {"max_new_tokens": 1}}, headers=AUTH),
                422,
            ),
            (httpx.post(f"{url}/v1/weights/version", json={"version": 3}, headers={}), 401),
            (httpx.post(f"{url}/v1/weights/version", json={"version": -1}, headers=AUTH), 422),
        ]
        for response, status in cases:
            assert response.status_code == status, (status, response.text)
            assert "message" in response.json()["error"]
        assert "outside manager.allowed_worker_cidrs" in cases[2][0].json()["error"]["message"]
        for bad in ({"worker_id": "local"}, {"url": "ftp://x"}, {"url": "http://:80"}, {"worker_id": "a b"}):
            response = httpx.post(f"{url}/v1/workers/register", json=reg | bad, headers=AUTH)
            assert response.status_code == 422, (bad, response.text)
        dup = batch(2, 1, 4).model_dump()
        dup["prompts"][1]["id"] = dup["prompts"][0]["id"]
        response = httpx.post(f"{url}/v1/batches", json=dup, headers=AUTH)
        assert response.status_code == 422 and "repeats" in response.json()["error"]["message"]
        assert workers_of(mt) == {} and not mt.manager.batches and not mt.manager.pending
        assert mt.manager.registry.latest_version == 0
        assert httpx.post(f"{url}/v1/weights/version", json={"version": 2}, headers=AUTH).status_code == 200
        assert httpx.post(f"{url}/v1/weights/version", json={"version": 1}, headers=AUTH).status_code == 409
        assert httpx.get(f"{url}/v1/workers", headers=AUTH).json()["latest_weight_version"] == 2


def test_client_sees_refusal_and_error_lines(manager: ManagerThread) -> None:
    with BatchClient(manager.url, token="wrong") as client, pytest.raises(BatchError) as err:
        list(client.generate(batch(1, 1, 2)))
    assert "HTTP 401" in str(err.value)
    with BatchClient(manager.url, token=TOKEN) as client, pytest.raises(BatchError) as err:
        list(client.generate(batch(1, 1, 2, deadline_s=0.3)))
    assert err.value.kind == "deadline"


def test_config_refuses_open_non_loopback_manager(tmp_path: Path) -> None:
    from polyrl.cli import main

    assert main(["manager", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert main(["manager", 'manager.allowed_worker_cidrs=["nonsense"]']) == 2


# ------------------------------------------------------------------------ local-engine fallback


def test_local_worker_serves_only_when_no_worker_is_left() -> None:
    """The trainer's own engine registers as `local`: with a remote worker alive it gets
    nothing; once that worker is gone, it serves the rest."""
    with ManagerThread(fast_cfg(heartbeat_timeout_s=1.0)) as mt, FakeWorker(mt.url, "local", local=True) as local:
        wait_active(mt, "local")
        with FakeWorker(mt.url, "w1"):
            wait_active(mt, "w1")
            groups = list(mt.generate(batch(2, 3, 6)))
            assert {seg.worker for g in groups for s in g.samples for seg in s.segments} == {"w1"}
            assert not local.calls
        _wait_until(lambda: all(w.worker_id != "w1" for w in mt.worker_list().workers), 10, "w1 gone")
        groups = list(mt.generate(batch(2, 3, 6)))
    assert len(groups) == 2
    for g in groups:
        for s in g.samples:
            assert len(s.output_ids) == 6 and [seg.worker for seg in s.segments] == ["local"]


def test_an_idle_local_worker_is_on_standby_until_the_fleet_needs_it() -> None:
    """Remote mode (no local window): while remote workers serve, the trainer's engine is
    not synced, and says so: `standby`, not `syncing v0` for the whole run (issue 38).
    Once no remote worker is left, a batch wakes it: it syncs to the latest version and
    serves the rest."""
    with ManagerThread(fast_cfg()) as mt, FakeWorker(mt.url, "local", local=True) as local:
        fakes, pulls = {"local": local}, []

        def deliver(record: Any, version: int) -> int:  # the transfer layer, at once
            pulls.append((record.worker_id, version))
            fakes[record.worker_id].version = version
            return version

        mt.add_sync_hook(deliver)
        wait_active(mt, "local")
        fakes["w1"] = FakeWorker(mt.url, "w1")
        with fakes["w1"]:
            wait_active(mt, "w1")
            for version in (1, 2):
                mt.publish_version(version)
                wait_active(mt, "w1")
            assert _state(mt, "local") == "standby" and workers_of(mt)["local"]["weight_version"] == 0
            groups = list(mt.generate(batch(2, 2, 4, min_weight_version=2)))
            assert {seg.worker for g in groups for s in g.samples for seg in s.segments} == {"w1"}
            assert _state(mt, "local") == "standby" and pulls == [("w1", 1), ("w1", 2)]
        _wait_until(lambda: "w1" not in workers_of(mt), 10, "w1 gone")
        groups = list(mt.generate(batch(2, 2, 4, min_weight_version=2)))
        events = [e.state for e in mt.call(fleet_status, mt.manager).events if e.worker_id == "local"]
    assert {seg.worker for g in groups for s in g.samples for seg in s.segments} == {"local"}
    assert pulls[2:] == [("local", 2)]
    assert events == ["registering", "active", "standby", "syncing", "active"]


def test_a_worker_may_not_take_the_local_id() -> None:
    with (
        ManagerThread(fast_cfg()) as mt,
        httpx.Client(base_url=mt.url, headers={"Authorization": f"Bearer {TOKEN}"}) as c,
    ):
        body = {
            "worker_id": "local",
            "url": "http://127.0.0.1:9",
            "model_path": "m",
            "weight_version": 0,
            "max_num_seqs": 1,
            "max_model_len": 8,
        }
        assert c.post("/v1/workers/register", json=body).status_code == 422
        assert c.post("/v1/workers/register", json=body | {"local": True}).status_code == 200


def test_peer_window_gives_the_local_worker_its_share_and_lets_it_finish() -> None:
    """Hybrid on a GPU trainer: the local worker is a peer of the workers for the whole
    step. While the only worker syncs, the local worker holds at most half the worker
    cap at once (the rest waits for the worker or its next wave); closing the window
    without hand-back lets it finish."""
    with ManagerThread(fast_cfg(max_inflight_per_worker=16)) as mt:
        with (
            FakeWorker(mt.url, "local", local=True, version=0, token_delay_s=0.01) as local,
            FakeWorker(mt.url, "w1", version=0, token_delay_s=0.01) as w1,
        ):
            wait_active(mt, "w1")
            wait_active(mt, "local")
            local.version = 1  # the local worker syncs first (the trainer's own device)
            mt.publish_version(1)  # w1 syncs until its heartbeat says v1
            _wait_until(lambda: _state(mt, "local") == "active", 10, "local synced")
            mt.call(mt.manager.open_local_window, None, False)
            # enough work that the local worker can't finish all of it in the moment
            # between the pending check and w1's next heartbeat (it may take more waves)
            request = batch(8, 4, 120, min_weight_version=1)
            consumer = Consumer(mt, request)
            _wait_until(lambda: mt.call(lambda: mt.manager.local_record.inflight) > 0, 20, "local work")
            assert mt.call(lambda: mt.manager.local_record.inflight) <= 8, "more than its share"
            assert mt.call(lambda: len(mt.manager.pending)) > 0, "the worker's share should wait"
            w1.version = 1
            _wait_until(lambda: w1.calls, 20, "w1 gets the rest")
            mt.call(mt.manager.learner_started)
            groups = consumer.join_ok(60)
    workers = {seg.worker for g in groups for s in g.samples for seg in s.segments}
    assert workers == {"local", "w1"}
    assert all(len(s.segments) == 1 for g in groups for s in g.samples), "nothing migrated"
    assert all(len(s.output_ids) == 120 for g in groups for s in g.samples)


def _state(mt: ManagerThread, worker_id: str) -> str:
    return next((w.state for w in mt.worker_list().workers if w.worker_id == worker_id), "gone")


# ------------------------------------------------------------------ real worker processes


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("manager_model"))


def _start_worker(model_dir: Path, manager_url: str, worker_id: str, **hold: Any) -> WorkerProcess:
    """`hold`: `WorkerProcess`'s `hold_at` / `hold_while`, for a worker whose samples must
    still run when the test acts (on a busy machine a worker process runs on while the
    test process waits for a core: 300 to 1,000 tokens, 1 to 3 s, could end between
    "tokens stream" and the act)."""
    args = ("--manager", manager_url, "--token", TOKEN, "--worker-id", worker_id)
    return WorkerProcess(model_dir, *args, **hold)


def test_calls_placed_together_share_a_request_and_each_fails_or_stops_alone(
    long_context_model: Path, tmp_path: Path
) -> None:
    """Calls placed on a worker in one pass go as one batched /generate. A call the worker
    refuses fails its own batch only, and a cancelled batch's calls are aborted on the
    worker by rid while the others in the same request run to their end."""
    hold = tmp_path / "hold"
    with ManagerThread(fast_cfg(stall_timeout_s=60)) as mt:  # a held engine streams nothing
        proc = _start_worker(long_context_model, mt.url, "w1", hold_at=1, hold_while=hold)
        try:
            url = proc.wait_ready()
            wait_active(mt, "w1")

            def submit_together(*requests: BatchRequest) -> list[Batch]:
                return mt.call(lambda: [mt.manager.submit(r) for r in requests])

            def sent() -> tuple[int, int]:
                return mt.call(lambda: (mt.manager.remote.num_requests, mt.manager.remote.num_calls))

            good = batch(2, 1, 40)
            bad = BatchRequest(prompts=[BatchPrompt(id="bad", input_ids=[1, 10_000])], sampling=good.sampling)
            good_batch, bad_batch = submit_together(good, bad)
            with pytest.raises(BatchError, match="invalid_request|refused"):
                list(mt.results(bad_batch))
            assert [len(s.output_ids) for g in mt.results(good_batch) for s in g.samples] == [40, 40]
            assert sent()[0] < sent()[1], "no call shared a request"

            keep, drop = batch(2, 1, 1000), batch(2, 1, 2000)
            for request in (keep, drop):
                request.sampling = request.sampling.model_copy(update={"ignore_eos": True})
            drop.prompts = [p.model_copy(update={"id": f"d{p.id}"}) for p in drop.prompts]

            def info() -> dict[str, Any]:
                return httpx.get(f"{url}/get_server_info", timeout=10).json()

            before = sent()
            hold.touch()  # the calls get their first token, then the engine waits until the test has acted
            kept, dropped = submit_together(keep, drop)
            _wait_until(lambda: _streamed_from(mt, "w1"), 30, "w1 streaming tokens")
            assert sent()[0] - before[0] == 1 and sent()[1] - before[1] == 4  # one request, four calls
            mt.call(mt.manager.close_batch, dropped)
            _wait_until(lambda: info()["num_running_reqs"] == 2, 20, "the cancelled calls aborted")
            assert mt.call(lambda: kept.num_groups_done) == 0, "the cancelled calls ran on until the others ended"
            hold.unlink()
            groups = list(mt.results(kept))
        finally:
            proc.kill()
    assert sorted(len(s.output_ids) for g in groups for s in g.samples) == [1000, 1000]
    assert all(len(s.segments) == 1 for g in groups for s in g.samples), "nothing migrated"


@pytest.mark.slow
def test_real_workers_join_and_die_mid_batch(long_context_model: Path) -> None:
    """Zero workers at submission; one joins, a second joins mid-batch and gets work; the
    first is killed with SIGKILL mid-stream: every sample still gets its full budget, and
    a migrated sample is token for token what an uninterrupted run produces."""
    budget = 1000
    request = batch(8, 2, budget)
    request.sampling = request.sampling.model_copy(update={"ignore_eos": True})
    procs: list[WorkerProcess] = []
    with ManagerThread(fast_cfg(heartbeat_timeout_s=3.0, stall_timeout_s=20)) as mt:
        consumer = Consumer(mt, request)
        try:
            procs.append(_start_worker(long_context_model, mt.url, "w1"))
            procs[0].wait_ready()
            wait_active(mt, "w1")
            procs.append(_start_worker(long_context_model, mt.url, "w2"))
            procs[1].wait_ready()
            wait_active(mt, "w2")
            _wait_until(lambda: workers_of(mt).get("w2", {}).get("num_inflight", 0) > 0, 60, "w2 gets work")
            assert mt.call(lambda: mt.manager.registry.get("w2").incremental_stream)  # polyrl workers stream deltas
            assert consumer.is_alive(), "the batch ended before the kill: raise the budget"
            procs[0].proc.send_signal(signal.SIGKILL)
            groups = consumer.join_ok(120)
            # the prompts of the samples that moved, again: the same seeds, on w2 alone
            moved = {g.prompt_id for g in groups for s in g.samples if len(s.segments) > 1}
            again = request.model_copy(update={"prompts": [p for p in request.prompts if p.id in moved]})
            reference = {g.prompt_id: g for g in mt.generate(again)} if moved else {}
        finally:
            for p in procs:
                p.kill()
    assert len(groups) == 8
    samples = [s for g in groups for s in g.samples]
    assert all(len(s.output_ids) == budget == len(s.logprobs) == len(s.weight_versions) for s in samples)
    workers = {seg.worker for s in samples for seg in s.segments}
    assert workers == {"w1", "w2"}
    migrated = [
        (g.prompt_id, s) for g in groups for s in g.samples if [seg.worker for seg in s.segments] == ["w1", "w2"]
    ]
    assert migrated and all(s.num_failures == 1 for _, s in migrated)
    for prompt_id, s in migrated:
        uninterrupted = reference[prompt_id].samples[s.index]
        assert [seg.worker for seg in uninterrupted.segments] == ["w2"]
        assert s.output_ids == uninterrupted.output_ids
        assert s.logprobs == pytest.approx(uninterrupted.logprobs, abs=1e-4)


def _streamed_from(mt: ManagerThread, worker_id: str) -> bool:
    """The manager holds tokens of a sample running on `worker_id` (a kill now leaves a
    sample to continue elsewhere, not one to start again)."""
    return mt.call(lambda: samples_streaming(mt.manager, {worker_id})) > 0


@pytest.mark.slow
def test_real_worker_frozen_with_sigstop_is_detected(long_context_model: Path, tmp_path: Path) -> None:
    budget = 300
    request = batch(4, 2, budget)
    request.sampling = request.sampling.model_copy(update={"ignore_eos": True})
    procs = []
    hold = tmp_path / "hold"
    with ManagerThread(fast_cfg(heartbeat_timeout_s=2.0, stall_timeout_s=60)) as mt:
        try:
            procs = [_start_worker(long_context_model, mt.url, "w1", hold_at=1, hold_while=hold)]
            procs.append(_start_worker(long_context_model, mt.url, "w2"))
            for p in procs:
                p.wait_ready()
            wait_active(mt, "w1", "w2")
            hold.touch()  # w1's samples get their first token, then wait: they are certain to migrate
            consumer = Consumer(mt, request)
            _wait_until(lambda: _streamed_from(mt, "w1"), 30, "w1 streaming tokens")  # so they migrate
            os.kill(procs[0].proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            _wait_until(lambda: "w1" not in workers_of(mt), 20, "frozen w1 declared gone")
            detected_s = time.monotonic() - t0
            groups = consumer.join_ok(120)
        finally:
            for p in procs:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.kill()
    assert detected_s < 2.0 + 2.0
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 8 and all(len(s.output_ids) == budget for s in samples)
    assert any([seg.worker for seg in s.segments] == ["w1", "w2"] for s in samples)


def greedy_tokens(engine: Engine, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """What `engine` generates greedily, in-process: the reference for a worker's output."""
    return _greedy_run(engine, input_ids, max_new_tokens)[0]


def _greedy_run(engine: Engine, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(f"ref-{len(input_ids)}-{input_ids[0]}", input_ids, sampling))
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_work:
        for d in engine.step():
            tokens += d.token_ids
            logprobs += d.logprobs
    return tokens, logprobs


@pytest.mark.slow
def test_real_worker_pulls_published_weights(long_context_model: Path, tmp_path: Path) -> None:
    """publish_version -> the sync hook grants a token -> the worker pulls over TCP (raw,
    then a delta) -> the manager routes to it at the new version, and the worker really
    generates with the published weights. The publisher has two groups: the late joiner
    is sent to the second."""
    from polyrl.manager.weight_sync import PublisherSync
    from polyrl.transfer.publisher import WeightPublisher

    other = _tiny(tmp_path / "other", seed=7)
    reference = Engine.from_pretrained(str(other), EngineConfig(max_num_seqs=4))
    new_weights = {k: p.detach().clone() for k, p in reference.model.named_parameters()}
    request = batch(2, 1, 12)
    request.sampling = request.sampling.model_copy(update={"temperature": 0.0, "ignore_eos": True})
    with ManagerThread(fast_cfg()) as mt, WeightPublisher(chunk_bytes=64 * 1024, num_groups=2) as pub:
        sync = PublisherSync(mt.manager, pub, codec="delta")  # auto would pick raw on loopback
        mt.add_sync_hook(sync)
        proc = _start_worker(long_context_model, mt.url, "w1")
        try:
            proc.wait_ready()
            wait_active(mt, "w1")
            pub.publish(new_weights, 1)
            mt.publish_version(1)
            _wait_until(lambda: workers_of(mt)["w1"]["weight_version"] == 1, 30, "w1 at v1")
            assert "raw" in sync.last_message["w1"]
            groups = list(mt.generate(request))
            nudged = {k: (v + 0.5 if k.endswith("norm.weight") else v) for k, v in new_weights.items()}
            pub.publish(nudged, 2)
            mt.publish_version(2)
            _wait_until(lambda: workers_of(mt)["w1"]["weight_version"] == 2, 30, "w1 at v2")
            assert "delta" in sync.last_message["w1"]
            late = _start_worker(long_context_model, mt.url, "w2")  # joins after v2: pulls it whole
            try:
                late.wait_ready()
                _wait_until(lambda: workers_of(mt).get("w2", {}).get("state") == "active", 30, "w2 active")
                assert workers_of(mt)["w2"]["weight_version"] == 2 and "raw" in sync.last_message["w2"]
                assert sync.group_of == {"w1": 0, "w2": 1}, "two workers, two publisher groups: one each"
            finally:
                late.kill()
        finally:
            proc.kill()
    for g in groups:
        s = g.samples[0]
        assert s.weight_versions == [1] * 12
        prompt = next(p for p in request.prompts if p.id == g.prompt_id)
        assert s.output_ids == greedy_tokens(reference, prompt.input_ids, 12)  # the published weights' tokens


@pytest.mark.slow
def test_real_workers_relay_a_version_down_a_chain(long_context_model: Path, tmp_path: Path) -> None:
    """`transfer.relay_fan_out = 1`: the first worker to have joined pulls the version from
    the publisher, each other one from the worker before it (its relay serving the chunks
    as they check out), so the publisher sends it once; every worker then generates the
    published weights' tokens."""
    from polyrl.config import TransferConfig
    from polyrl.manager.weight_sync import PublisherSync
    from polyrl.transfer.publisher import WeightPublisher

    other = _tiny(tmp_path / "other", seed=7)
    reference = Engine.from_pretrained(str(other), EngineConfig(max_num_seqs=4))
    new_weights = {k: p.detach().clone() for k, p in reference.model.named_parameters()}
    request = batch(3, 1, 8)
    request.sampling = request.sampling.model_copy(update={"temperature": 0.0, "ignore_eos": True})
    cfg = fast_cfg(transfer=TransferConfig(relay_fan_out=1))
    ids = ("w1", "w2", "w3")
    with ManagerThread(cfg) as mt, WeightPublisher(chunk_bytes=16 * 1024) as pub:
        sync = PublisherSync(mt.manager, pub, codec="raw")
        mt.add_sync_hook(sync)
        procs = [_start_worker(long_context_model, mt.url, w) for w in ids]
        try:
            for proc in procs:
                proc.wait_ready()
            wait_active(mt, *ids)
            records = {r.worker_id: r for r in mt.manager.registry}
            assert all(records[w].relay_port for w in ids)
            order = sorted(ids, key=lambda w: records[w].joined_at)
            chains = {w: [r.port for r in sync.relays_for(records[w], 1)[0]] for w in ids}
            assert chains[order[0]] == [] and chains[order[1]] == [records[order[0]].relay_port]
            assert chains[order[2]] == [records[order[1]].relay_port, records[order[0]].relay_port]
            total = pub.publish(new_weights, 1).manifest.total_bytes
            mt.publish_version(1)
            _wait_until(lambda: all(workers_of(mt)[w]["weight_version"] == 1 for w in ids), 60, "all at v1")
            assert pub.bytes_sent == total, (pub.bytes_sent, total)  # once, to the first
            groups = list(mt.generate(request))
        finally:
            for proc in procs:
                proc.kill()
    for g in groups:
        s = g.samples[0]
        prompt = next(p for p in request.prompts if p.id == g.prompt_id)
        assert s.weight_versions == [1] * 8
        assert s.output_ids == greedy_tokens(reference, prompt.input_ids, 8)


def test_real_worker_loads_versions_from_a_shared_directory(long_context_model: Path, tmp_path: Path) -> None:
    from polyrl.manager.weight_sync import DiskSync

    other = _tiny(tmp_path / "other", seed=9)
    reference = Engine.from_pretrained(str(other), EngineConfig(max_num_seqs=4))
    new_weights = {k: p.detach().clone() for k, p in reference.model.named_parameters()}
    request = batch(1, 1, 8)
    request.sampling = request.sampling.model_copy(update={"temperature": 0.0, "ignore_eos": True})
    with ManagerThread(fast_cfg()) as mt:
        disk = DiskSync(mt.manager, tmp_path / "versions")
        mt.add_sync_hook(disk)
        proc = _start_worker(long_context_model, mt.url, "w1")
        try:
            proc.wait_ready()
            wait_active(mt, "w1")
            disk.save(new_weights, 3)
            mt.publish_version(3)
            _wait_until(lambda: workers_of(mt)["w1"]["weight_version"] == 3, 30, "w1 at v3")
            [group] = list(mt.generate(request))
        finally:
            proc.kill()
    assert not list((tmp_path / "versions").glob("*.tmp"))
    sample = group.samples[0]
    assert sample.weight_versions == [3] * 8
    assert sample.output_ids == greedy_tokens(reference, request.prompts[0].input_ids, 8)


def test_min_p_travels_from_the_run_config_to_a_real_workers_engine(long_context_model: Path) -> None:
    """min_p, the worked example of one sampling vocabulary: set in `rollout.*`, it goes in
    the trainer's batch to the manager, in SGLang's `/generate` body to a worker process, and
    into its engine. min_p = 1 keeps only the most likely token, so sampling at temperature
    1 gives the greedy tokens and log-probs (log softmax(logits) either way); without it the
    same seeds sample other tokens."""
    from polyrl.config import RolloutConfig

    rollout = RolloutConfig(n=2, max_new_tokens=8, temperature=1.0, min_p=1.0)
    prompts = [BatchPrompt(id=f"p{i}", input_ids=ids, seed=100 + i) for i, ids in enumerate(([1, 5, 6], [2, 7, 9, 4]))]
    cut = BatchRequest(prompts=prompts, sampling=rollout.sampling([]))
    free = BatchRequest(prompts=prompts, sampling=rollout.model_copy(update={"min_p": 0.0}).sampling([]))
    assert cut.sampling.min_p == 1.0 and cut.sampling.n == 2
    reference = Engine.from_pretrained(str(long_context_model), EngineConfig(max_num_seqs=4))
    greedy = {p.id: _greedy_run(reference, p.input_ids, 8) for p in prompts}
    with ManagerThread(fast_cfg()) as mt:
        proc = _start_worker(long_context_model, mt.url, "w1")
        try:
            proc.wait_ready()
            wait_active(mt, "w1")
            with_cut, without = list(mt.generate(cut)), list(mt.generate(free))
        finally:
            proc.kill()
    for g in with_cut:
        tokens, logprobs = greedy[g.prompt_id]
        assert [s.output_ids for s in g.samples] == [tokens, tokens]
        assert all(s.logprobs == pytest.approx(logprobs, abs=1e-4) for s in g.samples)
    assert any(s.output_ids != greedy[g.prompt_id][0] for g in without for s in g.samples)


def test_task_reprs_stay_short() -> None:
    """anyio formats the current task's repr on every cancel scope (each new connection);
    the task's done-callback holds a work unit, which reached the whole batch through the
    generated dataclass reprs and stalled the manager's loop for seconds per connection."""
    import functools

    from polyrl.manager.batch import Batch

    request = batch(64, 16, 8)

    async def main() -> str:
        b = Batch.build("b0", request, 0, 1e9, list(range(64)))
        tasks = []
        for unit in b.fresh_units():
            task = asyncio.ensure_future(asyncio.sleep(10))
            task.add_done_callback(functools.partial(lambda u, t: None, unit))
            b.tasks.add(task)
            tasks.append(task)
        text = repr(tasks[0])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return text

    assert len(asyncio.run(main())) < 1000


def test_the_manager_and_publisher_processes_import_no_torch() -> None:
    """They start in about a second and restart as fast: importing torch made the manager
    process take 8 s to serve at the main job's start on 2 cores, beside the workers' own
    imports (BENCHMARKS.md)."""
    import subprocess
    import sys

    code = (
        "import sys, polyrl.cli, polyrl.manager.main, polyrl.transfer.serve; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_requests_open_at_shutdown_get_503_and_the_manager_exits_at_once(tmp_path: Path) -> None:
    """The end of an Atropos run: the workers are gone and the environments' requests wait
    for one when the manager gets SIGTERM. Each gets a 503 at once and the manager exits
    0 well inside uvicorn's graceful timeout (5 s), with no 'Cancel N running task(s)'
    line and no CancelledError traceback."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    ready, log_path = tmp_path / "url", tmp_path / "manager.log"
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "manager",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--token",
        TOKEN,
        "--ready-file",
        str(ready),
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=os.environ | {"POLYRL_TOKEN": ""})
    try:
        _wait_until(ready.exists, 30, "the manager serves")
        url = ready.read_text()

        sent: list[str] = []  # requests written whole to the manager's socket

        def note(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_body.complete":
                sent.append(event)

        def ask() -> httpx.Response:  # vLLM's /generate, as atroposlib's VLLMServer sends it
            body = {"prompt": {"prompt_token_ids": [5, 6, 7]}, "max_tokens": 4, "logprobs": 0}
            with httpx.Client(headers=AUTH, timeout=30) as client:
                return client.post(f"{url}/generate", json=body, extensions={"trace": note})

        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(ask) for _ in range(8)]
            # sent, not only asked for: the 8 clients take ~0.5 s of CPU before they send on
            # a busy 2-core machine, and one still connecting at SIGTERM is refused
            _wait_until(lambda: len(sent) == 8 or any(a.done() for a in answers), 30, "the 8 requests sent")
            time.sleep(2.0)  # all 8 wait for a worker (manager.inference_wait_s: 30 s)
            assert not any(a.done() for a in answers)
            stopped_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            responses = [a.result(timeout=10) for a in answers]
        assert proc.wait(timeout=10) == 0
        exit_s = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert [r.status_code for r in responses] == [503] * 8, log
    assert all("shutting down" in r.json()["error"]["message"] for r in responses)
    assert exit_s < 3.0, (exit_s, log)
    assert "Traceback" not in log and "CancelledError" not in log and "running task" not in log, log
