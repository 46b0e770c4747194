"""Disaggregated rollout: every sample comes through the rollout manager, from workers
that pull each weight version from the trainer's publisher.

The processes behind it (the manager, the publisher's data plane, the trainer's own
engine as the `local` worker, the launched workers) are started and kept alive by
`polyrl.launch` (README, "What runs where"); this module is only the rollout source. The
trainer's process keeps the learner, and only I/O threads beside it: one per batch,
reading finished groups. The hybrid window's policy is the manager's; the trainer only
says when its learner starts.

If the manager goes away, the rollout asks its supervisor (`Processes`) to bring it back,
tells it the publisher and the last version published, and resubmits the prompts whose
groups had not arrived (same seeds): nothing is lost, and workers register again by
themselves.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

import httpx
import torch
from transformers import PreTrainedModel

from polyrl.protocol.completions import VersionRuns
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import (
    BatchError,
    BatchPrompt,
    BatchRequest,
    FleetDecision,
    GroupResult,
    PublisherEndpoint,
    SampleResultOut,
    WorkerInfo,
    WorkerList,
)
from polyrl.protocol.routes import decode_routes, rows_through
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.local import engine_dtype, learner_weights
from polyrl.rollout.manager_link import BatchStream, ManagerLink, ManagerUnreachable
from polyrl.rollout.stats import FleetIdle, LostWorkers, RolloutStats
from polyrl.transfer.publisher import WeightPublisher

log = logging.getLogger("polyrl.rollout")

T = TypeVar("T")

RECOVERABLE = ("disconnected", "shutdown")
"""Batch failures that mean the manager went away, not that the batch was bad."""


class Processes(Protocol):
    """What the rollout asks of the processes' supervisor (`polyrl.launch.supervisor`)."""

    def revive_manager(self, why: str) -> bool:
        """The manager cannot be reached: start it again and return once it serves (True),
        or return False at once where it is not the run's to start (`manager.url`)."""

    def revive_local_worker(self) -> None:
        """Start the local worker again if it died (before each publish)."""


class RemoteRollout:
    """`generate` and `publish` as LocalRollout, through the manager and the workers."""

    shares_weights = False
    """The learner may update while generation goes on: nothing here reads its weights."""

    def __init__(
        self,
        *,
        model: PreTrainedModel,
        mode: str,
        compute_dtype: torch.dtype,
        link: ManagerLink,
        publisher: WeightPublisher,
        endpoint: PublisherEndpoint,
        processes: Processes,
        device_dtype: torch.dtype | None = None,
    ) -> None:
        """`mode`: `rollout.mode` (remote or hybrid). `link` reaches the manager;
        `publisher` serves the versions whose address the manager is told as `endpoint`;
        `processes` brings the manager and the local worker back when they die.
        `device_dtype`: the dtype of the copy on the trainer's GPU (`publisher.device`),
        which the GPU paths serve: the run's engines' (default: the published one)."""
        self.model, self.mode = model, mode
        self.link, self.publisher, self.endpoint, self.processes = link, publisher, endpoint, processes
        self.publish_dtype = engine_dtype(model, compute_dtype)
        self.device_dtype = device_dtype or self.publish_dtype
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

    def connect(self) -> None:
        """Tell the manager the publisher, once it serves (workers may start before: they
        retry their registration until it answers)."""
        self.link.set_publisher(self.endpoint)
        self.lost_workers = LostWorkers(seen=self.fleet().num_lost_workers)  # a standalone manager's past is not ours

    @property
    def num_instances(self) -> int:
        """Engines that generated for the last step (workers and the local one)."""
        return len(self.stats.tokens_by_worker)

    def fleet(self) -> WorkerList:
        return self._control(self.link.workers)

    def completion_versions(self, keys: list[str]) -> list[VersionRuns | None] | None:
        """The manager's booking of the completions it served under `keys` (None: none kept)."""
        return self._control(lambda: self.link.completion_versions(keys))

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
        with, and half the bytes of the master weights. The copy on the trainer's GPU is
        in the engines' dtype whatever the compute dtype (bf16 by default), so the local
        engine can decode from it in place (`manager.transfer.single_copy`)."""
        if weights is None:
            weights = learner_weights(self.model)
        # floating tensors in the engines' dtype; a LoRA version's spec (uint8) as it is
        device = self.publisher.device
        if device is not None:  # cast straight into the device copy (the local engine may decode from it in place)
            device.publish(weights, version, self.device_dtype)
        if device is not None and self.device_dtype == self.publish_dtype:
            host = device.views(version)  # the host copy reads the device copy: no second cast
        else:
            host = {k: t.detach().to(self.publish_dtype) if t.is_floating_point() else t for k, t in weights.items()}
        self.publisher.publish(host, version)
        self.weight_version = version
        self.processes.revive_local_worker()
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

    def fleet_decision(self, decision: FleetDecision) -> None:
        """Shown on the operator page; a manager that cannot be reached costs the run nothing."""
        try:
            self.link.fleet_decision(decision)
        except (ManagerUnreachable, httpx.HTTPError) as e:
            log.warning("could not tell the manager the fleet decision: %s", e)

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
            if not self.processes.revive_manager(why):
                self.link.retry_s = 300.0  # a standalone manager restarts on its own schedule
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
            except GeneratorExit:  # closed by its reader before its end: the rest is cancelled
                # No look at the fleet here (this may run in a garbage collection, with the
                # manager gone): what the fleet did meanwhile is booked at the next look.
                stream.close()
                raise
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
        """Before the processes stop: batches still read (fully asynchronous ones) fail
        from now on, and that is not a lost manager."""
        self._closing = True


def to_group(prompt: Prompt, result: GroupResult) -> Group:
    samples = [to_sample(s, result.prompt_tokens) for s in sorted(result.samples, key=lambda s: s.index)]
    return Group(prompt=prompt, samples=samples)


def to_sample(result: SampleResultOut, prompt_tokens: int) -> Sample:
    """One sample as the manager sent it: tokens, behaviour log-probs, each token's
    version, the engines it ran on (`prompt_tokens`: its prompt's length, for its routes)."""
    return Sample(
        completion_ids=result.output_ids,
        logprobs=result.logprobs,
        finish_reason=result.finish_reason,
        weight_versions=result.weight_versions,
        workers=[seg.worker for seg in result.segments],
        worker_tokens=[seg.num_tokens for seg in result.segments],
        gen_time_s=result.latency_s,
        routed_experts=None
        if result.routed_experts is None
        else decode_routes(result.routed_experts, rows_through(prompt_tokens, len(result.output_ids))),
    )
