"""Fully asynchronous rollout (`rollout.fully_async`): the fleet is never drained.

A synchronous step waits for its longest response, and the fleet idles through that
tail while the learner idles through generation. Here the trainer keeps (k + 1) steps'
worth of prompts in flight (k = `rollout.max_staleness`; AReaL's admission rule),
tops them up after every publish, and trains each step on the first `train_batch_size`
groups to finish, whichever step submitted them. Workers take each new version between
two decode steps and keep their running samples (`manager.swap_policy = continue`), so a
long response spans versions and every token keeps its own (PipelineRL's in-flight
update). The loss corrects with the behaviour log-probs, as for any lag.

The bound: the step that trains version V takes no token older than V - k. A group
whose oldest token may be V - k would be too old for the next step, so it is *due*: this
step takes it, and waits for it if it is still running; if more than a step's worth are
due, the step takes them all. The manager says which running groups are due
(`RolloutManager.due_groups`): it knows the lowest version of a worker each sample was
placed on, and new work goes only to workers at the latest version, so no group becomes
due between that question and the next publish. Waits for due groups are the bound's
cost (`async/due_wait_s`); prompts the bound keeps out of a fleet with free slots are the
other (`async/held_back_samples`).

Where the fleet outpaces the learner, finished groups queue for the learner and are
trained on near k versions late. `fresh` admission (`rollout.async_admission`) submits
nothing while a step's worth of them waits, so the fleet idles rather than add to the
queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from polyrl.data.source import PromptSource
from polyrl.protocol.manager_api import WorkerList
from polyrl.protocol.samples import Group, Prompt
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.stats import RolloutStats

log = logging.getLogger("polyrl.rollout")


class FedRollout(Protocol):
    """What the feed needs of a rollout: the fleet's (`RemoteRollout`), or agent episodes on
    it (`AgentRollout`), whose groups are items and whose due list is its own."""

    weight_version: WeightVersion

    def fleet(self) -> WorkerList: ...

    def generate(
        self, prompts: list[Prompt], sampling: SamplingParams, stats: RolloutStats | None = None
    ) -> Iterator[Group]:
        """Each prompt's group as it finishes; a prompt its producer drops (an agent episode
        that raised) gives none, and the feed learns so when the iterator ends."""

    def due_groups(self, max_floor_version: int) -> set[str]: ...

    def learner_waiting(self, due: set[str]) -> None: ...

    def note_fleet(self, stats: RolloutStats) -> WorkerList: ...


@dataclass
class Dropped:
    """Prompts a submitted batch ended without (their producer dropped them)."""

    indices: list[int]


@dataclass
class FeedStep:
    """What one step of the feed did, for the step's metrics."""

    stats: RolloutStats = field(default_factory=RolloutStats)
    num_due: int = 0
    """Groups taken because the bound required them now (their oldest token is V - k)."""
    wait_s: float = 0.0
    """Seconds the learner waited for groups."""
    due_wait_s: float = 0.0
    """Seconds the learner waited only for due groups (it had its batch otherwise)."""
    num_regenerated: int = 0
    """Groups that came back too old to train on, whose prompts went out again."""
    held_back_samples: int = 0
    """Samples the fleet had free slots for at the top-up, which the bound kept out."""
    in_flight_groups: int = 0
    """Groups submitted and not trained on, after the top-up."""
    ready_groups: int = 0
    """Groups finished and waiting for the learner when the step began (a backlog: the
    fleet is ahead of the learner)."""
    admission_paused: bool = False
    """`fresh` admission submitted nothing: a step's worth of groups was already waiting."""
    arrived_groups: int = 0
    arrived_tokens: int = 0
    """Groups (and their prompt + completion tokens) that the fleet delivered during the
    step: its delivery rate, against the learner's `perf/total_num_tokens`. Over many
    steps the slower of the two is the run's throughput; a backlog only hides which."""

    def metrics(self) -> dict[str, float]:
        return {
            "async/due_groups": float(self.num_due),
            "async/due_wait_s": self.due_wait_s,
            "async/held_back_samples": float(self.held_back_samples),
            "async/in_flight_groups": float(self.in_flight_groups),
            "async/ready_groups": float(self.ready_groups),
            "async/admission_paused": float(self.admission_paused),
            "async/arrived_groups": float(self.arrived_groups),
            "async/arrived_tokens": float(self.arrived_tokens),
            "async/regenerated_groups": float(self.num_regenerated),
        }


