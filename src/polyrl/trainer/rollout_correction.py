"""Rollout correction: importance weights, rejection and mismatch metrics for the gap
between the engine's behaviour policy (pi_rollout) and the trainer's proximal one (pi_old).

With rho_t = pi_old(y_t) / pi_rollout(y_t) on a sequence's counted tokens t (the
decoupled-PPO ratio; formulas as in verl's rollout correction, Liu, Li et al. 2025, "When
Speed Kills Stability", https://richardli.xyz/rl-collapse, and its part 3 on geometric
rejection, https://richardli.xyz/rl-collapse-3):

  token IS      w_t = min(rho_t, C)                       (truncated IS, TIS)
  sequence IS   w_t = min(prod_s rho_s, C) for every t     (log of the product bounded to
                                                           [-20, 20] first, as verl does)
  token RS      drop t        if rho_t is outside [lo, hi]
  sequence RS   drop the seq  if prod_s rho_s is outside [lo, hi]
  geometric RS  drop the seq  if exp(mean_s log rho_s) is outside [lo, hi]
  veto          drop the seq  if some rho_t < veto threshold

Everything is detached: the weights scale the gradient, they are not trained through.

Where we depart from verl: a dropped token keeps its place in the mini-batch's
denominators (the learner fixes them before the old log-probs of every micro-batch are
known); it is a token whose weight is 0, not one that was never sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polyrl.config import RolloutCorrectionConfig

SEQ_LOG_BOUND = 20.0
"""Bound on a sequence's log weight, so that exp cannot overflow (verl's safety bound)."""


@dataclass
class Correction:
    weight: torch.Tensor | None  # [B, T] importance weight per token (None: no IS)
    keep: torch.Tensor  # [B, T] bool: counted tokens that stay in the loss


def seq_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: sum over each sequence's counted tokens."""
    return torch.where(mask, values, 0.0).sum(-1, keepdim=True)


def seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: mean over each sequence's counted tokens (0 for a sequence with none)."""
    return seq_sum(values, mask) / mask.sum(-1, keepdim=True).clamp(min=1)


def importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor | None:
    """log_rho [B, T] (0 off the mask) -> truncated weights [B, T], or None without IS."""
    if cfg.rollout_is == "none":
        return None
    if cfg.rollout_is == "token":
        return log_rho.exp().clamp(max=cfg.rollout_is_threshold)  # [B, T]
    log_seq = seq_sum(log_rho, mask).clamp(-SEQ_LOG_BOUND, SEQ_LOG_BOUND)  # [B, 1]
    return log_seq.exp().clamp(max=cfg.rollout_is_threshold).expand_as(log_rho)  # [B, T]


