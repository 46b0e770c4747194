"""GRPO math as pure tensor functions: group advantages, token log-probs, the policy loss.

Nothing here knows about models or batching beyond the denominators it is handed, so each
piece can be checked against a plain-Python reference (tests/test_grpo.py).

Where we depart from textbook GRPO (Shao et al., 2024):
  * clip-higher: separate lower/upper clip bounds (DAPO);
  * loss aggregation is configurable, token-mean (DAPO) by default rather than GRPO's
    per-sequence mean;
  * std normalisation of advantages can be switched off (Dr.GRPO);
  * the ratio is against a proximal policy (`old_logp`), and a truncated importance weight
    corrects for the rollout engine's behaviour policy (decoupled PPO, as in AReaL), or
    any of rollout_correction.py's weights and rejections;
  * `algo.policy_loss` swaps PPO's per-token clipped surrogate for GSPO's sequence ratio or
    CISPO's clipped, detached weight on REINFORCE.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from polyrl.config import AlgoConfig
from polyrl.trainer import rollout_correction
from polyrl.trainer.rollout_correction import SEQ_LOG_BOUND, seq_mean

# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n]: r - mean(group); divided by (std(group, unbiased)
    + eps) when norm_by_std. A group of n=1 gives 0 advantage.

    The group mean is the baseline that replaces PPO's value network; n=1 has no baseline to
    compare against, so it carries no signal (and torch's unbiased std would be NaN).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    r = rewards.float() if not rewards.is_floating_point() else rewards  # [G, n]
    if r.shape[1] == 1:
        return torch.zeros_like(r)
    adv = r - r.mean(dim=1, keepdim=True)  # [G, n]
    if norm_by_std:
        adv = adv / (r.std(dim=1, correction=1, keepdim=True) + eps)  # [G, n]
    return adv


def filter_zero_variance(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, n] -> bool [G]: True for groups whose rewards are not all equal.

    A group with equal rewards has zero advantage everywhere, so it only dilutes the
    per-token denominators (DAPO's dynamic sampling drops such groups).
    """
    return (rewards != rewards[:, :1]).any(dim=1)  # [G]


# ---------------------------------------------------------------------------------------------
# Token log-probs and entropy
# ---------------------------------------------------------------------------------------------

# Elements of [*, V] processed at once. Bounds the transient float32 memory to a few of these
# (~128 MiB each) instead of several full [B, T, V] tensors; tests shrink it to force chunking.
_CHUNK_ELEMS = 1 << 25


def _chunks(batch: int, seq: int, vocab: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, time slice) pairs covering [B, T] in pieces of about _CHUNK_ELEMS.

    Slicing (rather than flattening B*T) keeps every piece a view even when the logits are a
    non-contiguous slice such as `logits[:, :-1]`.
    """
    rows = max(1, _CHUNK_ELEMS // max(vocab, 1))
    if rows >= seq:
        step = max(1, rows // max(seq, 1))
        for b0 in range(0, batch, step):
            yield slice(b0, b0 + step), slice(None)
    else:
        for b in range(batch):
            for t0 in range(0, seq, rows):
                yield slice(b, b + 1), slice(t0, t0 + rows)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: a bf16 softmax over a large vocabulary loses most of its digits."""
    return torch.promote_types(dtype, torch.float32)


