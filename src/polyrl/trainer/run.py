"""Everything a training run holds, built once from the config (or from a checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import ConfigError, EngineConfig, RunConfig, save_config
from polyrl.cpu_threads import process_threads
from polyrl.data.rewards import RewardPool
from polyrl.data.source import PromptSource
from polyrl.manager.protocol import BatchSampling
from polyrl.metrics.step_stats import (
    cost_metrics,
    cuda_memory_metrics,
    num_tokens,
    perf_metrics,
    rollout_metrics,
    version_lag_metrics,
)
from polyrl.metrics.tracker import Tracker
from polyrl.models.precision import DTYPES
from polyrl.models.tiny import save_tiny_model
from polyrl.preflight import check_world_size, shared_token
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.samples import Group
from polyrl.rollout.atropos import AtroposRollout
from polyrl.rollout.feed import AsyncFeed
from polyrl.rollout.fleet import Fleet, WorkerFleet
from polyrl.rollout.local import LocalRollout
from polyrl.rollout.remote import RemoteRollout
from polyrl.rollout.source import Rollout
from polyrl.trainer.checkpoint import (
    ADAPTER_DIR,
    MODEL_DIR,
    TrainState,
    latest_checkpoint,
    read_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from polyrl.trainer.distributed import DataParallel, gather_state, gather_weights, load_optimizer_state, shard_model
from polyrl.trainer.learner import Learner, build_optimizer, enable_gradient_checkpointing
from polyrl.trainer.lora import RANDOM_BASE, adapter_version, adapters_off, apply_lora, load_adapter, save_merged
from polyrl.trainer.stream import GroupScorer, StreamResult, in_prompt_order

if TYPE_CHECKING:
    from peft import PeftModel  # imported by trainer/lora.py when LoRA is on (PEFT costs a fraction of a second)

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device: cuda requested but CUDA is not available")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_process(cfg: RunConfig) -> None:
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.num_threads:
        process_threads().fix(cfg.trainer.num_threads)
    elif cfg.rollout.deterministic or cfg.rollout.mode == "local":
        # a reduction's bits depend on how many threads split it: runs that promise the same
        # bits for the same config (and exact resume) keep torch's count
        process_threads().fix(torch.get_num_threads())


def load_model(path: str | Path, device: torch.device) -> PreTrainedModel:
    """float32 master weights; lower precision is applied by autocast (models/precision.py)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.eval()
    return model


