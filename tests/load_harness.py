"""Load on a real manager: concurrent batches through a churning fake fleet (tests/fake_fleet.py,
run as a process of its own), an audit of every sample that comes back, and what the
manager holds afterwards.

`run_load` is shared by tests/test_load.py and benchmarks/load.py.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
from fake_fleet import Churn, expected_tokens, load_logprob

from polyrl.config import ManagerConfig
from polyrl.manager.batch import Batch
from polyrl.manager.client import BatchClient
from polyrl.manager.main import ManagerThread
from polyrl.manager.registry import WorkerRecord
from polyrl.protocol.manager_api import (
    BatchPrompt,
    BatchRequest,
    GroupResult,
    Heartbeat,
    RegisterRequest,
    SampleResultOut,
)
from polyrl.protocol.sampling import SamplingParams

MANAGER_PARTS = ("RolloutManager.", "Membership.", "VersionSync.", "WindowControl.", "Placement.", "Settlement.")
"""The classes the manager's own tasks are methods of (manager/manager.py and its parts)."""

TOKEN = "load-token"
PROBE_ID = "probe"
FLEET_SCRIPT = Path(__file__).with_name("fake_fleet.py")


def load_cfg(**overrides: Any) -> ManagerConfig:
    """Timeouts generous for a loaded 2-core box. retry_budget is raised: under this churn a
    sample may meet several kills, and the budget's own behaviour is tested in test_manager."""
    base: dict[str, Any] = {
        "port": 0,
        "token": TOKEN,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 3.0,
        "readiness_timeout_s": 3.0,
        "stall_timeout_s": 10.0,
        "batch_deadline_s": 120,
        "retry_budget": 20,
    }
    return ManagerConfig(**(base | overrides))


def make_request(batch_no: int, num_prompts: int, n: int, max_new_tokens: int) -> BatchRequest:
    """Prompts of varied lengths (resumed calls start at varied offsets); seeds unique
    across batches, spaced by 64 so that sample seeds (prompt seed + index) never collide."""
    prompts = [
        BatchPrompt(id=f"b{batch_no}-p{i}", input_ids=[7 + i % 5] * (1 + i % 4), seed=64 * (batch_no * num_prompts + i))
        for i in range(num_prompts)
    ]
    return BatchRequest(prompts=prompts, sampling=SamplingParams(n=n, max_new_tokens=max_new_tokens))


# ------------------------------------------------------------------------------- the audit


