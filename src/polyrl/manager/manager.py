"""The rollout manager: workers come and go, and every batch still gets all its samples.

One asyncio loop owns all state, so nothing here locks. Three things run on it:

* the dispatcher places waiting work on the least-loaded worker that serves the batch's
  weight version and has a free slot (a fresh group goes as one request with `n`, split
  over workers when one has too few slots);
* one task per generation call streams cumulative snapshots into the samples; when it
  ends without finishing them (worker died, froze, errored, handed back while
  draining), the unfinished samples go back to the front of the queue and continue
  from their tokens so far on the next worker, with the budget reduced;
* the monitor declares silent workers gone and fails batches past their deadline.

The trainer's own engine is an ordinary worker process that registers as `local`; it is
placed by the local window's rules (`window.py`), and synced like any other worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from polyrl.config import ManagerConfig
from polyrl.manager.backends import (
    Delta,
    GenerationCall,
    RemoteBackend,
    RequestRefused,
    WorkerBusy,
    WorkerFailed,
    WorkerUnreachable,
)
from polyrl.manager.batch import Batch, SampleState, WorkUnit
from polyrl.manager.metrics import ManagerMetrics
from polyrl.manager.protocol import (
    BatchError,
    BatchFailed,
    BatchFailureKind,
    BatchRequest,
    GroupResult,
    Heartbeat,
    RegisterRequest,
    RegisterResponse,
    WorkerList,
)
from polyrl.manager.registry import LOCAL_WORKER_ID, Registry, WorkerRecord
from polyrl.manager.window import SYNCED, LocalWindow, Opening

log = logging.getLogger("polyrl.manager")

SyncHook = Callable[[WorkerRecord, int], Awaitable[int | None] | int | None]
"""Called with (worker, version) when a worker needs weights `version` (the transfer
layer); returns the version the worker serves once it has it (None: not delivered). The
manager marks the worker synced itself."""

BUSY_BACKOFF_S = 1.0
"""A worker that answered 429/503 gets no new work for this long."""

FAILURE_BACKOFF_S = (0.5, 30.0)
"""After a failed call a worker gets no new work for 0.5 s, doubling with each failure in a
row up to 30 s: a worker behind a broken link must not eat every sample's retry budget
(it is the least loaded, so it would be picked first every time)."""

FAILURE_MEMORY = 4096
"""Workers (ids and URLs) whose back-off outlives their registration."""

REFUSALS_TOLERATED = 1
"""A sample's request refused (4xx) more often than this fails its batch as invalid."""


class _Outcome:
    """How a generation call ended, when it did not simply finish."""

    error: Exception | None = None


class _Cancel:
    """Why a generation task was cancelled; no reason means its batch ended."""

    def __init__(self, why: str, is_failure: bool) -> None:
        self.why, self.is_failure = why, is_failure