def fit_prompts_to_context(source: PromptSource, model: PreTrainedModel, max_new_tokens: int) -> None:
    """Prompt + completion must fit the model's positions: lower the prompt limit if needed."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context is None:
        return
    if max_new_tokens >= context:
        raise ValueError(f"rollout.max_new_tokens ({max_new_tokens}) leaves no room in the model's {context} positions")
    if source.max_prompt_tokens + max_new_tokens > context:
        source.max_prompt_tokens = context - max_new_tokens
        log.info("prompts limited to %d tokens to fit the model's %d positions", source.max_prompt_tokens, context)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the tokenizer and generation config (chat models often have several)."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def average_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the mini-batches that report it."""
    keys = {k for row in rows for k in row}
    return {k: float(np.mean([row[k] for row in rows if k in row])) for k in sorted(keys)}


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
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: PromptSource
    rollout: Rollout
    scorer: GroupScorer
    learner: Learner
    tracker: Tracker
    sampling: BatchSampling
    state: TrainState
    dp: DataParallel
    fleet: Fleet | None = None
    peft: PeftModel | None = None
    """With LoRA: the PEFT wrapper of `model` (whose layers it injected in place)."""
    feed: AsyncFeed | None = None
    """rollout.fully_async: the prompts in flight, and each step's first groups to finish."""
    ahead: deque[PendingBatch] = field(default_factory=deque)
    """Submitted batches of the steps to come (rollout.max_staleness of them), oldest first."""
    cleanup: ExitStack = field(default_factory=ExitStack)
    """Stops what the run started (reward pool, rollout, fleet, tracker), last first."""
    version: int = 0
    """The policy's weight version: the trainer's to count (one per step), the rollout's
    to deliver."""

    @classmethod
    def create(cls, cfg: RunConfig, run_dir: Path, resume: bool, dp: DataParallel) -> Run:
        tcfg = cfg.trainer
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
                device = pick_device(tcfg.device)
                if not cfg.model.path and not (init_path / "config.json").exists():
                    save_tiny_model(init_path, cfg.model.tiny)
                model, peft = load_policy(cfg, init_path, ckpt, device)
                tokenizer = AutoTokenizer.from_pretrained(init_path)
                source = PromptSource(cfg.data, tokenizer, tcfg.seed)
                fit_prompts_to_context(source, model, cfg.rollout.max_new_tokens)
                functions = cfg.reward.functions or [source.default_reward]
                pool = RewardPool(functions, cfg.reward.weights, cfg.reward.num_workers, cfg.reward.timeout_s)
            except (ValueError, OSError) as e:
                raise ConfigError(f"config error: {e}") from None
            cleanup.callback(pool.close)
            blob = read_trainer_state(ckpt) if ckpt else None
            state = TrainState(**blob["state"]) if blob else TrainState()
            source.cursor = state.cursor
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            compute_dtype = DTYPES[cfg.model.dtype]
            # The rollout first: its engine shares the model (colocated) before sharding, and
            # the local worker sizes its KV cache before the learner allocates.
            rollout, fleet = start_rollout(cfg, run_dir, model, compute_dtype, init_path, cleanup)
            rollout.publish(
                adapter_version(peft) if peft and not rollout.shares_weights else None, state.weight_version
            )
            if cfg.data.source == "atropos":  # groups from the Atropos API; the fleet still gets every version
                rollout = AtroposRollout.start(rollout, cfg, run_dir, model, state.step)
                cleanup.callback(rollout.close)
            with dp.command("start", cfg, init_path, pad_id, ckpt):
                learner = build_learner(cfg, model, init_path, pad_id, blob, dp, peft)
            if blob:
                set_rng_state(blob["rng"])
            sampling = BatchSampling(
                max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
                stop_token_ids=list(stop_token_ids(model, tokenizer)),
                ignore_eos=True,  # the stop ids already name the EOS tokens the run wants
            )
            name = cfg.run_name or run_dir.name
            # On resume, metrics past the checkpoint (or all of them, without one) are dropped.
            tracker = Tracker(cfg.logging, run_dir, state.step if resume else None, name, cfg.model_dump(mode="json"))
            cleanup.callback(tracker.close)
            feed = None
            if cfg.rollout.fully_async and isinstance(rollout, RemoteRollout):
                feed = AsyncFeed(
                    rollout,
                    source,
                    sampling,
                    cfg.rollout.n,
                    tcfg.train_batch_size,
                    cfg.rollout.max_staleness,
                    resubmit=state.pending,
                    fresh=cfg.rollout.async_admission == "fresh",
                )
                cleanup.callback(feed.close)  # before the rollout closes: its batches' ends are expected
            elif cfg.rollout.fully_async:  # Atropos environments feed themselves
                log.info(
                    "rollout.fully_async with Atropos data: workers keep their running samples across "
                    "versions; how far groups lag is the environments' max_batches_offpolicy"
                )
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
                model=model,
                tokenizer=tokenizer,
                source=source,
                rollout=rollout,
                scorer=GroupScorer(pool, tokenizer),
                learner=learner,
                tracker=tracker,
                sampling=sampling,
                state=state,
                dp=dp,
                fleet=fleet,
                peft=peft,
                feed=feed,
                cleanup=cleanup.pop_all(),
                version=state.weight_version,
            )

    def next_batch(self, step: int) -> Iterator[Group]:
        """Step `step`'s groups. With rollout.max_staleness = k, the next k steps' batches
        are submitted too: workers generate them while the learner trains on this one.
        Fully asynchronous: the first groups to finish of those in flight (rollout/feed.py)."""
        if self.feed is not None:
            self.feed.top_up(steps_left=self.cfg.trainer.total_steps - step + 1)
            return self.feed.take(self.version)
        last = min(step + self.cfg.rollout.max_staleness, self.cfg.trainer.total_steps)
        while step + len(self.ahead) <= last:
            cursor, rng = self.source.cursor, rng_state()
            prompts = self.source.take(self.num_prompts_per_step)
            groups = self.rollout.generate(prompts, self.cfg.rollout.n, self.sampling)
            if self.cfg.rollout.deterministic and prompts:  # (Atropos environments choose their own groups)
                groups = in_prompt_order(groups, [p.index for p in prompts])
            self.ahead.append(PendingBatch(groups, cursor, rng))
        return self.ahead.popleft().groups

    @property
    def num_prompts_per_step(self) -> int:
        """None from the source when Atropos environments bring their own."""
        return 0 if self.cfg.data.source == "atropos" else self.cfg.trainer.train_batch_size

    def end_step(self, step: int) -> None:
        """Record `step` as done. Batches in flight for later steps are not part of the
        state: a resumed run takes their prompts and draws their seeds again (fully
        asynchronous: the prompts in flight are listed, and go out again)."""
        if self.feed is not None:
            self.state = TrainState(step, self.source.cursor, self.version, self.feed.pending_indices)
            return
        cursor = self.ahead[0].cursor if self.ahead else self.source.cursor
        self.state = TrainState(step, cursor, self.version)

    def learner_started(self) -> None:
        """The learner is about to update (before each mini-batch): the local window closes."""
        self.rollout.learner_started()

    def publish_weights(self) -> None:
        """Colocated: a version bump (the engine runs on the trainer's model, adapters
        included); remote: a snapshot the workers pull (of the whole weights, gathered from
        every rank's shard; with LoRA, of the adapters only)."""
        self.version += 1
        if self.peft is not None and not self.rollout.shares_weights:
            self.rollout.publish(adapter_version(self.peft), self.version)  # megabytes, not the model
            return
        self.rollout.publish(gather_weights(self.model, self.dp), self.version)

    def step_metrics(self, groups: list[Group], result: StreamResult, timings: dict[str, float]) -> dict[str, float]:
        step_s = timings["step"]
        metrics = average_metrics(result.train_metrics)
        metrics.update(rollout_metrics(groups, self.cfg.rollout.max_new_tokens))
        if result.version is not None:
            metrics.update(version_lag_metrics(groups, result.version))
        total_tokens = num_tokens(groups)
        metrics.update(perf_metrics(total_tokens, step_s, world_size=self.dp.world_size))
        metrics.update(cuda_memory_metrics(self.model.device))
        if self.model.device.type == "cpu":
            metrics["perf/cpu_threads"] = float(process_threads().threads)
        stats = self.feed.step.stats if self.feed is not None else self.rollout.stats
        metrics.update(stats.metrics())
        if self.feed is not None:
            metrics.update(self.feed.step.metrics())
        metrics.update({f"timing_s/{k}": v for k, v in timings.items() if k != "step"})
        metrics["timing_s/gen"] = stats.gen_s
        metrics["timing_s/learner_idle"] = result.wait_s + timings.get("learner_idle", 0.0)  # (colocated: generating)
        metrics["timing_s/reward"] = result.reward_wait_s
        metrics["timing_s/update_actor"] = result.update_s
        metrics["training/num_rollout_instances"] = float(len(stats.tokens_by_worker) or self.rollout.num_instances)
        prices: list[float] = []
        if self.cfg.rollout.mode != "local":
            default = self.cfg.cost.worker_usd_per_hour
            prices = [w.usd_per_hour if w.usd_per_hour is not None else default for w in self.rollout.workers()]
            metrics["training/num_workers"] = float(len(prices))
            if stats.fleet_idle_s is not None and prices:
                metrics["rollout/fleet_idle_ratio"] = min(1.0, stats.fleet_idle_s / (step_s * len(prices)))
        trainer_usd = self.cfg.cost.trainer_usd_per_hour * self.dp.world_size  # one price per trainer GPU
        metrics.update(cost_metrics(total_tokens, step_s, trainer_usd, prices))
        if self.fleet is not None:
            events = self.fleet.events
            metrics.update(
                {
                    "fleet/launched": float(events.launched),
                    "fleet/retired": float(events.retired),
                    "fleet/killed": float(events.killed),
                }
            )
        metrics["training/filtered_groups"] = float(result.num_filtered_groups)
        metrics["reward/failed_samples"] = float(result.num_failed_samples)
        metrics["training/weight_version"] = float(self.version)
        return metrics

    def save(self) -> Path:
        model_state, optimizer_state = gather_state(self.model, self.learner.optimizer, self.dp)
        rng = self.ahead[0].rng if self.ahead else None  # as before the batches in flight (see end_step)
        return save_checkpoint(
            self.run_dir,
            self.state,
            self.peft or self.model,
            self.tokenizer,
            optimizer_state,
            self.learner.scheduler,
            model_state,
            rng,
        )

    def save_final(self, ckpt: Path) -> Path:
        """The final checkpoint's model (an HF directory with the tokenizer), as final_model/;
        with LoRA, its adapter (PEFT's format), and the merged model if `save_merged`."""
        out = self.run_dir / "final_model"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(ckpt / (ADAPTER_DIR if self.peft is not None else MODEL_DIR), out)
        if self.peft is not None and self.cfg.model.lora.save_merged:
            merged = self.run_dir / "final_model_merged"
            shutil.rmtree(merged, ignore_errors=True)
            save_merged(self.peft, self.tokenizer, merged)
            log.info("merged model in %s", merged)
        return out

    def close(self) -> None:
        self.cleanup.close()


