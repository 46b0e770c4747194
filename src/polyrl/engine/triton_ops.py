"""Triton kernels for the GPU decode step: paged attention and fused sampling.

Both exist because the PyTorch versions are memory-bound several times over at decode
time: SDPA over the paged cache first gathers every sequence's blocks into a padded copy,
and sampling with `sampler.sample` makes a dozen passes over the [S, vocab] logits. Each
kernel here reads its input once.

Triton is optional: `available()` is False without it (CPU-only installs) and the engine
keeps its PyTorch path. Under `TRITON_INTERPRET=1` the kernels also run on CPU tensors,
which is how the test suite checks them against the PyTorch reference.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def available(device_type: str) -> bool:
    """Whether the kernels can run on `device_type` tensors here."""
    if triton is None:
        return False
    return device_type == "cuda" or interpreted()


def supports(head_dim: int) -> bool:
    """The attention kernel's tile constraint: a power-of-two head size of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        ctx_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_kblk,
        stride_kslot,
        stride_kh,
        stride_ob,
        stride_oh,
        stride_tb,
        ks_ptr,
        vs_ptr,
        stride_sblk,
        stride_sslot,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        FP8_KV: tl.constexpr = False,
        CUDA_CORES: tl.constexpr = False,
        HEADS_FIRST: tl.constexpr = False,
    ):
        # FP8_KV: the cache holds e4m3 values with one float32 scale per (slot, KV head) in
        # `ks_ptr`/`vs_ptr`; the key scales multiply the scores, the value scales the
        # probabilities, and the values themselves enter the products as fp16 (e4m3 converts
        # to fp16 in one instruction, to bf16 in several).
        # CUDA_CORES (an FP8 cache with one or two query heads a KV head, `decode_loop`): each
        # head's scores are a [N, D] product summed along D and its values a [N, D] product
        # summed along N, so no work goes to the rows a tensor-core tile pads the heads to
        # (16). The heads are unrolled; their running max, sum and output live in the same
        # [GROUP_PAD] and [GROUP_PAD, D] tensors as the tensor-core loop's, each head
        # updating its row through a mask. Written as one [heads, N, D] product instead,
        # Triton's code was 2.5x slower (BENCHMARKS.md, "The FP8 cache's decode loop on
        # CUDA cores").
        # One program per (sequence, KV head): its GROUP query heads share every K/V load.
        # HEADS_FIRST: the grid is (KV heads, sequences), so that a sequence's KV heads are
        # launched together (`DECODE_HEADS_FIRST`).
        if HEADS_FIRST:
            b = tl.program_id(1)
            kvh = tl.program_id(0)
        else:
            b = tl.program_id(0)
            kvh = tl.program_id(1)
        ctx = tl.load(ctx_ptr + b)
        g = tl.arange(0, GROUP_PAD)
        heads = kvh * GROUP + g
        hmask = g < GROUP
        d = tl.arange(0, HEAD_DIM)
        if not CUDA_CORES:
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, ctx, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < ctx
            block = tl.load(tables_ptr + b * stride_tb + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            offs = block * stride_kblk + (n % BLOCK_SIZE) * stride_kslot + kvh * stride_kh
            k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=nmask[:, None], other=0.0)  # [N, D]
            v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            if CUDA_CORES:
                k = k.to(tl.float16).to(tl.float32)
                v = v.to(tl.float16).to(tl.float32)
            if FP8_KV:  # the scales multiply the [G, N] scores and probabilities, not the [N, D] values
                soffs = block * stride_sblk + (n % BLOCK_SIZE) * stride_sslot + kvh
                ks = tl.load(ks_ptr + soffs, mask=nmask, other=0.0)
                vs = tl.load(vs_ptr + soffs, mask=nmask, other=0.0)
            if CUDA_CORES:
                ks = ks * scale
                for i in tl.static_range(GROUP):
                    qi = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + i) * stride_qh + d).to(tl.float32)
                    s = tl.sum(k * qi[None, :], axis=1) * ks  # [N]
                    s = tl.where(nmask, s, float("-inf"))
                    mine = g == i
                    m_i = tl.max(tl.where(mine, m, float("-inf")), axis=0)
                    m_new = tl.maximum(m_i, tl.max(s, axis=0))
                    alpha = tl.exp(m_i - m_new)
                    p = tl.exp(s - m_new)
                    denom = tl.where(mine, denom * alpha + tl.sum(p, axis=0), denom)
                    m = tl.where(mine, m_new, m)
                    pv = tl.sum((p * vs)[:, None] * v, axis=0)  # [D]
                    acc = tl.where(mine[:, None], acc * alpha + pv[None, :], acc)
            else:
                if FP8_KV:
                    s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)), input_precision=PRECISION)
                    s = s * (ks * scale)[None, :]
                else:
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N] float32
                s = tl.where(nmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                denom = denom * alpha + tl.sum(p, axis=1)
                if FP8_KV:
                    # the values' weights over the tile's largest scale, so that they stay in fp16's
                    # normal range (from 6e-5) however small the model's values are: taken as they
                    # are, values of size 1e-5 came out a third off (tests/test_triton_ops.py)
                    vref = tl.maximum(tl.max(vs, axis=0), 1e-30)
                    w = (p * (vs / vref)[None, :]).to(tl.float16)
                    pv = tl.dot(w, v.to(tl.float16), input_precision=PRECISION) * vref
                else:
                    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m = m_new
        out = acc / tl.maximum(denom, 1e-30)[:, None]  # a padding row (ctx 0) writes zeros
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None],
        )

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        return x ^ (x >> 16)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        stride_l,
        temp_ptr,
        seed_ptr,
        pos_ptr,
        part_ptr,
        vocab_size,
        chunk,
        SPLITS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per (row, slice of the vocabulary), one pass over the slice: its
        # Gumbel-max draw (or argmax for greedy rows) and its part of the log-sum-exp,
        # written as five float32 partials that `_sample_combine_kernel` reduces. Splitting
        # the row keeps every SM busy at RL batch sizes: one program a row ran 256 long
        # loops on 132 SMs.
        row = tl.program_id(0)
        split = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        greedy = t == 0.0
        t = tl.where(greedy, 1.0, t)
        seed = tl.load(seed_ptr + row)
        pos = tl.load(pos_ptr + row)
        key = _mix32((seed >> 32).to(tl.uint32) ^ 0x9E3779B9)
        key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32(key ^ (pos & 0xFFFFFFFF).to(tl.uint32))
        # The draw and the log-sum-exp are kept per lane (each lane's best score, its index and
        # scaled logit; its running max and sum) and reduced once after the loop, so the loop
        # has no cross-lane work: a reduction a tile cost a block-wide barrier each time.
        lane_m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK_V], tl.float32)
        lane_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_idx = tl.zeros([BLOCK_V], tl.int32)
        lane_scaled = tl.zeros([BLOCK_V], tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab_size)
        for start in range(lo, hi, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            vmask = v < hi
            x = tl.load(logits_ptr + row * stride_l + v, mask=vmask, other=float("-inf")).to(tl.float32)
            scaled = x / t
            # one exp a logit: the smaller of (running max, logit) relative to the larger
            # either rescales the sum (a new max) or is added to it; a lane with nothing
            # finite yet keeps max -inf and sum 0
            up = scaled > lane_m
            top = tl.where(up, scaled, lane_m)
            e = tl.where(top == float("-inf"), 0.0, tl.exp(tl.where(up, lane_m, scaled) - top))
            lane_sum = tl.where(up, lane_sum * e + 1.0, lane_sum + e)
            lane_m = top
            bits = _mix32(key ^ _mix32(v.to(tl.uint32) ^ 0x7F4A7C15))
            uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(greedy, x, scaled - tl.log(-tl.log(uniform)))
            score = tl.where(vmask, score, float("-inf"))
            better = score > lane_best  # strict: a lane keeps its earliest index on a tie
            lane_best = tl.where(better, score, lane_best)
            lane_idx = tl.where(better, v, lane_idx)
            lane_scaled = tl.where(better, scaled, lane_scaled)
        m = tl.max(lane_m, axis=0)
        denom = tl.sum(tl.where(lane_m == float("-inf"), 0.0, lane_sum * tl.exp(lane_m - m)), axis=0)
        best = tl.max(lane_best, axis=0)
        # the earliest index among the lanes that reach it, like torch.argmax (a slice with no
        # finite score keeps index 0 and -inf, which the combine never picks over a real one)
        best_idx = tl.min(tl.where(lane_best == best, lane_idx, 2147483647), axis=0)
        best_scaled = tl.sum(tl.where((lane_idx == best_idx) & (lane_best == best), lane_scaled, 0.0), axis=0)
        out = part_ptr + (row * SPLITS + split) * 5
        tl.store(out, m)
        tl.store(out + 1, denom)
        tl.store(out + 2, best)
        tl.store(out + 3, best_idx.to(tl.float32))  # exact: vocabularies are far below 2**24
        tl.store(out + 4, best_scaled)

    @triton.jit
    def _sample_combine_kernel(part_ptr, token_ptr, logprob_ptr, SPLITS: tl.constexpr):
        # A row's slices in vocabulary order: the largest score wins, the earliest slice a
        # tie (so the earliest index, as in one pass); the log-sum-exp of the slices' parts.
        row = tl.program_id(0)
        base = part_ptr + row * SPLITS * 5 + tl.arange(0, SPLITS) * 5
        m = tl.load(base)
        denom = tl.load(base + 1)
        best = tl.load(base + 2)
        idx = tl.load(base + 3)
        scaled = tl.load(base + 4)
        m_all = tl.max(m, axis=0)
        total = tl.sum(tl.where(denom > 0, denom * tl.exp(m - m_all), 0.0), axis=0)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, tl.arange(0, SPLITS), SPLITS), axis=0)
        pick = tl.arange(0, SPLITS) == first
        tl.store(token_ptr + row, tl.sum(tl.where(pick, idx, 0.0), axis=0).to(tl.int64))
        tl.store(logprob_ptr + row, tl.sum(tl.where(pick, scaled, 0.0), axis=0) - m_all - tl.log(total))

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_r,
        stride_o,
        num_cols,
        eps,
        scale_ptr,
        fp8_max,
        xs_ptr,
        ws_ptr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        QUANT: tl.constexpr = False,
        PARTS: tl.constexpr = 1,
        stride_part=0,
        DEQUANT: tl.constexpr = False,
    ):
        # HF's RMSNorm rounding: normalise in float32, round to the input dtype, then scale.
        # QUANT: the output, rounded to the input dtype, is quantized per row into FP8
        # (`out_ptr` e4m3, its scale at `scale_ptr`), as `_quantize_rows_kernel` would.
        # PARTS > 1: x is [T, PARTS, N], summed over its parts in float32 and rounded once
        # to the residual's dtype (as torch's sum and transformers' cast) before the
        # residual add: a mixture of experts' per-expert outputs.
        # DEQUANT: x is an FP8 matmul's unscaled product; its row scale (`xs_ptr`) and
        # column scales (`ws_ptr`) are applied first, rounding to x's dtype as the scaled
        # matmul would have.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if DEQUANT:
            ws = tl.load(ws_ptr + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) * tl.load(xs_ptr + row) * ws).to(x.dtype)
        if PARTS > 1:
            total = x.to(tl.float32)
            for part in tl.static_range(1, PARTS):
                total += tl.load(x_ptr + row * stride_x + part * stride_part + cols, mask=mask, other=0.0).to(
                    tl.float32
                )
            x = total.to(res_ptr.dtype.element_ty)  # the block's output, in the residual stream's dtype
        if HAS_RESIDUAL:  # residual += x (rounded like a plain add), then normalise the sum
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
        if QUANT:
            y = y.to(x.dtype).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / fp8_max
            q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
            tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_cache_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cos,
        stride_ot,
        stride_oh,
        stride_cslot,
        stride_ch,
        eps,
        ks_ptr,
        vs_ptr,
        stride_sslot,
        fp8_max,
        num_q_heads,
        num_kv_heads,
        xs_ptr,
        qs_ptr,
        kws_ptr,
        vws_ptr,
        HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_NORM: tl.constexpr,
        FP8_KV: tl.constexpr = False,
        DEQUANT: tl.constexpr = False,
    ):
        # One token's query heads (program (t, 0)) or its key heads (t, 1), all at once in
        # a [HEADS, D] tile: optional per-head RMSNorm (Qwen3's q/k norms), rotate-half
        # RoPE; queries go to `out`, keys (and the token's values) into their cache slot.
        # A program per head was a 128-element program, and 14 us a layer at batch 512.
        # DEQUANT: q, k and v are an FP8 matmul's unscaled products: the token's row scale
        # (`xs_ptr`) and each column's weight scale (`qs_ptr`, `kws_ptr`, `vws_ptr`, [H*D]
        # each) are applied as they load, rounding to their dtype as the scaled matmul would.
        t = tl.program_id(0)
        is_key = tl.program_id(1) == 1
        h = tl.arange(0, HEADS)
        if is_key:
            rows = k_ptr + t * stride_kt + h * stride_kh
            w_ptr = kw_ptr
            cs_ptr = kws_ptr
            hmask = h < num_kv_heads
        else:
            rows = q_ptr + t * stride_qt + h * stride_qh
            w_ptr = qw_ptr
            cs_ptr = qs_ptr
            hmask = h < num_q_heads
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = HEAD_DIM // 2
        partner = (d + half) % HEAD_DIM
        x = tl.load(rows[:, None] + d[None, :], mask=hmask[:, None], other=0.0)
        x2 = tl.load(rows[:, None] + partner[None, :], mask=hmask[:, None], other=0.0)
        if DEQUANT:
            xs = tl.load(xs_ptr + t)
            cols = h[:, None] * HEAD_DIM + d[None, :]
            x = (x.to(tl.float32) * xs * tl.load(cs_ptr + cols, mask=hmask[:, None], other=0.0)).to(x.dtype)
            cols2 = h[:, None] * HEAD_DIM + partner[None, :]
            x2 = (x2.to(tl.float32) * xs * tl.load(cs_ptr + cols2, mask=hmask[:, None], other=0.0)).to(x2.dtype)
        xf = x.to(tl.float32)
        x2f = x2.to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
            w = tl.load(w_ptr + d).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + partner).to(tl.float32)[None, :]
            xf = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
            x2f = ((x2f * rstd).to(x.dtype).to(tl.float32) * w2).to(x.dtype).to(tl.float32)
        cos = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)[None, :]
        rotated = tl.where(d[None, :] < half, -x2f, x2f)
        y = xf * cos + rotated * sin
        if is_key:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=hmask[:, None], other=0.0)
            if DEQUANT:
                vws = tl.load(vws_ptr + h[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
                v = (v.to(tl.float32) * tl.load(xs_ptr + t) * vws).to(v.dtype)
            if FP8_KV:  # e4m3 with one scale per (slot, head): the head's largest value maps to fp8_max
                y = y.to(x.dtype).to(tl.float32)  # the key as a 16-bit cache would hold it
                vf = v.to(tl.float32)
                ks = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) / fp8_max
                vs = tl.maximum(tl.max(tl.abs(vf), axis=1), 1e-12) / fp8_max
                y = tl.minimum(tl.maximum(y / ks[:, None], -fp8_max), fp8_max)
                vf = tl.minimum(tl.maximum(vf / vs[:, None], -fp8_max), fp8_max)
                tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=hmask[:, None])
                tl.store(v_cache_ptr + dst, vf.to(v_cache_ptr.dtype.element_ty), mask=hmask[:, None])
                tl.store(ks_ptr + slot * stride_sslot + h, ks, mask=hmask)
                tl.store(vs_ptr + slot * stride_sslot + h, vs, mask=hmask)
            else:
                tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=hmask[:, None])
                tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
            out = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=hmask[:, None])

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, num, cols, stride_in, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num
        src = (offs // cols) * stride_in + offs % cols  # gate and up may be column slices of one tensor
        g = tl.load(gate_ptr + src, mask=mask, other=0.0)
        u = tl.load(up_ptr + src, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # rounded like torch's silu
        tl.store(out_ptr + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_fp8_kernel(
        gate_ptr,
        up_ptr,
        q_ptr,
        scale_ptr,
        cols,
        stride_in,
        fp8_max,
        xs_ptr,
        gs_ptr,
        us_ptr,
        BLOCK: tl.constexpr,
        DEQUANT: tl.constexpr = False,
    ):
        # DEQUANT: gate and up are an FP8 matmul's unscaled products: the row's scale and
        # their columns' scales are applied as they load, rounded as the scaled matmul would.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        g = tl.load(gate_ptr + row * stride_in + offs, mask=mask, other=0.0)
        u = tl.load(up_ptr + row * stride_in + offs, mask=mask, other=0.0)
        if DEQUANT:
            xs = tl.load(xs_ptr + row)
            g = (g.to(tl.float32) * xs * tl.load(gs_ptr + offs, mask=mask, other=0.0)).to(g.dtype)
            u = (u.to(tl.float32) * xs * tl.load(us_ptr + offs, mask=mask, other=0.0)).to(u.dtype)
        u = u.to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # rounded like torch's silu
        y = (act * u).to(g.dtype).to(tl.float32)  # rounded as silu_mul's output is
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / fp8_max
        q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * cols + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, fp8_max, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / fp8_max
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)  # rounding may pass the largest value
        tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_max: float) -> None:
    """Per-row FP8 quantization of a [T, K] tensor into `q` ([T, K], contiguous) and
    `scale` ([T, 1] float32): each row over its absolute maximum / `fp8_max`, in one pass."""
    _quantize_rows_kernel[(x.shape[0],)](
        x, q, scale, x.shape[1], x.stride(0), fp8_max, BLOCK=_next_pow2(x.shape[1]), num_warps=8
    )


Dequant = tuple[torch.Tensor, torch.Tensor] | None
"""An FP8 matmul's scales for a kernel's input that is its unscaled product: (row scales
[T, 1], column scales [1, N]) float32 (see `fp8.Product`); None: the input is as it is."""


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    dequant: Dequant = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of a [T, N] tensor; with `residual`, first `residual += x`
    (in place) and normalise the sum: the pre-norm block's add and norm in one pass. With
    a residual, x may also be [T, P, N] parts (rows contiguous) that add up to the block's
    output: they are summed first, in the same pass. `dequant`: x is an FP8 matmul's
    unscaled product, these its scales."""
    dtype = residual.dtype if x.dim() == 3 else x.dtype  # parts may be the experts' wider dtype
    out = torch.empty((x.shape[0], x.shape[-1]), dtype=dtype, device=x.device)
    _rmsnorm(x, weight, eps, residual, out, None, dequant=dequant)
    return out


def rmsnorm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fp8_max: float,
    dequant: Dequant = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm` with its output quantized per row to FP8 in the same pass, for an FP8
    matmul: (e4m3 [T, N], float32 scales [T, 1]), equal to `quantize_rows_fp8` of
    `rmsnorm`'s output."""
    out = torch.empty((x.shape[0], x.shape[-1]), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _rmsnorm(x, weight, eps, residual, out, scale, fp8_max, dequant)
    return out, scale


def _rmsnorm(x, weight, eps, residual, out, scale, fp8_max: float = 448.0, dequant: Dequant = None) -> None:
    res = residual if residual is not None else x
    parts = x.shape[1] if x.dim() == 3 else 1
    assert x.stride(-1) == 1 and (parts == 1 or residual is not None), "parts are summed into a residual"
    assert dequant is None or parts == 1, "an FP8 product is one part"
    xs, ws = dequant if dequant is not None else (x, x)
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        x.shape[-1],
        eps,
        scale if scale is not None else x,
        fp8_max,
        xs,
        ws,
        HAS_RESIDUAL=residual is not None,
        BLOCK=_next_pow2(x.shape[-1]),
        QUANT=scale is not None,
        PARTS=parts,
        stride_part=x.stride(1) if parts > 1 else 0,
        DEQUANT=dequant is not None,
    )


def rope_and_cache(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [S, KVH, D] one layer's keys by slot
    v_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None,  # [D] weights of per-head RMSNorms applied before RoPE
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scales: torch.Tensor | None = None,  # [S, KVH] float32: an FP8 cache's scales
    v_scales: torch.Tensor | None = None,
    dequant: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotated queries [T, H, D]; rotated keys and the values are written to the cache
    (an FP8 cache, `k_scales` given: each (slot, head) scaled to e4m3's range, its scale
    written beside it). `dequant`: q, k and v are an FP8 matmul's unscaled products, and
    these their scales: (row scales [T, 1], q's, k's and v's column scales [1, H*D] each)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    has_norm = q_norm is not None
    if not num_tokens:
        return out
    _rope_cache_kernel[(num_tokens, 2)](
        q,
        k,
        v,
        q_norm if has_norm else q,
        k_norm if has_norm else k,
        cos,
        sin,
        slot_mapping,
        out,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        eps,
        k_scales if k_scales is not None else q,
        v_scales if v_scales is not None else q,
        k_scales.stride(0) if k_scales is not None else 0,
        FP8_MAX,
        num_heads,
        k.shape[1],
        *(dequant if dequant is not None else (q, q, q, q)),
        HEADS=_next_pow2(max(num_heads, k.shape[1])),
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        FP8_KV=k_scales is not None,
        DEQUANT=dequant is not None,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the SwiGLU MLP's middle: [T, I] each, the same shape and row
    stride, rows contiguous (they may be the two halves of one [T, 2I] output); out [T, I]
    contiguous."""
    assert gate.shape == up.shape and gate.stride() == up.stride() and gate.stride(-1) == 1
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    num, cols = gate.numel(), gate.shape[-1]
    _silu_mul_kernel[(triton.cdiv(num, 1024),)](gate, up, out, num, cols, gate.stride(0), BLOCK=1024)
    return out


def silu_mul_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    fp8_max: float,
    dequant: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul` with its output quantized per row to FP8 in the same pass (for the down
    projection's FP8 matmul): equal to `quantize_rows_fp8` of `silu_mul`'s output.
    `dequant`: gate and up are an FP8 matmul's unscaled products, and these their scales:
    (row scales [T, 1], gate's and up's column scales [1, I] each)."""
    assert gate.shape == up.shape and gate.stride() == up.stride() and gate.stride(-1) == 1
    rows, cols = gate.shape
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=gate.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate.device)
    if rows:
        _silu_mul_fp8_kernel[(rows,)](
            gate,
            up,
            out,
            scale,
            cols,
            gate.stride(0),
            fp8_max,
            *(dequant if dequant is not None else (gate, gate, gate)),
            BLOCK=_next_pow2(cols),
            DEQUANT=dequant is not None,
            num_warps=16,  # on an H100, [256, 12288] with scales: 11.5 us against 13.6 at 8 warps
        )
    return out, scale


FP8_MAX = 448.0
"""The largest finite e4m3 value."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# The paged decode kernel's tile by loop (`decode_loop`): tokens a loop iteration reads,
# warps, pipeline stages. Read when the kernel is launched or captured in a CUDA graph, so
# that `benchmarks/decode_tiles.py` can compare tiles inside the whole engine.
DECODE_TILES: dict[str, tuple[int, int, int]] = {"16-bit": (16, 2, 4), "fp8": (32, 1, 3), "fp8 few heads": (32, 1, 3)}

DECODE_HEADS_FIRST = False
"""Launch the paged decode kernel's programs by sequence, each sequence's KV heads side by
side (grid (KV heads, sequences)), rather than one KV head for every sequence, then the
next (grid (sequences, KV heads)). An FP8 cache's scales of a slot's KV heads share one
32-byte sector; taken by KV head in turn, each program reads a sector for each 4-byte
scale it needs, unless the sector is still in L2 when the next head's program reads it.
Not yet measured on a GPU (`benchmarks/decode_tiles.py` compares both: a tile ending in
"h"); read at launch, as `DECODE_TILES` is."""

FP8_FEW_HEADS = 2
"""The most query heads a KV head for which an FP8 cache is read by the CUDA-core loop
(`_paged_decode_kernel`'s CUDA_CORES loop). Alone on an H200 it was 12-13% faster than the
tensor-core loop with two heads a KV head, and 1.65x slower with four (BENCHMARKS.md)."""


def decode_loop(fp8: bool, group: int) -> str:
    """Which loop reads the cache, as its key in `DECODE_TILES`: the tensor-core loop for a
    16-bit cache ("16-bit") or an FP8 one ("fp8"), or the CUDA-core loop for an FP8 cache
    with at most `FP8_FEW_HEADS` query heads a KV head ("fp8 few heads")."""
    if not fp8:
        return "16-bit"
    return "fp8 few heads" if group <= FP8_FEW_HEADS else "fp8"


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [NBLK, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= max blocks] int32
    context_lens: torch.Tensor,  # [B] int32; 0 = a padding row (output zeros)
    scale: float,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scales: torch.Tensor | None = None,  # [NBLK, BS, KVH] float32: an FP8 cache's scales
    v_scales: torch.Tensor | None = None,
    heads_first: bool | None = None,  # default DECODE_HEADS_FIRST
) -> torch.Tensor:  # [B, H, D] in q's dtype
    """One query token per sequence attending to its whole cached context. The tile
    (`block_n` tokens a loop iteration reads, warps, pipeline stages) defaults to
    `DECODE_TILES`: 16/2/4 for a 16-bit cache and 32/1/3 for an FP8 one, chosen from runs
    of the whole engine on an H200 (BENCHMARKS.md; kernel-only probes had picked tiles the
    engine did not gain from). Against the earlier 64/4/2 and 128/4/2 the engine made up to
    4% more tokens/s at 256 x 256 and 6% more at 256 x 2048 with a bf16 cache (a short tile
    keeps more programs resident on an SM), and about 22% more at 512 x 1024 with an FP8
    cache (one warp does the dots of the query heads, padded to 16 rows, without splitting
    them). An FP8 cache with one or two query heads a KV head is read by a loop on CUDA
    cores instead (`decode_loop`): at 512 x 1024 on Qwen3-0.6B's shape the FP8 engine made
    9-10% more tokens/s with it (1.29-1.33x the bf16-cache engine, from 1.20x)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    fp8 = k_scales is not None
    loop = decode_loop(fp8, group)
    tiles = DECODE_TILES[loop]
    block_n, num_warps, num_stages = block_n or tiles[0], num_warps or tiles[1], num_stages or tiles[2]
    q = q.to(torch.bfloat16 if fp8 else k_cache.dtype)
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    cuda_cores = loop == "fp8 few heads"
    heads_first = DECODE_HEADS_FIRST if heads_first is None else heads_first
    heads_first = heads_first and num_seqs < 2**16  # a grid's second size is at most 65,535
    grid = (num_kv_heads, num_seqs) if heads_first else (num_seqs, num_kv_heads)
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_scales if fp8 else q,
        v_scales if fp8 else q,
        k_scales.stride(0) if fp8 else 0,
        k_scales.stride(1) if fp8 else 0,
        GROUP=group,
        # a tensor-core tile has at least 16 rows; the CUDA-core loop's tensors need only 2
        GROUP_PAD=max(2 if cuda_cores else 16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PRECISION=precision,
        FP8_KV=fp8,
        CUDA_CORES=cuda_cores,
        HEADS_FIRST=heads_first,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fused_sample(
    logits: torch.Tensor,  # [S, V], any float dtype, last dim contiguous
    temperature: torch.Tensor,  # [S] float32, 0 = greedy
    seeds: torch.Tensor,  # [S] int64
    positions: torch.Tensor,  # [S] int64
    splits: int | None = None,
    block_v: int = 1024,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.sample` without top-k/top-p: token ids [S] int64, log-probs [S] float32.
    Each row's vocabulary is read by `splits` programs (a power of two; by default enough
    for about 2,048 programs in all, each at least one `block_v`-wide tile). The kernel is
    bound by its arithmetic (the hash and the two logs of each logit's Gumbel noise), not
    by reading the logits: 1,024-wide tiles over 4 warps, with the per-lane state in
    registers, took 145 us for 256 rows of 151,936 on an H200 against 210 us for 4,096-wide
    ones (BENCHMARKS.md)."""
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        tiles = triton.cdiv(vocab_size, block_v)
        splits = splits or min(_next_pow2(tiles), _next_pow2(triton.cdiv(2048, num_rows)))
        chunk = triton.cdiv(tiles, splits) * block_v
        parts = torch.empty(num_rows, splits, 5, dtype=torch.float32, device=logits.device)
        _sample_kernel[(num_rows, splits)](
            logits,
            logits.stride(0),
            temperature,
            seeds,
            positions,
            parts,
            vocab_size,
            chunk,
            SPLITS=splits,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
        _sample_combine_kernel[(num_rows,)](parts, tokens, logprobs, SPLITS=splits)
    return tokens, logprobs
