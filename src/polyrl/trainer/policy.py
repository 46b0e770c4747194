"""The model a run trains and the learner that updates it, from the initial model or a
checkpoint: the device, the float32 master weights, LoRA adapters on them, the tokenizer,
and the optimizer, scheduler and reference model around them. Also what every trainer
process sets before it computes (seeds, torch's thread count)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import RunConfig
from polyrl.cpu_threads import process_threads
from polyrl.models.precision import DTYPES
from polyrl.models.tiny import save_tiny_model
from polyrl.trainer.checkpoint import ADAPTER_DIR, MODEL_DIR, read_trainer_state
from polyrl.trainer.distributed import DataParallel, load_optimizer_state, shard_model
from polyrl.trainer.learner import Learner, build_optimizer, enable_gradient_checkpointing
from polyrl.trainer.lora import RANDOM_BASE, adapters_off, apply_lora, load_adapter

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


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The model to train, with its tokenizer."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    peft: PeftModel | None = None
    """With LoRA: the PEFT wrapper of `model` (whose layers it injected in place)."""

    @property
    def pad_id(self) -> int:
        """The tokenizer's padding id, else its EOS id."""
        tokenizer = self.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the tokenizer and generation config (chat models often have several)."""
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted(set(ids)))


def load_policy(cfg: RunConfig, init_path: Path, ckpt: Path | None) -> Policy:
    """The policy on `trainer.device`, from the initial model (a tiny one written to
    `init_path` first when no `model.path` is given) or the checkpoint `ckpt`."""
    device = pick_device(cfg.trainer.device)
    if not cfg.model.path and not (init_path / "config.json").exists():
        save_tiny_model(init_path, cfg.model.tiny)
    model, peft = load_weights(cfg, init_path, ckpt, device)
    return Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(init_path), peft=peft)


def load_weights(
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
    *,
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
    blob = read_trainer_state(ckpt) if ckpt else None
    return build_learner(cfg, model, init_path=init_path, pad_id=pad_id, blob=blob, dp=dp)