def load_policy(
    cfg: RunConfig, init_path: Path, ckpt: Path | None, device: torch.device
) -> tuple[PreTrainedModel, PeftModel | None]:
    """The model to train, from the initial model or a checkpoint. With LoRA: the base
    (always the initial model) with adapters injected, the checkpoint's adapters loaded."""
    if not cfg.model.lora.enabled:
        return load_model(ckpt / MODEL_DIR if ckpt else init_path, device), None
    if not cfg.model.path:
        log.warning(RANDOM_BASE)
    model = load_model(init_path, device)
    peft = apply_lora(model, cfg.model.lora)
    if ckpt:
        load_adapter(peft, ckpt / ADAPTER_DIR)
    return model, peft


def build_learner(
    cfg: RunConfig,
    model: PreTrainedModel,
    init_path: Path,
    pad_id: int,
    blob: dict | None,
    dp: DataParallel,
    peft: PeftModel | None = None,
) -> Learner:
    """The same on every rank: the model (sharded over the ranks when there are several), the
    reference model, optimizer and scheduler, their state from a checkpoint's `blob`. With
    LoRA (`peft`), the reference is the model with its adapters off: no second copy."""
    tcfg = cfg.trainer
    compute_dtype = DTYPES[cfg.model.dtype]
    ref_model = None
    if cfg.algo.kl_coef > 0 and peft is None:
        ref_model = load_model(init_path, model.device).requires_grad_(False)
    if tcfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if dp.world_size > 1:
        # float32 shards under autocast, as one process computes: on 2x H200 this trained at
        # 53 ms per 1k tokens against 72 with FSDP's bf16-parameter policy (BENCHMARKS.md)
        if ref_model is not None:
            shard_model(ref_model, compute_dtype, cast_params=False)
        compute_dtype = shard_model(model, compute_dtype, cast_params=False)
    updates_per_step = tcfg.train_batch_size // tcfg.ppo_mini_batch_size * cfg.algo.ppo_epochs
    optimizer, scheduler = build_optimizer(model, tcfg, tcfg.total_steps * updates_per_step)
    if blob:
        load_optimizer_state(model, optimizer, blob["optimizer"])
        scheduler.load_state_dict(blob["scheduler"])
    return Learner(
        model=model,
        ref_model=ref_model,
        optimizer=optimizer,
        scheduler=scheduler,
        algo=cfg.algo,
        cfg=tcfg,
        temperature=cfg.rollout.temperature,
        pad_id=pad_id,
        compute_dtype=compute_dtype,
        dp=dp,
        adapters_off=(lambda: adapters_off(peft)) if peft is not None else None,
    )


