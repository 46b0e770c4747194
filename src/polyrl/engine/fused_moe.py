"""The engine's mixture-of-experts layer for its fused decode step (Triton).

Why not the model's own block: transformers' `grouped_mm` experts spend half of a
Qwen3-30B-A3B decode step outside their GEMMs on an H200 (BENCHMARKS.md, "Mixture of
experts at the Qwen3-30B-A3B shape"): a radix sort of the token-expert pairs, gathers and
index puts to permute the rows there and back, and a dozen elementwise launches a layer.
Here a layer is five kernels besides the router's matmul:

1. the router's logits (the model's own linear), then one kernel for softmax, top-k,
   the renormalised weights and each expert's count, a program per token;
2. one kernel that groups the token-expert pairs by expert (a counting sort: the
   routing kernel counted each expert's pairs atomically, so each pair's place is its
   expert's start plus its rank) and cuts each expert's pairs into blocks of `block_m`
   rows;
3. gate and up projections of a block against its expert in one kernel, the rows
   gathered from the tokens as they are read and SwiGLU applied before the store;
4. the down projection, each row scaled by its routing weight, stored per pair;
5. the sum over a token's k pairs (transformers sums them the same way), which the
   engine folds into its next residual add and RMSNorm.

Every shape is fixed by the number of tokens (no host sync), so a decode step that runs
it is captured in the engine's CUDA graphs. At decode batch sizes each expert's pairs fit
in one or two blocks, so a step reads every expert's weights about once: the kernel is
bound by the weight reads, which is the decode roofline. Large prefills keep the model's
`grouped_mm` block, whose GEMMs are the better ones when every expert has thousands of
rows (`FUSED_MAX_PAIRS`).

On CPU the kernels run only in Triton's interpreter (the tests); the CPU engine keeps
the model's block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.engine.triton_ops import _next_pow2, triton
from polyrl.models.moe import is_moe_block

if triton is not None:
    import triton.language as tl

FUSED_MAX_PAIRS = 16384
"""Token-expert pairs above which a forward keeps the model's block (a prefill chunk):
when every expert has hundreds of rows the GEMMs are bound by compute, cuBLAS's
strength, not by reading the weights, which is what these kernels are shaped for."""


@dataclass(frozen=True)
class Tiles:
    """A GEMM launch's tile shape: `block_m` pair rows per program (the grouping's block
    size), `block_n` output columns, `block_k` reduction step; warps and pipeline stages."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def launch(self) -> dict[str, int]:
        """The GEMM kernels' tile constants and launch options, as keyword arguments."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


def tiles_for(num_pairs: int, num_experts: int, itemsize: int = 2) -> tuple[Tiles, Tiles]:
    """(gate-up, down) tiles for a forward of `num_pairs` token-expert pairs of
    `itemsize`-byte weights. Each expert gets about num_pairs / num_experts rows; a block
    that holds them all reads the expert's weights once, so `block_m` grows with the rows
    an expert gets. The 16-bit shapes are the fastest of `benchmarks/moe_layer.py --sweep`
    on an H200 at Qwen3-30B-A3B's layer (64, 256 and 512 tokens: 4, 16 and 32 rows an
    expert); float32 weights (a float32 engine) take narrow tiles that fit shared memory."""
    per_expert = num_pairs / max(1, num_experts)
    block_m = 16 if per_expert <= 12 else 32 if per_expert <= 24 else 64
    if itemsize > 2:
        return Tiles(block_m, 64, 32, 4, 2), Tiles(block_m, 64, 32, 4, 2)
    if block_m == 16:
        return Tiles(16, 128, 128, 4, 3), Tiles(16, 64, 128, 4, 4)
    if block_m == 32:
        return Tiles(32, 64, 128, 4, 3), Tiles(32, 64, 128, 4, 3)
    return Tiles(64, 64, 64, 4, 3), Tiles(64, 64, 64, 4, 4)


def supports(mlp: nn.Module, hidden_act: str) -> bool:
    """The experts this layer computes: transformers' fused 3-D expert weights (Qwen3-MoE's
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]) with SwiGLU, no biases, and a
    top-k softmax router."""
    if not is_moe_block(mlp) or hidden_act != "silu":
        return False
    experts, gate = mlp.experts, getattr(mlp, "gate", None)
    up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and up.dim() == 3
        and down.dim() == 3
        and up.shape[1] == 2 * down.shape[2]
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "has_post_expert_norm", False)
        and all(hasattr(gate, name) for name in ("top_k", "weight", "norm_topk_prob"))
        and not hasattr(mlp, "shared_expert")
    )


def moe_forward(
    mlp: nn.Module,
    x: torch.Tensor,
    routes: list[torch.Tensor] | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
    summed: bool = True,
) -> torch.Tensor:
    """One MoE block on [T, hidden] rows (the same result as the block's own forward up to
    rounding); `routes`, when given, gets this layer's experts per row ([T, k]); `tiles`
    (gate-up, down; their `block_m` equal) replaces `tiles_for`'s choice. `summed=False`
    returns each token's k weighted expert outputs, [T, k, hidden], for a caller that sums
    them in its next kernel (the engine's residual add and RMSNorm)."""
    gate, experts = mlp.gate, mlp.experts
    num_tokens, top_k = x.shape[0], gate.top_k
    logits = F.linear(x, gate.weight)  # [T, E]; under the engine's autocast, as the block's router
    routed = route(logits, top_k, gate.norm_topk_prob)
    if routes is not None:
        routes.append(routed.expert_ids)
    w_up, w_down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    tiles_up, tiles_down = tiles or tiles_for(num_tokens * top_k, w_up.shape[0], w_up.element_size())
    assert tiles_up.block_m == tiles_down.block_m, "both GEMMs take the grouping's blocks"
    order, blocks = group_by_expert(routed, tiles_up.block_m)
    inter = expert_gate_up(x.to(w_up.dtype).contiguous(), order, blocks, w_up, top_k, tiles_up)  # [T*k, I]
    out = expert_down(inter, order, blocks, w_down, routed.weights, tiles_down)  # [T*k, H]
    out = out.view(num_tokens, top_k, -1)  # the experts' dtype, until summed
    return out.sum(dim=1).to(x.dtype) if summed else out


@dataclass(frozen=True)
class Routed:
    """A forward's routing: each token's experts and weights, and what grouping needs."""

    expert_ids: torch.Tensor  # [T, k] int32, descending probability
    weights: torch.Tensor  # [T, k], the logits' dtype
    counts: torch.Tensor  # [E] int32: pairs per expert
    ranks: torch.Tensor  # [T*k] int32: each pair's place among its expert's pairs


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routed:
    """Softmax (float32) over [T, E] router logits, the top `top_k` experts of each row in
    descending order, their probabilities (renormalised to sum to 1 when asked), cast to
    the logits' dtype as transformers' router does; each pick also takes the next place
    among its expert's pairs (an atomic count, so the places within an expert come in no
    fixed order: each pair's row is computed alone, so its result does not depend on it)."""
    num_tokens, num_experts = logits.shape
    device = logits.device
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_tokens * top_k, dtype=torch.int32, device=device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits,
            ids,
            weights,
            counts,
            ranks,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            BLOCK_K=_next_pow2(top_k),
            RENORMALIZE=renormalize,
            BLOCK_E=_next_pow2(num_experts),
        )
    return Routed(ids, weights, counts, ranks)


