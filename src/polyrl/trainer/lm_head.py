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

import functools

import torch

from polyrl.trainer import head_kernels
from polyrl.trainer.grpo import _compute_dtype

HEAD_CHUNK_ELEMS = 1 << 28
"""Logit elements per chunk: 1 GiB in float32, about 1.7k tokens of a 152k vocabulary.
Tests shrink it to force several chunks."""
FUSED_CHUNK_FACTOR = 4
"""Fused, no float32 temporaries exist: chunks this many times larger (two bf16 [n, V]
buffers of 2 GiB), so the head weight's gradient is accumulated a quarter as often (each
accumulation reads and writes the float32 [V, H] sum: 0.6 ms on an H100)."""
USE_TRITON = True
"""Fused on CUDA: the Triton kernels of `head_kernels` (else inductor's compiled formulas)."""


def _chunk_rows(vocab: int, fused: bool = False) -> int:
    elems = HEAD_CHUNK_ELEMS * (FUSED_CHUNK_FACTOR if fused else 1)
    return max(1, elems // max(vocab, 1))


def _tail(fused: bool, logits_like: torch.Tensor):
    """The per-chunk (forward, backward) softmax math: Triton kernels, compiled or eager."""
    if fused and USE_TRITON and head_kernels.usable(logits_like):
        return head_kernels.chunk_forward, head_kernels.chunk_backward
    if fused:
        return _fused(_chunk_forward), _fused(_chunk_backward)
    return _chunk_forward, _chunk_backward


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h [n, H], w [V, H], both in the compute dtype -> logits [n, V] in that dtype."""
    return h @ w.t()  # [n, V]


def _chunk_forward(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float):
    """logits [n, V] -> (logp [n], entropy [n], lse [n]) of softmax(logits / temperature), in at
    least float32 (a bf16 softmax over a large vocabulary loses most of its digits)."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    log_p = z - lse.unsqueeze(-1)  # [n, V]
    logp = log_p.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)  # [n]
    entropy = -(log_p.exp() * log_p).sum(-1)  # [n] from log p: no cancellation
    return logp, entropy, lse


def _chunk_backward(logits, target_ids, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dL/dlogits [n, V] in the logits' dtype, from dL/dlogp and dL/dentropy [n]:
    d logp_y/dz = onehot_y - p ; dH/dz = -p (log p + H)  (as in grpo._LogprobEntropy)."""
    log_p = logits.to(lse.dtype) / temperature - lse.unsqueeze(-1)  # [n, V]
    g_z = -log_p.exp() * (g_lp.unsqueeze(-1) + g_ent.unsqueeze(-1) * (log_p + entropy.unsqueeze(-1)))  # [n, V]
    g_z = g_z.scatter_add(-1, target_ids.unsqueeze(-1), g_lp.unsqueeze(-1))
    return (g_z / temperature).to(logits.dtype)  # z = logits / temperature


@functools.cache
def _fused(fn):
    """`fn` compiled: one or two fused kernels over the logits instead of a dozen passes of
    float32 temporaries (the softmax tail was 17% of the learner's GPU time)."""
    return torch.compile(fn, dynamic=True)


class _HeadLogprobEntropy(torch.autograd.Function):
    """logp of the target and entropy of softmax(h w^T / temperature), chunked over tokens.

    Saves hidden, weight, targets and two floats per token; the compute-dtype copy of the
    weight is made again in backward rather than kept (it would pin 300 MiB per micro-batch).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, temperature: float, compute_dtype: torch.dtype, fused: bool):
        N = hidden.shape[0]
        w = weight.to(compute_dtype)  # [V, H]
        dt = _compute_dtype(compute_dtype)
        logp, entropy, lse = (hidden.new_empty(N, dtype=dt) for _ in range(3))  # [N] each
        chunk_forward = _tail(fused, w)[0]
        step = _chunk_rows(w.shape[0], fused)
        for t0 in range(0, N, step):
            rows = slice(t0, t0 + step)
            logits = _chunk_logits(hidden[rows].to(compute_dtype), w)  # [n, V]
            logp[rows], entropy[rows], lse[rows] = chunk_forward(logits, target_ids[rows], temperature)
        ctx.save_for_backward(hidden, weight, target_ids, lse, entropy)
        ctx.temperature, ctx.compute_dtype, ctx.fused = temperature, compute_dtype, fused
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, target_ids, lse, entropy = ctx.saved_tensors
        cd = ctx.compute_dtype
        w = weight.to(cd)  # [V, H]
        grad_h = torch.empty_like(hidden)  # [N, H]
        grad_w = torch.zeros_like(weight, dtype=_compute_dtype(weight.dtype))  # [V, H]
        chunk_backward = _tail(ctx.fused, w)[1]
        step = _chunk_rows(w.shape[0], ctx.fused)
        for t0 in range(0, hidden.shape[0], step):
            rows = slice(t0, t0 + step)
            h = hidden[rows].to(cd)  # [n, H]
            g_lp, g_h = g_logp[rows].to(lse.dtype), g_ent[rows].to(lse.dtype)  # [n] each
            logits = _chunk_logits(h, w)  # [n, V] recomputed
            g_z = chunk_backward(logits, target_ids[rows], lse[rows], entropy[rows], g_lp, g_h, ctx.temperature)
            grad_h[rows] = g_z @ w  # [n, H]
            grad_w += g_z.t() @ h  # [V, H]
        return grad_h, grad_w.to(weight.dtype), None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float,
    compute_dtype: torch.dtype = torch.float32,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] (row i predicts target_ids[i]), head weight [V, H] -> (logp [N],
    entropy [N]) of softmax(hidden weight^T / temperature), in at least float32.

    compute_dtype: the matmuls' dtype (bf16 as autocast would run the head); autocast
    itself is switched off inside, so the function behaves the same under it or not.
    fused: the per-chunk softmax math as Triton kernels (or torch.compile'd) in larger chunks
    (GPU; the same formulas).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with torch.autocast(hidden.device.type, enabled=False):
        return _HeadLogprobEntropy.apply(hidden, weight, target_ids.long(), float(temperature), compute_dtype, fused)
