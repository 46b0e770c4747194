// Paged decode attention on the tensor cores' mma.sync, for a bf16 or an FP8 (e4m3) cache.
//
// One CTA per (sequence, KV head); NW warps, warp w reads tiles w, w + NW, ... of 16
// tokens and keeps its own online softmax, merged through shared memory at the end.
// Head size 128; at most 8 query heads a KV head (G); the cache's block size a multiple
// of 16. No headers: NVRTC compiles it as it is, every special instruction is inline PTX.
//
// Layout of one 16-token tile in a warp (g = lane / 4, t = lane % 4):
//   scores  S[head, tok] = Q[head, :] . K[tok, :] as m16n8k16 mmas: A = Q (rows: heads,
//           padded to 16 with zeros), B = K^T (n: 8 tokens, two n-tiles). The 128 dims
//           are permuted (`key_dim`) so that a quad's 4 lanes copy 64 contiguous bytes of
//           their token's row at a time (tokens g and g + 8), in the A fragment of Q as in
//           the B fragment of K.
//   values  O^T[dim, head] += V^T[dim, tok] P^T[tok, head]: A = V^T (16 dims an m-tile,
//           k: the 16 tokens), B = P^T, which is the scores' C fragment of row g as it
//           stands (no shuffle). m-tile i's rows g and g + 8 are dims `value_dim(i, g)`
//           and the one after, so that the 8 lane groups copy a value row's contiguous
//           bytes together (tokens 2t, 2t+1, 2t+8, 2t+9), pairs of tokens interleaved by
//           byte permutes into the fragment.
// Each thread copies exactly the 16-byte chunks it will read into its own slots of
// shared memory (cp.async, STAGES - 1 tiles ahead), so the loop needs no barrier.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct __align__(16) u32x4 { u32 x, y, z, w; };

// The instructions, one small function each. PAGED_DECODE_HOST swaps in the CPU's versions
// (tests/cuda_host/), under which the tests run this file's every lane on the host.
#ifdef PAGED_DECODE_HOST
#include "paged_decode_host.h"
#else

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ u32x4 lds128(u32 addr) {
    u32x4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ float lds32f(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// two e4m3 values (low byte, high byte of the low 16 bits) -> f16x2 (low half, high half)
__device__ __forceinline__ void e4m3x4_to_f16x2x2(u32 x, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(d) : "f"(lo), "f"(hi));
    return d;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(d) : "f"(lo), "f"(hi));
    return d;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float shfl_xor(float x, int m) {
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(m));
    return y;
}

__device__ __forceinline__ float shfl_idx(float x, int lane) {
    float y;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(lane));
    return y;
}

__device__ __forceinline__ bool any_sync(bool p) {
    u32 r;
    asm volatile("{ .reg .pred a, b; setp.ne.u32 a, %1, 0; vote.sync.any.pred b, a, 0xffffffff; selp.u32 %0, 1, 0, b; }"
                 : "=r"(r)
                 : "r"((u32)p));
    return r != 0;
}

template <int FP8>
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (FP8) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

#endif  // PAGED_DECODE_HOST

__device__ __forceinline__ void unpack(u32* dst, u32x4 w) {
    dst[0] = w.x;
    dst[1] = w.y;
    dst[2] = w.z;
    dst[3] = w.w;
}

__device__ __forceinline__ float bf16_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// The first of the 4 consecutive dims of k-chunk j (0..7) that quad lane t holds.
template <int FP8>
__device__ __forceinline__ int key_dim(int j, int t) {
    return FP8 ? 64 * (j >> 2) + 16 * t + 4 * (j & 3) : 32 * (j >> 1) + 8 * t + 4 * (j & 1);
}

// The dim of row g of m-tile i (0..7) of the values; row g + 8 is the next one.
template <int FP8>
__device__ __forceinline__ int value_dim(int i, int g) {
    return FP8 ? 16 * g + 2 * i : 64 * (i >> 2) + 8 * g + 2 * (i & 3);
}