def load_learner(dp: DataParallel, cfg: RunConfig, init_path: Path, pad_id: int, ckpt: Path | None) -> Learner:
    """The learner from the initial model or a checkpoint: what a rank > 0 builds from rank
    0's "start" command (rank 0 loads its model earlier, for the rollout)."""
    prepare_process(cfg)
    model = load_model(ckpt / MODEL_DIR if ckpt else init_path, pick_device(cfg.trainer.device))
    return build_learner(cfg, model, init_path, pad_id, read_trainer_state(ckpt) if ckpt else None, dp)


def start_rollout(
    cfg: RunConfig,
    run_dir: Path,
    model: PreTrainedModel,
    compute_dtype: torch.dtype,
    init_path: Path,
    cleanup: ExitStack,
) -> tuple[Rollout, Fleet | None]:
    """The rollout and, remote or hybrid, the launched workers; `cleanup` stops them."""
    if cfg.rollout.mode == "local":
        return LocalRollout.colocated(model, cfg.engine, compute_dtype), None
    return start_remote(cfg, run_dir, model, compute_dtype, init_path, cleanup)


def start_remote(
    cfg: RunConfig,
    run_dir: Path,
    model: PreTrainedModel,
    compute_dtype: torch.dtype,
    init_path: Path,
    cleanup: ExitStack,
) -> tuple[RemoteRollout, Fleet | None]:
    """The manager, publisher and local worker processes, then the launched workers (if
    any). The manager always has a token (a random one unless given), so that workers
    from anywhere can be added later; it goes to RUN_DIR/manager.json (owner-only), not
    to the log."""
    try:
        token = shared_token(cfg.manager.token, cfg.manager.token_file, "manager.token_file") or secrets.token_hex(16)
    except ValueError as e:  # the file went away since the preflight
        raise ConfigError(f"config error: {e}") from None
    cfg = cfg.model_copy(update={"engine": started_engines(cfg)})
    try:
        rollout = RemoteRollout(model, cfg, run_dir, token, init_path, compute_dtype)
    except OSError as e:  # the port is taken, the address is not ours
        raise ConfigError(
            f"config error: manager: cannot listen on {cfg.manager.host}:{cfg.manager.port}: {e}"
        ) from None
    cleanup.callback(rollout.close)
    info = run_dir / "manager.json"
    ca_file = {"ca_file": cfg.manager.tls.ca_file} if cfg.manager.tls.ca_file else {}
    info.write_text(json.dumps({"url": rollout.url, "token": token} | ca_file))
    os.chmod(info, 0o600)
    extra = f" worker.tls.ca_file={cfg.manager.tls.ca_file}" if cfg.manager.tls.ca_file else ""
    if cfg.engine.dtype == "float64":  # as the run's own workers (rollout.deterministic)
        extra += " engine.dtype=float64"
    log.info(
        "rollout manager on %s; add a worker: polyrl worker --model %s --manager %s --token-file %s%s",
        rollout.url,
        init_path,
        rollout.public_url,
        info,
        extra,
    )
    log.info(
        "operator page: %s/?token=<token in %s> (terminal: polyrl status %s --token-file %s)",
        rollout.url,
        info,
        rollout.url,
        info,
    )
    fleet = None
    if cfg.fleet.num_workers:
        fleet = launcher(cfg, init_path, rollout, token, run_dir)
        cleanup.callback(fleet.stop)
        cleanup.callback(rollout.local.terminate)  # runs first: the local worker drains while the fleet does
    ids = fleet.start() if fleet is not None else []  # while the manager starts: they register once it serves
    rollout.connect()
    wait_for_workers(rollout, fleet, ids, cfg.fleet.min_workers, cfg.fleet.ready_timeout_s)
    return rollout, fleet