class _LogprobEntropy(torch.autograd.Function):
    """Fused, chunked log-prob-at-target and entropy of softmax(logits / temperature).

    Autograd through log_softmax/softmax would keep a float copy of the logits plus the
    probabilities ([B, T, V] each) alive until backward. Here only the input logits, the
    log-normaliser and the entropy ([B, T]) are saved; backward recomputes the probabilities
    chunk by chunk, so the only full-size allocation is the gradient itself.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_ids: torch.Tensor, temperature: float):
        B, T, V = logits.shape
        dt = _compute_dtype(logits.dtype)
        lse = logits.new_empty((B, T), dtype=dt)  # [B, T]
        logp = logits.new_empty((B, T), dtype=dt)  # [B, T]
        entropy = logits.new_empty((B, T), dtype=dt)  # [B, T]
        for bs, ts in _chunks(B, T, V):
            z = logits[bs, ts].to(dt) / temperature  # [b, t, V] (always a fresh tensor)
            lse_c = torch.logsumexp(z, dim=-1)  # [b, t]
            log_q = z.sub_(lse_c.unsqueeze(-1))  # [b, t, V] full log-softmax, in place
            logp[bs, ts] = log_q.gather(-1, target_ids[bs, ts].unsqueeze(-1)).squeeze(-1)
            # H = -sum p log p, from log p directly (lse - sum p z cancels badly for big logits).
            entropy[bs, ts] = -(log_q.exp() * log_q).sum(-1)  # [b, t]
            lse[bs, ts] = lse_c
        ctx.save_for_backward(logits, target_ids, lse, entropy)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_ent: torch.Tensor):
        logits, target_ids, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        B, T, V = logits.shape
        dt = _compute_dtype(logits.dtype)
        grad = torch.empty_like(logits)  # [B, T, V] in the logits' dtype
        for bs, ts in _chunks(B, T, V):
            g_lp = g_logp[bs, ts].to(dt).unsqueeze(-1)  # [b, t, 1]
            g_h = g_ent[bs, ts].to(dt).unsqueeze(-1)  # [b, t, 1]
            log_q = logits[bs, ts].to(dt) / temperature  # [b, t, V]
            log_q.sub_(lse[bs, ts].unsqueeze(-1))  # log p
            p = log_q.exp()  # [b, t, V]
            # d logp_y / dz = onehot_y - p ;  dH / dz = -p * (log p + H)
            # => dL/dz = onehot_y * g_lp - p * (g_lp + g_h * (log p + H))
            log_q.add_(entropy[bs, ts].unsqueeze(-1)).mul_(g_h).add_(g_lp)
            g_z = p.mul_(log_q).neg_()  # [b, t, V]
            g_z.scatter_add_(-1, target_ids[bs, ts].unsqueeze(-1), g_lp)
            grad[bs, ts] = g_z.div_(temperature)  # z = logits / temperature
        return grad, None, None


def token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V] (position t predicts target_ids[:, t]), target_ids [B, T] ->
    (logp [B, T], entropy [B, T]) of softmax(logits / temperature), in at least float32.

    The temperature must be the sampler's, so that logp is comparable with the engine's
    behaviour log-probs. Memory: no extra [B, T, V] tensor outlives this call (see
    _LogprobEntropy); float64 logits stay float64.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3 or target_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"need logits [B, T, V] and target_ids [B, T], got {tuple(logits.shape)} and {tuple(target_ids.shape)}"
        )
    return _LogprobEntropy.apply(logits, target_ids.long(), float(temperature))


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    logp: torch.Tensor  # [B, T] current policy log-probs (requires grad)
    old_logp: torch.Tensor  # [B, T] proximal/old policy log-probs (no grad)
    behav_logp: torch.Tensor  # [B, T] behaviour log-probs from the rollout engine (no grad)
    advantages: torch.Tensor  # [B] one advantage per sequence (broadcast over tokens), or [B, T] per token
    mask: torch.Tensor  # [B, T] 1.0 on completion tokens that count, 0 on padding/prompt
    entropy: torch.Tensor | None = None  # [B, T]
    ref_logp: torch.Tensor | None = None  # [B, T] frozen reference policy


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: int, num_seqs: int) -> torch.Tensor:
    """Reduce a per-token matrix [B, T] to a scalar by `mode`.

    The denominators are the MINI-batch totals, not this micro-batch's, so that summing the
    micro-batch losses reproduces the mini-batch loss exactly under gradient accumulation.
    """
    masked = torch.where(mask, values, 0.0)  # [B, T]
    if mode == "token-mean":
        return masked.sum() / max(num_tokens, 1)
    per_seq = masked.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1)  # [B]
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return per_seq.sum() / max(num_seqs, 1)


def _clipped_pg(log_ratio: torch.Tensor, adv: torch.Tensor, cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, with clip-higher (DAPO: a wider upper bound lets
    low-probability tokens grow, which slows entropy collapse). Returns (pg, is_clipped)."""
    ratio = log_ratio.exp()  # [B, T]
    pg_unclipped = -adv * ratio  # [B, T]
    pg_clipped = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)  # [B, T]
    # Pessimistic bound. `where` rather than `maximum`: at ties maximum splits the gradient in
    # half between branches; here the clipped branch is only taken when it is constant.
    is_clipped = pg_clipped > pg_unclipped  # [B, T]
    return torch.where(is_clipped, pg_clipped, pg_unclipped), is_clipped


def _gspo_log_ratio(logp: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): the
    ratio is the sequence's, s_i = exp(mean_t log(pi / pi_old)), length-normalised so that
    one clip range suits every length. Written in the paper's token form, log s_i,t =
    log pi_t - sg(log pi_t) + sg(log s_i): every token's value is s_i, and with one advantage
    per sequence and seq-mean-token-mean its gradient is the sequence objective's; per-token
    advantages then work too. [B, T] -> [B, T], 0 off the mask."""
    log_seq = seq_mean(log_ratio, mask).detach().clamp(max=SEQ_LOG_BOUND)  # [B, 1]
    return torch.where(mask, logp - logp.detach() + log_seq, 0.0)  # [B, T]


def _cispo_pg(
    logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1 report, arXiv 2506.13585, eq. 4): REINFORCE on log pi weighted by
    the ratio clipped and detached, sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi. No
    token is cut off from the gradient as PPO's clip cuts the ones past the bound; only the
    weight is bounded. Returns (pg, is_clipped) [B, T]."""
    ratio = log_ratio.detach().exp()  # [B, T]
    w = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)  # [B, T]
    return -w * adv * torch.where(mask, logp, 0.0), w != ratio


