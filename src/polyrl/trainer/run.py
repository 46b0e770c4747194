"""Everything a training run holds, built once from the config (or from a checkpoint),
and what the loop asks of it between steps: the next batch, the step's end, the publish,
the metrics and the checkpoints.

Each part is built where its job is: the policy and learner in `policy.py`, the prompts
and rewards in `task.py`, the processes and the rollout source in `polyrl.launch`, the
metrics in `step_metrics.py`, checkpoints in `checkpoint.py`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from polyrl.config import ConfigError, RunConfig, save_config
from polyrl.data.source import PromptSource
from polyrl.launch.autoscale import Autoscaler, autoscaler_for
from polyrl.launch.fleet import Fleet
from polyrl.launch.start import start_rollout
from polyrl.metrics.tracker import Tracker
from polyrl.models.precision import DTYPES
from polyrl.preflight import check_world_size
from polyrl.protocol.manager_api import FleetDecision
from polyrl.protocol.samples import Group
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.agent import AgentRollout
from polyrl.rollout.atropos import AtroposRollout
from polyrl.rollout.feed import AsyncFeed
from polyrl.rollout.remote import RemoteRollout
from polyrl.rollout.source import Rollout
from polyrl.trainer.checkpoint import (
    TrainState,
    export_final_model,
    latest_checkpoint,
    read_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from polyrl.trainer.distributed import DataParallel, gather_state, gather_weights
from polyrl.trainer.dynamic_sampling import DynamicSampler
from polyrl.trainer.learner import Learner
from polyrl.trainer.lora import adapter_version
from polyrl.trainer.policy import Policy, build_learner, load_policy, prepare_process
from polyrl.trainer.step_metrics import step_metrics
from polyrl.trainer.stream import GroupScorer, StreamResult, in_prompt_order
from polyrl.trainer.task import prompts_and_rewards

log = logging.getLogger(__name__)


@dataclass
class PendingBatch:
    """A step's batch, submitted (maybe steps ahead), read as its groups finish."""

    groups: Iterator[Group]
    cursor: int
    """The source's cursor before its prompts were taken."""
    rng: dict[str, Any]
    """The RNG states before its seeds were drawn."""