def rejection_keep(log_rho: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """[B, T] bool: the counted tokens that neither rejection sampling nor the veto drop.
    Compared in log space, so a sequence's product of ratios cannot overflow."""
    keep = mask.clone()
    if cfg.rollout_rs is not None:
        upper = cfg.rollout_rs_threshold
        lower = cfg.rollout_rs_threshold_lower or 1 / upper
        if cfg.rollout_rs == "token":
            stat = log_rho  # [B, T]
        elif cfg.rollout_rs == "sequence":
            stat = seq_sum(log_rho, mask)  # [B, 1]
        else:
            stat = seq_mean(log_rho, mask)  # [B, 1] log of the geometric mean
        keep &= (stat >= math.log(lower)) & (stat <= math.log(upper))
    if cfg.rollout_token_veto_threshold is not None:
        is_vetoed = (mask & (log_rho < math.log(cfg.rollout_token_veto_threshold))).any(-1, keepdim=True)  # [B, 1]
        keep &= ~is_vetoed
    return keep


def correct(old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrectionConfig):
    """(log_rho [B, T], Correction) for detached old and behaviour log-probs [B, T] and the
    counted tokens `mask` [B, T] bool. log_rho is 0 off the mask (padding may hold -inf)."""
    log_rho = torch.where(mask, old_logp - behav_logp, 0.0)  # [B, T]
    return log_rho, Correction(importance_weights(log_rho, mask, cfg), rejection_keep(log_rho, mask, cfg))


# ---------------------------------------------------------------------------------------------
# Mismatch metrics
# ---------------------------------------------------------------------------------------------

TOKEN_MEANS = (
    "mismatch/k1_kl",
    "mismatch/k3_kl",
    "mismatch/is_weight_mean",
    "mismatch/is_weight_sq_mean",
    "mismatch/masked_token_frac",
)
"""Means over one micro-batch's counted tokens (the learner weights them by tokens)."""
SEQ_SUMS = ("mismatch/log_ppl_diff", "mismatch/masked_seq_frac")
"""Already divided by the mini-batch's sequence count (the learner sums them)."""


def token_kls(log_rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimates of KL(p || q) from samples of p, with log_rho = log q - log p:
    k1 = -log_rho, k3 = rho - 1 - log_rho (Schulman's non-negative, lower-variance
    estimator). Both [B, T]. Here p is pi_rollout and q pi_old; the loss's KL term
    (grpo._kl) takes p = pi and q = pi_ref."""
    return -log_rho, log_rho.exp() - 1 - log_rho


def mismatch_metrics(
    log_rho: torch.Tensor, mask: torch.Tensor, corr: Correction, num_seqs: int
) -> dict[str, torch.Tensor]:
    """0-d tensors named in TOKEN_MEANS and SEQ_SUMS. log_ppl_diff: the trainer's minus the
    engine's log-perplexity of each sequence (mean_t -log pi), averaged over sequences;
    is_weight_*: the tokens' applied weights (the raw rho_t without IS), for `with_ess`;
    masked_seq_frac: sequences with counted tokens of which none is kept."""
    n = mask.sum().clamp(min=1).to(log_rho.dtype)
    k1, k3 = token_kls(log_rho)
    w = log_rho.exp() if corr.weight is None else corr.weight
    w = torch.where(mask, w, 0.0)  # [B, T]
    has_tokens = mask.any(-1)  # [B]
    is_dropped = has_tokens & ~corr.keep.any(-1)  # [B]
    return {
        "mismatch/k1_kl": torch.where(mask, k1, 0.0).sum() / n,
        "mismatch/k3_kl": torch.where(mask, k3, 0.0).sum() / n,
        "mismatch/is_weight_mean": w.sum() / n,
        "mismatch/is_weight_sq_mean": (w * w).sum() / n,
        "mismatch/masked_token_frac": (mask & ~corr.keep).sum() / n,
        "mismatch/log_ppl_diff": -seq_mean(log_rho, mask).sum() / max(num_seqs, 1),
        "mismatch/masked_seq_frac": is_dropped.sum().to(log_rho.dtype) / max(num_seqs, 1),
    }


def with_ess(metrics: dict[str, float]) -> dict[str, float]:
    """Adds "mismatch/is_ess" = (sum w)^2 / (n sum w^2), the normalised effective sample size
    of the importance weights (1 when they are all equal), from the summed token means, so
    that it is the whole mini-batch's whatever its split into micro-batches."""
    mean, sq_mean = metrics.get("mismatch/is_weight_mean"), metrics.get("mismatch/is_weight_sq_mean")
    if mean is not None and sq_mean:
        metrics["mismatch/is_ess"] = mean * mean / sq_mean
    return metrics


def lag_token_counts(items) -> dict[int, int]:
    """{lag: counted tokens sampled that many versions back} over `SeqItem`s, lags > 0 only:
    the denominators of `lag_kls`, for the whole mini-batch."""
    counts: dict[int, int] = {}
    for it in items:
        if it.lags is None:
            continue
        counted = it.loss_mask or [True] * len(it.lags)
        for lag, is_counted in zip(it.lags, counted, strict=True):
            if is_counted and lag > 0:
                counts[lag] = counts.get(lag, 0) + 1
    return counts


def lag_kls(log_rho: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor, counts: dict[int, int]):
    """ "mismatch/lag_{k}/k1_kl" and ".../k3_kl" for each lag k > 0 in `counts`: this
    micro-batch's tokens of that lag, summed and divided by the mini-batch's count, so that
    the learner sums them. At lag k the gap is k updates of policy change plus the engine's
    own mismatch; the lag-0 tokens' (the whole metric when no token lags) is the latter alone."""
    k1, k3 = token_kls(log_rho)
    out = {}
    for k, n in sorted(counts.items()):
        at = mask & (lag == k)  # [B, T]
        k1_key, k3_key = lag_keys(k)
        out[k1_key] = torch.where(at, k1, 0.0).sum() / n
        out[k3_key] = torch.where(at, k3, 0.0).sum() / n
    return out


def lag_keys(lag: int) -> tuple[str, str]:
    return f"mismatch/lag_{lag}/k1_kl", f"mismatch/lag_{lag}/k3_kl"