def launcher(cfg: RunConfig, init_path: Path, rollout: RemoteRollout, token: str, run_dir: Path) -> Fleet:
    """The fleet that launches `fleet.num_workers` workers: subprocesses here, or Ray actors
    on a cluster (which reach the manager at its advertised address)."""
    if cfg.fleet.launcher == "ray":
        from polyrl.rollout.ray_fleet import RayFleet

        model_path = cfg.fleet.ray_model_path or str(init_path)
        return RayFleet(cfg.fleet, cfg.engine, model_path, rollout.public_url, token, cfg.model.lora, cfg.manager.tls)
    return WorkerFleet(
        cfg.fleet, cfg.engine, init_path, rollout.url, token, run_dir / "workers", cfg.model.lora, cfg.manager.tls
    )


def started_engines(cfg: RunConfig) -> EngineConfig:
    """The engine settings of the workers the run starts (the local one included). A
    deterministic run's CPU engines compute in float64 unless `engine.dtype` says
    otherwise: float32 log-probs change in their last bits with the batch a sample shared
    (see `engine/sampler.py`, LOGIT_GRID). Workers started by hand need `engine.dtype=float64`."""
    engine = cfg.engine
    on_cpu = engine.device == "cpu" or (engine.device == "auto" and not torch.cuda.is_available())
    if cfg.rollout.deterministic and engine.dtype == "auto" and on_cpu:
        log.info("rollout.deterministic: the run's CPU engines compute in float64")
        return engine.model_copy(update={"dtype": "float64"})
    return engine