@dataclass(kw_only=True)
class Run:
    cfg: RunConfig
    run_dir: Path
    policy: Policy
    source: PromptSource
    rollout: Rollout
    scorer: GroupScorer
    learner: Learner
    tracker: Tracker
    sampling: SamplingParams
    state: TrainState
    dp: DataParallel
    fleet: Fleet | None = None
    feed: AsyncFeed | None = None
    """rollout.fully_async: the prompts in flight, and each step's first groups to finish."""
    sampler: DynamicSampler | None = None
    """algo.filter_groups: the step's rounds of generation, for its metrics."""
    autoscaler: Autoscaler | None = None
    """fleet.autoscale: the launched fleet's size, decided after each step."""
    ahead: deque[PendingBatch] = field(default_factory=deque)
    """Submitted batches of the steps to come (rollout.max_staleness of them), oldest first."""
    cleanup: ExitStack = field(default_factory=ExitStack)
    """Stops what the run started (reward pool, rollout, fleet, tracker), last first."""

    @classmethod
    def create(cls, cfg: RunConfig, run_dir: Path, resume: bool, dp: DataParallel) -> Run:
        check_world_size(cfg, dp.world_size)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
        prepare_process(cfg)
        init_path = Path(cfg.model.path) if cfg.model.path else run_dir / "init_model"
        ckpt = latest_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            log.warning("no checkpoint in %s: starting from step 0", run_dir)
        with ExitStack() as cleanup:
            try:  # user input checked against real files and modules: report it as config
                policy = load_policy(cfg, init_path, ckpt)
                source, pool = prompts_and_rewards(cfg, policy.tokenizer, policy.model)
            except (ValueError, OSError) as e:
                raise ConfigError(f"config error: {e}") from None
            if pool is not None:
                cleanup.callback(pool.close)
            blob = read_trainer_state(ckpt) if ckpt else None
            state = TrainState(**blob["state"]) if blob else TrainState()
            source.cursor = state.cursor
            rollout, fleet = start_run_rollout(cfg, run_dir, policy, init_path, state, cleanup)
            with dp.command("start", cfg, init_path, policy.pad_id, ckpt):
                learner = build_learner(
                    cfg, policy.model, init_path=init_path, pad_id=policy.pad_id, blob=blob, dp=dp, peft=policy.peft
                )
            if blob:
                set_rng_state(blob["rng"])
            sampling = cfg.rollout.sampling(policy.stop_token_ids())
            if cfg.algo.router_replay == "R3":  # the engines' routes, for the learner to replay
                sampling = sampling.model_copy(update={"return_routed_experts": True})
            name = cfg.run_name or run_dir.name
            # On resume, metrics past the checkpoint (or all of them, without one) are dropped.
            tracker = Tracker(cfg.logging, run_dir, state.step if resume else None, name, cfg.model_dump(mode="json"))
            cleanup.callback(tracker.close)
            feed = start_feed(cfg, rollout, source, sampling, state, cleanup)
            if ckpt:
                log.info(
                    "resumed from %s at step %d%s",
                    ckpt,
                    state.step,
                    f" ({len(state.pending)} prompts in flight go out again)" if feed and state.pending else "",
                )
            return cls(
                cfg=cfg,
                run_dir=run_dir,
                policy=policy,
                source=source,
                rollout=rollout,
                scorer=GroupScorer(pool, policy.tokenizer, cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens),
                learner=learner,
                tracker=tracker,
                sampling=sampling,
                state=state,
                dp=dp,
                fleet=fleet,
                feed=feed,
                autoscaler=autoscaler_for(cfg, dp.world_size) if fleet is not None else None,
                cleanup=cleanup.pop_all(),
            )

    def next_batch(self, step: int) -> Iterator[Group]:
        """Step `step`'s groups. With rollout.max_staleness = k, the next k steps' batches
        are submitted too: workers generate them while the learner trains on this one.
        Fully asynchronous: the first groups to finish of those in flight (rollout/feed.py)."""
        if self.feed is not None:
            self.feed.top_up(steps_left=self.cfg.trainer.total_steps - step + 1)
            return self.feed.take(self.state.weight_version)
        if self.cfg.algo.filter_groups.enable:  # (max_staleness is 0: nothing was submitted ahead)
            self.sampler = DynamicSampler(
                lambda: self._submit(step).groups,
                self.scorer,
                self.cfg.algo.filter_groups,
                self.cfg.trainer.train_batch_size,
                self.rollout,
            )
            return iter(self.sampler)
        last = min(step + self.cfg.rollout.max_staleness, self.cfg.trainer.total_steps)
        while step + len(self.ahead) <= last:
            self.ahead.append(self._submit(step + len(self.ahead)))
        return self.ahead.popleft().groups

    def _submit(self, step: int) -> PendingBatch:
        """Step `step`'s worth of prompts, submitted (with its generation budget)."""
        cursor, rng = self.source.cursor, rng_state()
        prompts = self.source.take(self.num_prompts_per_step)
        sampling = self.sampling
        if self.cfg.rollout.max_new_tokens_schedule:
            sampling = sampling.model_copy(update={"max_new_tokens": self.cfg.rollout.budget_at(step)})
        groups = self.rollout.generate(prompts, sampling)
        if self.cfg.rollout.deterministic and prompts:  # (Atropos environments choose their own groups)
            groups = in_prompt_order(groups, [p.index for p in prompts])
        return PendingBatch(groups, cursor, rng)

    @property
    def num_prompts_per_step(self) -> int:
        """None from the source when Atropos environments bring their own."""
        return 0 if self.cfg.data.source == "atropos" else self.cfg.trainer.train_batch_size

    def end_step(self, step: int) -> None:
        """Record `step` as done. Batches in flight for later steps are not part of the
        state: a resumed run takes their prompts and draws their seeds again (fully
        asynchronous: the prompts in flight are listed, and go out again)."""
        if self.feed is not None:
            self.state = replace(self.state, step=step, cursor=self.source.cursor, pending=self.feed.pending_indices)
            return
        cursor = self.ahead[0].cursor if self.ahead else self.source.cursor
        self.state = replace(self.state, step=step, cursor=cursor, pending=[])

    def learner_started(self) -> None:
        """The learner is about to update (before each mini-batch): the local window closes."""
        self.rollout.learner_started()

    def publish_weights(self) -> None:
        """Colocated: a version bump (the engine runs on the trainer's model, adapters
        included); remote: a snapshot the workers pull (of the whole weights, gathered from
        every rank's shard; with LoRA, of the adapters only)."""
        version = self.state.next_version()
        peft = self.policy.peft
        if peft is not None and not self.rollout.shares_weights:
            self.rollout.publish(adapter_version(peft), version)  # megabytes, not the model
            return
        self.rollout.publish(gather_weights(self.policy.model, self.dp), version)

    def step_metrics(self, groups: list[Group], result: StreamResult, timings: dict[str, float]) -> dict[str, float]:
        if self.sampler is not None:
            result.num_failed_samples += self.sampler.stats.num_failed_samples  # scored before the learner saw them
        metrics = step_metrics(
            cfg=self.cfg,
            groups=groups,
            result=result,
            timings=timings,
            rollout=self.rollout,
            feed=self.feed,
            fleet=self.fleet,
            world_size=self.dp.world_size,
            device=self.policy.model.device,
            weight_version=self.state.weight_version,
            budget=self.cfg.rollout.budget_at(self.state.step),
        )
        if self.sampler is not None:
            metrics.update(self.sampler.stats.metrics())
        return metrics

    def scale_fleet(self, metrics: dict[str, float]) -> None:
        """fleet.autoscale: one worker more or fewer when the steps say so (launch/autoscale.py);
        `fleet/autoscale_target` joins the step's metrics."""
        if self.autoscaler is None or self.fleet is None:
            return
        decision = self.autoscaler.observe(metrics)
        if decision is not None:
            now = int(metrics["training/num_workers"])
            self.rollout.fleet_decision(FleetDecision(workers=now, target=decision.target, reason=decision.reason))
            self.fleet.request(decision.target)
            for _ in range(decision.target - now):
                self.fleet.launch()
            for _ in range(now - decision.target):
                self.fleet.retire_oldest()
        metrics["fleet/autoscale_target"] = float(self.autoscaler.target or metrics.get("training/num_workers", 0))

    def save(self) -> Path:
        model = self.policy.model
        model_state, optimizer_state = gather_state(model, self.learner.optimizer, self.dp)
        rng = self.ahead[0].rng if self.ahead else None  # as before the batches in flight (see end_step)
        return save_checkpoint(
            self.run_dir,
            self.state,
            self.policy.peft or model,
            self.policy.tokenizer,
            optimizer_state,
            self.learner.scheduler,
            model_state,
            rng,
        )

    def save_final(self, ckpt: Path) -> Path:
        """The final checkpoint's model as final_model/ (`export_final_model`)."""
        return export_final_model(
            self.run_dir,
            ckpt,
            peft=self.policy.peft,
            tokenizer=self.policy.tokenizer,
            merged=self.cfg.model.lora.save_merged,
        )

    def close(self) -> None:
        self.cleanup.close()


