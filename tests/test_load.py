"""The manager under load: thousands of samples through dozens of fake workers that keep
joining, dying and draining, and what the manager holds afterwards.

The fleet is tests/fake_fleet.py: every engine a path of one server in a process of its
own, memberships the real worker's ManagerSession; tests/load_harness.py drives it. What
is checked, and why:

* nothing lost, duplicated or corrupted: every batch returns exactly its prompts, each
  group exactly n samples, each sample exactly the tokens an uninterrupted run gives,
  however often it moved (kills cut streams mid-sample; drains hand samples back);
* the manager's counters agree with what happened: each sample counted once, failure
  migrations equal to the samples' own failure counts, every delivered leave counted;
* bounded: afterwards no batch, queued unit, cancel reason, in-flight count or task is
  left, the registry holds exactly the live workers, no Batch or SampleState object is
  alive, and over rounds the heap stops growing after a warm-up round;
* not blocking: GET /health and heartbeats answer within a second while all this runs
  (a check that the loop is never held for long, not a benchmark: benchmarks/load.py).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import anyio.to_thread
import httpx
import pytest
from fake_fleet import Churn
from load_harness import TOKEN, LoadHarness, load_cfg, make_request, run_load
from test_worker import ThreadedServer

from polyrl.manager.backends import GenerationCall, RemoteBackend
from polyrl.manager.main import ManagerThread
from polyrl.manager.registry import WorkerRecord
from polyrl.protocol.sampling import SamplingParams

CONTROL_P99_S = 1.0
"""A third of the tests' heartbeat timeout: later than that, live workers start to be
declared gone."""

IDLE = {
    "batches": 0,
    "pending": 0,
    "cancels": 0,
    "inflight": 0,
    "worker_tasks": 0,
    "busy_connections": 0,
    "manager_tasks": ["Placement.dispatch_loop", "RolloutManager._monitor_loop"],
}


def check_idle(result: dict[str, Any], leftovers: dict[str, Any]) -> None:
    """Nothing per batch or per call is left, and the loop holds no more tasks than before."""
    assert {k: leftovers[k] for k in IDLE} == IDLE, leftovers
    assert leftovers["loop_tasks"] <= result["base"]["loop_tasks"], (leftovers, result["base"])


@pytest.mark.slow
def test_thousands_of_samples_survive_a_churning_fleet() -> None:
    """32 workers at first, a churn event every 50 ms (60 at most), 4 concurrent batches
    (2 in-process, 2 over HTTP) of 128 prompts x 4 samples x 8 tokens."""
    churn = Churn(interval_s=0.05, max_events=60)
    r = run_load(num_workers=32, num_batches=4, num_prompts=128, n=4, max_new_tokens=8, churn=churn)
    assert not r["errors"] and not r["problems"], (r["errors"], r["problems"])
    assert r["samples"] == r["ok"] == 2048
    assert r["lost"] == r["duplicated"] == r["corrupted"] == 0

    f, c = r["fleet"], r["counters"]
    assert r["churn_events"] >= 30 and f["num_killed"] >= 3 and f["num_drained"] >= 3, f  # the load lasts ~3 s or more
    assert f["num_cut_streams"] > 0, "no kill hit a running stream: the test lost its point"
    assert r["resumed"] > 0, "no sample continued elsewhere with its tokens so far"
    assert c["samples"] == 2048 and c["batches_ok"] == 4  # each sample counted exactly once
    assert c["migrated_failure"] > 0 and c["migrated_handback"] > 0
    assert c["migrated_failure"] == r["sample_failures"]  # each failure migration charged to its sample
    assert c["workers_left"] == f["num_leaves_delivered"]
    assert c["workers_registered"] >= f["num_registrations"]  # some replies die with their engine
    assert c["generate_calls"] > c["generate_requests"], "no batched request: the fleet's half that takes them"

    check_idle(r, r["leftovers"])
    assert r["live_objects"] == {"Batch": 0, "GroupState": 0, "SampleState": 0, "WorkerRecord": r["registry_size"]}
    assert r["health_p99_s"] < CONTROL_P99_S and r["heartbeat_p99_s"] < CONTROL_P99_S, (
        r["health_p99_s"],
        r["heartbeat_p99_s"],
        r["lag_p99_s"],
    )


@pytest.mark.slow
def test_memory_and_tasks_stay_flat_over_rounds() -> None:
    """Four rounds of load; from the end of the second round to the end of the fourth,
    the heap does not grow by more than a fraction of one round's samples."""
    r = run_load(
        num_workers=16,
        num_batches=2,
        num_prompts=64,
        n=4,
        max_new_tokens=8,
        rounds=4,
        churn=Churn(max_events=20),
        measure_memory=True,
    )
    assert not r["errors"] and r["ok"] == r["samples"] == 4 * 512, (r["errors"], r["problems"])
    for row in r["rounds"]:
        check_idle(r, row["leftovers"])
    growth = r["memory_growth"]
    # a leak of one object per sample would add 1024 objects, of a sample's tokens 4096 blocks
    assert growth["gc_objects"] < 1000 and growth["heap_blocks"] < 4000, growth
    assert r["live_objects"]["SampleState"] == 0 and r["live_objects"]["WorkerRecord"] == r["registry_size"]


