"""The LM head's Triton softmax-tail kernels against the PyTorch formulas they replace (on
CPU in Triton's interpreter, which tests/conftest.py switches on; compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from polyrl.trainer import head_kernels, lm_head

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(dtype: torch.dtype, rows: int = 5, vocab: int = 3000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)  # wide: a peaked softmax
    logits[0, 7] = 40.0  # one row nearly one-hot (entropy ~ 0)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    targets[1] = vocab - 1  # the last column, inside the final partial block
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_kernel_matches_the_formulas(dtype, temperature):
    logits, targets = _case(dtype)
    want = lm_head._chunk_forward(logits, targets, temperature)
    got = head_kernels.chunk_forward(logits, targets, temperature)
    for name, w, x in zip(("logp", "entropy", "lse"), want, got):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, w.float(), rtol=1e-5, atol=2e-5, msg=name)
    assert got[1][0] < 1e-3 < got[1][2]  # the peaked row's entropy is ~0, a random row's is not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_kernel_matches_the_formulas(dtype):
    logits, targets = _case(dtype, seed=1)
    temperature = 0.8
    _, entropy, lse = lm_head._chunk_forward(logits, targets, temperature)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = (torch.randn(logits.shape[0], generator=g).to(DEVICE) for _ in range(2))
    want = lm_head._chunk_backward(logits, targets, lse, entropy, g_lp, g_ent, temperature)
    got = head_kernels.chunk_backward(logits, targets, lse, entropy, g_lp, g_ent, temperature)
    assert got.dtype == logits.dtype and got.shape == logits.shape
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)


def test_fused_head_with_the_kernels_equals_the_plain_head(monkeypatch):
    """head_logprobs fused (the kernels, larger chunks) against unfused, values and grads."""
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMS", 4 * 1000)  # several chunks either way
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g).to(DEVICE)
    weight = torch.randn(1000, 16, generator=g).to(DEVICE)
    targets = torch.randint(0, 1000, (37,), generator=g).to(DEVICE)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = lm_head.head_logprobs(h, w, targets, 0.9, torch.float32, fused=fused)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        results.append((logp, entropy, h.grad, w.grad))
    for name, a, b in zip(("logp", "entropy", "grad h", "grad w"), *results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