def start_run_rollout(
    cfg: RunConfig, run_dir: Path, policy: Policy, init_path: Path, state: TrainState, cleanup: ExitStack
) -> tuple[Rollout, Fleet | None]:
    """The rollout, its processes started (`cleanup` stops them) and the resumed version
    published; with Atropos data, wrapped so that groups come from the Atropos API (the
    fleet still gets every version). Before the learner: the colocated engine shares the
    model before sharding, and the local worker sizes its KV cache before the learner
    allocates."""
    rollout, fleet = start_rollout(cfg, run_dir, policy.model, DTYPES[cfg.model.dtype], init_path, cleanup)
    peft = policy.peft
    rollout.publish(adapter_version(peft) if peft and not rollout.shares_weights else None, state.weight_version)
    if cfg.data.source == "atropos":
        rollout = AtroposRollout.start(rollout, cfg, run_dir, policy.model, state.step)
        cleanup.callback(rollout.close)
    elif cfg.data.source == "agent":
        assert isinstance(rollout, RemoteRollout)  # (the config allows no other mode)
        context = cfg.engine.max_model_len or policy.model.config.max_position_embeddings
        rollout = AgentRollout(
            rollout, cfg.data, policy.tokenizer, policy.stop_token_ids(), cfg.rollout.temperature, context
        )
        cleanup.callback(rollout.close)
    return rollout, fleet


def start_feed(
    cfg: RunConfig,
    rollout: Rollout,
    source: PromptSource,
    sampling: SamplingParams,
    state: TrainState,
    cleanup: ExitStack,
) -> AsyncFeed | None:
    """rollout.fully_async: the feed that keeps prompts in flight (a resumed run's go out
    again first); `cleanup` closes it before the rollout, whose batches' ends it expects."""
    if cfg.rollout.fully_async and isinstance(rollout, RemoteRollout | AgentRollout):
        feed = AsyncFeed(
            rollout,
            source,
            sampling,
            cfg.trainer.train_batch_size,
            cfg.rollout.max_staleness,
            resubmit=state.pending,
            fresh=cfg.rollout.async_admission == "fresh",
            counts_drops=isinstance(rollout, AgentRollout),
        )
        cleanup.callback(feed.close)
        return feed
    if cfg.rollout.fully_async:  # Atropos environments feed themselves
        log.info(
            "rollout.fully_async with Atropos data: workers keep their running samples across "
            "versions; how far groups lag is the environments' max_batches_offpolicy"
        )
    return None
