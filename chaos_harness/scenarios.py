"""The fault scenarios: each breaks a running rollout system in one way, as often as its
scale asks, and reports what was lost.

Every scenario runs real `polyrl worker` processes behind FaultProxies (harness.py) and
measures, per fault kind: how many faults it injected, how many samples its batches
asked for, lost, duplicated or cut short, how many samples migrated between workers,
and the recovery time: from the injection (or from the end of a fault that lasts a
while) until the manager no longer counts on the faulty worker, or has it back, and no
work waits in its queue. Batches use `ignore_eos`, so every sample must come back with
exactly its budget of tokens.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from chaos_harness.harness import (
    BatchCheck,
    ChaosFleet,
    RunningBatch,
    WorkerHandle,
    kill_while_holding,
    make_batch,
    samples_streaming,
    wait_for,
)

log = logging.getLogger("chaos_harness")

BATCH_TIMEOUT_S = 300.0
KILL_TRIES = 5
"""Batches a kill meant to land on samples in flight is tried on (a freeze finding them done is no kill)."""


@dataclass(frozen=True)
class Scale:
    num_prompts: int = 8
    n: int = 2
    max_new_tokens: int = 400
    injections: int = 1
    num_workers: int = 2


@dataclass
class FaultRow:
    fault: str
    injected: int = 0
    samples: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong_length: int = 0
    migrated: int = 0
    recovery_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, check: BatchCheck) -> BatchCheck:
        self.samples += check.requested
        self.lost += check.lost
        self.duplicated += check.duplicated
        self.wrong_length += check.wrong_length
        self.migrated += check.migrated
        if check.error:
            self.errors.append(check.error)
        return check

    @property
    def ok(self) -> bool:
        return self.injected > 0 and self.lost == self.duplicated == self.wrong_length == 0 and not self.errors

    def summary(self) -> dict[str, object]:
        out = asdict(self)
        rec = self.recovery_s
        out["recovery_max_s"] = round(max(rec), 3) if rec else None
        out["recovery_median_s"] = round(statistics.median(rec), 3) if rec else None
        out["recovery_s"] = [round(r, 3) for r in rec]
        out["ok"] = self.ok
        return out


Weights = Callable[[int], dict[str, torch.Tensor]]
"""The state dict to publish as a version (a different one per version)."""


@dataclass
class Context:
    fleet: ChaosFleet
    scale: Scale
    weights: Weights
    version: int = 0

    def batch(self, tag: str) -> RunningBatch:
        s = self.scale
        return RunningBatch(self.fleet.mt, make_batch(s.num_prompts, s.n, s.max_new_tokens, tag=tag))

    def publish_next(self) -> int:
        self.version += 1
        self.fleet.publish(self.weights(self.version), self.version)
        return self.version

    def healthy_fleet(self) -> list[WorkerHandle]:
        """Back to `num_workers` live workers, all active at the latest version."""
        fleet = self.fleet
        for worker_id in [w for w, h in fleet.workers.items() if h.proc.poll() is not None]:
            fleet.remove(worker_id)
        while len(fleet.workers) < self.scale.num_workers:
            fleet.launch()
        for handle in fleet.workers.values():
            handle.to_worker.heal()
            handle.to_manager.heal()
        fleet.wait_active(*fleet.workers)
        return list(fleet.workers.values())

    def busy_worker(self, timeout_s: float = 60) -> WorkerHandle:
        """A worker holding some of our samples."""
        found: list[WorkerHandle] = []

        def any_busy() -> bool:
            found[:] = [h for w, h in self.fleet.workers.items() if self.fleet.inflight(w) > 0]
            return bool(found)

        wait_for(any_busy, timeout_s, "a worker with samples in flight", poll_s=0.05)
        return found[0]

    def streaming(self, worker_ids: Collection[str]) -> bool:
        """One of `worker_ids` holds an unfinished sample whose tokens have reached the
        manager: killed now, it migrates with them (before its first tokens it would only
        start again elsewhere)."""
        mt = self.fleet.mt
        return mt.call(lambda: samples_streaming(mt.manager, worker_ids)) > 0

    def streaming_worker(self, running: RunningBatch, timeout_s: float = 60) -> WorkerHandle | None:
        """A worker streaming some of `running`'s samples (`streaming`); None if the batch
        ended before one was seen (a starved test process can miss a whole batch)."""
        found: list[WorkerHandle] = []

        def seen() -> bool:
            found[:] = [h for w, h in self.fleet.workers.items() if self.streaming([w])]
            return bool(found) or not running.is_alive()

        wait_for(seen, timeout_s, "a worker streaming samples", poll_s=0.02)
        return found[0] if found else None

    def kill_streaming(
        self, row: FaultRow, tag: str, victims: Callable[[WorkerHandle], list[WorkerHandle]]
    ) -> tuple[RunningBatch, list[WorkerHandle]]:
        """Run batches until a kill -9 of `victims(the streaming worker)` lands while they hold
        samples with tokens (frozen first and asked again: `kill_while_holding`): samples of
        a few hundred tokens finish within a second or two, and a kill after a look and a
        fixed pause found them done on a loaded machine. Returns the batch it hit and the
        killed workers (reaped)."""
        for attempt in range(KILL_TRIES):
            self.healthy_fleet()
            running = self.batch(f"{tag}{attempt}-")
            streaming = self.streaming_worker(running)
            if streaming is not None:
                handles = victims(streaming)
                ids = {h.worker_id for h in handles}
                if kill_while_holding([h.proc.pid for h in handles], lambda: self.streaming(ids)):
                    for h in handles:
                        h.proc.wait(timeout=10)
                    return running, handles
            row.add(running.result(BATCH_TIMEOUT_S))  # missed: a batch without a fault
        raise RuntimeError(f"no kill landed on samples in flight in {KILL_TRIES} batches")

    def recover(self, worker_id: str, back: bool = False, timeout_s: float = 120) -> float:
        what = f"recovery from {worker_id}'s fault"
        return wait_for(lambda: self.fleet.settled(worker_id, back), timeout_s, what)

    def check_versions(self, row: FaultRow, batch: RunningBatch, version: int) -> None:
        stale = sum(v != version for g in batch.groups for s in g.samples for v in s.weight_versions)
        if stale:
            row.errors.append(f"{stale} tokens not from weights v{version}")


# ----------------------------------------------------------------------------- processes


def kill_generating(ctx: Context, row: FaultRow) -> None:
    """SIGKILL a worker while it streams samples; a replacement joins."""
    for i in range(ctx.scale.injections):
        running, [victim] = ctx.kill_streaming(row, f"kg{i}-", lambda streaming: [streaming])
        row.injected += 1
        ctx.fleet.launch()
        row.recovery_s.append(ctx.recover(victim.worker_id))
        row.add(running.result(BATCH_TIMEOUT_S))


def kill_during_transfer(ctx: Context, row: FaultRow) -> None:
    """SIGKILL a worker halfway through pulling a new version (the data plane is slowed
    so the pull takes a while); the others sync and serve it."""
    proxy = ctx.fleet.data_proxy
    assert proxy is not None
    for i in range(ctx.scale.injections):
        victim = ctx.healthy_fleet()[0]
        proxy.set(delay_s=0.1)
        sent = proxy.stats.bytes_to_client
        version = ctx.publish_next()
        wait_for(lambda: proxy.stats.bytes_to_client > sent, 30, "a pull to start")
        victim.kill()
        row.injected += 1
        proxy.heal()
        row.recovery_s.append(ctx.recover(victim.worker_id))
        running = ctx.batch(f"kt{i}-")
        row.add(running.result(BATCH_TIMEOUT_S))
        ctx.check_versions(row, running, version)


def kill_during_readiness(ctx: Context, row: FaultRow) -> None:
    """SIGKILL a new worker after it registered, while the manager's readiness check is
    in flight (slowed by its proxy), with a batch running on the others."""
    for i in range(ctx.scale.injections):
        ctx.healthy_fleet()
        running = ctx.batch(f"kr{i}-")
        joiner = ctx.fleet.launch()
        joiner.to_worker.set(delay_s=1.0)
        wait_for(lambda: ctx.fleet.info().get(joiner.worker_id) is not None, 120, "the joiner to register", 0.01)
        state = ctx.fleet.info().get(joiner.worker_id)
        if state is None or state.state != "registering":
            row.errors.append(f"joiner was {state.state if state else 'gone'} before the kill, not registering")
        joiner.kill()
        row.injected += 1
        row.recovery_s.append(ctx.recover(joiner.worker_id))
        ctx.fleet.remove(joiner.worker_id)
        row.add(running.result(BATCH_TIMEOUT_S))


def freeze_and_resume(ctx: Context, row: FaultRow) -> None:
    """SIGSTOP a worker mid-stream (its samples move on once it is declared gone); a new
    version is published while it is frozen; then SIGCONT: it comes back with stale
    weights and dead requests, and must re-register and sync before serving again."""
    for i in range(ctx.scale.injections):
        ctx.healthy_fleet()
        running = ctx.batch(f"fz{i}-")
        victim = ctx.busy_worker()
        time.sleep(0.3)
        victim.signal(signal.SIGSTOP)
        row.injected += 1
        row.recovery_s.append(ctx.recover(victim.worker_id))
        row.add(running.result(BATCH_TIMEOUT_S))
        version = ctx.publish_next()
        victim.signal(signal.SIGCONT)
        ctx.fleet.wait_active(victim.worker_id, version=version)
        after = ctx.batch(f"fz{i}-after-")
        row.add(after.result(BATCH_TIMEOUT_S))
        ctx.check_versions(row, after, version)


def all_workers_gone(ctx: Context, row: FaultRow) -> None:
    """Every worker killed mid-batch; new ones arrive a moment later."""
    for i in range(ctx.scale.injections):
        running, workers = ctx.kill_streaming(row, f"ag{i}-", lambda _: list(ctx.fleet.workers.values()))
        row.injected += 1
        started = time.monotonic()
        for _ in workers:
            ctx.fleet.launch()
        wait_for(lambda: all(ctx.fleet.settled(h.worker_id) for h in workers), 180, "the fleet to come back")
        row.recovery_s.append(time.monotonic() - started)
        row.add(running.result(BATCH_TIMEOUT_S))


# ------------------------------------------------------------------------------ network


def slow_link(ctx: Context, row: FaultRow) -> None:
    """One worker's streams and heartbeats crawl (100 ms per chunk each way)."""
    for i in range(ctx.scale.injections):
        victim = ctx.healthy_fleet()[0]
        victim.to_worker.set(delay_s=0.1)
        victim.to_manager.set(delay_s=0.1)
        row.injected += 1
        row.add(ctx.batch(f"sl{i}-").result(BATCH_TIMEOUT_S))
        victim.to_worker.heal()
        victim.to_manager.heal()