@dataclass
class Audit:
    """What came back against what was asked, sample by sample."""

    num_samples: int = 0
    num_ok: int = 0
    num_lost: int = 0
    num_duplicated: int = 0
    num_corrupted: int = 0
    num_resumed: int = 0
    """Samples made of more than one segment (they moved on with their tokens so far)."""
    num_failures: int = 0
    """Sum of the samples' `num_failures`."""
    problems: list[str] = field(default_factory=list)

    def add(self, request: BatchRequest, groups: list[GroupResult]) -> None:
        prompts = {p.id: p for p in request.prompts}
        budget = request.sampling.max_new_tokens
        self.num_samples += len(prompts) * request.sampling.n
        seen: dict[tuple[str, int], int] = {}
        for g in groups:
            prompt = prompts.get(g.prompt_id)
            if prompt is None:
                self._problem(f"group for unknown prompt {g.prompt_id!r}")
                self.num_corrupted += len(g.samples)
                continue
            for s in g.samples:
                key = (g.prompt_id, s.index)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > 1 or not 0 <= s.index < request.sampling.n:
                    self.num_duplicated += 1
                    self._problem(f"{key} delivered {seen[key]} times")
                    continue
                why = _sample_problem(prompt, s, budget)
                if why:
                    self.num_corrupted += 1
                    self._problem(f"{key}: {why}")
                    continue
                self.num_ok += 1
                self.num_resumed += len(s.segments) > 1
                self.num_failures += s.num_failures
        self.num_lost += sum((p.id, i) not in seen for p in request.prompts for i in range(request.sampling.n))

    def merge(self, other: Audit) -> None:
        for name in (
            "num_samples",
            "num_ok",
            "num_lost",
            "num_duplicated",
            "num_corrupted",
            "num_resumed",
            "num_failures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.problems += other.problems[: 20 - len(self.problems)]

    def _problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def _sample_problem(prompt: BatchPrompt, s: SampleResultOut, budget: int) -> str | None:
    start, seed = len(prompt.input_ids), (prompt.seed or 0) + s.index
    if s.output_ids != expected_tokens(prompt, s.index, budget):
        return f"tokens differ ({len(s.output_ids)} of {budget})"
    if s.logprobs != [load_logprob(seed, start + t) for t in range(budget)]:
        return "log-probs differ"
    if s.weight_versions != [0] * budget or s.finish_reason != "length":
        return f"versions or finish reason wrong ({s.finish_reason})"
    if sum(seg.num_tokens for seg in s.segments) != budget or any(seg.num_tokens <= 0 for seg in s.segments):
        return f"segments {[(seg.worker, seg.num_tokens) for seg in s.segments]} do not add up to {budget}"
    return None


# ------------------------------------------------------------------------------- the fleet


class FleetProcess:
    """tests/fake_fleet.py in a process of its own, driven over its control routes."""

    def __init__(self, manager_url: str, *, max_num_seqs: int, token_delay_s: float, seed: int) -> None:
        command = [
            sys.executable,
            str(FLEET_SCRIPT),
            "--manager",
            manager_url,
            "--token",
            TOKEN,
            "--max-num-seqs",
            str(max_num_seqs),
            "--token-delay-s",
            str(token_delay_s),
            "--seed",
            str(seed),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # its only line on stdout; logs go to stderr
        assert line.startswith("fake fleet serving on "), f"the fake fleet did not start: {line!r}"
        self.url = line.split()[-1]
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def control(self, action: str, **body: Any) -> Any:
        response = self.http.post(f"/_fleet/{action}", json=body)
        response.raise_for_status()
        return response.json()

    def join(self, count: int) -> list[str]:
        return self.control("join", count=count)

    def alive_ids(self) -> set[str]:
        """Engines that serve and mean to stay (not draining, not dead)."""
        return set(self.control("alive"))

    def stats(self) -> dict[str, Any]:
        return self.control("stats")

    def close(self) -> None:
        self.http.close()
        self.proc.kill()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


# ---------------------------------------------------------------------------- the clients


class _Reader(threading.Thread):
    """Reads one batch, in-process or over HTTP, from a background thread."""

    def __init__(self, mt: ManagerThread, request: BatchRequest, over_http: bool) -> None:
        super().__init__(daemon=True)
        self.mt, self.request, self.over_http = mt, request, over_http
        self.groups: list[GroupResult] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            if self.over_http:
                with BatchClient(self.mt.url, token=TOKEN) as client:
                    self.groups.extend(client.generate(self.request))
            else:
                self.groups.extend(self.mt.generate(self.request))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e


class Probe(threading.Thread):
    """Times the manager's control path from a thread of its own: GET /health, and a real
    heartbeat of a registered engine (`probe`: it serves like the others, is never
    churned, and reports nothing running, which only zeroes its external load); and the
    manager loop's lag, how late a 10 ms sleep wakes up on it (anything blocking the loop
    shows there first)."""

    def __init__(self, mt: ManagerThread, fleet: FleetProcess, max_num_seqs: int, interval_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.mt, self.interval_s = mt, interval_s
        # arrays of doubles, not lists of floats: the memory test counts heap blocks
        self.health_s, self.heartbeat_s, self.lag_s = array("d"), array("d"), array("d")
        self.num_reregistrations = 0
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.registration = RegisterRequest(
            worker_id=PROBE_ID,
            url=fleet.control("probe", worker_id=PROBE_ID),
            model_path="fake",
            weight_version=0,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            capabilities=["incremental_stream"],
        )
        self._lag = asyncio.run_coroutine_threadsafe(self._measure_lag(), mt.loop)
        self.start()

    async def _measure_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.01)
            self.lag_s.append(loop.time() - t0 - 0.01)

    def run(self) -> None:
        beat = Heartbeat(state="active", weight_version=0, num_running=0, num_waiting=0, gen_throughput=0.0)
        with httpx.Client(base_url=self.mt.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
            c.post("/v1/workers/register", json=self.registration.model_dump()).raise_for_status()
            while not self.stopping.wait(self.interval_s):
                try:
                    t0 = time.perf_counter()
                    c.get("/health").raise_for_status()
                    t1 = time.perf_counter()
                    response = c.post(f"/v1/workers/{PROBE_ID}/heartbeat", json=beat.model_dump())
                    self.health_s.append(t1 - t0)
                    self.heartbeat_s.append(time.perf_counter() - t1)
                    if response.status_code == 404:  # declared gone: our beats came too late
                        self.num_reregistrations += 1
                        c.post("/v1/workers/register", json=self.registration.model_dump()).raise_for_status()
                    else:
                        response.raise_for_status()
                except httpx.HTTPError as e:
                    self.errors.append(f"probe: {e!r}")

    def marks(self) -> tuple[int, int, int]:
        return len(self.health_s), len(self.heartbeat_s), len(self.lag_s)

    def finish(self) -> None:
        self.stopping.set()
        self.join(10)
        self._lag.result(10)


def quantile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


# ------------------------------------------------------------------------------ the harness


@dataclass
class RoundResult:
    audit: Audit
    errors: list[str]
    elapsed_s: float
    health_s: Sequence[float]
    heartbeat_s: Sequence[float]
    lag_s: Sequence[float]
    fleet: dict[str, int]
    """What the fleet did during the round: joins, kills, drains, cut streams, hand-backs..."""


class LoadHarness:
    """A ManagerThread, a fleet of `num_workers` fake engines and the latency Probe."""

    def __init__(
        self,
        num_workers: int,
        cfg: ManagerConfig | None = None,
        *,
        max_num_seqs: int = 8,
        token_delay_s: float = 0.02,
        seed: int = 0,
    ) -> None:
        self.num_workers, self.max_num_seqs = num_workers, max_num_seqs
        self.mt = ManagerThread(cfg or load_cfg())
        self.fleet_options: dict[str, Any] = {
            "max_num_seqs": max_num_seqs,
            "token_delay_s": token_delay_s,
            "seed": seed,
        }
        self.fleet: FleetProcess | None = None
        self.probe: Probe | None = None
        self._batch_no = itertools.count()

    def __enter__(self) -> Self:
        self.mt.start()
        self._track_objects()
        try:
            self.fleet = FleetProcess(self.mt.url, **self.fleet_options)
            self.probe = Probe(self.mt, self.fleet, self.max_num_seqs)
            self.fleet.join(self.num_workers)
            self.settle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _track_objects(self) -> None:
        """Keep a weak reference to every worker record, batch, group and sample the
        manager makes, to tell afterwards which are still alive. Not a census of the heap:
        the service freezes it at start, and frozen objects are not listed."""
        self.tracked: weakref.WeakSet[Any] = weakref.WeakSet()
        m = self.mt.manager
        add, submit = m.registry.add, m.submit

        def tracked_add(request: RegisterRequest, worker_id: str) -> WorkerRecord:
            record = add(request, worker_id)
            self.tracked.add(record)
            return record

        def tracked_submit(request: BatchRequest) -> Batch:
            batch = submit(request)
            self.tracked.update([batch, *batch.groups, *(s for g in batch.groups for s in g.samples)])
            return batch

        m.registry.add, m.submit = tracked_add, tracked_submit  # type: ignore[method-assign]

    def live_objects(self) -> dict[str, int]:
        """The manager's objects still alive, by type, after a full collection."""
        gc.collect()
        counts = dict.fromkeys(("Batch", "GroupState", "SampleState", "WorkerRecord"), 0)
        for obj in list(self.tracked):
            counts[type(obj).__name__] += 1
        return counts

    def __exit__(self, *exc: object) -> None:
        try:
            if self.probe is not None:
                self.probe.finish()
            if self.fleet is not None:
                self.fleet.close()
        finally:
            self.mt.stop()

    def run_round(
        self,
        num_batches: int,
        num_prompts: int,
        n: int,
        max_new_tokens: int,
        churn: Churn | None,
        timeout_s: float = 120,
    ) -> RoundResult:
        """`num_batches` concurrent batches (every other one over HTTP) while the fleet
        churns; returns once all are read and the fleet has settled again."""
        assert self.fleet is not None and self.probe is not None
        fleet, probe = self.fleet, self.probe
        stats0, marks = fleet.stats(), probe.marks()
        requests = [make_request(next(self._batch_no), num_prompts, n, max_new_tokens) for _ in range(num_batches)]
        t0 = time.monotonic()
        if churn is not None:
            fleet.control("churn", **asdict(churn))
        readers = [_Reader(self.mt, r, over_http=i % 2 == 1) for i, r in enumerate(requests)]
        deadline = time.monotonic() + timeout_s
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        elapsed_s = time.monotonic() - t0
        fleet.control("churn/stop")
        health_s, heartbeat_s, lag_s = (
            values[mark:] for values, mark in zip((probe.health_s, probe.heartbeat_s, probe.lag_s), marks, strict=True)
        )
        audit, errors = Audit(), []
        for reader in readers:
            if reader.is_alive():
                errors.append(f"batch of {reader.request.prompts[0].id} did not finish in {timeout_s:g}s")
            elif reader.error is not None:
                errors.append(f"batch of {reader.request.prompts[0].id}: {reader.error!r}")
            audit.add(reader.request, reader.groups)
        self.settle()
        stats = fleet.stats()
        return RoundResult(
            audit=audit,
            errors=errors + stats["errors"][len(stats0["errors"]) :] + probe.errors[:5],
            elapsed_s=elapsed_s,
            health_s=health_s,
            heartbeat_s=heartbeat_s,
            lag_s=lag_s,
            fleet={k: v - stats0[k] for k, v in stats.items() if isinstance(v, int)},
        )

    def settle(self, timeout_s: float = 30) -> None:
        """Wait until the manager knows exactly the live engines, all active and idle
        (killed ones go by heartbeat timeout)."""
        assert self.fleet is not None
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.fleet.alive_ids() | {PROBE_ID}
            workers = {w.worker_id: w for w in self.mt.worker_list().workers}
            if set(workers) == alive and all(w.state == "active" and w.num_inflight == 0 for w in workers.values()):
                return
            if time.monotonic() > deadline:
                states = sorted((w.worker_id, w.state, w.num_inflight) for w in workers.values())
                raise AssertionError(
                    f"fleet did not settle: the manager has {states}, the fleet has {sorted(alive)}; "
                    f"fleet errors: {self.fleet.stats()['errors'][:5]}"
                )
            time.sleep(0.1)

    def leftovers(self) -> dict[str, Any]:
        """What the manager still holds per batch and per call (all empty when idle), and
        the tasks on its loop, less HTTP requests being served right then (heartbeats)."""
        m = self.mt.manager

        def read() -> dict[str, Any]:
            # an async generator's aclose() runs as a task too, and has no __qualname__
            names = [getattr(t.get_coro(), "__qualname__", type(t.get_coro()).__name__) for t in asyncio.all_tasks()]
            pool = m.remote.http._transport._pool  # a leaked connection: neither idle nor closed
            return {
                "batches": len(m.batches),
                "pending": len(m.pending),
                "cancels": len(m.state.cancels),
                "inflight": sum(r.inflight for r in m.registry),
                "worker_tasks": sum(len(r.tasks) for r in m.registry),
                "busy_connections": sum(not (c.is_idle() or c.is_closed()) for c in pool.connections),
                "manager_tasks": sorted(n for n in names if n.startswith(MANAGER_PARTS)),
                "loop_tasks": sum(n != "RequestResponseCycle.run_asgi" for n in names),
            }

        return self.mt.call(read)

    def leftovers_when_idle(self, timeout_s: float = 5) -> dict[str, Any]:
        """`leftovers` once only the manager's two loops and no busy connection are left: a
        readiness check of a worker that went away meanwhile may still sleep out its
        half-second retry, a cancelled call's HTTP side ends at its next line. A leak
        stays, and is returned after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            leftovers = self.leftovers()
            idle = len(leftovers["manager_tasks"]) <= 2 and leftovers["busy_connections"] == 0
            if idle or time.monotonic() > deadline:
                return leftovers
            time.sleep(0.1)

    def counters(self) -> dict[str, float]:
        registry = self.mt.manager.metrics.registry

        def read() -> dict[str, float]:
            def get(name: str, **labels: str) -> float:
                return registry.get_sample_value(name, labels) or 0.0

            return {
                "samples": get("polyrl_manager_samples_total"),
                "batches_ok": get("polyrl_manager_batches_total", outcome="ok"),
                "migrated_failure": get("polyrl_manager_migrations_total", cause="failure"),
                "migrated_handback": get("polyrl_manager_migrations_total", cause="handback"),
                **{
                    f"workers_{e}": get("polyrl_manager_worker_events_total", event=e)
                    for e in ("registered", "failed", "left")
                },
                "generate_requests": self.mt.manager.remote.num_requests,
                "generate_calls": self.mt.manager.remote.num_calls,
            }

        return self.mt.call(read)


def heap_size() -> dict[str, int]:
    """This process's Python heap after a full collection: memory blocks the interpreter
    holds, objects the collector tracks, and the RSS. Not tracemalloc: tracing every
    allocation made this workload 20 to 50 times slower."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"heap_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects()), "rss_bytes": rss_bytes}


# ------------------------------------------------------------------------------ run_load


def run_load(
    num_workers: int = 32,
    num_batches: int = 4,
    num_prompts: int = 128,
    n: int = 4,
    max_new_tokens: int = 8,
    rounds: int = 1,
    churn: Churn | None = Churn(),
    *,
    max_num_seqs: int = 8,
    token_delay_s: float = 0.02,
    measure_memory: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """`rounds` rounds of `num_batches` concurrent batches of `num_prompts` x `n` samples
    through a churning fleet of about `num_workers`; returns what was measured (the
    numbers of benchmarks/load.py) and what the manager holds afterwards. With
    `measure_memory`, the heap after each round (compared from the second on: the first
    warms up connection pools and caches)."""
    with LoadHarness(num_workers, max_num_seqs=max_num_seqs, token_delay_s=token_delay_s, seed=seed) as h:
        assert h.probe is not None
        base, counters0 = h.leftovers(), h.counters()
        rows: list[dict[str, Any]] = []
        total, errors = Audit(), []
        latencies = {"health": array("d"), "heartbeat": array("d"), "lag": array("d")}
        fleet: dict[str, int] = {}
        for _ in range(rounds):
            r = h.run_round(num_batches, num_prompts, n, max_new_tokens, churn)
            row: dict[str, Any] = {
                "samples": r.audit.num_samples,
                "lost": r.audit.num_lost,
                "duplicated": r.audit.num_duplicated,
                "corrupted": r.audit.num_corrupted,
                "elapsed_s": round(r.elapsed_s, 2),
                **r.fleet,
                "heartbeat_p99_s": round(quantile(r.heartbeat_s, 0.99), 4),
                "leftovers": h.leftovers_when_idle(),
            }
            if measure_memory:
                row |= heap_size()
            rows.append(row)
            total.merge(r.audit)
            errors += r.errors
            for name, values in (("health", r.health_s), ("heartbeat", r.heartbeat_s), ("lag", r.lag_s)):
                latencies[name] += values
            fleet = {k: fleet.get(k, 0) + v for k, v in r.fleet.items()}
        counters = {k: v - counters0[k] for k, v in h.counters().items()}
        return {
            "workers": num_workers,
            "rounds": rows,
            "samples": total.num_samples,
            "ok": total.num_ok,
            "lost": total.num_lost,
            "duplicated": total.num_duplicated,
            "corrupted": total.num_corrupted,
            "resumed": total.num_resumed,
            "sample_failures": total.num_failures,
            "problems": total.problems,
            "errors": errors,
            "fleet": fleet,
            "counters": counters,
            "churn_events": fleet["num_joined"] + fleet["num_killed"] + fleet["num_drained"],
            "probe_reregistrations": h.probe.num_reregistrations,
            **{
                f"{name}_{q}_s": quantile(values, p)
                for name, values in latencies.items()
                for q, p in (("p50", 0.5), ("p99", 0.99))
            },
            "lag_max_s": max(latencies["lag"], default=0.0),
            "elapsed_s": sum(row["elapsed_s"] for row in rows),
            "memory_growth": _growth(rows) if measure_memory else None,
            "base": base,
            "leftovers": h.leftovers_when_idle(),
            "live_objects": h.live_objects(),
            "registry_size": len(h.mt.worker_list().workers),
        }


def _growth(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """Heap growth from the end of the second round to the end of the last (None for
    fewer than three rounds: the first warms up connection pools and caches)."""
    if len(rows) < 3:
        return None
    return {k: rows[-1][k] - rows[1][k] for k in ("heap_blocks", "gc_objects", "rss_bytes")}


def table(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The headline numbers, in the order benchmarks/load.py prints them."""
    c, f, growth = result["counters"], result["fleet"], result["memory_growth"]

    def ms(name: str) -> str:
        return f"{1e3 * result[f'{name}_p50_s']:.1f} / {1e3 * result[f'{name}_p99_s']:.1f}"

    rows = [
        ("workers (at start)", str(result["workers"])),
        (
            "churn events (joined / killed / drained)",
            f"{result['churn_events']} ({f['num_joined']} / {f['num_killed']} / {f['num_drained']})",
        ),
        ("samples", str(result["samples"])),
        ("lost / duplicated / corrupted", f"{result['lost']} / {result['duplicated']} / {result['corrupted']}"),
        ("migrated (failure / handback)", f"{c['migrated_failure']:.0f} / {c['migrated_handback']:.0f}"),
        ("resumed samples (> 1 segment)", str(result["resumed"])),
        ("GET /health p50 / p99 (ms)", ms("health")),
        ("heartbeat p50 / p99 (ms)", ms("heartbeat")),
        ("manager loop lag p50 / p99 (ms)", ms("lag")),
        ("load time (s)", f"{result['elapsed_s']:.1f}"),
    ]
    if growth is not None:
        rows += [
            ("heap growth after warm-up (blocks)", f"{growth['heap_blocks']:+d}"),
            ("gc objects growth after warm-up", f"{growth['gc_objects']:+d}"),
            ("RSS growth after warm-up (KiB)", f"{growth['rss_bytes'] // 1024:+d}"),
        ]
    return rows
