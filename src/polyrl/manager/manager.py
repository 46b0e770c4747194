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

Composed of parts, each an object that gets the shared state (`state.py`) and the parts
it calls, and calls them by their public methods:

* membership (`membership.py`): register, readiness, heartbeats, leaving, going;
* sync (`sync.py`): a published version makes workers sync; marks them synced;
* the local window's controller (`local_window.py`): its timer, what moves when it
  opens or closes;
* placement (`placement.py`): where waiting work runs;
* settlement (`settlement.py`): runs each call and migrates what it did not finish.

Membership hands changed workers to sync, sync tells the window, placement asks sync for
the local worker and hands calls to settlement, settlement sends unreachable workers
back to membership and failing batches to this class. This class builds them, owns
the batches' life (submit, results, close, fail), runs the monitor, and is the API the
HTTP server, the trainer and the weight-sync hooks call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator

from polyrl.config import ManagerConfig
from polyrl.inference.versions import VersionBook
from polyrl.manager.backends import RemoteBackend
from polyrl.manager.batch import Batch, WorkUnit
from polyrl.manager.fleet import MAX_DECISIONS, History
from polyrl.manager.local_window import WindowControl
from polyrl.manager.membership import Membership
from polyrl.manager.metrics import ManagerMetrics
from polyrl.manager.placement import Placement
from polyrl.manager.registry import Registry, WorkerRecord
from polyrl.manager.settlement import Settlement
from polyrl.manager.state import ManagerState, SyncHook
from polyrl.manager.sync import VersionSync
from polyrl.manager.window import LocalWindow
from polyrl.protocol.manager_api import (
    BatchError,
    BatchFailed,
    BatchFailureKind,
    BatchRequest,
    FleetDecision,
    GroupResult,
    Heartbeat,
    RegisterRequest,
    RegisterResponse,
    WorkerList,
)

__all__ = ["RolloutManager", "SyncHook"]

log = logging.getLogger("polyrl.manager")


