"""Disaggregated rollout: every sample comes through the rollout manager, from workers
that pull each weight version from the trainer's publisher.

Each role runs in a process of its own (README, "What runs where"): the manager
(`manager_process.py`, or a standalone one at `manager.url`), the publisher's data
plane, the trainer's own engine (the `local` worker, `local_worker.py`) and the
launched workers. The trainer's process keeps the learner, and only I/O threads beside
it: one per batch, reading finished groups. The hybrid window's policy is the
manager's; the trainer only says when its learner starts.

If the manager's process dies, the trainer starts it again on the same port, tells it
the publisher and the last version published, and resubmits the prompts whose groups
had not arrived (same seeds): nothing is lost, and workers register again by themselves.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from polyrl.config import ManagerConfig, RunConfig
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import (
    BatchError,
    BatchPrompt,
    BatchRequest,
    GroupResult,
    PublisherEndpoint,
    WorkerInfo,
    WorkerList,
)
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.local import engine_dtype, learner_weights
from polyrl.rollout.local_worker import LocalWorker
from polyrl.rollout.manager_link import BatchStream, ManagerLink, ManagerUnreachable
from polyrl.rollout.manager_process import ManagerProcess
from polyrl.rollout.stats import FleetIdle, LostWorkers, RolloutStats
from polyrl.tls import reachable_host
from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.publisher import WeightPublisher

log = logging.getLogger("polyrl.rollout")

T = TypeVar("T")

RECOVERABLE = ("disconnected", "shutdown")
"""Batch failures that mean the manager went away, not that the batch was bad."""


def window_policy(cfg: RunConfig, device: torch.device) -> ManagerConfig:
    """The manager's config with the hybrid window's mode (see `manager/window.py`) and,
    for fully asynchronous training, workers that keep their running samples across
    versions (`manager.swap_policy`, unless set)."""
    r = cfg.rollout
    if r.mode != "hybrid":
        mode = "off"
    elif r.fully_async:
        # auto: the trainer's engine fills the learner's waits only. `always` (beside the
        # learner) helps where the fleet is the bottleneck (one H100 split by MPS: it made
        # 47% of the tokens) and costs where the learner is (2 H200s: the spot idled 30%
        # of the time while the learner's updates took 1.5x as long per token); see
        # BENCHMARKS.md.
        mode = "idle" if r.hybrid_local_until == "auto" else r.hybrid_local_until
    elif r.hybrid_local_until == "auto":
        mode = "learner" if device.type == "cuda" and not r.max_staleness else "synced"
    else:
        mode = r.hybrid_local_until
    update: dict[str, object] = {"local_window": mode, "local_window_max_s": r.hybrid_max_window_s}
    if r.fully_async and cfg.manager.swap_policy is None:
        update["swap_policy"] = "continue"
    return cfg.manager.model_copy(update=update)


class RemoteRollout:
    """`generate` and `publish` as LocalRollout, through the manager and the workers."""

    shares_weights = False
    """The learner may update while generation goes on: nothing here reads its weights."""

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: RunConfig,
        run_dir: Path,
        token: str,
        init_path: Path,
        compute_dtype: torch.dtype,
    ) -> None:
        self.model, self.mode = model, cfg.rollout.mode
        self.publish_dtype = engine_dtype(model, compute_dtype)
        self.weight_version: WeightVersion = 0
        """The last version `publish` was given (the trainer's `TrainState` counts them):
        what new batches need, and what a restarted manager, which forgets it, is told
        again. 0 until the first publish, the initial weights, as a fresh manager assumes."""
        self.stats = RolloutStats()
        self.fleet_idle = FleetIdle()
        self.lost_workers = LostWorkers()
        self.num_recoveries = 0
        self._closing = False
        self._window_may_be_open = False
        """A local window may be open (hybrid): the learner's start closes it."""
        self._moved: set[str] = set()
        """Groups `learner_waiting` asked to move to the trainer's engine in this window."""
        self._recover_lock = threading.Lock()
        self._stack = ExitStack()
        try:
            self._start(cfg, run_dir, token, init_path)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, cfg: RunConfig, run_dir: Path, token: str, init_path: Path) -> None:
        mcfg, transfer = window_policy(cfg, self.model.device), cfg.manager.transfer
        tls = (mcfg.tls.cert_file, mcfg.tls.key_file) if transfer.tls else None
        self.publisher = WeightPublisher(
            mcfg.host,
            transfer.port,
            num_groups=transfer.num_groups,
            group_hosts=transfer.group_hosts,
            send_mode=transfer.send_mode,
            tls=tls,  # type: ignore[arg-type]
        ).start()
        self._stack.callback(self.publisher.stop)
        # workers on this host pull over NCCL / CUDA IPC (not with TLS: those sockets go to another process)
        if transfer.gpu_paths and not transfer.tls and self.model.device.type == "cuda":
            self.publisher.device = DeviceVersions(self.model.device)
        # each group's own bind address, else where other machines reach this one
        reachable = transfer.advertise_host or reachable_host(mcfg.host, mcfg.advertise_host)
        advertise = None if transfer.group_hosts else reachable
        device = self.publisher.device.identity if self.publisher.device is not None else None
        self.endpoint = PublisherEndpoint(
            groups=[(advertise or host, port) for host, port in self.publisher.addresses],
            key=self.publisher.key.hex(),
            device_host_id=device.host_id if device else None,
            device_gpu_uuid=device.gpu_uuid if device else None,
            tls=transfer.tls,
        )
        self.manager: ManagerProcess | None = None
        if mcfg.url:
            self.url = self.public_url = mcfg.url
            log.info("using the rollout manager at %s", self.url)
        else:
            self.manager = ManagerProcess(mcfg, token, run_dir)  # binds its port now: the URL is known
            self.url = self.manager.url
            self.public_url = self.manager.public_url
            self.manager.spawn()
            self._stack.callback(self.manager.stop)
        self.link = ManagerLink(self.url, token, ca_file=cfg.manager.tls.ca_file)
        self._stack.callback(self.link.close)
        self.local = LocalWorker(
            init_path,
            self.url,
            token,
            cfg.engine,
            self.model.device,
            run_dir / "workers",
            cfg.fleet.worker_threads,
            cfg.model.lora,
            cfg.manager.tls,
        )
        self.local.start()  # it registers once the manager serves, as every worker does
        self._stack.callback(self.local.stop)

    def connect(self) -> None:
        """Wait for the manager to serve and tell it the publisher (workers may start
        before: they retry their registration until it answers)."""
        if self.manager is not None:
            self.manager.wait_ready()
        self.link.set_publisher(self.endpoint)
        self.lost_workers = LostWorkers(seen=self.fleet().num_lost_workers)  # a standalone manager's past is not ours

    @property
    def num_instances(self) -> int:
        """Engines that generated for the last step (workers and the local one)."""
        return len(self.stats.tokens_by_worker)

    def fleet(self) -> WorkerList:
        return self._control(self.link.workers)

    def workers(self) -> list[WorkerInfo]:
        """The rollout workers, without the trainer's own engine."""
        return [w for w in self.fleet().workers if w.worker_id != LOCAL_WORKER_ID]

    def local_active(self) -> bool:
        return any(w.worker_id == LOCAL_WORKER_ID and w.state == "active" for w in self.fleet().workers)

    # --------------------------------------------------------------------------- publishing

    def publish(self, weights: Mapping[str, torch.Tensor] | None, version: WeightVersion) -> None:
        """Snapshot the learner's weights (or `weights`, full tensors by HF name) as
        `version` for the workers to pull; batches from now on need `version`. On CUDA
        with bf16 compute, the version is published in bf16: what every engine computes
        with, and half the bytes of the master weights."""
        if weights is None:
            weights = learner_weights(self.model)
        # floating tensors in the engines' dtype; a LoRA version's spec (uint8) as it is
        weights = {k: t.detach().to(self.publish_dtype) if t.is_floating_point() else t for k, t in weights.items()}
        self.publisher.publish(weights, version)
        if self.publisher.device is not None:
            self.publisher.device.publish(weights, version)
        self.weight_version = version
        self.local.restart_if_dead()
        self._control(lambda: self.link.publish_version(version, self.publisher.device is not None))
        self._window_may_be_open = self.mode == "hybrid"  # the synced and learner windows open now

    def learner_started(self) -> None:
        """The learner is about to update: the local window closes (a call only when one
        may be open: this runs before every mini-batch)."""
        if self._window_may_be_open:
            self._window_may_be_open = False
            self._moved = set()
            self._control(self.link.learner_started)

    def learner_waiting(self, due: set[str]) -> None:
        """The learner waits for groups: in hybrid mode the `idle` window opens, and the
        groups in `due` (the step cannot do without them) move to the trainer's engine.
        A call only when the window may be closed or there is a group to move."""
        if self.mode != "hybrid":
            return
        new = due - self._moved
        if self._window_may_be_open and not new:
            return
        self._window_may_be_open = True
        self._moved |= new
        self._control(lambda: self.link.learner_waiting(sorted(new)))

    def due_groups(self, max_floor_version: int) -> set[str]:
        """Prompt ids of unfinished groups that may hold a token of that version or older."""
        return set(self._control(lambda: self.link.due_groups(max_floor_version)))

    def _control(self, call: Callable[[], T]) -> T:
        """A control call; if the manager is gone, bring it back and call once more."""
        generation = self.num_recoveries
        try:
            return call()
        except ManagerUnreachable as e:
            self._recover(generation, str(e))
            return call()

    def _recover(self, generation: int, why: str) -> None:
        """Start the manager again (unless another thread did since `generation`) and tell
        it what it forgot: the publisher and the last version published."""
        with self._recover_lock:
            if self.num_recoveries != generation:
                return
            if self.manager is None:
                log.warning("lost the rollout manager at %s (%s); waiting for it to come back", self.url, why)
                self.link.retry_s = 300.0  # a standalone manager restarts on its own schedule
            else:
                self.manager.restart()
            self.link.set_publisher(self.endpoint)
            self.link.publish_version(self.weight_version, self.publisher.device is not None)
            self.num_recoveries += 1

    # --------------------------------------------------------------------------- generating

    def generate(
        self, prompts: list[Prompt], sampling: SamplingParams, stats: RolloutStats | None = None
    ) -> Iterator[Group]:
        """Submits the batch now (workers start on it at once, even ahead of its step); the
        iterator gives each prompt's group as soon as its last sample is done. `stats`:
        where its groups are booked (default: a new `self.stats`, the step's, once read)."""
        request = BatchRequest(
            prompts=[
                # seeds from the run's seeded (and checkpointed) RNG, as in local rollout
                BatchPrompt(
                    id=str(p.index),
                    input_ids=p.prompt_ids,
                    seed=random.getrandbits(62),
                    max_new_tokens=None if p.max_new_tokens is None else p.budget(sampling.max_new_tokens),
                )
                for p in prompts
            ],
            sampling=sampling,
            min_weight_version=self.weight_version,
        )
        stream = self.link.open_batch(request)
        return self._groups(request, stream, self.num_recoveries, {str(p.index): p for p in prompts}, stats)

    def _groups(
        self,
        request: BatchRequest,
        stream: BatchStream,
        generation: int,
        by_id: dict[str, Prompt],
        stats: RolloutStats | None,
    ) -> Iterator[Group]:
        is_step = stats is None
        if stats is None:
            # the step's: set when it starts reading
            self.stats = stats = RolloutStats(num_requested=len(by_id) * request.sampling.n)
        received: set[str] = set()
        while True:
            try:
                for result in stream:
                    received.add(result.prompt_id)
                    group = to_group(by_id[result.prompt_id], result)
                    stats.count(group)
                    yield self._note(group, result, stats)
                break
            except BatchError as e:
                if e.kind not in RECOVERABLE or self._closing:
                    raise
                self._recover(generation, str(e))
                generation = self.num_recoveries
                rest = [p for p in request.prompts if p.id not in received]
                log.warning("resubmitting %d of %d prompts after losing the manager (%s)", len(rest), len(by_id), e)
                stream = self.link.open_batch(request.model_copy(update={"prompts": rest}))
        if is_step:
            self.note_fleet(stats)

    def note_fleet(self, stats: RolloutStats) -> WorkerList:
        """Book the fleet's state at the end of a step into its stats: the last local
        window, the slowest weight sync, the workers' idle time and the workers lost since
        the last look."""
        fleet = self.fleet()
        self.lost_workers.since_last(fleet)
        stats.num_lost_workers = self.lost_workers.num_lost
        if fleet.last_window is not None and self.mode == "hybrid":
            stats.window_s, stats.window_closed_by = fleet.last_window.open_s, fleet.last_window.closed_by
        remote = [s for w, s in fleet.sync_s.items() if w != LOCAL_WORKER_ID]
        stats.weight_sync_s = max(remote) if remote else None
        stats.fleet_idle_s = self.fleet_idle.since_last(fleet)
        return fleet

    @staticmethod
    def _note(group: Group, result: GroupResult, stats: RolloutStats) -> Group:
        # the manager's clock, not ours: the learner consumes groups at its own pace
        done_s = max(s.latency_s for s in result.samples)
        stats.first_group_s = min(stats.first_group_s or done_s, done_s)
        stats.gen_s = max(stats.gen_s, done_s)
        return group

    def close(self) -> None:
        self._closing = True  # batches still read (fully asynchronous ones) fail now: not a lost manager
        self._stack.close()


def to_group(prompt: Prompt, result: GroupResult) -> Group:
    samples = [
        Sample(
            completion_ids=s.output_ids,
            logprobs=s.logprobs,
            finish_reason=s.finish_reason,
            weight_versions=s.weight_versions,
            workers=[seg.worker for seg in s.segments],
            worker_tokens=[seg.num_tokens for seg in s.segments],
            gen_time_s=s.latency_s,
        )
        for s in sorted(result.samples, key=lambda s: s.index)
    ]
    return Group(prompt=prompt, samples=samples)
