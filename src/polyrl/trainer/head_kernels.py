"""Triton kernels for the LM head's softmax tail: one pass over a chunk of logits forward,
one backward.

The head's chunk of logits is [n, V] with V = 152k for Qwen3: the log-normaliser, the
target's log-prob and the entropy need a max, a sum of exponentials and a sum of
p * log p over each row. Compiled by inductor that became a looped reduction at about
0.5 TB/s, 1.1 ms per 1.8k-token chunk, 41 ms of a 0.87 s learner step on one H100
(BENCHMARKS.md, "Learner speed"). Here each row is read once, with an online softmax that
keeps, per lane, the running max m, s = sum exp(z - m) and t = sum exp(z - m) * z, so that

    lse = m + log s,    entropy = lse - t / s,    logp = z[target] - lse

(z = logits / temperature, in float32). The backward writes dL/dlogits of the same chunk
in one elementwise pass from the row statistics.

Like `polyrl.engine.triton_ops`, the kernels run on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1`, which is how the tests compare them with the PyTorch formulas.
"""

from __future__ import annotations

import torch

from polyrl.engine.triton_ops import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _forward_kernel(
        logits_ptr, row_stride, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, vocab, inv_temp, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1e30, tl.float32)  # finite: exp(m - m_new) stays defined
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            valid = cols < vocab
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
            z = tl.where(valid, z, -1e30)
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            e = tl.where(valid, tl.exp(z - m_new), 0.0)
            s = s * alpha + e
            t = t * alpha + e * tl.where(valid, z, 0.0)
            m = m_new
        m_row = tl.max(m, 0)
        w = tl.exp(m - m_row)
        s_row = tl.sum(s * w, 0)
        t_row = tl.sum(t * w, 0)
        lse = m_row + tl.log(s_row)
        target = tl.load(targets_ptr + row)
        z_target = tl.load(base + target).to(tl.float32) * inv_temp
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, z_target - lse)
        tl.store(entropy_ptr + row, lse - t_row / s_row)

    @triton.jit
    def _backward_kernel(
        logits_ptr,
        grad_ptr,
        row_stride,
        targets_ptr,
        lse_ptr,
        entropy_ptr,
        g_logp_ptr,
        g_entropy_ptr,
        vocab,
        inv_temp,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        offset = row.to(tl.int64) * row_stride
        lse = tl.load(lse_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        g_lp = tl.load(g_logp_ptr + row)
        g_h = tl.load(g_entropy_ptr + row)
        target = tl.load(targets_ptr + row)
        z = tl.load(logits_ptr + offset + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        log_p = z - lse
        # d logp_y / dz = onehot_y - p ;  d H / dz = -p (log p + H) ;  z = logits / temperature
        g = -tl.exp(log_p) * (g_lp + g_h * (log_p + entropy)) + tl.where(cols == target, g_lp, 0.0)
        tl.store(grad_ptr + offset + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=valid)


FORWARD_BLOCK = 2048
BACKWARD_BLOCK = 4096


def usable(logits: torch.Tensor) -> bool:
    """Whether these kernels can take `logits` here (rows contiguous, Triton for its device)."""
    return logits.dim() == 2 and logits.stride(1) == 1 and available(logits.device.type)


def chunk_forward(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float):
    """logits [n, V] -> (logp [n], entropy [n], lse [n]) in float32, as `lm_head._chunk_forward`."""
    n, vocab = logits.shape
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    if n:
        _forward_kernel[(n,)](
            logits, logits.stride(0), target_ids, logp, entropy, lse, vocab, 1.0 / temperature, BLOCK=FORWARD_BLOCK
        )
    return logp, entropy, lse


def chunk_backward(logits, target_ids, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dL/dlogits [n, V] in the logits' dtype, as `lm_head._chunk_backward`."""
    n, vocab = logits.shape
    grad = torch.empty_like(logits)
    if n:
        grid = (n, triton.cdiv(vocab, BACKWARD_BLOCK))
        _backward_kernel[grid](
            logits,
            grad,
            logits.stride(0),
            target_ids,
            lse,
            entropy,
            g_lp.float().contiguous(),
            g_ent.float().contiguous(),
            vocab,
            1.0 / temperature,
            BLOCK=BACKWARD_BLOCK,
        )
    return grad
