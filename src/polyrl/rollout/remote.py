"""Disaggregated rollout: every sample comes through the rollout manager, from workers
that pull each weight version over the transfer layer.

Rank 0 of the trainer holds the pieces: the manager (in-process, HTTP for workers), the
weight publisher (TCP data plane) and a local engine on its own copy of the weights. The
local engine is the fallback that lets a step finish with no worker at all and, in
hybrid mode, the engine that generates while the workers sync a new version (the
"local window", RLBoost's adaptive local rollout); when the window closes its unfinished
samples move to the workers, token for token. The copy costs one more set of weights,
and buys exactness: the learner updates its own parameters mid-step while the local
engine may still be generating with the step's version.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
from transformers import PreTrainedModel

from polyrl.config import EngineConfig, ManagerConfig, RolloutConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.manager.batch import Batch
from polyrl.manager.main import ManagerThread
from polyrl.manager.protocol import BatchPrompt, BatchRequest, BatchSampling, GroupResult, WorkerInfo
from polyrl.manager.registry import LOCAL_WORKER_ID
from polyrl.manager.weight_sync import PublisherSync
from polyrl.rollout.local import engine_copy, engine_dtype, learner_weights
from polyrl.rollout.stats import RolloutStats
from polyrl.rollout.types import Group, Prompt, Sample, SamplingParams
from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.publisher import WeightPublisher

WINDOW_EMA = 0.5
"""Weight of the newest measured sync time in the hybrid window's estimate."""