class RolloutManager:
    def __init__(self, cfg: ManagerConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.registry = Registry()
        self.metrics = ManagerMetrics(self)
        self.remote = RemoteBackend(cfg.connect_timeout_s, cfg.stall_timeout_s, cfg.token, cfg.stream_interval_s)
        self.pending: deque[WorkUnit] = deque()
        self.batches: dict[str, Batch] = {}
        self.sync_hooks: list[SyncHook] = []
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._cancels: dict[asyncio.Task[None], _Cancel] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._failed_before: dict[str, tuple[int, float]] = {}
        """Worker id or URL -> (failures in a row, back-off end) of a worker that failed
        lately, for when it registers again."""
        self._wake: asyncio.Event | None = None
        self._closed = False
        self.window = LocalWindow(cfg.local_window, cfg.local_window_max_s)
        self._window_timer: asyncio.TimerHandle | None = None
        self._published_at = time.monotonic()
        self.sync_s: dict[str, float] = {}
        """Worker id -> seconds from `publish_version` of the latest version to the worker
        serving it (the weight update as the trainer sees it)."""

    @property
    def local_record(self) -> WorkerRecord | None:
        """The trainer's own engine, while it is registered."""
        record = self.registry.get(LOCAL_WORKER_ID)
        return record if record is not None and record.is_local else None

    # ------------------------------------------------------------------------ life of the service

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._spawn(self._dispatch_loop())
        self._spawn(self._monitor_loop())

    async def close(self) -> None:
        """Fail open batches (clients get an error, not a cut stream) and stop everything."""
        self._closed = True
        for batch in list(self.batches.values()):
            self._fail(batch, "shutdown", "the rollout manager is shutting down")
        tasks = set(self._background)
        for record in self.registry:
            tasks |= record.tasks
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.remote.aclose()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("manager task failed: %r", task.exception(), exc_info=task.exception())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---------------------------------------------------------------------------- membership

    def register(self, request: RegisterRequest) -> RegisterResponse:
        url = request.url.rstrip("/")
        worker_id = LOCAL_WORKER_ID if request.local else request.worker_id
        previous = [r for r in self.registry if r.worker_id == worker_id or r.url == url]
        for old in previous:  # a restarted worker: its old streams are dead
            self._worker_gone(old, "registered again", is_failure=True)
        record = self.registry.add(request, worker_id)
        for key in (request.worker_id, url):  # coming back does not wipe its record of failing
            failures, until = self._failed_before.get(key, (0, 0.0))
            record.consecutive_failures = max(record.consecutive_failures, failures)
            record.busy_until = max(record.busy_until, until)
        self.metrics.worker_events.labels("registered").inc()
        self._spawn(self._admit(record))
        return RegisterResponse(worker_id=record.worker_id, heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def _admit(self, record: WorkerRecord) -> None:
        """Readiness: /health_generate must succeed within readiness_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.readiness_timeout_s
        why = "no answer"
        while record.state == "registering":
            remaining = deadline - loop.time()
            if remaining <= 0:
                self._worker_gone(record, f"not ready within {self.cfg.readiness_timeout_s:g}s: {why}", is_failure=False)
                return
            try:
                response = await self.remote.get(record, "/health_generate", timeout_s=min(remaining, 10.0))
                if response.status_code == 200:
                    break
                why = f"HTTP {response.status_code}"
            except httpx.ConnectError as e:  # it listened before registering: refused means dead
                self._worker_gone(record, f"readiness check: {type(e).__name__}: {e}", is_failure=True)
                return
            except Exception as e:  # anything: a worker must never stay `registering` forever
                why = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(0.5, max(remaining, 0)))
        if record.state != "registering":
            return  # left or replaced meanwhile
        self.registry.ready(record)
        self._after_version_change(record)

    def heartbeat(self, worker_id: str, beat: Heartbeat) -> bool:
        """False: unknown worker (it registers again)."""
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.registry.heartbeat(record, beat)
        self._after_version_change(record)
        return True

    def leave(self, worker_id: str, reason: str) -> bool:
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.metrics.worker_events.labels("left").inc()
        self._worker_gone(record, f"left: {reason}", is_failure=False)
        return True

    def publish_version(self, version: int) -> None:
        """The trainer has weights `version`: batches need it from now on by default."""
        if version < self.registry.latest_version:
            raise ValueError(f"version {version} is older than the latest ({self.registry.latest_version})")
        self._published_at = time.monotonic()
        self.sync_s = {}
        for record in self.registry.publish(version):
            self._call_sync_hooks(record, version)
        opening = self.window.on_publish()
        if opening is not None:
            self._open_window(opening)

    def learner_started(self) -> None:
        """The trainer's learner has its first mini-batch of the step: the window closes."""
        self.close_local_window("learner starts")

    def mark_synced(self, worker_id: str, version: int) -> None:
        """The transfer layer's hook: `worker_id` now serves `version`."""
        record = self.registry.get(worker_id)
        if record is not None:
            if version >= self.registry.latest_version:
                self.sync_s[worker_id] = time.monotonic() - self._published_at
            self.registry.set_version(record, version)
            self._after_version_change(record)

    def _after_version_change(self, record: WorkerRecord) -> None:
        if record.state == "syncing":
            self._call_sync_hooks(record, self.registry.latest_version)
        if self.window.closes_when_synced and self._fleet_synced():
            self.close_local_window(SYNCED)
        self.wake()

    def _alive_remote(self) -> list[WorkerRecord]:
        """Remote workers that serve now or soon (not leaving, not gone)."""
        return [r for r in self.registry if not r.is_local and r.state in ("registering", "syncing", "active")]

    def _fleet_synced(self) -> bool:
        alive = self._alive_remote()
        return bool(alive) and all(r.state == "active" for r in alive)

    # ------------------------------------------------------------------------- local window

    def open_local_window(self, max_s: float | None, until_synced: bool = True) -> None:
        """Open the local window now, whatever `manager.local_window` says (tests and
        benchmarks; the trainer's windows open at each publish). `until_synced=False`
        makes the local worker a peer that finishes what it holds when the window closes."""
        self._open_window(self.window.open_now(Opening(max_s, until_synced, hand_back=until_synced)))

    def _open_window(self, opening: Opening) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        if opening.max_s is not None:
            self._window_timer = asyncio.get_running_loop().call_later(
                opening.max_s, self.close_local_window, "window elapsed"
            )
        if opening.until_synced and self._fleet_synced():
            self.close_local_window(SYNCED)
        self.wake()

    def close_local_window(self, why: str, hand_back: bool | None = None) -> None:
        """No new work for the local worker beyond the fallbacks; with `hand_back` (default:
        as the window was opened) its unfinished samples move to the remote workers
        (re-prefilled there), else it finishes them."""
        opening = self.window.close(why)
        if opening is None:
            return
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        local = self.local_record
        if hand_back is None:
            hand_back = opening.hand_back
        if hand_back and local is not None and local.tasks and self._alive_remote():
            log.debug("local window closed (%s): handing %d samples to remote workers", why, local.inflight)
            for task in list(local.tasks):
                self._cancels[task] = _Cancel(f"local window closed ({why})", is_failure=False)
                task.cancel()
        self.wake()

    def _call_sync_hooks(self, record: WorkerRecord, version: int) -> None:
        """Once per (worker, version): a heartbeat during a long transfer starts no other."""
        if record.sync_requested >= version:
            return
        record.sync_requested = version
        for hook in self.sync_hooks:
            try:
                result = hook(record, version)
            except Exception as e:
                log.error("sync hook for worker %s failed: %r", record.worker_id, e)
                continue
            if inspect.isawaitable(result):
                self._spawn(self._synced_after(record, result))
            elif result is not None:
                self.mark_synced(record.worker_id, result)

    async def _synced_after(self, record: WorkerRecord, delivery: Awaitable[int | None]) -> None:
        served = await delivery
        if served is not None and record.state != "gone":
            self.mark_synced(record.worker_id, served)

    def _worker_gone(self, record: WorkerRecord, why: str, is_failure: bool) -> None:
        """Forget the worker and move its unfinished work to others."""
        if record.state == "gone":
            return
        self.registry.remove(record, why)
        if is_failure:
            record.num_failures += 1
            self.metrics.worker_events.labels("failed").inc()
        if record.tasks:
            log.info("worker %s: migrating %d samples (%s)", record.worker_id, record.inflight, why)
        for task in list(record.tasks):
            self._cancels[task] = _Cancel(why, is_failure)
            task.cancel()
        self.wake()

    def worker_unreachable(self, record: WorkerRecord, why: str) -> None:
        """A worker refused or cut a connection outside a generation call."""
        self._worker_gone(record, why, is_failure=True)

    def worker_list(self) -> WorkerList:
        now = time.monotonic()
        return WorkerList(
            latest_weight_version=self.registry.latest_version,
            workers=[r.info(now) for r in self.registry],
            last_window=self.window.last,
            sync_s={k: round(v, 6) for k, v in self.sync_s.items()},
        )

    # ------------------------------------------------------------------------------- batches

    def submit(self, request: BatchRequest) -> Batch:
        if self._closed:
            raise RuntimeError("the rollout manager is shut down")
        required = request.min_weight_version
        if required is None:
            required = self.registry.latest_version
        deadline = time.monotonic() + (request.deadline_s or self.cfg.batch_deadline_s)
        seeds = [p.seed if p.seed is not None else self._rng.getrandbits(62) for p in request.prompts]
        batch = Batch.build(f"b{next(self._ids)}", request, required, deadline, seeds)
        self.batches[batch.batch_id] = batch
        self.pending.extend(batch.fresh_units())
        log.debug("batch %s: %d prompts x %d, weights >= v%d", batch.batch_id, len(request.prompts), request.n, required)
        self.wake()
        return batch

    async def results(self, batch: Batch) -> AsyncIterator[GroupResult]:
        """The batch's groups in completion order; raises BatchError if it fails. The
        caller calls `close_batch` when done with it (also after an early exit)."""
        for _ in range(len(batch.groups)):
            item = await batch.results.get()
            if isinstance(item, BatchFailed):
                raise BatchError(item)
            yield item
        self.metrics.batches.labels("ok").inc()
        log.debug("batch %s done in %.2fs", batch.batch_id, time.monotonic() - batch.submitted_at)

    def close_batch(self, batch: Batch) -> None:
        """Forget the batch; what is left of it is cancelled (its workers abort it)."""
        if batch.num_groups_done < len(batch.groups):
            self._fail(batch, "cancelled", f"batch {batch.batch_id} was cancelled by its client")
        self.batches.pop(batch.batch_id, None)

    async def generate(self, request: BatchRequest) -> AsyncIterator[GroupResult]:
        """submit + results + close_batch: groups in completion order; closing the
        iterator early cancels the rest of the batch."""
        batch = self.submit(request)
        try:
            async for group in self.results(batch):
                yield group
        finally:
            self.close_batch(batch)

    def _fail(self, batch: Batch, kind: BatchFailureKind, message: str) -> None:
        if batch.finished:
            return
        batch.fail(BatchFailed(batch_id=batch.batch_id, kind=kind, message=message))
        self.metrics.batches.labels(kind).inc()
        if kind != "cancelled":
            log.warning("batch %s failed: %s", batch.batch_id, message)
        for task in list(batch.tasks):
            task.cancel()  # no _Cancel reason: nothing is requeued
        self.pending = deque(u for u in self.pending if u.group.batch is not batch)

    # ------------------------------------------------------------------------------- placing

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._place()

    def _place(self) -> None:
        now = time.monotonic()
        if self.pending and not self._any_free_slot(now):
            return  # the common case under load: every worker is full
        waiting: deque[WorkUnit] = deque()
        no_worker: set[tuple[int, bool]] = set()  # (version, stalled) with nothing free right now
        while self.pending:
            unit = self.pending.popleft()
            batch = unit.group.batch
            if batch.finished:
                continue
            version = batch.required_version
            stalled = now - batch.submitted_at > self.cfg.local_fallback_s
            key = (version, stalled)
            picked = None if key in no_worker else self._pick(version, now, stalled)
            if picked is None:
                no_worker.add(key)
                waiting.append(unit)
                continue
            worker, slots = picked
            piece, rest = unit.split(slots)
            self._launch(piece, worker)
            if rest is not None:
                self.pending.appendleft(rest)
        self.pending = waiting

    def _any_free_slot(self, now: float) -> bool:
        cap = self.cfg.max_inflight_per_worker
        return any(r.state == "active" and now >= r.busy_until and r.free_slots(cap) > 0 for r in self.registry)

    def _pick(self, version: int, now: float, stalled: bool = False) -> tuple[WorkerRecord, int] | None:
        """(worker, free slots): the least loaded remote worker with a free slot; the local
        engine only while the local window is open, when no remote worker is left (none
        registering, syncing or active), or when the batch is `stalled` (older than
        `local_fallback_s`) and no remote worker serves its version: a fleet that is merely
        syncing is waited for, one that cannot sync is not."""
        cap = self.cfg.max_inflight_per_worker
        serving = [r for r in self.registry if not r.is_local and r.serves(version, now)]
        free = [r for r in serving if r.free_slots(cap) > 0]
        if free:
            worker = min(free, key=lambda r: (r.load(), r.inflight))
            return worker, worker.free_slots(cap)
        local = self.local_record
        alive = self._alive_remote()
        use_local = self.window.is_open or not alive or (stalled and not serving)
        if use_local and local is not None:
            peers = [r for r in alive if r.state != "registering"]  # one still starting may take a minute
            if self.window.is_peer and peers and not stalled:
                cap = max(1, cap // (1 + len(peers)))  # a peer: its share, not the whole batch
            if local.serves(version, now) and local.free_slots(cap) > 0:
                return local, local.free_slots(cap)
        return None

    def _launch(self, unit: WorkUnit, worker: WorkerRecord) -> None:
        first = unit.samples[0]
        call = GenerationCall(
            rid=f"{unit.group.batch.batch_id}-{next(self._ids)}",
            input_ids=unit.group.prompt.input_ids + first.token_ids,
            num_samples=len(unit.samples),
            seed=first.seed,
            remaining_tokens=first.remaining,
            sampling=unit.group.batch.request.sampling,
        )
        for sample in unit.samples:
            sample.start_segment(worker.worker_id)
        worker.inflight += len(unit.samples)
        outcome = _Outcome()
        task = asyncio.ensure_future(self._run(unit, worker, call, outcome))
        worker.tasks.add(task)
        unit.group.batch.tasks.add(task)
        # a done-callback, not a `finally`: a task cancelled before its first step never
        # runs its body, and its samples and slots must come back all the same
        task.add_done_callback(functools.partial(self._call_done, unit, worker, outcome))

    # ----------------------------------------------------------------------------- generating

    async def _run(self, unit: WorkUnit, worker: WorkerRecord, call: GenerationCall, outcome: _Outcome) -> None:
        try:
            async with contextlib.aclosing(self.remote.stream(worker, call)) as stream:  # closed at once on errors
                async for deltas in stream:
                    for d in deltas:
                        self._apply(unit, d)
        except (WorkerUnreachable, WorkerFailed, WorkerBusy, RequestRefused) as e:
            outcome.error = e
        except Exception as e:  # a bug here must not lose the samples: retry them elsewhere
            log.exception("generation call %s on %s failed unexpectedly", call.rid, worker.worker_id)
            outcome.error = WorkerFailed(f"internal error: {type(e).__name__}: {e}")

    def _apply(self, unit: WorkUnit, d: Delta) -> None:
        if not 0 <= d.index < len(unit.samples):
            raise WorkerFailed(f"worker sent sample index {d.index} of {len(unit.samples)}")
        sample = unit.samples[d.index]
        if sample.done:
            raise WorkerFailed(f"worker sent more for finished sample {d.index}")
        try:
            sample.extend(d.token_ids, d.logprobs, d.weight_versions, d.finish_reason)
        except ValueError as e:
            raise WorkerFailed(str(e)) from None
        self.metrics.tokens.inc(len(d.token_ids))
        self._count_if_done(sample)

    def _call_done(self, unit: WorkUnit, worker: WorkerRecord, outcome: _Outcome, task: asyncio.Task[None]) -> None:
        worker.inflight -= len(unit.samples)
        worker.tasks.discard(task)
        unit.group.batch.tasks.discard(task)
        cancel = self._cancels.pop(task, None)  # no reason: cancelled because its batch ended
        self._settle(unit, worker, outcome.error, cancel)

    def _settle(self, unit: WorkUnit, worker: WorkerRecord, error: Exception | None, cancel: _Cancel | None) -> None:
        """After a call: count what finished, decide about the worker, requeue the rest."""
        batch = unit.group.batch
        for sample in unit.samples:
            sample.end_segment()
            self._count_if_done(sample)
        unfinished = [s for s in unit.samples if not s.done]
        is_failure, why = False, "handed back"
        if isinstance(error, WorkerUnreachable):
            self._worker_gone(worker, str(error), is_failure=True)
            is_failure, why = True, str(error)
        elif isinstance(error, WorkerFailed):
            worker.num_failures += 1
            is_failure, why = True, str(error)
            log.warning("worker %s failed a request: %s", worker.worker_id, error)
        elif isinstance(error, WorkerBusy):
            worker.busy_until = time.monotonic() + BUSY_BACKOFF_S
            why = str(error)
        elif isinstance(error, RequestRefused):
            # Usually the request's own fault, but a request damaged on the way (headers
            # the body checksum does not cover) is refused the same way: one more try.
            for sample in unit.samples:
                sample.num_refusals += 1
            if any(s.num_refusals > REFUSALS_TOLERATED for s in unit.samples):
                self._fail(batch, "invalid_request", f"worker {worker.worker_id} refused a request: {error}")
            else:
                is_failure, why = True, f"refused: {error}"
                log.warning("worker %s refused a request (retrying it once): %s", worker.worker_id, error)
        elif cancel is not None:
            is_failure, why = cancel.is_failure, cancel.why
        if is_failure:
            self._back_off(worker)
        elif error is None and cancel is None:
            worker.consecutive_failures = 0
        if batch.finished or not unfinished:
            self.wake()
            return
        for sample in unfinished:
            sample.num_failures += is_failure
            if sample.num_failures > self.cfg.retry_budget:
                self._fail(
                    batch, "retry_budget",
                    f"sample {sample.index} of prompt {unit.group.prompt.id!r} met {sample.num_failures} worker "
                    f"failures (retry_budget {self.cfg.retry_budget}); last: {why}",
                )  # fmt: skip
                return
        batch.num_migrated += len(unfinished)
        self.metrics.migrations.labels("failure" if is_failure else "handback").inc(len(unfinished))
        for sample in reversed(unfinished):  # to the front: the oldest work goes first
            self.pending.appendleft(WorkUnit(unit.group, [sample]))
        self.wake()

    def _back_off(self, worker: WorkerRecord) -> None:
        """No new work for the worker for a while, longer with each failure in a row; the
        calls that fail together (a cut link) count once."""
        now = time.monotonic()
        if now < worker.busy_until:
            return
        worker.consecutive_failures += 1
        low, high = FAILURE_BACKOFF_S
        worker.busy_until = now + min(high, low * 2 ** (worker.consecutive_failures - 1))
        entry = (worker.consecutive_failures, worker.busy_until)
        for key in (worker.worker_id, worker.url):
            self._failed_before.pop(key, None)  # re-inserted last: the dict stays oldest-first
            self._failed_before[key] = entry
        while len(self._failed_before) > FAILURE_MEMORY:  # bounded: forget the oldest
            del self._failed_before[next(iter(self._failed_before))]

    def _count_if_done(self, sample: SampleState) -> None:
        if sample.done and not sample.counted:
            sample.counted = True
            self.metrics.samples.inc()
            sample.group.batch.sample_done(sample)

    # ------------------------------------------------------------------------------- monitor

    async def _monitor_loop(self) -> None:
        tick = min(0.5, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            self._monitor_tick(time.monotonic())

    def _monitor_tick(self, now: float) -> None:
        """A method of its own so that its loop variables die with it: left in the loop's
        frame, they kept the last batch (every token of it) alive while the manager idled."""
        for record in self.registry:
            silent = now - record.last_seen
            # registering too: a worker killed during its readiness check heartbeats no
            # more, while a check through a relay would only fail at readiness_timeout_s
            if silent > self.cfg.heartbeat_timeout_s:
                self._worker_gone(record, f"no heartbeat for {silent:.1f}s", is_failure=True)
        for batch in list(self.batches.values()):
            if not batch.finished and now > batch.deadline:
                self._fail(batch, "deadline", self._deadline_message(batch))
        if self.pending:
            self.wake()  # busy back-offs expire without an event

    def _deadline_message(self, batch: Batch) -> str:
        counts = self.registry.counts()
        return (
            f"batch {batch.batch_id} missed its deadline "
            f"({batch.request.deadline_s or self.cfg.batch_deadline_s:g}s): "
            f"{batch.num_groups_done}/{len(batch.groups)} groups done, {batch.unfinished_samples()} samples "
            f"unfinished; workers: {counts['active']} active, {counts['syncing']} syncing, "
            f"{counts['registering']} registering (needs weights >= v{batch.required_version})"
        )

