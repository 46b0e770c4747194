"""The GRPO learner: one optimizer step per mini-batch, gradients accumulated over
micro-batches whose loss uses the mini-batch's denominators (so the split is exact).

On several ranks (see distributed.py) every rank runs the same step on its share of the
mini-batch, still with the whole mini-batch's denominators, and FSDP sums the gradients:
the split over ranks is exact in the same way as the split into micro-batches."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from transformers import PreTrainedModel

from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.cpu_threads import checked_each, measured
from polyrl.models.moe import has_moe
from polyrl.models.precision import autocast
from polyrl.trainer.batching import MicroBatch, SeqItem, collate
from polyrl.trainer.distributed import DataParallel, is_sharded
from polyrl.trainer.grpo import LossInputs, policy_loss_on_device, token_logprobs
from polyrl.trainer.lm_head import head_logprobs
from polyrl.trainer.packing import collate_packed, default_backend, make_docs, pack_by_tokens, use_packed_attention
from polyrl.trainer.rollout_correction import SEQ_SUMS, lag_keys, lag_kls, lag_token_counts, with_ess
from polyrl.trainer.router_aux import RouterLogits
from polyrl.trainer.router_replay import RouterReplay

log = logging.getLogger(__name__)


SUMMED_METRICS = frozenset(("actor/pg_loss", "actor/kl_loss", *SEQ_SUMS))
"""Metrics of `policy_loss_on_device` divided by the mini-batch's totals already."""

GPU_BOUND_MICRO_BATCH_TOKENS = 16384
"""Where the compiled learner's step became bound by the GPU rather than by the host's
launches on an H100 for the 0.6B shape (BENCHMARKS.md: 8k-token micro-batches, 72k
tokens/s; 16k, 93k); a hint, not a limit: larger models reach it sooner."""


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
    """AdamW over the trainable parameters: all of them, or only the adapters with LoRA."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        fused=model.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))
    return optimizer, scheduler


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """HF's per-layer activation checkpointing, non-reentrant. It acts only in train mode,
    which the learner sets for its updates, so the engine's forward passes never recompute.
    HF's hook that makes the embeddings' output require grad is removed: only reentrant
    checkpointing needs it, and the colocated engine runs these very modules."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (transformers >= 5.2x)
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)
    if getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()


TRACE_ATTENTION = True
"""Compiled layers trace the varlen attention op into their graph instead of breaking around
it: one graph per layer forward and one backward, 12% faster on the H100 (BENCHMARKS.md)."""