def oldest_version(group: Group) -> int | None:
    """The version of the group's oldest token (None: it has no token)."""
    return min((min(s.weight_versions) for s in group.samples if s.weight_versions), default=None)


class AsyncFeed:
    """Keeps the fleet fed and hands the learner each step's groups (see the module)."""

    def __init__(
        self,
        rollout: FedRollout,
        source: PromptSource,
        sampling: SamplingParams,
        batch_size: int,
        max_staleness: int,
        resubmit: list[int] | None = None,
        fresh: bool = False,
        counts_drops: bool = False,
    ) -> None:
        """`resubmit`: prompt indices a resumed run had in flight, submitted again first.
        `fresh`: submit nothing while a step's worth of finished groups waits.
        `counts_drops`: the producer may drop a prompt (agent episodes): each step logs
        how many it dropped (`rollout/agent_failed_groups`), 0 included."""
        self.rollout, self.source, self.sampling = rollout, source, sampling
        self.batch_size, self.max_staleness, self.fresh = batch_size, max_staleness, fresh
        self.counts_drops = counts_drops
        self.outstanding: dict[str, Prompt] = {}
        """Submitted and not trained on, by prompt id."""
        self.arrived: list[Group] = []
        """Finished and not trained on, in arrival order."""
        self._oldest: dict[str, int | None] = {}
        """Each arrived group's oldest token version, by prompt id: found once on arrival
        (every token of every sample), not at each pick, which scans the whole backlog."""
        self._resubmit = list(resubmit or [])
        self._inbox: queue.SimpleQueue[Group | Dropped | BaseException] = queue.SimpleQueue()
        self._closed = False
        self.step = FeedStep()

    # ------------------------------------------------------------------------------- feeding

    def top_up(self, steps_left: int) -> None:
        """Submit prompts up to (k + 1) steps' worth in flight, or what the run still needs
        (with `fresh`, none while a step's worth of finished groups waits)."""
        self.step = FeedStep(stats=RolloutStats(num_failed_groups=0 if self.counts_drops else None))
        target = min(self.max_staleness + 1, steps_left) * self.batch_size
        free = self.rollout.fleet().num_free_slots
        self._drain()
        self.step.admission_paused = self.fresh and len(self.arrived) >= self.batch_size
        count = 0 if self.step.admission_paused else max(target - len(self.outstanding), 0)
        prompts = self._prompts(count)
        if prompts:
            self._submit(prompts)
        self.step.held_back_samples = max(0, free - len(prompts) * self.sampling.n)
        self.step.in_flight_groups = len(self.outstanding)
        self._drain()
        self.step.ready_groups = len(self.arrived)

    def _prompts(self, count: int) -> list[Prompt]:
        prompts = []
        while self._resubmit and len(prompts) < count:
            prompt = self.source.prompt_at(self._resubmit.pop(0))
            if prompt is not None:
                prompts.append(prompt)
        return prompts + self.source.take(count - len(prompts))

    def _submit(self, prompts: list[Prompt]) -> None:
        for p in prompts:
            self.outstanding[str(p.index)] = p
        groups = self.rollout.generate(prompts, self.sampling, stats=RolloutStats())
        indices = [p.index for p in prompts]
        threading.Thread(target=self._read, args=(groups, indices), name="polyrl-feed", daemon=True).start()

    def _read(self, groups: Iterator[Group], indices: list[int]) -> None:
        """An I/O thread per submitted batch: its groups go to the learner's inbox, and at
        its end the prompts it gave no group for."""
        missing = set(indices)
        try:
            for group in groups:
                missing.discard(group.prompt.index)
                self._inbox.put(group)
        except BaseException as e:  # the learner raises it (a batch that failed for good)
            if not self._closed:
                self._inbox.put(e)
            return
        if missing and not self._closed:
            self._inbox.put(Dropped(sorted(missing)))

    # ------------------------------------------------------------------------------- taking

    def take(self, version: WeightVersion) -> Iterator[Group]:
        """The groups to train version `version` on: every due group, then the first to
        finish, `batch_size` in all (more if more are due)."""
        limit = version - self.max_staleness
        due = self.rollout.due_groups(limit) & self.outstanding.keys()
        taken = 0
        while True:
            self._drain()
            due &= self.outstanding.keys()  # a due group its producer dropped is not waited for
            group = self._pick(limit, due, room=self.batch_size - taken - len(due))
            if group is None:
                if taken >= self.batch_size and not due:
                    break
                self._wait(due, only_due=taken + len(due) >= self.batch_size)
                continue
            gid = str(group.prompt.index)
            due.discard(gid)
            oldest = self._oldest.pop(gid, None)
            if oldest is not None and oldest < limit:  # should not happen: see _pick
                self._regenerate(group, oldest, version)
                continue
            self.step.num_due += oldest == limit
            del self.outstanding[gid]
            self.step.stats.count(group)
            taken += 1
            yield group
        self.step.stats.num_requested = taken * self.sampling.n
        self.step.stats.gen_s = self.step.wait_s
        self.rollout.note_fleet(self.step.stats)

    def _pick(self, limit: int, due: set[str], room: int) -> Group | None:
        """A due group that has arrived (oldest tokens first); else, while there is room
        beside the due groups still running, the first to arrive."""

        def oldest(g: Group) -> int:
            v = self._oldest.get(str(g.prompt.index))
            return limit + 1 if v is None else v

        is_due = [g for g in self.arrived if str(g.prompt.index) in due or oldest(g) <= limit]
        if is_due:
            group = min(is_due, key=oldest)
        elif self.arrived and room > 0:
            group = self.arrived[0]
        else:
            return None
        self.arrived.remove(group)
        return group

    def _regenerate(self, group: Group, oldest: int, version: WeightVersion) -> None:
        """A group too old to train on: its prompt goes out again. Only a group whose result
        was on its way while its batch closed can miss the due list; the bound holds anyway."""
        log.warning(
            "prompt %d: its oldest token (v%d) is more than %d versions behind v%d; generating it again",
            group.prompt.index,
            oldest,
            self.max_staleness,
            version,
        )
        self._submit([group.prompt])  # now: the step may be waiting for it
        self.step.num_regenerated += 1

    def _drain(self) -> None:
        while True:
            try:
                self._arrive(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _wait(self, due: set[str], only_due: bool) -> None:
        """Block for the next group. The learner is idle meanwhile: in hybrid mode the
        trainer's own engine takes work (the `idle` local window), the `due` groups first."""
        self.rollout.learner_waiting(due)
        t0 = time.monotonic()
        self._arrive(self._inbox.get())
        waited = time.monotonic() - t0
        self.step.wait_s += waited
        if only_due:
            self.step.due_wait_s += waited

    def _arrive(self, item: Group | Dropped | BaseException) -> None:
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Dropped):  # logged by the producer; no longer in flight
            for index in item.indices:
                self.outstanding.pop(str(index), None)
            self.step.stats.num_failed_groups = (self.step.stats.num_failed_groups or 0) + len(item.indices)
            return
        self.arrived.append(item)
        self._oldest[str(item.prompt.index)] = oldest_version(item)
        self.step.arrived_groups += 1
        self.step.arrived_tokens += sum(len(item.prompt.prompt_ids) + len(s.completion_ids) for s in item.samples)

    @property
    def pending_indices(self) -> list[int]:
        """Prompts in flight or waiting to be trained on (a checkpoint's): a resumed run
        generates them again."""
        return sorted([p.index for p in self.outstanding.values()] + self._resubmit)

    def close(self) -> None:
        """Stop reading (what is in flight is cancelled when the rollout closes)."""
        self._closed = True