# ---------------------------------------------------------------------------- regressions


def test_finished_batch_is_not_kept_alive_by_the_monitor() -> None:
    """Regression: the monitor's loop variable kept the last batch it looked at, every
    token of it, until the next batch came; an idle manager held a finished batch for good."""
    with LoadHarness(2, token_delay_s=0.05) as h:  # 20 tokens: about a second, several monitor ticks
        stream = h.mt.generate(make_request(0, 4, 2, 20))
        next(stream)
        batch = h.mt.call(lambda: weakref.ref(next(iter(h.mt.manager.batches.values()))))
        assert len(list(stream)) == 3
        time.sleep(0.6)  # one more tick
        gc.collect()
        alive = batch()
        assert alive is None, [getattr(r, "__qualname__", type(r).__name__) for r in gc.get_referrers(alive)]


def test_heartbeats_do_not_wait_for_the_threadpool() -> None:
    """Regression: the bearer check was a plain function, which FastAPI runs in its
    threadpool: every heartbeat, registration and batch waited for one of its 40 threads,
    behind whatever else they ran (about 100 ms more per heartbeat at the median, under
    the load test)."""
    with ManagerThread(load_cfg()) as mt:
        limiter = mt.run(_default_limiter())
        release = threading.Event()
        blockers = [
            asyncio.run_coroutine_threadsafe(anyio.to_thread.run_sync(release.wait), mt.loop)
            for _ in range(int(limiter.total_tokens))
        ]
        try:
            t0 = time.monotonic()
            response = httpx.post(
                f"{mt.url}/v1/workers/nobody/heartbeat",
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={
                    "state": "active",
                    "weight_version": 0,
                    "num_running": 0,
                    "num_waiting": 0,
                    "gen_throughput": 0.0,
                },
                timeout=3,
            )
            assert response.status_code == 404  # answered: the worker is unknown
            assert time.monotonic() - t0 < 2
        finally:
            release.set()
            for blocker in blockers:
                blocker.result(10)


async def _default_limiter() -> anyio.CapacityLimiter:
    return anyio.to_thread.current_default_thread_limiter()


def test_manager_start_freezes_the_startup_heap() -> None:
    """Regression: importing torch leaves about 390k objects the collector tracks, and
    every full collection walked them all: a 0.2-0.3 s stall of the manager's loop every
    few seconds under load. What is alive at start lives as long as the service: it is
    frozen, out of the collector's reach."""
    gc.unfreeze()  # what an earlier test froze: start from the whole heap
    num_tracked = len(gc.get_objects())
    assert num_tracked > 100_000  # torch is imported
    with ManagerThread(load_cfg()):
        num_tracked = len(gc.get_objects())
        assert num_tracked < 50_000


async def _slow_sse(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A worker slow to answer (0.1 s) that then streams a line every 10 ms for a second."""
    if scope["type"] != "http":
        return
    await asyncio.sleep(0.1)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(100):
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b": waiting\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def test_cancelled_calls_leave_no_connection_behind() -> None:
    """Regression: the manager cancels a call whenever its worker goes or its batch ends,
    and httpcore leaks the connection when a cancellation lands while it connects, sends,
    or cleans up after an error or an earlier cancellation (encode/httpx#3782,
    encode/httpcore#1093): a dozen or more connections, each an open socket, per round of
    the churn test, for good. Calls are cancelled here at every stage, once or twice in a
    row; afterwards the pool holds no connection that is neither idle nor closed."""
    with ThreadedServer(_slow_sse) as server:  # type: ignore[arg-type]
        worker = WorkerRecord("w", server.url, "fake", 8, 4096, 0)
        call = GenerationCall("r", [1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))

        async def consume(backend: RemoteBackend) -> None:
            async for _ in backend.stream(worker, call):
                pass

        async def main() -> list[str]:
            backend = RemoteBackend(connect_timeout_s=5, stall_timeout_s=5)
            tasks = []
            for delay_s in (0, 0.0005, 0.001, 0.002, 0.005, 0.02, 0.15, 0.3):  # connecting ... streaming
                for times in (1, 2):
                    task = asyncio.ensure_future(consume(backend))
                    tasks.append(task)
                    await asyncio.sleep(delay_s)
                    for _ in range(times):
                        task.cancel()
                        await asyncio.sleep(0)
            await asyncio.gather(*tasks, return_exceptions=True)
            pool = backend.http._transport._pool  # type: ignore[attr-defined]  # what a leak looks like
            deadline = time.monotonic() + 5  # calls still streaming end at their next line
            while any(not (c.is_idle() or c.is_closed()) for c in pool.connections) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            busy = [repr(c) for c in pool.connections if not (c.is_idle() or c.is_closed())]
            await backend.aclose()
            return busy

        assert asyncio.run(main()) == []