class RemoteRollout:
    """`generate` and `publish` as LocalRollout, through the manager and the workers."""

    shares_weights = False
    """The learner may update while generation goes on: nothing here reads its weights."""

    def __init__(
        self,
        model: PreTrainedModel,
        mode: Literal["remote", "hybrid"],
        rollout_cfg: RolloutConfig,
        manager_cfg: ManagerConfig,
        engine_cfg: EngineConfig,
        compute_dtype: torch.dtype,
        window_groups: int,
    ) -> None:
        self.model, self.mode, self.cfg = model, mode, rollout_cfg
        self.window_groups = window_groups
        """Hybrid: the window closes once this many groups are in (the learner starts)."""
        self.publish_dtype = engine_dtype(model, compute_dtype)
        self.local_engine = AsyncEngine(Engine(engine_copy(model, self.publish_dtype), engine_cfg, compute_dtype))
        self.local_until_learner = mode == "hybrid" and (
            rollout_cfg.hybrid_local_until == "learner"
            or (rollout_cfg.hybrid_local_until == "auto" and model.device.type == "cuda" and not rollout_cfg.max_staleness)
        )
        self.local_engine.start()
        transfer = manager_cfg.transfer
        try:
            self.publisher = WeightPublisher(
                manager_cfg.host, transfer.port, num_groups=transfer.num_groups, group_hosts=transfer.group_hosts
            ).start()
        except BaseException:
            self.local_engine.shutdown()
            raise
        if transfer.gpu_paths and model.device.type == "cuda":  # workers on this host pull over NCCL / CUDA IPC
            self.publisher.device = DeviceVersions(model.device)
        self.mt = ManagerThread(manager_cfg, self.local_engine)
        try:
            self.mt.start()
        except BaseException:
            self.mt.stop()
            self.publisher.stop()
            self.local_engine.shutdown()
            raise
        advertise = None if transfer.group_hosts else transfer.advertise_host  # each group's own bind address
        self.mt.add_sync_hook(PublisherSync(self.mt.manager, self.publisher, advertise, codec=transfer.codec))
        self.version = self.local_engine.engine.weight_version
        self.stats = RolloutStats()
        self._sync_estimate_s: float | None = None

    @property
    def url(self) -> str:
        return self.mt.url

    @property
    def weight_version(self) -> int:
        return self.version

    @property
    def num_instances(self) -> int:
        """Engines that generated for the last step (workers and the local engine)."""
        return len(self.stats.tokens_by_worker)

    def workers(self) -> list[WorkerInfo]:
        return [w for w in self.mt.worker_list().workers if w.worker_id != LOCAL_WORKER_ID]

    # --------------------------------------------------------------------------- publishing

    def publish(self, version: int, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Snapshot the learner's weights (or `weights`, full tensors by HF name) as
        `version` for the workers to pull, and load them into the local engine; batches
        from now on need `version`. On CUDA with bf16 compute, the version is published in
        bf16: what every engine computes with, and half the bytes of the master weights."""
        if weights is None:
            weights = learner_weights(self.model)
        weights = {k: t.detach().to(self.publish_dtype) for k, t in weights.items()}
        self.publisher.publish(weights, version)
        if self.publisher.device is not None:
            self.publisher.device.publish(weights, version)
        self.mt.run(self.local_engine.update_weights(weights, version))
        self._note_sync_time()
        self.mt.publish_version(version)
        self.version = version
        if self.local_until_learner:
            self.mt.call(self.mt.manager.open_local_window, None, False)
        elif self.mode == "hybrid":
            self.mt.call(self.mt.manager.open_local_window, self._window_s())

    def _note_sync_time(self) -> None:
        """The last window's length, when the workers' sync closed it, is the fleet's sync time."""
        last = self._last_window()
        if last is None or last[1] != "remote workers synced":
            return
        s = last[0]
        prev = self._sync_estimate_s
        self._sync_estimate_s = s if prev is None else WINDOW_EMA * s + (1 - WINDOW_EMA) * prev

    def _last_window(self) -> tuple[float, str] | None:
        return self.mt.call(getattr, self.mt.manager, "last_window")

    def _window_s(self) -> float:
        """Twice the measured sync time (a slow sync should not stall the step), at least
        a second, at most `rollout.hybrid_max_window_s`."""
        estimate = self._sync_estimate_s if self._sync_estimate_s is not None else self.cfg.hybrid_max_window_s
        return min(max(2 * estimate, 1.0), self.cfg.hybrid_max_window_s)

    # --------------------------------------------------------------------------- generating

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> Iterator[Group]:
        """Submits the batch now (workers start on it at once, even ahead of its step); the
        iterator gives each prompt's group as soon as its last sample is done."""
        request = BatchRequest(
            prompts=[
                # seeds from the run's seeded (and checkpointed) RNG, as in local rollout
                BatchPrompt(id=str(p.index), input_ids=p.prompt_ids, seed=random.getrandbits(62))
                for p in prompts
            ],
            n=n,
            sampling=BatchSampling(
                max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
            ),  # fmt: skip
            min_weight_version=self.version,
        )
        return self._groups(self.mt.submit(request), {str(p.index): p for p in prompts}, n)

    def _groups(self, batch: Batch, by_id: dict[str, Prompt], n: int) -> Iterator[Group]:
        self.stats = stats = RolloutStats(num_requested=len(by_id) * n)  # the step's: set when it starts reading
        for result in self.mt.results(batch):
            group = to_group(by_id[result.prompt_id], result, stats)
            # the manager's clock, not ours: the learner consumes groups at its own pace
            done_s = max(s.latency_s for s in result.samples)
            stats.first_group_s = min(stats.first_group_s or done_s, done_s)
            stats.gen_s = max(stats.gen_s, done_s)
            if self.mode == "hybrid" and stats.num_received == self.window_groups * n:
                # a peer finishes what it holds (moving it costs a re-prefill); a stopgap hands it on
                self.mt.call(self.mt.manager.close_local_window, "learner starts", not self.local_until_learner)
            yield group
        window = self._last_window()
        if self.mode == "hybrid" and window is not None:
            stats.window_s, stats.window_closed_by = window
        synced = self.mt.call(getattr, self.mt.manager, "sync_s")
        stats.weight_sync_s = max(synced.values()) if synced else None

    def close(self) -> None:
        self.mt.stop()
        self.publisher.stop()
        self.local_engine.shutdown()


def to_group(prompt: Prompt, result: GroupResult, stats: RolloutStats) -> Group:
    samples = []
    for s in sorted(result.samples, key=lambda s: s.index):
        for seg in s.segments:
            stats.tokens_by_worker[seg.worker] += seg.num_tokens
        stats.num_migrated += len(s.segments) > 1
        stats.num_local += any(seg.worker == LOCAL_WORKER_ID for seg in s.segments)
        samples.append(
            Sample(
                completion_ids=s.output_ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                weight_versions=s.weight_versions,
                workers=[seg.worker for seg in s.segments],
                gen_time_s=s.latency_s,
            )
        )
    stats.num_received += len(samples)
    return Group(prompt=prompt, samples=samples)
