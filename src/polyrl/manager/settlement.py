"""Running and settling generation calls: each call streams deltas into its samples; when
it ends without finishing them (worker died, froze, errored, was busy, handed back, or
its request was refused), this decides what the worker gets (gone, back-off) and puts
the unfinished samples back at the front of the queue, to continue from their tokens so
far on the next worker with the budget reduced (token-level migration)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator

from polyrl.manager.backends import (
    CallStream,
    Delta,
    GenerationCall,
    RequestRefused,
    WorkerBusy,
    WorkerFailed,
    WorkerUnreachable,
)
from polyrl.manager.batch import SampleState, WorkUnit
from polyrl.manager.membership import Membership
from polyrl.manager.registry import WorkerRecord
from polyrl.manager.state import Cancel, FailBatch, ManagerState

log = logging.getLogger("polyrl.manager")

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


class Outcome:
    """How a generation call ended, when it did not simply finish."""

    error: Exception | None = None


class Settlement:
    """Owns each call from its start to its end: the worker's slots and the task's
    bookkeeping are taken in `launch` and given back when the task ends. A worker found
    unreachable goes through membership; a batch beyond saving through `fail`."""

    def __init__(self, state: ManagerState, membership: Membership, fail: FailBatch) -> None:
        self.state, self.cfg, self.metrics = state, state.cfg, state.metrics
        self.membership, self.fail = membership, fail

    def reserve(self, unit: WorkUnit, worker: WorkerRecord) -> None:
        """Take the worker's slots for `unit`'s samples now, as placement plans the call (its
        next pick must see them); `launch` runs the call, and its end gives them back."""
        worker.add_inflight(len(unit.samples))

    def launch(self, worker: WorkerRecord, pieces: list[tuple[WorkUnit, GenerationCall]]) -> None:
        """Run each call for its unit's samples (their segments started, slots reserved) on
        `worker`; the backend carries calls placed together in one request where it can."""
        streams = self.state.remote.streams(worker, [call for _, call in pieces])
        for (unit, call), stream in zip(pieces, streams, strict=True):
            outcome = Outcome()
            task = asyncio.ensure_future(self._run(unit, worker, call, stream, outcome))
            worker.tasks.add(task)
            unit.group.batch.tasks.add(task)
            self.state.units[task] = unit
            # a done-callback, not a `finally`: a task cancelled before its first step never
            # runs its body, and its samples and slots must come back all the same
            task.add_done_callback(functools.partial(self._call_done, unit, worker, stream, outcome))

    async def _run(
        self,
        unit: WorkUnit,
        worker: WorkerRecord,
        call: GenerationCall,
        stream: AsyncIterator[list[Delta]],
        outcome: Outcome,
    ) -> None:
        try:
            async with contextlib.aclosing(stream):  # closed at once on errors
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
            sample.extend(
                d.token_ids, d.logprobs, d.weight_versions, d.finish_reason, d.top_logprobs, d.routes, d.routes_start
            )
        except ValueError as e:
            raise WorkerFailed(str(e)) from None
        self.metrics.tokens.inc(len(d.token_ids))
        self._count_if_done(sample)

    def _call_done(
        self,
        unit: WorkUnit,
        worker: WorkerRecord,
        stream: AsyncIterator[list[Delta]],
        outcome: Outcome,
        task: asyncio.Task[None],
    ) -> None:
        if isinstance(stream, CallStream):
            stream.close()  # a task cancelled before its first step never opened it to close it
        worker.add_inflight(-len(unit.samples))
        worker.tasks.discard(task)
        unit.group.batch.tasks.discard(task)
        self.state.units.pop(task, None)
        cancel = self.state.cancels.pop(task, None)  # no reason: cancelled because its batch ended
        self._settle(unit, worker, outcome.error, cancel)

    def _settle(self, unit: WorkUnit, worker: WorkerRecord, error: Exception | None, cancel: Cancel | None) -> None:
        """After a call: count what finished, decide about the worker, requeue the rest."""
        batch = unit.group.batch
        for sample in unit.samples:
            sample.end_segment()
            self._count_if_done(sample)
        unfinished = [s for s in unit.samples if not s.done]
        is_failure, why = False, "handed back"
        if isinstance(error, WorkerUnreachable):
            self.membership.worker_gone(worker, str(error), is_failure=True, num_moving=len(unfinished))
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
                self.fail(batch, "invalid_request", f"worker {worker.worker_id} refused a request: {error}")
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
            self.state.wake()
            return
        for sample in unfinished:
            sample.num_failures += is_failure
            if sample.num_failures > self.cfg.retry_budget:
                self.fail(
                    batch,
                    "retry_budget",
                    f"sample {sample.index} of prompt {unit.group.prompt.id!r} met {sample.num_failures} worker "
                    f"failures (retry_budget {self.cfg.retry_budget}); last: {why}",
                )
                return
        batch.num_migrated += len(unfinished)
        self.metrics.migrated("failure" if is_failure else "handback", len(unfinished))
        self.state.requeue([WorkUnit(unit.group, [sample]) for sample in unfinished])
        self.state.wake()

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
        failed_before = self.state.failed_before
        for key in (worker.worker_id, worker.url):
            failed_before.pop(key, None)  # re-inserted last: the dict stays oldest-first
            failed_before[key] = entry
        while len(failed_before) > FAILURE_MEMORY:  # bounded: forget the oldest
            del failed_before[next(iter(failed_before))]

    def _count_if_done(self, sample: SampleState) -> None:
        if sample.done and not sample.counted:
            sample.counted = True
            self.metrics.samples.inc()
            sample.group.batch.sample_done(sample)
