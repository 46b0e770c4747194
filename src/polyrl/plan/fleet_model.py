"""A discrete-event model of training steps on a fleet: what `polyrl plan` predicts with.

It plays the run's own schedule over measured rates (`Calibration`), one decode step at a
time on each engine, so that what decides a step on real hardware decides it here too:
* the long tail: a group is ready when its longest sample is (on a shared host, once the
  trainer has read it), and an engine's step takes as long as its batch's decode step,
  however few sequences are left in it;
* placement: samples go to the least-loaded worker with a free slot (`max_num_seqs`), and
  to the trainer's own engines only when no worker has one, as the manager places them;
  a fully asynchronous run places new work only on engines that hold the latest version;
* the learner: a step-synchronous run trains each mini-batch as soon as its groups are
  in (the remote modes) or after the whole batch (colocated), then publishes, and the
  workers pull before the next step starts; a fully asynchronous run trains on the first
  `prompts` groups to finish, takes every group its staleness bound makes due, and keeps
  (k + 1) steps of prompts in flight;
* shared devices: processes on one device run at `capacity / demand` of their full speed
  while their busy demands add up past its capacity (processor sharing): the CPU box's
  cores, or the trainer's GPU shared by its learner and its own engine;
* preemptions: a worker lost at random (or killed in a given step) moves its running
  samples, tokens kept, to the queue (they re-prefill where they land) and comes back
  after `restart_s`;
* context: a decode step also pays for the context its batch holds (the KV reads, which
  on a GPU at RL lengths outweigh the weights), and an engine's KV cache bounds what it
  admits; a step that would overflow it sends its latest sequences back to wait on it, tokens kept;
* one GPU under MPS: the processes run side by side at the slowdowns the calibration
  measured, and while the learner trains among more busy clients than the GPU has SM
  shares for, each gets its part of them;
* the learner's first mini-batch takes its compile time too, and the fleet runs ahead;
* a shared CPU host's thread governor (`polyrl.cpu_threads`): the learner's threads, and
  so its speed and its demand on the cores, follow the load as the trainer's governor
  moves them, checked after each micro-batch.

Deterministic for a seed; a step of the 8B seeds' setup takes well under a second.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Literal

from polyrl import cpu_threads
from polyrl.plan.calibration import Calibration

Mode = Literal["colocated", "remote", "fully_async"]


@dataclass(frozen=True)
class Workload:
    prompts: int
    """Groups a step trains on (`trainer.train_batch_size`)."""
    n: int
    """Samples per prompt (`rollout.n`)."""
    prompt_tokens: int
    budgets: tuple[int, ...]
    """Response lengths, one per group, drawn in turn (samples of a prompt share it: the
    long-tail workloads' budgets, and what the learner waits on is the group)."""
    mini_batches: int = 1
    """Optimizer steps per step (train_batch_size / ppo_mini_batch_size)."""
    micro_batch_tokens: int | None = None
    """The learner's micro-batches (`trainer.micro_batch_max_tokens`): on a shared host the
    thread governor checks the load after each. None: one per mini-batch."""

    @staticmethod
    def fixed(
        prompts: int,
        n: int,
        prompt_tokens: int,
        length: int,
        mini_batches: int = 1,
        micro_batch_tokens: int | None = None,
    ) -> Workload:
        return Workload(prompts, n, prompt_tokens, (length,), mini_batches, micro_batch_tokens)

    @staticmethod
    def long_tail(
        prompts: int,
        n: int,
        prompt_tokens: int,
        median: int,
        p99: int,
        cap: int,
        mini_batches: int = 1,
        seed: int = 0,
        micro_batch_tokens: int | None = None,
    ) -> Workload:
        """Lognormal budgets with the given median and 99th percentile, capped."""
        sigma = math.log(p99 / median) / 2.326
        rng = random.Random(seed)
        budgets = tuple(max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(prompts * 64))
        return Workload(prompts, n, prompt_tokens, budgets, mini_batches, micro_batch_tokens)


@dataclass(frozen=True)
class Fleet:
    workers: int
    mode: Mode = "remote"
    staleness: int = 1
    """fully_async's k."""
    trainer_engine: bool = False
    """The trainer's own engine takes work too; colocated mode always has it and nothing
    else. Colocated, it decodes in the trainer's process (`Calibration.trainer_decode`);
    beside a fleet it is a worker process on the trainer's device, at a worker's rate."""
    trainer_until: Literal["always", "learner"] = "always"
    """With `trainer_engine` in a step-synchronous run: `learner` (`hybrid_local_until =
    learner`, RLBoost's schedule) hands the trainer's running samples to the workers, tokens
    kept, when the step's first mini-batch starts training, and takes no more work until
    the next step; `always` keeps generating beside the learner."""
    trainer_engines: int = 1
    """Engines on the trainer's devices (one per tensor-parallel group); they and the
    learner share those devices."""
    max_num_seqs: int = 256
    trainer_max_num_seqs: int = 256
    trainer_usd_per_hour: float = 10.47
    worker_usd_per_hour: float = 2.66
    preempt_per_hour: float = 0.0
    restart_s: float = 60.0
    kill_in_step: int | None = None
    """The first worker is killed halfway into this step (by the step before's length,
    counted from 1 with the warm-up steps), and comes back `restart_s` later."""
    kv_tokens: int | None = None
    """A worker's KV cache, in tokens (None: no limit). Admission needs the running
    sequences' context plus the new prompt to fit; a step that would overflow it sends
    the latest-joined sequences back to the queue, tokens kept (recomputed where they
    land), as the engine's preemption does."""
    trainer_kv_tokens: int | None = None
    batched_tokens: int | None = None
    """A worker engine's token budget a step (`engine.max_num_batched_tokens`; None: no
    limit): decodes first, then prefill chunks, so a batch of moved samples re-prefills
    over many steps, each slower by its chunk, and joins as its chunks finish."""
    trainer_batched_tokens: int | None = None
    admit_wait_steps: int = 0
    """Engines whose decode steps overlap (CUDA): decode steps a busy batch of at least
    `admit_batch` sequences runs before it admits fewer than `admit_batch` waiting samples
    (`engine.admit_wait_steps`), so that arrivals share one step that also prefills
    (`Calibration.prefill_step_s`). 0: admitted at the next step (a CPU engine)."""
    admit_batch: int = 8


@dataclass
class Prediction:
    step_s: float
    tokens_per_step: float
    usd_per_hour: float
    learner_idle_s: float
    fleet_idle_ratio: float
    lag_mean: float
    lag_max: int
    steps: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tokens_per_usd(self) -> float:
        return self.tokens_per_s * 3600 / self.usd_per_hour


@dataclass(eq=False)
class _Group:
    length: int
    samples_left: int
    version: int | None = None
    """The lowest version any of its samples started at."""
    ready_at: float | None = None


@dataclass(eq=False)
class _Seq:
    group: _Group
    left: int
    """Tokens still to decode when it joined its engine."""
    done: int = 0
    """Tokens decoded before it joined (re-prefilled with the prompt after a move)."""
    prefill_left: int = 0
    """Tokens of its prefill not yet computed on its engine."""
    start: int = 0
    """Its engine's decode-step count when it joined."""


@dataclass(eq=False)
class _Actor:
    """One process that does work on a shared device."""

    device: str
    demand: float
    work_left: float = 0.0
    """Seconds of work at full speed in its current task (0: idle)."""
    busy: bool = False


@dataclass(eq=False)
class _Engine(_Actor):
    name: str = ""
    slots: int = 256
    remote: bool = True
    version: int = 0
    running: list[tuple[int, int, _Seq]] = field(default_factory=list)
    """A heap of (the engine's step count at which it ends, a tie-break, the sample)."""
    ticks: int = 0
    """Decode steps done so far: a sample's progress is read from it, not kept per token."""
    joined: list[_Seq] = field(default_factory=list)
    waiting: list[_Seq] = field(default_factory=list)
    """Placed here, not yet admitted: its KV cache had no room (the manager counts them as
    the worker's, and the engine admits them as sequences finish)."""
    up: bool = True
    open: bool = True
    """Takes work (a trainer's engine is closed from its hand-back to the next step)."""
    paused_until: float = 0.0
    idle_s: float = 0.0
    context: float = 0.0
    """Tokens of context its running and joined sequences hold (their KV cache)."""
    kv_tokens: int | None = None
    batched_tokens: int | None = None
    waited: int = 0
    """Decode steps a waiting sample has waited to be admitted (`Fleet.admit_wait_steps`)."""
    steps: int = 0
    prefill_steps: int = 0
    """Of its `steps`, those that also prefilled (a worker's `num_prefill_steps`)."""


@dataclass(eq=False)
class _Governor:
    """The trainer's CPU thread governor (`polyrl.cpu_threads.CpuThreads`), played on the
    model's shared host with its own thresholds, read from the model's load instead of
    /proc: a mini-batch is one measurement, checked after each micro-batch; a thread goes
    when the learner's threads waited for a core, and comes back after `RAISE_S` of idle
    cores. Beside a busy worker on 2 cores the learner runs on one thread, and after the
    worker stops it stays there for a while (BENCHMARKS.md: the fleet model on this box)."""

    threads: int
    max_threads: int
    start: float | None = None
    """When the open measurement began (None: none open)."""
    wait_s: float = 0.0
    """The learner's threads' run-queue wait since `start`, thread-seconds."""
    idle_s: float = 0.0
    """Idle core-seconds on the host since `start`."""
    last_exit: float = -math.inf

    def account(self, dt: float, wait_share: float, idle_cores: float) -> None:
        if self.start is not None:
            self.wait_s += self.threads * wait_share * dt
            self.idle_s += idle_cores * dt

    def enter(self, now: float) -> None:
        if self.start is None or now - self.last_exit > cpu_threads.MAX_GAP_S:
            self._open(now)

    def checkpoint(self, now: float) -> None:
        if self.start is None or now - self.start < cpu_threads.CHECK_S:
            return
        self._adjust(now, may_add=now - self.start >= cpu_threads.RAISE_S)
        self._open(now)

    def exit(self, now: float) -> None:
        self.last_exit = now
        if self.start is not None and now - self.start >= cpu_threads.MIN_MEASURE_S:
            self._adjust(now, may_add=True)
            self.start = None

    def _open(self, now: float) -> None:
        self.start, self.wait_s, self.idle_s = now, 0.0, 0.0

    def _adjust(self, now: float, may_add: bool) -> None:
        wall = now - (self.start or now)
        if wall > 0:
            wait_ratio, idle_cores = self.wait_s / (wall * self.threads), self.idle_s / wall
            self.threads = cpu_threads.next_count(self.threads, self.max_threads, wait_ratio, idle_cores, may_add)


class FleetModel:
    def __init__(self, cal: Calibration, workload: Workload, fleet: Fleet, seed: int = 0) -> None:
        if fleet.mode != "colocated" and fleet.workers < 1 and not fleet.trainer_engine:
            raise ValueError("a remote mode needs workers or the trainer's engine")
        self.cal, self.w, self.f = cal, workload, fleet
        self.rng = random.Random(seed)
        self.now = 0.0
        self.version = 0
        self.queue: list[_Seq] = []
        self.timers: list[tuple[float, int, str, object]] = []
        self._tick = 0
        shared = cal.host_cores is not None
        self.capacity = {"host": cal.host_cores} if shared else {"trainer": float(fleet.trainer_engines)}
        trainer_dev = "host" if shared else "trainer"
        mps = cal.shared_gpu and not shared
        if mps:  # every process is a client of one GPU with its own share of the SMs
            self.capacity = {"learner": 1.0}
            trainer_dev = "learner"
        self.learner = _Actor(trainer_dev, cal.learner_cores if shared else float(fleet.trainer_engines))
        threads = round(cal.learner_cores)
        self.governor = _Governor(threads, threads) if shared and threads > 1 else None
        self.streams = _Actor("host", 1.0)
        """The manager's reading of the workers' token streams (shared hosts)."""
        self.reader = _Actor("host", 1.0)
        """The trainer's reading of finished groups from the manager (shared hosts): one
        thread, a group at a time, and the learner has a group once it is read."""
        self.unread: list[_Group] = []
        self.reads_streams = shared and cal.stream_cpu_s_per_token > 0 and fleet.mode != "colocated"
        """Finished tokens pass through the manager's and the trainer's readers (a colocated
        engine runs in the trainer's process: no stream)."""
        self.engines: list[_Engine] = []
        if fleet.mode == "colocated" or fleet.trainer_engine:
            for i in range(fleet.trainer_engines):
                dev = f"trainer{i}" if mps else trainer_dev
                self.capacity.setdefault(dev, 1.0)
                self.engines.append(
                    _Engine(
                        dev,
                        cal.engine_cores if shared else 1.0,
                        name=f"trainer{i}",
                        slots=fleet.trainer_max_num_seqs,
                        remote=False,
                        kv_tokens=fleet.trainer_kv_tokens,
                        batched_tokens=fleet.trainer_batched_tokens,
                    )
                )
        if fleet.mode != "colocated":
            for i in range(fleet.workers):
                dev = "host" if shared else f"w{i}"
                self.capacity.setdefault(dev, 1.0)
                self.engines.append(
                    _Engine(
                        dev,
                        cal.engine_cores if shared else 1.0,
                        name=f"w{i}",
                        slots=fleet.max_num_seqs,
                        kv_tokens=fleet.kv_tokens,
                        batched_tokens=fleet.batched_tokens,
                    )
                )
                self._schedule_preemption(self.engines[-1])
        self._budget = 0
        self.in_flight: list[_Group] = []
        self.ready: list[_Group] = []
        self.lags: list[int] = []
        self.kv_preemptions = 0
        self._trained = False

    # ------------------------------------------------------------------ the schedule

    def run(self, steps: int, warmup: int = 2) -> Prediction:
        times, tokens, idle = [], [], []
        idle0 = 0.0
        start = 0.0
        for s in range(warmup + steps):
            if s == warmup:
                idle0 = self._fleet_idle()
                start = self.now
            if self.f.kill_in_step == s + 1 and any(e.remote for e in self.engines):
                half = times[-1] / 2 if times else 0.0
                self._timer(self.now + half, "preempt", next(e for e in self.engines if e.remote))
            t0 = self.now
            trained, waited = self._step()
            times.append(self.now - t0)
            tokens.append(trained)
            idle.append(waited)
        span = self.now - start
        remote = [e for e in self.engines if e.remote] or self.engines
        fleet_idle = (self._fleet_idle() - idle0) / (span * len(remote)) if span else 0.0
        usd = (
            self.f.trainer_usd_per_hour
            + (self.f.workers if self.f.mode != "colocated" else 0) * self.f.worker_usd_per_hour
        )
        m = times[warmup:]
        lags = self.lags
        return Prediction(
            step_s=statistics.fmean(m),
            tokens_per_step=statistics.fmean(tokens[warmup:]),
            usd_per_hour=usd,
            learner_idle_s=statistics.fmean(idle[warmup:]),
            fleet_idle_ratio=fleet_idle,
            lag_mean=statistics.fmean(lags) if lags else 0.0,
            lag_max=max(lags, default=0),
            steps=m,
        )

    def _step(self) -> tuple[float, float]:
        """One trainer step; returns (tokens trained, seconds the learner waited)."""
        if self.f.mode == "fully_async":
            return self._async_step()
        groups = [self._submit() for _ in range(self.w.prompts)]
        waited = 0.0
        per = math.ceil(self.w.prompts / self.w.mini_batches)
        if self.f.mode == "colocated":
            t0 = self.now
            self._until(lambda: all(g.ready_at is not None for g in groups))
            waited = self.now - t0
            self._train(groups)
        else:
            for e in self.engines:
                e.open = True
            arrival: list[_Group] = []
            for _ in range(self.w.mini_batches):
                t0 = self.now
                self._until(lambda: len(self._arrived(groups)) >= min(len(groups), len(arrival) + per))
                waited += self.now - t0
                batch = [g for g in self._arrived(groups) if g not in arrival][:per]
                arrival += batch
                if self.f.trainer_until == "learner" and any(e.remote for e in self.engines):
                    self._hand_back()
                self._train(batch, mini_batches=1)
        self.ready = [g for g in self.ready if g not in groups]
        self._publish(wait_for_pull=True)
        for g in groups:
            self.lags.append(0)
        return self._tokens(groups), waited

    def _async_step(self) -> tuple[float, float]:
        k = self.f.staleness
        target = (k + 1) * self.w.prompts
        while len(self.in_flight) < target:
            self.in_flight.append(self._submit())
        t0 = self.now

        def due() -> list[_Group]:
            return [g for g in self.in_flight if g.version is not None and g.version <= self.version - k]

        self._until(lambda: len(self.ready) >= self.w.prompts and all(g.ready_at is not None for g in due()))
        waited = self.now - t0
        taken = due()
        taken += sorted((g for g in self.ready if g not in taken), key=lambda g: g.ready_at)[
            : self.w.prompts - len(taken)
        ]
        for g in taken:
            self.lags.append(self.version - (g.version or 0))
        self.ready = [g for g in self.ready if g not in taken]
        self.in_flight = [g for g in self.in_flight if g not in taken]
        self._train(taken)
        self._publish(wait_for_pull=False)
        return self._tokens(taken), waited

    # ------------------------------------------------------------------ pieces

    def _submit(self) -> _Group:
        length = self.w.budgets[self._budget % len(self.w.budgets)]
        self._budget += 1
        g = _Group(length, self.w.n)
        self.queue += [_Seq(g, length) for _ in range(self.w.n)]
        return g

    def _arrived(self, groups: list[_Group]) -> list[_Group]:
        return sorted((g for g in groups if g.ready_at is not None), key=lambda g: g.ready_at)

    def _tokens(self, groups: list[_Group]) -> float:
        return sum((self.w.prompt_tokens + g.length) * self.w.n for g in groups)

    def _train(self, groups: list[_Group], mini_batches: int | None = None) -> None:
        """`mini_batches` optimizer steps over `groups`, each in micro-batches (the governor,
        where there is one, is checked after each)."""
        steps = self.w.mini_batches if mini_batches is None else mini_batches
        tokens = self._tokens(groups) / steps
        micro = max(1, math.ceil(tokens / self.w.micro_batch_tokens)) if self.w.micro_batch_tokens else 1
        gov = self.governor
        for _ in range(steps):
            if gov:
                gov.enter(self.now)
            for i in range(micro):
                work = tokens / micro / self.cal.learner_tokens_per_s
                if i == micro - 1:
                    work += self.cal.optimizer_step_s
                if not self._trained:
                    work += self.cal.learner_compile_s
                    self._trained = True
                self.learner.work_left, self.learner.busy = work, True
                self._until(lambda: not self.learner.busy)
                if gov:
                    gov.checkpoint(self.now)
                    self.learner.demand = gov.threads
            if gov:
                gov.exit(self.now)
                self.learner.demand = gov.threads

    def _publish(self, wait_for_pull: bool) -> None:
        # a colocated engine decodes from the trainer's own weights: a version bump, no snapshot
        self._advance(self.cal.step_overhead_s + (self.cal.publish_s if self.f.mode != "colocated" else 0.0))
        self.version += 1
        pull = self.cal.pull_s()
        for e in self.engines:
            if not e.remote or (self.cal.shared_gpu and e.up):
                # the trainer's own engines, and on one GPU the workers too, decode from the
                # published device copy in place: no pull (BENCHMARKS.md, the MPS rows)
                e.version = self.version
            elif e.up:
                self._timer(self.now + pull, "version", (e, self.version))
        if wait_for_pull and any(e.remote and e.up for e in self.engines):
            self._until(lambda: all(e.version == self.version for e in self.engines if e.up))

    def _advance(self, seconds: float) -> None:
        if seconds > 0:
            end = self.now + seconds
            self._until(lambda: self.now >= end - 1e-12, deadline=end)

    def _timer(self, at: float, kind: str, payload: object) -> None:
        self._tick += 1
        heapq.heappush(self.timers, (at, self._tick, kind, payload))

    def _hand_back(self) -> None:
        """The trainer's engines stop; their samples go to the queue's front, tokens kept."""
        for e in self.engines:
            if not e.remote and e.open:
                e.open = False
                self.queue = self._evict(e) + self.queue

    def _evict(self, e: _Engine) -> list[_Seq]:
        """An engine's samples, its running step abandoned, each with the tokens it has."""
        for end, _, s in e.running:
            s.done += e.ticks - s.start
            s.left = end - e.ticks
        moved = [s for _, _, s in e.running] + e.joined + e.waiting
        e.running, e.joined, e.waiting, e.busy, e.work_left, e.context = [], [], [], False, 0.0, 0.0
        return moved

    def _overflow(self, e: _Engine) -> None:
        """Out of KV cache for the next step's tokens: the latest-joined running sequences
        go back to the front of the engine's own waiting list, tokens kept, until the rest
        fit (the engine's preemption: they stay on that engine)."""
        if e.kv_tokens is None:
            return
        while e.running and e.context + len(e.running) > e.kv_tokens:
            latest = max(e.running, key=lambda r: (r[2].start, r[1]))
            e.running.remove(latest)
            heapq.heapify(e.running)
            end, _, seq = latest
            seq.done += e.ticks - seq.start
            seq.left = end - e.ticks
            e.context -= self.w.prompt_tokens + seq.done
            e.waiting.insert(0, seq)
            self.kv_preemptions += 1

    def _schedule_preemption(self, e: _Engine) -> None:
        if self.f.preempt_per_hour > 0:
            self._timer(self.now + self.rng.expovariate(self.f.preempt_per_hour / 3600), "preempt", e)

    def _fleet_idle(self) -> float:
        remote = [e for e in self.engines if e.remote] or self.engines
        return sum(e.idle_s for e in remote)

    # ------------------------------------------------------------------ the event loop

    def _can_take(self, e: _Engine) -> bool:
        if not e.up or not e.open or self.now < e.paused_until:
            return False
        return self.f.mode != "fully_async" or e.version == self.version

    def _slots(self, e: _Engine) -> int:
        """Samples `e` may hold: a trainer's engine that is a peer of the workers
        (`hybrid_local_until = learner`) takes its share of a worker's, as the manager caps it."""
        if e.remote or self.f.trainer_until != "learner":
            return e.slots
        peers = sum(1 for x in self.engines if x.remote and x.up)
        return min(e.slots, max(1, self.f.max_num_seqs // (1 + peers))) if peers else e.slots

    @staticmethod
    def _held(e: _Engine) -> int:
        return len(e.running) + len(e.joined) + len(e.waiting)

    def _fill(self) -> None:
        """Placement, as the manager places: queued samples to the least-loaded worker with
        a free slot, and to the trainer's own engines only when no worker has one. The
        manager counts slots, not KV: what an engine's cache cannot take yet waits there."""
        if not self.queue:
            return
        free = [e for e in self.engines if self._can_take(e) and self._held(e) < self._slots(e)]
        while self.queue and free:
            e = min([x for x in free if x.remote] or free, key=self._held)
            seq = self.queue.pop(0)
            if seq.group.version is None or e.version < seq.group.version:
                seq.group.version = e.version if seq.group.version is None else min(seq.group.version, e.version)
            e.waiting.append(seq)
            if self._held(e) >= self._slots(e):
                free.remove(e)

    def _admit(self, e: _Engine) -> None:
        """An engine's waiting sequences join its batch, oldest first, while its KV cache
        has room for their context and the next step's tokens."""
        while e.waiting:
            need = self.w.prompt_tokens + e.waiting[0].done
            growth = len(e.running) + len(e.joined) + 1
            if e.kv_tokens is not None and e.context + need + growth > e.kv_tokens and (e.running or e.joined):
                return  # full until sequences finish
            e.context += need
            e.waiting[0].prefill_left = need
            e.joined.append(e.waiting.pop(0))

    def _start_steps(self) -> None:
        for e in self.engines:
            if e.busy or not e.up or self.now < e.paused_until:
                continue
            if self._admits_now(e):
                self._admit(e)
            if e.joined or e.running:
                chunk = self._prefill_chunk(e)
                self._overflow(e)
                if not e.running and not chunk:
                    continue
                # only a colocated run decodes in the trainer's process; beside a fleet the
                # trainer's engine is a served `polyrl worker` (`launch/local_worker.py`)
                in_process = not e.remote and self.f.mode == "colocated"
                decode = self.cal.decode_step_s(len(e.running), in_process, e.context) if e.running else 0.0
                prefill = self.cal.prefill_step_s + chunk / self.cal.prefill_tokens_per_s if chunk else 0.0
                e.work_left = decode + prefill
                e.busy = True
                e.steps += 1
                e.prefill_steps += chunk > 0

    def _admits_now(self, e: _Engine) -> bool:
        """Whether the engine's scheduler takes its waiting samples this step: at once
        unless its decode steps overlap and a busy batch gathers arrivals, as the engine's
        `_admit_now` does (each admission costs one step that also prefills)."""
        f = self.f
        if not e.waiting or not f.admit_wait_steps or e.joined:
            e.waited = 0
            return True
        if e.waited >= f.admit_wait_steps or len(e.running) < f.admit_batch or len(e.waiting) >= f.admit_batch:
            e.waited = 0
            return True
        e.waited += 1
        return False

    def _prefill_chunk(self, e: _Engine) -> int:
        """This step's prefill tokens, as the engine's scheduler takes them: what the step's
        token budget leaves after the running sequences' decodes, oldest joined first;
        a sequence whose prefill is done decodes from this step on."""
        budget = math.inf if e.batched_tokens is None else max(0, e.batched_tokens - len(e.running))
        chunk = 0
        while e.joined and budget > 0:
            s = e.joined[0]
            take = min(s.prefill_left, budget)
            s.prefill_left -= take
            chunk += take
            budget -= take
            if s.prefill_left > 0:
                break
            e.joined.pop(0)
            s.start = e.ticks
            self._tick += 1
            heapq.heappush(e.running, (e.ticks + s.left, self._tick, s))
        return chunk

    def _loads(self) -> dict[str, float]:
        load: dict[str, float] = {}
        for a in self._actors():
            if a.busy:
                load[a.device] = load.get(a.device, 0.0) + a.demand
        return load

    def _rates(self, load: dict[str, float]) -> dict[int, float]:
        rates = {}
        for a in self._actors():
            if a.busy:
                rates[id(a)] = min(1.0, self.capacity[a.device] / load[a.device])
        if self.governor and self.learner.busy:
            rates[id(self.learner)] *= self.cal.learner_speed(self.governor.threads)
        if self.cal.shared_gpu and self.cal.host_cores is None:  # clients of one GPU (MPS)
            decoding = sum(1 for e in self.engines if e.busy)
            if self.learner.busy:
                # the pairwise slowdowns `calibrate --corun` measured; past the GPU's SM
                # shares every busy client gets its part of them, the engines too (with
                # the learner alone crowded, the fully asynchronous row's fleet outran the
                # measured one and idled a quarter of the time: BENCHMARKS.md)
                crowd = self.cal.gpu_clients / (1 + decoding) if self.cal.gpu_clients is not None else 1.0
                rates[id(self.learner)] /= 1 + self.cal.learner_slowdown_per_engine * decoding
                rates[id(self.learner)] = min(rates[id(self.learner)], crowd)
                for e in self.engines:
                    if e.busy:
                        rates[id(e)] = min(rates[id(e)] / (1 + self.cal.engine_slowdown_beside_learner), crowd)
        return rates

    def _until(self, done, deadline: float | None = None) -> None:
        """Advance time, event by event, until `done()`."""
        guard = 0
        while not done():
            guard += 1
            if guard > 50_000_000:
                raise RuntimeError("the fleet model made no progress")
            self._fill()
            self._start_steps()
            load = self._loads()
            rates = self._rates(load)
            actors = [a for a in self._actors() if a.busy]
            nxt = min((self.now + a.work_left / rates[id(a)] for a in actors), default=math.inf)
            if self.timers:
                nxt = min(nxt, self.timers[0][0])
            paused = [e.paused_until for e in self.engines if e.paused_until > self.now]
            nxt = min([nxt, *paused])
            if deadline is not None:
                nxt = min(nxt, deadline)
            if nxt == math.inf:
                raise RuntimeError("the fleet model is stuck: no work, no timer, and the step is not done")
            dt = nxt - self.now
            if self.governor:
                host, cores = load.get("host", 0.0), self.capacity["host"]
                waiting = max(0.0, 1 - cores / host) if self.learner.busy and host else 0.0
                self.governor.account(dt, waiting, max(0.0, cores - host))
            for e in self.engines:
                if not e.busy and (e.up or not e.remote):  # a preempted worker is not idle: it is gone
                    e.idle_s += dt
            for a in actors:
                a.work_left -= dt * rates[id(a)]
            self.now = nxt
            for a in actors:
                if a.work_left <= 1e-12:
                    a.busy, a.work_left = False, 0.0
                    if isinstance(a, _Engine):
                        self._decoded(a)
                    elif a is self.reader:
                        self._group_ready(self.unread.pop(0))
                        self._read_next()
            while self.timers and self.timers[0][0] <= self.now + 1e-12:
                _, _, kind, payload = heapq.heappop(self.timers)
                self._on_timer(kind, payload)

    def _actors(self) -> list[_Actor]:
        return [self.learner, *self.engines, self.streams, self.reader]

    def _decoded(self, e: _Engine) -> None:
        e.ticks += 1
        e.context += len(e.running)
        if self.reads_streams:
            self.streams.work_left += self.cal.stream_cpu_s_per_token * len(e.running)
            self.streams.busy = True
        while e.running and e.running[0][0] <= e.ticks:
            s = heapq.heappop(e.running)[2]
            e.context -= self.w.prompt_tokens + s.done + s.left
            s.group.samples_left -= 1
            if s.group.samples_left == 0:
                if self.reads_streams:
                    self.unread.append(s.group)
                    self._read_next()
                else:
                    self._group_ready(s.group)

    def _group_ready(self, g: _Group) -> None:
        g.ready_at = self.now
        self.ready.append(g)

    def _read_next(self) -> None:
        """The trainer's reader takes the next finished group: its tokens at the cost of
        reading a streamed token (the manager sends each group whole, once it is done)."""
        if not self.reader.busy and self.unread:
            g = self.unread[0]
            self.reader.work_left = self.cal.stream_cpu_s_per_token * self.w.n * (self.w.prompt_tokens + g.length)
            self.reader.busy = True

    def _on_timer(self, kind: str, payload) -> None:
        if kind == "version":
            e, v = payload
            if e.up:
                e.version = max(e.version, v)
                e.paused_until = max(e.paused_until, self.now + self.cal.swap_s)
        elif kind == "preempt":
            e = payload
            if not e.up:
                return
            self.queue = self._evict(e) + self.queue
            e.up = False
            self._timer(self.now + self.f.restart_s, "restart", e)
        elif kind == "restart":
            e = payload
            e.up, e.version = True, self.version
            e.paused_until = self.now + self.cal.pull_s()
            self._schedule_preemption(e)


def predict(
    cal: Calibration, workload: Workload, fleet: Fleet, steps: int = 8, warmup: int = 2, seed: int = 0
) -> Prediction:
    return FleetModel(cal, workload, fleet, seed).run(steps, warmup)