class RolloutManager:
    """Workers come and go, and every batch still gets all its samples."""

    def __init__(self, cfg: ManagerConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.started_at = time.time()
        self.state = ManagerState(cfg)
        self.history = History()
        """Fleet throughput and price over time, for the operator page."""
        self.decisions: deque[FleetDecision] = deque(maxlen=MAX_DECISIONS)
        """The trainer's autoscaler's decisions, as it reported them, for the operator page."""
        self.completions = VersionBook()
        """The completions served on the OpenAI/vLLM routes, with their tokens' weight
        versions, for the trainer's Atropos groups (`inference/versions.py`)."""
        self.window_control = WindowControl(self.state)
        self.sync = VersionSync(self.state, self.window_control)
        self.membership = Membership(self.state, self.sync)
        self.settlement = Settlement(self.state, self.membership, self.fail)
        self.placement = Placement(self.state, self.sync, self.settlement)
        self._rng = random.Random(seed)
        self._closed = False

    # the shared state, read by the server, the operator page, the metrics and tests

    @property
    def registry(self) -> Registry:
        return self.state.registry

    @property
    def metrics(self) -> ManagerMetrics:
        return self.state.metrics

    @property
    def remote(self) -> RemoteBackend:
        return self.state.remote

    @property
    def window(self) -> LocalWindow:
        return self.state.window

    @property
    def batches(self) -> dict[str, Batch]:
        return self.state.batches

    @property
    def pending(self) -> deque[WorkUnit]:
        """Work waiting for a worker, oldest first."""
        return self.state.pending

    @property
    def sync_hooks(self) -> list[SyncHook]:
        """Called when a worker needs a version (see `SyncHook`); append to add one."""
        return self.sync.hooks

    @property
    def local_record(self) -> WorkerRecord | None:
        """The trainer's own engine, while it is registered."""
        return self.state.registry.local()

    @property
    def closed(self) -> bool:
        """Shutting down: new work is refused (a 503 to the OpenAI and vLLM routes)."""
        return self._closed

    # ------------------------------------------------------------------------ life of the service

    async def start(self) -> None:
        self.state.spawn(self.placement.dispatch_loop(self.state.start()))
        self.state.spawn(self._monitor_loop())

    async def close(self) -> None:
        """Fail open batches (clients get an error, not a cut stream) and stop everything."""
        self._closed = True
        for batch in list(self.batches.values()):
            self.fail(batch, "shutdown", "the rollout manager is shutting down")
        tasks = set(self.state.background)
        for record in self.registry:
            tasks |= record.tasks
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.remote.aclose()

    def wake(self) -> None:
        self.state.wake()

    # ------------------------------------------------------------------------------- workers

    def register(self, request: RegisterRequest) -> RegisterResponse:
        return self.membership.register(request)

    def heartbeat(self, worker_id: str, beat: Heartbeat) -> bool:
        """False: unknown worker (it registers again)."""
        return self.membership.heartbeat(worker_id, beat)

    def leave(self, worker_id: str, reason: str) -> bool:
        return self.membership.leave(worker_id, reason)

    def worker_unreachable(self, record: WorkerRecord, why: str) -> None:
        """A worker refused or cut a connection outside a generation call."""
        self.membership.worker_gone(record, why, is_failure=True)

    def worker_list(self) -> WorkerList:
        now = time.monotonic()
        cap = self.cfg.max_inflight_per_worker
        serving = [
            r for r in self.registry if not r.is_local and r.state in ("syncing", "active") and now >= r.busy_until
        ]
        free = sum(max(0, r.free_slots(cap)) for r in serving)  # (a syncing worker serves again in a moment)
        waiting = sum(len(u.samples) for u in self.pending)
        return WorkerList(
            latest_weight_version=self.registry.latest_version,
            workers=[r.info(now) for r in self.registry],
            last_window=self.window.last,
            sync_s={k: round(v, 6) for k, v in self.sync.sync_s.items()},
            num_free_slots=max(0, free - waiting),
            num_migrations=self.metrics.num_migrations,
            num_lost_workers=self.membership.num_lost_workers,
            lost_workers=list(self.membership.lost_workers),
        )

    # ---------------------------------------------------------------------- versions and windows

    def publish_version(self, version: int) -> None:
        """The trainer has weights `version`: batches need it from now on by default."""
        self.sync.publish(version)

    def mark_synced(self, worker_id: str, version: int) -> None:
        """The transfer layer's hook: `worker_id` now serves `version`."""
        self.sync.mark_synced(worker_id, version)

    def want_local(self) -> None:
        """Placement needs the local worker: sync it if it is behind (from now on)."""
        self.sync.want_local()

    def learner_started(self) -> None:
        """The trainer's learner has its first mini-batch of the step: the window closes."""
        self.window_control.close("learner starts")

    def learner_waiting(self, prompt_ids: list[str] | None = None) -> None:
        """The trainer's learner waits for groups: the `idle` window opens. The unfinished
        samples of `prompt_ids` (the groups it waits for) move to the trainer's engine,
        which now has its device to itself: a long response's last tokens decode there at
        a small batch's latency instead of inside a full remote batch."""
        self.window_control.learner_waiting(prompt_ids)

    def open_local_window(self, max_s: float | None, until_synced: bool = True) -> None:
        """Open the local window now, whatever `manager.local_window` says (tests and
        benchmarks; the trainer's windows open at each publish). `until_synced=False`
        makes the local worker a peer that finishes what it holds when the window closes."""
        self.window_control.open_now(max_s, until_synced)

    def close_local_window(self, why: str, hand_back: bool | None = None) -> None:
        """No new work for the local worker beyond the fallbacks; with `hand_back` (default:
        as the window was opened) its unfinished samples move to the remote workers
        (re-prefilled there), else it finishes them."""
        self.window_control.close(why, hand_back)

    # ------------------------------------------------------------------------------- batches

    def submit(self, request: BatchRequest, watch: bool = False) -> Batch:
        """Queue a batch. `watch`: also report each sample's tokens as they arrive
        (`Batch.progress`)."""
        if self._closed:
            raise RuntimeError("the rollout manager is shut down")
        required = request.min_weight_version
        if required is None:
            required = self.registry.latest_version
        deadline = time.monotonic() + (request.deadline_s or self.cfg.batch_deadline_s)
        default = request.sampling.seed
        seeds = [
            p.seed if p.seed is not None else default if default is not None else self._rng.getrandbits(62)
            for p in request.prompts
        ]
        batch = Batch.build(f"b{next(self.state.ids)}", request, required, deadline, seeds)
        if watch:
            batch.progress = asyncio.Queue()
        self.batches[batch.batch_id] = batch
        self.pending.extend(batch.fresh_units())
        log.debug(
            "batch %s: %d prompts x %d, weights >= v%d",
            batch.batch_id,
            len(request.prompts),
            request.sampling.n,
            required,
        )
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
            self.fail(batch, "cancelled", f"batch {batch.batch_id} was cancelled by its client")
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

    def due_groups(self, max_floor_version: int) -> list[str]:
        """Prompt ids of the groups of open batches that may hold a token of
        `max_floor_version` or older (see `SampleState.floor_version`), finished ones
        included (their result may still be on its way). New work goes only to workers at
        the latest version, so the answer stays true until the next publish."""
        return [
            group.prompt.id
            for batch in self.batches.values()
            if not batch.failed
            for group in batch.groups
            if group.floor_version is not None and group.floor_version <= max_floor_version
        ]

    def fail(self, batch: Batch, kind: BatchFailureKind, message: str) -> None:
        """End the batch with an error: its client gets it, its calls are cancelled (their
        samples are not requeued), its waiting work is dropped."""
        if batch.finished:
            return
        batch.fail(BatchFailed(batch_id=batch.batch_id, kind=kind, message=message))
        self.metrics.batches.labels(kind).inc()
        if kind != "cancelled":
            self.metrics.lost_samples.inc(batch.unfinished_samples())
            log.warning("batch %s failed: %s", batch.batch_id, message)
        for task in list(batch.tasks):
            task.cancel()  # no Cancel reason: nothing is requeued
        self.state.pending = deque(u for u in self.pending if u.group.batch is not batch)

    # ------------------------------------------------------------------------------- monitor

    async def _monitor_loop(self) -> None:
        tick = min(0.5, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            self._monitor_tick(time.monotonic())

    def _monitor_tick(self, now: float) -> None:
        """A method of its own so that its loop variables die with it: left in the loop's
        frame, they kept the last batch (every token of it) alive while the manager idled."""
        self.membership.drop_silent(now)
        for batch in list(self.batches.values()):
            if not batch.finished and now > batch.deadline:
                self.fail(batch, "deadline", self._deadline_message(batch))
        if self.pending:
            self.wake()  # busy back-offs expire without an event
        self.history.maybe_sample(list(self.registry))

    def _deadline_message(self, batch: Batch) -> str:
        counts = self.registry.counts()
        return (
            f"batch {batch.batch_id} missed its deadline "
            f"({batch.request.deadline_s or self.cfg.batch_deadline_s:g}s): "
            f"{batch.num_groups_done}/{len(batch.groups)} groups done, {batch.unfinished_samples()} samples "
            f"unfinished; workers: {counts['active']} active, {counts['syncing']} syncing, "
            f"{counts['registering']} registering (needs weights >= v{batch.required_version})"
        )
