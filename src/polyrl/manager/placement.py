"""Placing waiting work: the least-loaded worker that serves the batch's weight version
and has a free slot (a fresh group goes as one request with `n`, split over workers
when one has too few slots); the local worker only by the local window's rules. A prompt
of a session (an agent episode's next turn) goes back to the worker that served the
session last, when it can take it: that worker's prefix cache holds the conversation."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

from polyrl.manager.backends import GenerationCall
from polyrl.manager.batch import WorkUnit
from polyrl.manager.registry import WorkerRecord
from polyrl.manager.settlement import Settlement
from polyrl.manager.state import ManagerState
from polyrl.manager.sync import VersionSync

MAX_SESSIONS = 65536
"""Sessions remembered (least recently placed forgotten first): far more episodes than a
fleet runs at once, a few MB."""


class Placement:
    """Decides where work runs; settlement runs it. It asks sync for the local worker
    when that is the only one that could take the work."""

    def __init__(self, state: ManagerState, sync: VersionSync, settlement: Settlement) -> None:
        self.state, self.cfg, self.registry, self.window = state, state.cfg, state.registry, state.window
        self.sync, self.settlement = sync, settlement
        self.sessions: OrderedDict[str, str] = OrderedDict()
        """Session -> the worker its last prompt went to."""
        self.num_session_hits = 0
        self.num_session_misses = 0
        """Session prompts placed on their last worker, and elsewhere (it was busy or gone)."""

    async def dispatch_loop(self, wake: asyncio.Event) -> None:
        """Place waiting work each time something wakes the dispatcher (`ManagerState.wake`)."""
        while True:
            await wake.wait()
            wake.clear()
            self._place()

    def _place(self) -> None:
        state = self.state
        now = time.monotonic()
        if (
            state.pending
            and not self._any_free_slot(now)
            and (self.sync.local_wanted or state.registry.local() is None)
        ):
            return  # the common case under load: every worker is full (a lazy local worker is asked below)
        waiting: deque[WorkUnit] = deque()
        planned: dict[str, tuple[WorkerRecord, list[tuple[WorkUnit, GenerationCall]]]] = {}
        no_worker: set[tuple[int, bool, bool]] = set()  # (version, stalled, to_local) with nothing free right now
        while state.pending:
            unit = state.pending.popleft()
            batch = unit.group.batch
            if batch.finished:
                continue
            version = batch.required_version
            stalled = now - batch.submitted_at > self.cfg.local_fallback_s
            to_local = unit.samples[0].to_local
            key = (version, stalled, to_local)
            session = unit.group.prompt.session
            prefer = self.sessions.get(session) if session is not None else None
            picked = None if key in no_worker else self.pick(version, now, stalled, to_local, prefer)
            if picked is None:
                no_worker.add(key)
                waiting.append(unit)
                continue
            worker, slots = picked
            piece, rest = unit.split(slots)
            planned.setdefault(worker.worker_id, (worker, []))[1].append((piece, self._plan(piece, worker)))
            if rest is not None:
                state.pending.appendleft(rest)
        state.pending = waiting
        for worker, pieces in planned.values():  # a worker's calls of this pass go together
            self.settlement.launch(worker, pieces)

    def _any_free_slot(self, now: float) -> bool:
        cap = self.cfg.max_inflight_per_worker
        return any(r.state == "active" and now >= r.busy_until and r.free_slots(cap) > 0 for r in self.registry)

    def pick(
        self, version: int, now: float, stalled: bool = False, to_local: bool = False, prefer: str | None = None
    ) -> tuple[WorkerRecord, int] | None:
        """(worker, free slots): the least loaded remote worker with a free slot; the local
        engine only while the local window is open, when no remote worker is left (none
        registering, syncing or active), or when the batch is `stalled` (older than
        `local_fallback_s`) and no remote worker serves its version: a fleet that is merely
        syncing is waited for, one that cannot sync is not. `to_local`: the learner waits
        for this work, so the local engine comes first while the window is open."""
        cap = self.cfg.max_inflight_per_worker
        local = self.state.registry.local()
        if to_local and self.window.is_open and local is not None and local.serves(version, now):
            if local.free_slots(cap) > 0:
                return local, local.free_slots(cap)
        serving = [r for r in self.registry if not r.is_local and r.serves(version, now)]
        free = [r for r in serving if r.free_slots(cap) > 0]
        mine = next((r for r in free if r.worker_id == prefer), None) if prefer is not None else None
        if mine is not None:
            return mine, mine.free_slots(cap)
        if free:
            worker = min(free, key=lambda r: (r.load(), r.inflight))
            return worker, worker.free_slots(cap)
        alive = self.registry.alive_remote()
        use_local = self.window.takes_any or not alive or (stalled and not serving)
        if use_local and local is not None:
            peers = [r for r in alive if r.state != "registering"]  # one still starting may take a minute
            if self.window.is_peer and peers and not stalled:
                cap = max(1, cap // (1 + len(peers)))  # a peer: its share, not the whole batch
            if local.serves(version, now) and local.free_slots(cap) > 0:
                return local, local.free_slots(cap)
            if not self.sync.local_wanted:
                self.sync.want_local()
        return None

    def _plan(self, unit: WorkUnit, worker: WorkerRecord) -> GenerationCall:
        """The call that runs `unit` on `worker`: its samples' segments start and the
        worker's slots are taken now; settlement launches it after the pass."""
        first = unit.samples[0]
        call = GenerationCall(
            rid=f"{unit.group.batch.batch_id}-{next(self.state.ids)}",
            input_ids=unit.group.prompt.input_ids + first.token_ids,
            # the samples of the call, from the first one's seed, with what is left of its budget
            sampling=unit.group.batch.request.sampling.model_copy(
                update={"n": len(unit.samples), "seed": first.seed, "max_new_tokens": first.remaining}
            ),
        )
        for sample in unit.samples:
            sample.start_segment(worker.worker_id, worker.weight_version)
        session = unit.group.prompt.session
        if session is not None:
            last = self.sessions.pop(session, None)
            if last is not None:
                self.num_session_hits += last == worker.worker_id
                self.num_session_misses += last != worker.worker_id
            self.sessions[session] = worker.worker_id
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.settlement.reserve(unit, worker)
        return call