template <int FP8, int G, int KVH, int BS, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) paged_decode(
    const u16* __restrict__ q,  // [B, H, 128] bf16, rows 16-byte aligned
    const unsigned char* __restrict__ k_cache,  // [blocks, BS, KVH, 128] e4m3 or bf16, contiguous
    const unsigned char* __restrict__ v_cache,
    u16* __restrict__ out,  // [B, H, 128] bf16
    const int* __restrict__ tables,  // [B, >= blocks] int32
    const int* __restrict__ ctx_lens,  // [B] int32, 0: a padding row
    const float* __restrict__ k_scales,  // [blocks, BS, KVH] float32, contiguous (FP8 only)
    const float* __restrict__ v_scales,
    double scale_log2,  // softmax scale * log2(e)
    int stride_qb, int stride_qh,  // in elements
    int stride_ob, int stride_oh,
    int stride_tb,
    int heads_first) {  // the grid is (KV heads, sequences), not (sequences, KV heads)
    constexpr int D = 128;
    constexpr int E = FP8 ? 1 : 2;  // bytes an element
    constexpr int KC = FP8 ? 4 : 8;  // 16-byte chunks of keys a thread copies a tile (and of values)
    constexpr int SC = FP8 ? 8 : 0;  // scales a thread copies a tile (4 key, 4 value)
    constexpr int STAGE_BYTES = (2 * KC * 16 + SC * 4) * 32;  // one warp's stage
    constexpr int SLOT = KVH * D * E;  // bytes of one slot of a block (all KV heads)
    constexpr long BLOCK = (long)BS * SLOT;
    static_assert(G >= 1 && G <= 8, "1 to 8 query heads a KV head");
    static_assert(BS % 16 == 0, "block size a multiple of 16");

    extern __shared__ u32x4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int b = heads_first ? blockIdx.y : blockIdx.x, kvh = heads_first ? blockIdx.x : blockIdx.y;
    const int ctx = ctx_lens[b];
    const int ntiles = (ctx + 15) >> 4;
    const int mine = warp < ntiles ? (ntiles - 1 - warp) / NW + 1 : 0;
    const float sl2 = (float)scale_log2;

    // Q as the scores' A fragment: row g (head kvh * G + g), k-chunk j's dims key_dim(j, t) + (0, 1)
    // and + (2, 3). The 16 dims that key_dim gives this lane come in 4 runs of 8: 16t + 64(k / 2)
    // + 8(k % 2) for FP8, 8t + 32k for bf16.
    u32 qa[8][2];
    if (g < G) {
        const u16* row = q + (long)b * stride_qb + (long)(kvh * G + g) * stride_qh;
        u32 qw[16];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            unpack(qw + 4 * k, *reinterpret_cast<const u32x4*>(row + (FP8 ? 16 * t + 64 * (k >> 1) + 8 * (k & 1) : 8 * t + 32 * k)));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (FP8) {  // e4m3 converts to f16 exactly: the score products run in f16
                qa[j][0] = pack_f16x2(bf16_lo(qw[2 * j]), bf16_hi(qw[2 * j]));
                qa[j][1] = pack_f16x2(bf16_lo(qw[2 * j + 1]), bf16_hi(qw[2 * j + 1]));
            } else {
                qa[j][0] = qw[2 * j];
                qa[j][1] = qw[2 * j + 1];
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) qa[j][0] = qa[j][1] = 0u;
    }

    // this lane's addresses in block 0, slot 0: the keys of token g from byte 16t, in 16-byte
    // chunks 64 bytes apart (token g + 8 is 8 slots on); the values of token 2t from byte 16g,
    // chunks 128 bytes apart (tokens 2t + 1, 2t + 8, 2t + 9: 1, 8, 9 slots on); the scales of
    // token 2t (the same slots on)
    const unsigned char* k_lane = k_cache + kvh * D * E + g * SLOT + 16 * t;
    const unsigned char* v_lane = v_cache + kvh * D * E + 2 * t * SLOT + 16 * g;
    const float* ks_lane = k_scales + kvh + 2 * t * KVH;
    const float* vs_lane = v_scales + kvh + 2 * t * KVH;
    const int* table = tables + (long)b * stride_tb;
    const u32 warp_smem = smem_addr(smem) + warp * STAGES * STAGE_BYTES;
    const u32 dst_lane = warp_smem + lane * 16;
    const u32 dst_scale = warp_smem + 2 * KC * 512 + lane * 4;
    constexpr int VSLOT[4] = {0, 1, 8, 9};  // tokens 2t, 2t+1, 2t+8, 2t+9 from token 2t

    // copies tile i (of this warp's sequence, in block blk) into stage s; a tile past the
    // context's end (the last one only) zero-fills the tokens it does not have
    auto issue = [&](int i, int blk, int s) {
        const int tok0 = i * 16;
        const long off = blk * BLOCK + (long)(tok0 % BS) * SLOT;
        const unsigned char* kb = k_lane + off;
        const unsigned char* vb = v_lane + off;
        const u32 dst = dst_lane + s * STAGE_BYTES;
        const int rem = ctx - tok0;  // tokens of this tile that exist, if under 16
        const bool full = rem >= 16;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int ok = (full || r * 8 + g < rem) ? 16 : 0;
#pragma unroll
            for (int c = 0; c < KC / 2; ++c) cp_async16(dst + (r * (KC / 2) + c) * 512, kb + r * 8 * SLOT + 64 * c, ok);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int ok = (full || 2 * t + VSLOT[r] < rem) ? 16 : 0;
#pragma unroll
            for (int c = 0; c < KC / 4; ++c) cp_async16(dst + (KC + r * (KC / 4) + c) * 512, vb + VSLOT[r] * SLOT + 128 * c, ok);
        }
        if (FP8) {  // keys' scales, then values'
            const long soff = (long)blk * (BS * KVH) + (tok0 % BS) * KVH;
            const u32 sdst = dst_scale + s * STAGE_BYTES;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int ok = (full || 2 * t + VSLOT[r] < rem) ? 4 : 0;
                cp_async4(sdst + r * 128, ks_lane + soff + VSLOT[r] * KVH, ok);
                cp_async4(sdst + (4 + r) * 128, vs_lane + soff + VSLOT[r] * KVH, ok);
            }
        }
    };

    float m = -__int_as_float(0x7f800000), l = 0.f;
    // FP8: the values' weights p * scale enter the f16 product over `ref`, a power of two at or
    // above every value scale this warp has read (its biased float exponent, 0 before the first
    // tile), so that they stay in f16's normal range however small the model's values are; acc
    // counts in units of ref and is rescaled when ref grows, as when the max moves
    int ref = 0;
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    // the block numbers are read one tile before their copies are issued
    int blk_next = 0;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < mine) {
            const int i = warp + NW * s;
            issue(i, table[(i * 16) / BS], s);
        }
        cp_commit();
    }
    if (STAGES - 1 < mine) blk_next = table[((warp + NW * (STAGES - 1)) * 16) / BS];

    int s_read = 0, s_write = STAGES - 1;  // the stages read and written this iteration
    for (int k = 0; k < mine; ++k) {
        const int ahead = k + STAGES - 1;
        if (ahead < mine) {
            const int blk = blk_next;
            if (ahead + 1 < mine) blk_next = table[((warp + NW * (ahead + 1)) * 16) / BS];
            issue(warp + NW * ahead, blk, s_write);
        }
        cp_commit();
        cp_wait<STAGES - 1>();

        const u32 base = dst_lane + s_read * STAGE_BYTES;
        const int tok0 = (warp + NW * k) * 16;
        s_read = s_read == STAGES - 1 ? 0 : s_read + 1;
        s_write = s_write == STAGES - 1 ? 0 : s_write + 1;

        // scores: two n-tiles of 8 tokens (g, g + 8), 8 k-chunks
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            u32 kw[2 * KC];  // this thread's 32 dims of token n * 8 + g (key_dim's)
#pragma unroll
            for (int c = 0; c < KC / 2; ++c) unpack(kw + 4 * c, lds128(base + (n * (KC / 2) + c) * 512));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                u32 b0, b1;
                if (FP8) {
                    e4m3x4_to_f16x2x2(kw[j], b0, b1);  // dims key_dim(j, t) + (0, 1), (2, 3)
                } else {
                    b0 = kw[2 * j];
                    b1 = kw[2 * j + 1];
                }
                mma<FP8>(sc[n], qa[j][0], 0u, qa[j][1], 0u, b0, b1);
            }
        }

        // online softmax of row g over this tile's tokens n * 8 + 2t + c
        float ks[4] = {1.f, 1.f, 1.f, 1.f}, vs[4] = {1.f, 1.f, 1.f, 1.f};
        if (FP8) {
            const u32 sbase = base - lane * 16 + 2 * KC * 512 + lane * 4;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                ks[r] = lds32f(sbase + r * 128);
                vs[r] = lds32f(sbase + (4 + r) * 128);
            }
        }
        float s[4];
        float tmax = -__int_as_float(0x7f800000);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int n = r >> 1, c = r & 1;
            const int tok = tok0 + n * 8 + 2 * t + c;
            s[r] = tok < ctx ? sc[n][c] * ks[r] * sl2 : -__int_as_float(0x7f800000);
            tmax = fmaxf(tmax, s[r]);
        }
        tmax = fmaxf(tmax, shfl_xor(tmax, 1));
        tmax = fmaxf(tmax, shfl_xor(tmax, 2));
        const float m_new = fmaxf(m, tmax);
        const float alpha = ex2(m - m_new);
        float p[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) p[r] = ex2(s[r] - m_new);
        l = l * alpha + (p[0] + p[1] + p[2] + p[3]);
        m = m_new;
        u32 pb0, pb1;
        float rescale = alpha;
        if (FP8) {
            // the tile's largest value scale (a token's scale is the same in every quad)
            float vmax = fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3]));
            vmax = fmaxf(vmax, shfl_xor(vmax, 1));
            vmax = fmaxf(vmax, shfl_xor(vmax, 2));
            const int ref_new = max(ref, (__float_as_int(vmax) >> 23) + 1);  // 2^(e+1) > vmax >= 2^e
            rescale *= __int_as_float(max(127 + ref - ref_new, 0) << 23);  // old ref / new ref (0 at the first)
            ref = ref_new;
            const float inv_ref = __int_as_float((254 - ref) << 23);
            pb0 = pack_f16x2(p[0] * (vs[0] * inv_ref), p[1] * (vs[1] * inv_ref));
            pb1 = pack_f16x2(p[2] * (vs[2] * inv_ref), p[3] * (vs[3] * inv_ref));
        } else {
            pb0 = pack_bf16x2(p[0], p[1]);
            pb1 = pack_bf16x2(p[2], p[3]);
        }
        // the accumulator's columns are heads 2t and 2t + 1, whose rescales live in quads 2t, 2t + 1
        // (after the first tiles a row's max rarely moves: skip the rescale when none did)
        if (any_sync(rescale != 1.f)) {
            const float a_lo = shfl_idx(rescale, 8 * t), a_hi = shfl_idx(rescale, 8 * t + 4);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[i][0] *= a_lo;
                acc[i][1] *= a_hi;
                acc[i][2] *= a_lo;
                acc[i][3] *= a_hi;
            }
        }

        // values: tokens 2t, 2t+1, 2t+8, 2t+9; word i of a token: dims value_dim(i, g) and the next
        // (bf16), or word i / 2's bytes: dims value_dim(2 * (i / 2), g) .. + 4 (FP8)
        u32 vw[4][KC];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int c = 0; c < KC / 4; ++c) unpack(vw[r] + 4 * c, lds128(base + (KC + r * (KC / 4) + c) * 512));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // m-tile i: dims value_dim(i, g) (row g) and the next (row g + 8)
            u32 a0, a1, a2, a3;
            if (FP8) {
                const int w = i >> 1;
                const u32 sel = (i & 1) ? 0x7362u : 0x5140u;  // bytes (2i, 2i+1) of the word pair, interleaved
                e4m3x4_to_f16x2x2(prmt(vw[0][w], vw[1][w], sel), a0, a1);
                e4m3x4_to_f16x2x2(prmt(vw[2][w], vw[3][w], sel), a2, a3);
            } else {
                a0 = prmt(vw[0][i], vw[1][i], 0x5410u);
                a1 = prmt(vw[0][i], vw[1][i], 0x7632u);
                a2 = prmt(vw[2][i], vw[3][i], 0x5410u);
                a3 = prmt(vw[2][i], vw[3][i], 0x7632u);
            }
            mma<FP8>(acc[i], a0, a1, a2, a3, pb0, pb1);
        }
    }
    cp_wait<0>();
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);  // row g's sum, in every lane of quad g
    const float unit = FP8 ? __int_as_float(ref << 23) : 1.f;  // what acc counts in
    if (NW == 1) {
        const float l_lo = shfl_idx(l, 8 * t), l_hi = shfl_idx(l, 8 * t + 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int head = 2 * t + h;
            if (head < G) {
                const float den = h ? l_hi : l_lo;
                const float inv = den > 0.f ? unit / den : 0.f;
                u16* dst = out + (long)b * stride_ob + (long)(kvh * G + head) * stride_oh;
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    *reinterpret_cast<u32*>(dst + value_dim<FP8>(i, g)) = pack_bf16x2(acc[i][h] * inv, acc[i][2 + h] * inv);
            }
        }
        return;
    }

    // NW warps: each writes its max, sum and [8 heads, 128] accumulator, then the CTA combines them
    __syncthreads();
    float* fbuf = reinterpret_cast<float*>(smem);
    float* mbuf = fbuf;  // [NW][8]
    float* lbuf = fbuf + NW * 8;  // [NW][8]
    float* obuf = fbuf + NW * 16;  // [NW][8][128]
    if (t == 0) {
        mbuf[warp * 8 + g] = m;
        lbuf[warp * 8 + g] = l;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float* o = obuf + warp * 8 * D;
        const int d = value_dim<FP8>(i, g);
        o[(2 * t) * D + d] = acc[i][0] * unit;
        o[(2 * t + 1) * D + d] = acc[i][1] * unit;
        o[(2 * t) * D + d + 1] = acc[i][2] * unit;
        o[(2 * t + 1) * D + d + 1] = acc[i][3] * unit;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += NW * 32) {
        const int head = e / D, d = e % D;
        float mx = -__int_as_float(0x7f800000);
#pragma unroll
        for (int w = 0; w < NW; ++w) mx = fmaxf(mx, mbuf[w * 8 + head]);
        float num = 0.f, den = 0.f;
        if (mx != -__int_as_float(0x7f800000)) {
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float f = ex2(mbuf[w * 8 + head] - mx);
                num += f * obuf[(w * 8 + head) * D + d];
                den += f * lbuf[w * 8 + head];
            }
        }
        const float v = den > 0.f ? num / den : 0.f;
        out[(long)b * stride_ob + (long)(kvh * G + head) * stride_oh + d] = (u16)(pack_bf16x2(v, 0.f) & 0xffffu);
    }
}
