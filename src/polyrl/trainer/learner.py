"""The GRPO learner: one optimizer step per mini-batch, gradients accumulated over
micro-batches whose loss uses the mini-batch's denominators (so the split is exact)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers import PreTrainedModel

from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.models.precision import autocast
from polyrl.trainer.batching import MicroBatch, SeqItem, collate, pack_micro_batches
from polyrl.trainer.grpo import LossInputs, policy_loss, token_logprobs


def lr_lambda(cfg: TrainerConfig, total_updates: int):
    """Linear warmup, then constant / linear / cosine decay to `min_lr_ratio`."""

    def factor(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps))
        shape = 1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor


def build_optimizer(model: PreTrainedModel, cfg: TrainerConfig, total_updates: int):
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        fused=model.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))
    return optimizer, scheduler


class Learner:
    def __init__(
        self,
        model: PreTrainedModel,
        ref_model: PreTrainedModel | None,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        algo: AlgoConfig,
        cfg: TrainerConfig,
        temperature: float,
        pad_id: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.ref_model = model, ref_model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.algo, self.cfg = algo, cfg
        self.temperature, self.pad_id = temperature, pad_id
        self.compute_dtype = compute_dtype

    def logprobs(self, model: PreTrainedModel, mb: MicroBatch, with_entropy: bool):
        with autocast(mb.input_ids.device, self.compute_dtype):
            logits = model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
            ).logits[:, :-1]  # [B, L-1, V]
        logp, entropy = token_logprobs(logits, mb.target_ids, self.temperature)
        return logp, (entropy if with_entropy else None)

    @torch.no_grad()
    def _prepare(self, items: list[SeqItem]) -> list[MicroBatch]:
        """Collate, and attach old (proximal) and reference log-probs before any update."""
        device = self.model.device
        mbs = [collate(b, self.pad_id).to(device) for b in pack_micro_batches(items, self.cfg.micro_batch_max_tokens)]
        for mb in mbs:
            mb.old_logp = self.logprobs(self.model, mb, False)[0] if self.algo.recompute_old_logprobs else mb.behav_logp
            if self.ref_model is not None and self.algo.kl_coef > 0:
                mb.ref_logp = self.logprobs(self.ref_model, mb, False)[0]
        return mbs

    def train_mini_batch(self, items: list[SeqItem], weights_as_sampled: bool) -> dict[str, float]:
        """ppo_epochs optimizer steps on one mini-batch; returns its metrics.

        weights_as_sampled: the model still holds the weights that generated `items` (no
        update since), so old vs behaviour log-probs measure engine/trainer mismatch alone.
        """
        self.model.train()
        mbs = self._prepare(items)
        num_tokens = sum(it.num_completion_tokens for it in items)
        sums: dict[str, float] = defaultdict(float)
        if weights_as_sampled and self.algo.recompute_old_logprobs:
            for mb in mbs:
                diff = ((mb.old_logp - mb.behav_logp).abs() * mb.mask).sum().item()
                sums["rollout/logprob_diff"] += diff / max(num_tokens, 1)
        for _ in range(self.algo.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in mbs:
                with_entropy = True  # cheap next to the forward pass, and always logged
                logp, entropy = self.logprobs(self.model, mb, with_entropy)
                inputs = LossInputs(
                    logp=logp,
                    old_logp=mb.old_logp,
                    behav_logp=mb.behav_logp,
                    advantages=mb.advantages,
                    mask=mb.mask,
                    entropy=entropy,
                    ref_logp=mb.ref_logp,
                )
                loss, metrics = policy_loss(inputs, self.algo, num_tokens, len(items))
                loss.backward()
                weight = metrics.pop("_num_tokens") / max(num_tokens, 1) / self.algo.ppo_epochs
                for key, value in metrics.items():
                    # Loss terms already carry mini-batch denominators: sum them; others are
                    # token means per micro-batch: weight them by tokens.
                    is_loss = key in ("actor/pg_loss", "actor/kl_loss")
                    sums[key] += value / self.algo.ppo_epochs if is_loss else value * weight
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            sums["actor/grad_norm"] += grad_norm.item() / self.algo.ppo_epochs
            sums["actor/lr"] = self.scheduler.get_last_lr()[0]
            if torch.isfinite(grad_norm):
                self.optimizer.step()
            self.scheduler.step()
        self.model.eval()
        return dict(sums)
