"""Token log-probs and entropy straight from the last hidden states, never holding the
[tokens, vocab] logits of a whole micro-batch.

The padded path materialises bf16 logits for every position ([B, L, V]: 5 GiB for 16k
tokens of Qwen3's 152k vocabulary), then `token_logprobs` reads them back in float32, and
autograd keeps them until backward. Here the LM head runs chunk by chunk inside one
autograd function: forward keeps only per-token log-normaliser and entropy, backward
recomputes each chunk's logits and turns them straight into the hidden states' and the
head weight's gradients. Only the positions whose targets count are computed at all.
"""

from __future__ import annotations

import torch

from polyrl.trainer.grpo import _compute_dtype

HEAD_CHUNK_ELEMS = 1 << 28
"""Logit elements per chunk: 1 GiB in float32, about 1.7k tokens of a 152k vocabulary.
Tests shrink it to force several chunks."""


def _chunk_rows(vocab: int) -> int:
    return max(1, HEAD_CHUNK_ELEMS // max(vocab, 1))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """h [n, H], w [V, H] (both in the compute dtype) -> z = h w^T / temperature [n, V] in at
    least float32, so the softmax keeps its digits."""
    return (h @ w.t()).to(_compute_dtype(h.dtype)).div_(temperature)  # [n, V]


class _HeadLogprobEntropy(torch.autograd.Function):
    """logp of the target and entropy of softmax(h w^T / temperature), chunked over tokens.

    Saves hidden, weight, targets and two floats per token; the compute-dtype copy of the
    weight is made again in backward rather than kept (it would pin 300 MiB per micro-batch).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, temperature: float, compute_dtype: torch.dtype):
        N = hidden.shape[0]
        w = weight.to(compute_dtype)  # [V, H]
        dt = _compute_dtype(compute_dtype)
        logp = hidden.new_empty(N, dtype=dt)  # [N]
        entropy = hidden.new_empty(N, dtype=dt)  # [N]
        lse = hidden.new_empty(N, dtype=dt)  # [N]
        for t0 in range(0, N, _chunk_rows(w.shape[0])):
            rows = slice(t0, t0 + _chunk_rows(w.shape[0]))
            log_q = _chunk_logits(hidden[rows].to(compute_dtype), w, temperature)  # [n, V]
            lse[rows] = torch.logsumexp(log_q, dim=-1)
            log_q.sub_(lse[rows].unsqueeze(-1))  # log p
            logp[rows] = log_q.gather(-1, target_ids[rows].unsqueeze(-1)).squeeze(-1)
            entropy[rows] = -(log_q.exp() * log_q).sum(-1)  # from log p: no cancellation
        ctx.save_for_backward(hidden, weight, target_ids, lse, entropy)
        ctx.temperature, ctx.compute_dtype = temperature, compute_dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, target_ids, lse, entropy = ctx.saved_tensors
        cd, temperature = ctx.compute_dtype, ctx.temperature
        w = weight.to(cd)  # [V, H]
        grad_h = torch.empty_like(hidden)  # [N, H]
        grad_w = torch.zeros_like(weight, dtype=_compute_dtype(weight.dtype))  # [V, H]
        step = _chunk_rows(w.shape[0])
        for t0 in range(0, hidden.shape[0], step):
            rows = slice(t0, t0 + step)
            h = hidden[rows].to(cd)  # [n, H]
            log_q = _chunk_logits(h, w, temperature).sub_(lse[rows].unsqueeze(-1))  # [n, V] log p
            p = log_q.exp()  # [n, V]
            g_lp = g_logp[rows].to(p.dtype).unsqueeze(-1)  # [n, 1]
            # d logp_y/dz = onehot_y - p ; dH/dz = -p (log p + H)  (as in grpo._LogprobEntropy)
            log_q.add_(entropy[rows].unsqueeze(-1)).mul_(g_ent[rows].to(p.dtype).unsqueeze(-1)).add_(g_lp)
            g_z = p.mul_(log_q).neg_()  # [n, V]
            g_z.scatter_add_(-1, target_ids[rows].unsqueeze(-1), g_lp)
            g_z = g_z.div_(temperature).to(cd)  # [n, V] dL/d(h w^T)
            grad_h[rows] = g_z @ w  # [n, H]
            grad_w += g_z.t() @ h  # [V, H]
        return grad_h, grad_w.to(weight.dtype), None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] (row i predicts target_ids[i]), head weight [V, H] -> (logp [N],
    entropy [N]) of softmax(hidden weight^T / temperature), in at least float32.

    compute_dtype: the matmuls' dtype (bf16 as autocast would run the head); autocast
    itself is switched off inside, so the function behaves the same under it or not.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with torch.autocast(hidden.device.type, enabled=False):
        return _HeadLogprobEntropy.apply(hidden, weight, target_ids.long(), float(temperature), compute_dtype)