def _pg(x: LossInputs, log_ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, cfg: AlgoConfig):
    """Per-token policy-gradient term and where it clipped, by `cfg.policy_loss`."""
    if cfg.policy_loss == "cispo":
        return _cispo_pg(x.logp, log_ratio, adv, m, cfg)
    if cfg.policy_loss == "gspo":
        return _clipped_pg(_gspo_log_ratio(x.logp, log_ratio, m), adv, cfg)
    if cfg.policy_loss == "vanilla":
        return _clipped_pg(log_ratio, adv, cfg)
    raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}")


def _kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref is unbiased but can be negative; k3 (Schulman) is unbiased,
    non-negative and lower variance, and is what GRPO uses.
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"unknown kl_estimator {estimator!r}")
    k1, k3 = rollout_correction.token_kls(torch.where(mask, ref_logp - logp, 0.0))  # log(pi_ref / pi)
    return k1 if estimator == "k1" else k3


def policy_loss(
    x: LossInputs, cfg: AlgoConfig, num_tokens: int, num_seqs: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss_on_device` with its metrics read back as floats (one device sync)."""
    loss, stats = policy_loss_on_device(x, cfg, num_tokens, num_seqs)
    values = torch.stack(list(stats.values())).tolist()
    return loss, rollout_correction.with_ess(dict(zip(stats.keys(), values)))


def policy_loss_on_device(
    x: LossInputs, cfg: AlgoConfig, num_tokens: int, num_seqs: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, scaled so that micro-batch losses sum to the mini-batch loss.

    num_tokens / num_seqs: masked tokens / sequences in the whole MINI-batch.
    loss = pg + kl_coef * kl - entropy_coef * entropy, each aggregated by cfg.loss_agg_mode.
    Metrics (0-d tensors, left on the device so that a learner reads them once per step):
    "actor/pg_loss", "actor/kl_loss" and rollout_correction.SEQ_SUMS are divided by the
    mini-batch's totals (sum them over micro-batches); the rest are token means over this
    micro-batch, to be averaged by weight "_num_tokens". Tokens that rollout correction drops
    add nothing to any loss term.
    """
    m = x.mask > 0  # [B, T] bool
    adv = x.advantages.detach().to(x.logp.dtype)  # [B] or [B, T] (per-token advantages)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    old_logp = x.old_logp.detach()  # [B, T]

    # Padding may hold arbitrary log-probs; zero the exponent there so no inf/NaN can reach
    # backward (masking only after exp would still give inf * 0 = NaN gradients).
    log_ratio = torch.where(m, x.logp - old_logp, 0.0)  # [B, T]
    pg, is_clipped = _pg(x, log_ratio, adv, m, cfg)  # [B, T]

    # Departure (decoupled PPO): the samples come from the engine (behaviour policy), the
    # trust region is around the proximal policy; rollout correction's detached weights and
    # rejection bridge the two (rollout_correction.py).
    log_rho, corr = rollout_correction.correct(old_logp, x.behav_logp.detach(), m, cfg.rollout_correction)
    w = corr.weight
    if w is not None:
        pg = pg * w
    keep = corr.keep  # [B, T] the counted tokens that no rejection dropped

    def agg(v: torch.Tensor) -> torch.Tensor:
        return aggregate(v, keep, cfg.loss_agg_mode, num_tokens, num_seqs)

    pg_loss = agg(pg)
    loss = pg_loss

    kl_loss = None
    if x.ref_logp is not None:
        kl_loss = agg(_kl(x.logp, x.ref_logp.detach(), m, cfg.kl_estimator))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if x.entropy is not None and cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * agg(x.entropy)

    with torch.no_grad():
        n = m.sum()
        zero = pg_loss.new_zeros(())

        def tmean(v: torch.Tensor) -> torch.Tensor:
            return torch.where(m, v.to(pg_loss.dtype), 0.0).sum() / n.clamp(min=1)

        stats = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/kl_loss": zero if kl_loss is None else kl_loss.detach(),
            "actor/entropy": zero if x.entropy is None else tmean(x.entropy),
            "actor/clipfrac": tmean(is_clipped),
            "actor/ppo_kl": tmean(old_logp - x.logp),
            "actor/tis_weight_mean": zero + 1.0 if w is None else tmean(w),
            "_num_tokens": n.to(pg_loss.dtype),
        }
        mismatch = rollout_correction.mismatch_metrics(log_rho, m, corr, num_seqs)
        stats.update({k: v.to(pg_loss.dtype) for k, v in mismatch.items()})
    return loss, stats