def _link_fault_window(ctx: Context, row: FaultRow, tag: str, **fault: object) -> RunningBatch:
    """A batch runs while one worker's link misbehaves (`fault`) for 3 s; then the link
    heals and the worker must serve again. Returns the batch, already checked."""
    victim = ctx.healthy_fleet()[0]
    running = ctx.batch(tag)
    victim.to_worker.set(**fault)
    row.injected += 1
    time.sleep(3.0)
    victim.to_worker.heal()
    row.recovery_s.append(ctx.recover(victim.worker_id, back=True))
    row.add(running.result(BATCH_TIMEOUT_S))
    return running


def cut_streams(ctx: Context, row: FaultRow) -> None:
    """The link to one worker resets every connection after 4 KiB, for a while: streams
    break mid-sample again and again, and the worker keeps coming back."""
    for i in range(ctx.scale.injections):
        _link_fault_window(ctx, row, f"cs{i}-", cut_after_bytes=4096)


def corrupt_streams(ctx: Context, row: FaultRow) -> None:
    """Bits flip on the link between the manager and one worker, both ways, for a while
    (requests and streams carry checksums on that link). Every sample is then compared
    with the same batch run again on a clean network: a flipped token id that still
    parses would show up there."""
    for i in range(ctx.scale.injections):
        running = _link_fault_window(ctx, row, f"cx{i}-", corrupt_rate=0.05)
        clean = ctx.batch(f"cx{i}-")
        clean.result(BATCH_TIMEOUT_S)
        expected = {(g.prompt_id, s.index): s.output_ids for g in clean.groups for s in g.samples}
        wrong = sum(expected.get((g.prompt_id, s.index)) != s.output_ids for g in running.groups for s in g.samples)
        if wrong:
            row.errors.append(f"{wrong} samples differ from the clean run: corrupted tokens were accepted")