def wait_for_workers(
    rollout: RemoteRollout, fleet: Fleet | None, ids: list[str], min_active: int, timeout_s: float
) -> None:
    """Wait until the local worker and the launched workers `ids` are active, and at
    least `min_active` workers in all (a worker's start-up is mostly imports and model
    loading); a launched worker that dies or is late, or a fleet short of `min_active`,
    is left behind with a warning."""
    deadline = time.monotonic() + timeout_s
    if min_active:
        log.info("waiting up to %.0fs for %d active rollout workers (fleet.min_workers)", timeout_s, min_active)

    def active() -> set[str]:
        return {w.worker_id for w in rollout.fleet().workers if w.state == "active"}

    while time.monotonic() < deadline:
        now, launched = active(), {w.worker_id for w in fleet.alive()} if fleet is not None else set()
        local_up = LOCAL_WORKER_ID in now or not rollout.local.alive()
        if local_up and len(now - {LOCAL_WORKER_ID}) >= min_active and all(i in now or i not in launched for i in ids):
            break
        time.sleep(0.2)
    now = active()
    if LOCAL_WORKER_ID not in now:
        log.warning(
            "the local worker is not active after %.0fs (see %s)", timeout_s, rollout.local.log_dir / "local.log"
        )
    now.discard(LOCAL_WORKER_ID)
    missing = [i for i in ids if i not in now]
    if missing and fleet is not None:  # launched ids come with their fleet
        log.warning(
            "workers %s died or were not ready within %.0fs (see %s): training goes on without them",
            missing,
            timeout_s,
            fleet.logs,
        )
    if len(now) < min_active:
        log.warning(
            "%d of fleet.min_workers=%d workers active after %.0fs: training starts with them",
            len(now),
            min_active,
            timeout_s,
        )
    log.info("%d rollout workers ready", len(now))


class Timer:
    """Collects named wall-clock spans: `with timer("gen"): ...`."""

    def __init__(self) -> None:
        self.spans: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans[name] = self.spans.get(name, 0.0) + time.perf_counter() - t0