def compile_layers(model: PreTrainedModel) -> None:
    """torch.compile every decoder layer's forward (not its __call__: checkpointing and FSDP
    hooks stay outside the compiled graph). All layers share one graph, compiled per shape."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
    setattr(config, name, max(64, getattr(config, name)))
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward)


def is_fast_path_default(device: torch.device, compute_dtype: torch.dtype, is_packed: bool, world_size: int) -> bool:
    """What "auto" means for trainer.working_copy and trainer.compile_layers: on where both
    were measured to pay (the packed learner, one CUDA device, 16-bit compute: 3.05x the
    padded path's tokens/s on equal lengths, 5.8x on a long tail, 37 GiB peak against 55,
    within bf16's tolerance of it). CPU keeps exact float32 and skips compile time."""
    is_16bit = compute_dtype in (torch.bfloat16, torch.float16)
    return is_packed and device.type == "cuda" and is_16bit and world_size == 1


def _resolve(setting: str | bool, default: bool) -> bool:
    return default if setting == "auto" else bool(setting)


def _store_frozen_in(model: PreTrainedModel, dtype: torch.dtype) -> bool:
    """LoRA's counterpart of the working copy: the frozen base weights (all but the
    adapters) are stored in `dtype`, in place, and the adapters stay float32 masters.
    A copy would not do: its adapters would be the copy's, and `adapters_off` switches
    the model's. The base never changes, so nothing is lost by rounding it once; autocast
    then has nothing to cast but the adapters, the residual stream is 16-bit as with the
    working copy, and the base takes half the memory (an 8B base: 16 GiB, not 32)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)  # the same Parameter object: tied weights stay tied
    return True


@contextlib.contextmanager
def _swapped_forward(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def _on_grid(values: torch.Tensor, grid_index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """values [N] at flat positions grid_index of a zero [B, L-1] grid shaped like `like`."""
    flat = values.new_zeros(like.numel()).index_put((grid_index,), values)  # [B * (L-1)]
    return flat.view(like.shape)


def _read_back(sums: dict[str, torch.Tensor | float], device: torch.device) -> dict[str, float]:
    """The step's metrics, summed on the device, read back with one copy."""
    if not sums:
        return {}
    values = [torch.as_tensor(v, dtype=torch.float32, device=device) for v in sums.values()]
    return dict(zip(sums, torch.stack(values).tolist()))


class Learner:
    def __init__(
        self,
        *,
        model: PreTrainedModel,
        ref_model: PreTrainedModel | None,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        algo: AlgoConfig,
        cfg: TrainerConfig,
        temperature: float,
        pad_id: int,
        compute_dtype: torch.dtype = torch.float32,
        dp: DataParallel | None = None,
        adapters_off: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        """`adapters_off` (LoRA): a context in which `model` is its base model, which is then
        the KL reference instead of `ref_model` (no second copy of the weights)."""
        self.model, self.ref_model = model, ref_model
        self.adapters_off = adapters_off
        self.optimizer, self.scheduler = optimizer, scheduler
        self.algo, self.cfg = algo, cfg
        self.temperature, self.pad_id = temperature, pad_id
        self.compute_dtype = compute_dtype
        self.router_logits: RouterLogits | None = None
        """Recorded in training forwards when the load-balancing loss is on (an MoE model)."""
        """Autocast dtype (float32: none; a sharded model may cast its parameters instead)."""
        self.dp = dp or DataParallel()
        self.attn_backend = cfg.packed_attention
        if self.attn_backend == "auto":
            self.attn_backend = default_backend(model.device, compute_dtype)
        # auto packs only where a fused packed attention exists (16-bit compute on CUDA): the
        # exact per-sequence SDPA loop made the tiny float32 model's learner step on an H100 0.62 s, not 0.08
        fused = self.attn_backend != "sdpa"
        self.is_packed = cfg.learner_impl == "packed" or (
            cfg.learner_impl == "auto" and model.device.type == "cuda" and fused
        )
        if self.is_packed:
            for m in (model, ref_model):
                if m is not None:
                    use_packed_attention(m)
        fast = is_fast_path_default(model.device, compute_dtype, self.is_packed, self.dp.world_size)
        self.work = self.model
        """The weights forward and backward run on: the model itself, or its bf16 copy."""
        is_lora = adapters_off is not None
        self.is_base_16bit = False
        """LoRA with `working_copy`: the frozen base is stored in the compute dtype."""
        if _resolve(cfg.working_copy, fast) and compute_dtype != torch.float32 and self.dp.world_size == 1:
            if is_lora:
                self.is_base_16bit = _store_frozen_in(model, compute_dtype)
            else:
                self.work = copy.deepcopy(model).to(compute_dtype)
        if algo.router_aux_loss_coef > 0 and has_moe(self.work):
            self.router_logits = RouterLogits(self.work)  # hooks before any compile
        self.router_replay = RouterReplay(self.work) if algo.router_replay != "disabled" else None
        has_triton = importlib.util.find_spec("triton") is not None  # inductor's CUDA kernels need it
        self.is_compiled = _resolve(cfg.compile_layers, fast and has_triton)
        if self.is_compiled:
            compile_layers(self.work)
        self.trace_attention = self.is_compiled and TRACE_ATTENTION
        attention = self.attn_backend if self.is_packed else "-"
        is_copy = self.work is not self.model
        log.info(
            "learner: %s, attention %s, working copy %s, compiled layers %s, micro-batches of %d tokens",
            "packed" if self.is_packed else "padded",
            attention,
            "(LoRA: frozen base in 16 bits)" if self.is_base_16bit else is_copy,
            self.is_compiled,
            cfg.micro_batch_max_tokens,
        )
        if self.is_compiled and cfg.micro_batch_max_tokens < GPU_BOUND_MICRO_BATCH_TOKENS:
            log.info(
                "learner: micro-batches under %d tokens leave the GPU waiting on the host, and host load "
                'then slows the learner (trainer.micro_batch_max_tokens; README, "The GRPO learner")',
                GPU_BOUND_MICRO_BATCH_TOKENS,
            )

    @contextlib.contextmanager
    def _routes_recorded(self, mb: MicroBatch) -> Iterator[None]:
        """R2: the proximal forward's experts go with the micro-batch."""
        if self.router_replay is None or self.algo.router_replay != "R2":
            yield
            return
        with self.router_replay.recording() as routes:
            yield
        mb.routes = routes

    def _router_logits_recorded(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.router_logits is None else self.router_logits.recording()

    def _autocast_dtype(self, model: PreTrainedModel) -> torch.dtype:
        """The bf16 working copy runs as it is; the float32 models under autocast."""
        return torch.float32 if model is self.work and self.work is not self.model else self.compute_dtype

    def logprobs(self, model: PreTrainedModel, mb: MicroBatch, with_entropy: bool):
        if mb.packed is not None:
            return self._packed_logprobs(model, mb, with_entropy)
        with autocast(mb.input_ids.device, self._autocast_dtype(model)):
            logits = model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
            ).logits[:, :-1]  # [B, L-1, V]
        logp, entropy = token_logprobs(logits, mb.target_ids, self.temperature)
        return logp, (entropy if with_entropy else None)

    def _packed_logprobs(self, model: PreTrainedModel, mb: MicroBatch, with_entropy: bool):
        """The padded path's (logp, entropy) [B, L-1] from one packed row: only the counted
        targets' positions go through the LM head, and the rest stay 0 (every use masks them).

        Sharded, the head runs inside the model's own forward (its `forward` swapped for the
        call), so FSDP's root hooks gather and reduce its weight as they do for the logits; in
        one process the head is left alone, as the engine may be calling it meanwhile."""
        row = mb.packed
        docs = make_docs(row.lengths, self.attn_backend, row.input_ids.device, self.trace_attention)
        head = model.get_output_embeddings()
        autocast_dtype = self._autocast_dtype(model)
        cd = autocast_dtype if autocast_dtype != torch.float32 else head.weight.dtype  # bf16 copy: bf16

        def logp_and_entropy(hidden: torch.Tensor) -> torch.Tensor:  # [1, T, H] -> [2, N]
            h = hidden[0].index_select(0, row.head_rows)  # [N, H]
            fused = self.is_compiled
            return torch.stack(head_logprobs(h, head.weight, row.head_targets, self.temperature, cd, fused))

        inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids, "use_cache": False, "packed_docs": docs}
        with autocast(row.input_ids.device, autocast_dtype):
            if is_sharded(model):
                with _swapped_forward(head, logp_and_entropy):
                    stacked = model(**inputs).logits  # [2, N]
            else:
                stacked = logp_and_entropy(model.model(**inputs).last_hidden_state)  # [2, N]
        logp, entropy = (_on_grid(v, row.grid_index, mb.mask) for v in stacked)  # [B, L-1] each
        return logp, (entropy if with_entropy else None)

    def _grads_to_master(self) -> None:
        """The working copy's gradients, in float32, become the master weights' gradients."""
        if self.work is self.model:
            return
        for master, work in zip(self.model.parameters(), self.work.parameters(), strict=True):
            master.grad = None if work.grad is None else work.grad.to(master.dtype)
            work.grad = None

    @torch.no_grad()
    def _refresh_work(self) -> None:
        """Once per optimizer step, not once per micro-batch as autocast casts."""
        if self.work is not self.model:
            torch._foreach_copy_(list(self.work.parameters()), list(self.model.parameters()))

    @property
    def _old_logp_from_training_pass(self) -> bool:
        """With one epoch, the proximal policy is the model as it is when each micro-batch
        is trained on (the update comes after the last one): the training forward's
        log-probs, detached, are exactly the recomputed ones, and a whole forward pass is
        saved (28% of the learner's time on the Qwen3-0.6B shape, BENCHMARKS.md)."""
        return self.algo.recompute_old_logprobs and self.algo.ppo_epochs == 1

    @torch.no_grad()
    def _prepare(self, batches: list[list[SeqItem]], fill_behav: bool) -> list[MicroBatch]:
        """Collate, and attach old (proximal) and reference log-probs before any update.
        fill_behav: some of the mini-batch's samples came without behaviour log-probs (an
        Atropos group without inference_logprobs); the same on every rank, so that every
        rank runs the same forward passes."""
        device = self.model.device
        collate_fn = collate_packed if self.is_packed else collate
        mbs = [collate_fn(b, self.pad_id).to(device) for b in batches]
        for mb in mbs:
            if self.router_replay is not None and self.algo.router_replay == "R3" and mb.expert_routes is not None:
                mb.routes = self.router_replay.engine_routes(mb.expert_routes)
                self.router_replay.replay(mb.routes, mb.routes_known)  # the proximal forward too
            if fill_behav:
                # Such samples count as on-policy for the weights held now: the truncated
                # importance weight is 1 on their tokens.
                own = self.logprobs(self.work, mb, False)[0]
                if mb.behav_known is not None:
                    mb.behav_logp = torch.where(mb.behav_known > 0, mb.behav_logp, own)
            if not self.algo.recompute_old_logprobs:
                mb.old_logp = mb.behav_logp
            elif not self._old_logp_from_training_pass:
                with self._routes_recorded(mb):
                    mb.old_logp = self.logprobs(self.work, mb, False)[0]
            if self.algo.kl_coef > 0:
                mb.ref_logp = self._ref_logprobs(mb)
            if self.router_replay is not None:
                self.router_replay.replay(None)
        return mbs

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.adapters_off is not None:
            with self.adapters_off():
                return self.logprobs(self.work, mb, False)[0]
        return None if self.ref_model is None else self.logprobs(self.ref_model, mb, False)[0]

    def train_mini_batch(self, items: list[SeqItem], weights_as_sampled: bool) -> dict[str, float]:
        """ppo_epochs optimizer steps on one mini-batch; returns its metrics.

        weights_as_sampled: no update since the step began, so on the tokens those weights
        generated (`SeqItem.current`), old vs behaviour log-probs measure engine/trainer
        mismatch alone.
        On several ranks, rank 0's call runs on all of them, each on its share of `items`.
        """
        with self.dp.command("train", items, weights_as_sampled), measured(self.model.device):
            return self._train(items, weights_as_sampled)

    def _train(self, items: list[SeqItem], weights_as_sampled: bool) -> dict[str, float]:
        self.work.train()
        num_tokens = sum(it.num_loss_tokens for it in items)  # the whole mini-batch's, on every rank
        num_current = sum(it.num_current_tokens for it in items) if weights_as_sampled else 0
        pack = pack_by_tokens if self.is_packed else None
        fill_behav = not all(it.behav_known for it in items)
        lag_counts = lag_token_counts(items)  # the whole mini-batch's, on every rank
        with record_function("learner.prepare"):
            batches = self.dp.micro_batches(items, self.cfg.micro_batch_max_tokens, self.pad_id, pack)
            mbs = self._prepare(batches, fill_behav)
        sums: dict[str, torch.Tensor | float] = defaultdict(float)  # this rank's part of each metric, on the device
        for lag in lag_counts:  # every rank sums the same keys, lagged tokens in its share or not
            sums.update(dict.fromkeys(lag_keys(lag), 0.0))
        grad_norms, lr = [], 0.0
        for epoch in range(self.algo.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in checked_each(mbs, self.model.device):
                with_entropy = True  # cheap next to the forward pass, and always logged
                if self.router_replay is not None:  # kept through backward: recomputed layers replay too
                    self.router_replay.replay(mb.routes, mb.routes_known)
                with record_function("learner.forward"), self._router_logits_recorded():
                    logp, entropy = self.logprobs(self.work, mb, with_entropy)
                if mb.old_logp is None:
                    mb.old_logp = logp.detach()
                if epoch == 0 and num_current and self.algo.recompute_old_logprobs:
                    diff = ((mb.old_logp - mb.behav_logp).abs() * mb.mask * mb.current_mask).sum()
                    sums["rollout/logprob_diff"] += diff / num_current
                if epoch == 0 and lag_counts and mb.lag is not None:
                    m = mb.mask > 0
                    log_rho = torch.where(m, mb.old_logp - mb.behav_logp, 0.0)  # [B, L-1]
                    for key, value in lag_kls(log_rho, m, mb.lag, lag_counts).items():
                        sums[key] += value
                inputs = LossInputs(
                    logp=logp,
                    old_logp=mb.old_logp,
                    behav_logp=mb.behav_logp,
                    advantages=mb.advantages,
                    mask=mb.mask,
                    entropy=entropy,
                    ref_logp=mb.ref_logp,
                )
                loss, metrics = policy_loss_on_device(inputs, self.algo, num_tokens, len(items))
                if self.router_logits is not None:  # this micro-batch's share of the mini-batch's mean
                    share = mb.mask.sum() / max(num_tokens, 1)
                    aux = self.router_logits.loss(None if mb.packed is not None else mb.attention_mask) * share
                    loss = loss + self.algo.router_aux_loss_coef * aux
                    sums["actor/router_aux_loss"] += aux.detach() / self.algo.ppo_epochs
                with record_function("learner.backward"):
                    loss.backward()
                weight = metrics.pop("_num_tokens") / max(num_tokens, 1) / self.algo.ppo_epochs
                for key, value in metrics.items():
                    # Loss terms and per-sequence metrics already carry mini-batch
                    # denominators: sum them; others are token means per micro-batch: weight
                    # them by tokens.
                    is_loss = key in SUMMED_METRICS
                    sums[key] += value / self.algo.ppo_epochs if is_loss else value * weight
            with record_function("learner.grads_to_master"):
                self._grads_to_master()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            if isinstance(grad_norm, DTensor):  # sharded: the global norm, replicated on every rank
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(grad_norm.item())  # the step's one wait for the device
            lr = self.scheduler.get_last_lr()[0]
            if math.isfinite(grad_norms[-1]):
                with record_function("learner.optimizer"):
                    self.optimizer.step()
                    self._refresh_work()
            self.scheduler.step()
        self.work.eval()
        if self.router_replay is not None:
            self.router_replay.replay(None)
        sums = _read_back(sums, self.model.device)
        grad_norm_mean = sum(grad_norms) / len(grad_norms)
        out = with_ess(self.dp.sum_over_ranks(sums))
        out["actor/grad_norm"], out["actor/lr"] = grad_norm_mean, lr
        changed = None if self.router_replay is None else self.router_replay.take_changed_frac()
        if changed is not None:
            out["actor/router_replay_changed_frac"] = changed
        return out