def corrupt_weights(ctx: Context, row: FaultRow) -> None:
    """The data plane flips bits (then cuts connections) during a pull: every bad chunk
    is caught by its checksum, the pull is retried, and the version arrives whole."""
    proxy = ctx.fleet.data_proxy
    assert proxy is not None
    for i in range(ctx.scale.injections):
        ctx.healthy_fleet()
        fault = {"corrupt_rate": 0.5} if i % 2 == 0 else {"cut_after_bytes": 32 * 1024}
        proxy.set(direction="to_client", **fault)
        version = ctx.publish_next()
        row.injected += 1
        time.sleep(1.5)
        proxy.heal()
        healed = time.monotonic()
        ctx.fleet.wait_active(*ctx.fleet.workers, version=version)
        row.recovery_s.append(time.monotonic() - healed)
        running = ctx.batch(f"cw{i}-")
        row.add(running.result(BATCH_TIMEOUT_S))
        ctx.check_versions(row, running, version)


def kill_publisher(ctx: Context, row: FaultRow) -> None:
    """SIGKILL the publisher process while workers pull a new version (the data plane is
    slowed so the pulls take a while): the trainer's side restarts it on the same port
    with the versions it holds, the manager retries the pulls, every worker serves the
    version. Recovery: from the kill until every worker is active at that version."""
    proxy, publisher = ctx.fleet.data_proxy, ctx.fleet.publisher
    assert proxy is not None
    for i in range(ctx.scale.injections):
        ctx.healthy_fleet()
        proxy.set(delay_s=0.1)
        sent = proxy.stats.bytes_to_client
        version = ctx.publish_next()
        wait_for(lambda: proxy.stats.bytes_to_client > sent, 30, "a pull to start")
        pid, restarts = publisher.pid, publisher.restarts
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        row.injected += 1
        proxy.heal()
        ctx.fleet.wait_active(*ctx.fleet.workers, version=version)
        row.recovery_s.append(time.monotonic() - killed)
        if publisher.restarts != restarts + 1:
            row.errors.append(f"the publisher process was restarted {publisher.restarts - restarts} times, not once")
        running = ctx.batch(f"kp{i}-")
        row.add(running.result(BATCH_TIMEOUT_S))
        ctx.check_versions(row, running, version)


