"""Token sampling that depends only on (seed, position), never on the batch.

Sampling is Gumbel-max: argmax(logits / T + g) over the allowed tokens, with the Gumbel
noise g computed by hashing (seed, absolute position, token id). That is an exact draw
from softmax(logits / T) restricted to the tokens that pass the cuts (top-k, top-p,
min-p), and it makes every draw
reproducible wherever the sequence runs: the same request gives the same tokens alone or
in any batch, after a preemption, or resumed on another worker with the same seed (up to
the floating-point noise of the logits themselves). That noise is removed too for float64
logits (a deterministic run's CPU engines): `to_float32` rounds them to a grid far coarser
than the float64 rounding noise (and about float32's own precision for logits near 10),
so the logits, tokens and log-probs do not depend on the batch.

Reported log-probs are log softmax(logits / T) of the chosen token, *before* truncation
(log softmax(logits) for greedy); see README "Log-probs".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from polyrl.engine import triton_ops

_M32 = 0xFFFFFFFF

LOGIT_GRID = 2.0**-20
"""float64 logits are rounded to multiples of this (a log-prob moves by 1e-6 at most).
Batch composition changes a float64 logit by ~1e-15: it crosses a grid point with a
probability of ~1e-9. In float32, a sample of the tiny model had different log-probs (by
up to 1e-6) alone and in a batch of 64 prompts x 16 in 201 of 256 comparisons."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without signed 64-bit overflow."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (murmur3's): every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4)
def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    return mix32(torch.arange(vocab_size, device=device) ^ 0x7F4A7C15)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 Gumbel(0, 1) noise keyed by (seed [S], position [S], token id)."""
    key = mix32((seeds >> 32) ^ 0x9E3779B9)
    key = mix32(key ^ (seeds & _M32))
    key = mix32(key ^ (positions & _M32))  # [S]
    token_keys = _token_keys(vocab_size, seeds.device)  # [V]
    bits = mix32(key[:, None] ^ token_keys[None, :])  # [S, V] uniform 32-bit
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits like a float32 mantissa
    return -torch.log(-torch.log(uniform))


def truncation_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[S, V] bool, True for tokens that pass each row's cuts: among the top_k most likely
    (<= 0: off), inside the top_p nucleus, and at least min_p times as likely as the most
    likely token (0: off). Every cut is measured on the same temperature-scaled
    distribution, so their order does not matter (as in SGLang's PyTorch sampler; vLLM
    applies min-p first and measures top-p on what is left, which differs only when both
    are on). The most likely token always passes."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V] probability of strictly better tokens
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep_sorted = (mass_before < top_p[:, None]) & ((top_k[:, None] <= 0) | (rank < top_k[:, None]))
    keep_sorted &= probs >= min_p[:, None] * probs[:, :1]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, <= 0 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seeds: torch.Tensor  # [S] int64 in [0, 2**63)
    positions: torch.Tensor  # [S] int64 absolute position of the token being sampled
    needs_truncation: bool
    all_greedy: bool
    num_top_logprobs: int = 0  # the most any row asks for (0: none does)


def to_float32(logits: torch.Tensor) -> torch.Tensor:
    """The logits [S, V] in float32; float64 ones rounded to `LOGIT_GRID` first."""
    if logits.dtype == torch.float64:
        logits = torch.round(logits * (1 / LOGIT_GRID)) * LOGIT_GRID  # exact: powers of two
    return logits.float()


def sample(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (token ids [S], log-probs [S] float32). On CUDA without cuts
    this is one fused Triton kernel (`triton_ops.fused_sample`): the same draws, one pass."""
    if (
        logits.is_cuda
        and logits.dtype != torch.float64
        and not params.needs_truncation
        and triton_ops.available("cuda")
    ):
        return triton_ops.fused_sample(logits, params.temperature, params.seeds, params.positions)
    logits = to_float32(logits)
    greedy = params.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temperature[:, None]
    logprobs = scaled.log_softmax(dim=-1)
    token_ids = logits.argmax(dim=-1)
    if not params.all_greedy:
        scores = scaled + gumbel_noise(params.seeds, params.positions, logits.shape[-1])
        if params.needs_truncation:
            scores = scores.masked_fill(
                ~truncation_mask(scaled, params.top_k, params.top_p, params.min_p), float("-inf")
            )
        token_ids = torch.where(greedy, token_ids, scores.argmax(dim=-1))
    return token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The `params.num_top_logprobs` most likely tokens per row: (log-probs [S, k] float32,
    token ids [S, k]), in the same definition as the sampled token's (before truncation).
    A second pass over the logits, run only for steps where some request asked for it."""
    temperature = torch.where(params.temperature == 0, torch.ones_like(params.temperature), params.temperature)
    logprobs = (to_float32(logits) / temperature[:, None]).log_softmax(dim=-1)
    return logprobs.topk(min(params.num_top_logprobs, logits.shape[-1]), dim=-1)