def group_by_expert(routed: Routed, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (row-major flat indices into [T, k]) in expert order, and the blocks of
    at most `block_m` of them that the GEMM kernels take: ([T*k] int32, [max blocks, 3]
    int32 rows of (expert, first, end) into that order; expert -1 past the last block).
    The number of blocks is at most pairs / block_m + experts, which fixes every launch's
    grid without reading the counts back."""
    num_pairs, num_experts = routed.ranks.numel(), routed.counts.numel()
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    device = routed.ranks.device
    order = torch.empty(num_pairs, dtype=torch.int32, device=device)
    blocks = torch.empty((max_blocks, 3), dtype=torch.int32, device=device)
    block_e = _next_pow2(num_experts)
    chunk = max(16, 4096 // block_e)  # pairs (and blocks) a program places: a [chunk, E] one-hot tile
    grid = (max(triton.cdiv(num_pairs, chunk), triton.cdiv(max_blocks, chunk)),)
    _group_kernel[grid](
        routed.expert_ids,
        routed.ranks,
        routed.counts,
        order,
        blocks,
        num_pairs,
        max_blocks,
        num_experts,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=chunk,
    )
    return order, blocks


def expert_gate_up(
    x: torch.Tensor, order: torch.Tensor, blocks: torch.Tensor, w_up: torch.Tensor, top_k: int, tiles: Tiles
) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for every pair, its token's row against its expert:
    [T*k, I] in pair order."""
    inter_size, hidden = w_up.shape[1] // 2, w_up.shape[2]
    out = torch.empty((order.numel(), inter_size), dtype=x.dtype, device=x.device)
    grid = (blocks.shape[0], triton.cdiv(inter_size, tiles.block_n))
    _gate_up_kernel[grid](
        x,
        w_up,
        out,
        order,
        blocks,
        hidden,
        inter_size,
        x.stride(0),
        w_up.stride(0),
        w_up.stride(1),
        TOP_K=top_k,
        IEEE=x.dtype == torch.float32,
        **tiles.launch(),
    )
    return out


def expert_down(
    inter: torch.Tensor,
    order: torch.Tensor,
    blocks: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    tiles: Tiles,
) -> torch.Tensor:
    """Each pair's row of `inter` against its expert's down projection, times the pair's
    routing weight: [T*k, H] in pair order."""
    hidden, inter_size = w_down.shape[1], w_down.shape[2]
    out = torch.empty((order.numel(), hidden), dtype=inter.dtype, device=inter.device)
    grid = (blocks.shape[0], triton.cdiv(hidden, tiles.block_n))
    _down_kernel[grid](
        inter,
        w_down,
        out,
        order,
        blocks,
        weights,
        inter_size,
        hidden,
        w_down.stride(0),
        w_down.stride(1),
        IEEE=inter.dtype == torch.float32,
        **tiles.launch(),
    )
    return out


if triton is not None:

    @triton.jit
    def _route_kernel(
        logits_ptr, ids_ptr, weights_ptr, counts_ptr, ranks_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
        BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        k = tl.arange(0, BLOCK_K)
        top_p = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_e = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            pick = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # the lowest index among ties, as torch.topk
            top_p = tl.where(k == i, best, top_p)
            top_e = tl.where(k == i, pick, top_e)
            p = tl.where(e == pick, -1.0, p)
        if RENORMALIZE:
            top_p = top_p / tl.sum(top_p, axis=0)
        picked = k < TOP_K
        tl.store(ids_ptr + t * TOP_K + k, top_e, mask=picked)
        tl.store(weights_ptr + t * TOP_K + k, top_p.to(weights_ptr.dtype.element_ty), mask=picked)
        rank = tl.atomic_add(counts_ptr + top_e, 1, mask=picked)  # the k experts differ: no clash within a token
        tl.store(ranks_ptr + t * TOP_K + k, rank, mask=picked)

    @triton.jit
    def _group_kernel(
        ids_ptr, ranks_ptr, counts_ptr, order_ptr, blocks_ptr, num_pairs, max_blocks, num_experts,
        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # Every program reads the counts (one [E] vector) and places one chunk of pairs
        # (at its expert's first place + its rank) and writes one chunk of the block table.
        e = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
        firsts = tl.cumsum(counts, axis=0) - counts  # where each expert's pairs start in the order
        s = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        pair_ok = s < num_pairs
        ids = tl.load(ids_ptr + s, mask=pair_ok, other=BLOCK_E)
        first = tl.sum(tl.where(ids[:, None] == e[None, :], firsts[None, :], 0), axis=1)
        rank = tl.load(ranks_ptr + s, mask=pair_ok, other=0)
        tl.store(order_ptr + first + rank, s, mask=pair_ok)
        num_blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_ends = tl.cumsum(num_blocks, axis=0)
        block_firsts = block_ends - num_blocks
        b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        expert = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)  # the expert that owns block b
        own = expert[:, None] == e[None, :]
        start = tl.sum(tl.where(own, firsts[None, :], 0), axis=1)
        start += (b - tl.sum(tl.where(own, block_firsts[None, :], 0), axis=1)) * BLOCK_M
        end = tl.minimum(start + BLOCK_M, tl.sum(tl.where(own, (firsts + counts)[None, :], 0), axis=1))
        used = expert < num_experts
        row = blocks_ptr + b * 3
        block_ok = b < max_blocks
        tl.store(row, tl.where(used, expert, -1), mask=block_ok)
        tl.store(row + 1, tl.where(used, start, 0), mask=block_ok)
        tl.store(row + 2, tl.where(used, end, 0), mask=block_ok)

    @triton.jit
    def _block_rows(order_ptr, blocks_ptr, BLOCK_M: tl.constexpr):
        """This program's block: (expert, pair indices [BLOCK_M], row mask); expert < 0 past
        the last block."""
        row = blocks_ptr + tl.program_id(0) * 3
        expert = tl.load(row)
        m = tl.load(row + 1) + tl.arange(0, BLOCK_M)
        valid = m < tl.load(row + 2)
        pairs = tl.load(order_ptr + m, mask=valid, other=0)
        return expert, pairs, valid

    @triton.jit
    def _gate_up_kernel(
        x_ptr, w_ptr, out_ptr, order_ptr, blocks_ptr, hidden, inter_size, stride_xt, stride_we, stride_wn,
        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        expert, pairs, valid = _block_rows(order_ptr, blocks_ptr, BLOCK_M)
        if expert < 0:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter_size
        tokens = pairs // TOP_K
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(
                x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_expert + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)  # [K, N]
            w_up = tl.load(w_expert + (n + inter_size)[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
            if IEEE:
                acc_gate += tl.dot(a, w_gate, input_precision="ieee")
                acc_up += tl.dot(a, w_up, input_precision="ieee")
            else:
                acc_gate += tl.dot(a, w_gate)
                acc_up += tl.dot(a, w_up)
        # Rounded as transformers rounds: the projections' outputs, then silu, in the
        # weights' dtype.
        g = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        dst = out_ptr + pairs[:, None] * inter_size + n[None, :]
        tl.store(dst, (act * u).to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(
        x_ptr, w_ptr, out_ptr, order_ptr, blocks_ptr, weights_ptr, inter_size, hidden, stride_we, stride_wn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        expert, pairs, valid = _block_rows(order_ptr, blocks_ptr, BLOCK_M)
        if expert < 0:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter_size
            a = tl.load(
                x_ptr + pairs[:, None] * inter_size + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(w_expert + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        # The projection's output rounded to its dtype, then scaled, as transformers does.
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        dst = out_ptr + pairs[:, None] * hidden + n[None, :]
        tl.store(dst, (y * scale[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