SCENARIOS: dict[str, Callable[[Context, FaultRow], None]] = {
    "kill -9 while generating": kill_generating,
    "kill -9 during weight pull": kill_during_transfer,
    "kill -9 during readiness check": kill_during_readiness,
    "SIGSTOP, new version, SIGCONT": freeze_and_resume,
    "all workers killed, new ones join": all_workers_gone,
    "slow link (100 ms/chunk)": slow_link,
    "connections cut after 4 KiB": cut_streams,
    "stream bytes corrupted": corrupt_streams,
    "weight chunks corrupted / cut": corrupt_weights,
    "publisher process kill -9 during pulls": kill_publisher,
}


def run_fleet_scenarios(
    model_dir: Path, log_dir: Path, weights: Weights, scale: Scale, names: list[str] | None = None
) -> Iterator[FaultRow]:
    """Run the named scenarios (default: all) one after another on one fleet."""
    with ChaosFleet(model_dir, log_dir) as fleet:
        ctx = Context(fleet, scale, weights)
        for name in names or list(SCENARIOS):
            row = FaultRow(name)
            started = time.monotonic()
            try:
                SCENARIOS[name](ctx, row)
            except Exception as e:  # one broken scenario must not hide the others' rows
                log.exception("scenario %r failed", name)
                row.errors.append(f"{type(e).__name__}: {e}")
            row.wall_s = round(time.monotonic() - started, 2)
            yield row
