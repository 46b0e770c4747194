// The CPU's versions of paged_decode.cu's instructions: with them, run_paged_decode.cpp
// runs the kernel's own source on the host, one thread a lane, so that its indexing, its
// fragments and its copies are checked on a machine without a GPU (tests/test_cuda_ops.py).
//
// What each stands for (PTX ISA):
// * mma.sync m16n8k16: the 32 lanes' fragments are gathered and the 16x16 by 16x8 product
//   computed in float; A's rows g and g + 8 and B's columns g come from lane 4g + t, whose
//   registers hold the pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of the k dimension.
// * shfl / vote: every lane of the warp must be at the same instruction; a lane that is not
//   stops the run with a message rather than reading a stale value.
// * cp.async: the destination reads as NaN bytes from the issue until cp.async.wait_group
//   retires the group, which is when the bytes land (zeros past src-size). A read of a
//   stage before its wait, or a copy into a stage still to be read, then shows as NaN.
// * shared memory: one buffer for the CTA, NaN bytes at its start, poisoned for the address
//   sanitizer past the launch's size, every access checked against that size.
// * conversions round to nearest even as the hardware's .rn; ex2.approx is exp2f.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

struct HostDim3 {
    int x = 0, y = 0, z = 0;
};
inline thread_local HostDim3 threadIdx, blockIdx;

namespace host {

constexpr int SHARED_MAX = 4 * 4 * 8192;  // the largest launch the tests make (bf16, 4 warps, 4 stages)

[[noreturn]] inline void die(const char* what) {
    std::fprintf(stderr, "paged_decode on the host: %s (block %d,%d thread %d)\n", what, blockIdx.x, blockIdx.y,
                 threadIdx.x);
    std::fflush(stderr);
    std::abort();
}

struct Warp {
    std::barrier<> sync{32};
    int op[32];
    u32 word[32][6];
};

struct Cta {
    std::vector<std::unique_ptr<Warp>> warps;
    std::barrier<> all;
    explicit Cta(int threads) : all(threads) {
        for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    }
};

inline Cta* cta = nullptr;
inline int shared_bytes = 0;

struct Copy {
    u32 dst;
    const void* src;
    int size, bytes;
};
inline thread_local std::vector<Copy> inflight;  // issued, oldest first
inline thread_local std::vector<int> groups;  // copies in each committed group, oldest first
inline thread_local int uncommitted = 0;

inline u32 bits(float x) {
    u32 u;
    std::memcpy(&u, &x, 4);
    return u;
}

inline float from_bits(u32 u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

inline float f16_to_float(u32 h) {
    _Float16 v;
    const unsigned short s = (unsigned short)h;
    std::memcpy(&v, &s, 2);
    return (float)v;
}

inline u32 float_to_f16(float x) {
    const _Float16 v = (_Float16)x;  // round to nearest even
    unsigned short s;
    std::memcpy(&s, &v, 2);
    return s;
}

inline u32 float_to_bf16(float x) {
    const u32 u = bits(x);
    if (std::isnan(x)) return 0x7fff;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

inline float e4m3_to_float(u32 byte) {
    const int sign = byte & 0x80, exp = (byte >> 3) & 0xf, man = byte & 7;
    float v;
    if (exp == 0xf && man == 7)
        v = NAN;
    else if (exp == 0)
        v = std::ldexp((float)man, -9);  // subnormal: man / 8 * 2^-6
    else
        v = std::ldexp(1.f + man / 8.f, exp - 7);
    return sign ? -v : v;
}

inline unsigned char* shared();

inline void check_shared(u32 addr, int size) {
    if ((long)addr + size > shared_bytes) die("shared memory read or written past the launch's size");
}

// Every lane of the warp deposits its words for instruction `op`, then sees all 32 deposits;
// `release` lets the warp go on once each lane has read what it needs.
inline const u32 (*exchange(int op, std::initializer_list<u32> words))[6] {
    Warp& w = *cta->warps[threadIdx.x >> 5];
    const int lane = threadIdx.x & 31;
    w.op[lane] = op;
    int i = 0;
    for (u32 x : words) w.word[lane][i++] = x;
    w.sync.arrive_and_wait();
    for (int l = 0; l < 32; ++l)
        if (w.op[l] != op) die("the lanes of a warp reached different warp-wide instructions");
    return w.word;
}

inline void release() { cta->warps[threadIdx.x >> 5]->sync.arrive_and_wait(); }

enum Op { MMA_BF16 = 1, MMA_F16, SHFL, VOTE };

inline void land(const Copy& c) {
    std::memset(shared() + c.dst, 0, c.size);
    if (c.bytes) std::memcpy(shared() + c.dst, c.src, c.bytes);
}

}  // namespace host

// the kernel's shared memory (`extern __shared__ u32x4 smem[]`)
alignas(16) inline u32x4 smem[host::SHARED_MAX / 16];

inline unsigned char* host::shared() { return reinterpret_cast<unsigned char*>(smem); }

inline void __syncthreads() { host::cta->all.arrive_and_wait(); }
inline float __uint_as_float(u32 u) { return host::from_bits(u); }
inline float __int_as_float(int i) { return host::from_bits((u32)i); }
inline int __float_as_int(float x) { return (int)host::bits(x); }
using std::max;

inline u32 smem_addr(const void* p) {
    const long off = static_cast<const unsigned char*>(p) - host::shared();
    if (off < 0 || off > host::SHARED_MAX) host::die("an address outside shared memory taken as a shared one");
    return (u32)off;
}

inline void cp_async(u32 dst, const void* src, int size, int bytes) {
    if (bytes != 0 && bytes != size) host::die("cp.async with a src-size other than 0 or the whole copy");
    if (dst % size) host::die("cp.async to a misaligned shared address");
    if ((unsigned long)src % size) host::die("cp.async from a misaligned global address");
    host::check_shared(dst, size);
    std::memset(host::shared() + dst, 0xff, size);  // in flight: NaN until its group is waited for
    host::inflight.push_back({dst, src, size, bytes});
    ++host::uncommitted;
}

inline void cp_async16(u32 dst, const void* src, int bytes) { cp_async(dst, src, 16, bytes); }
inline void cp_async4(u32 dst, const void* src, int bytes) { cp_async(dst, src, 4, bytes); }

inline void cp_commit() {
    host::groups.push_back(host::uncommitted);
    host::uncommitted = 0;
}

template <int N>
inline void cp_wait() {
    while ((int)host::groups.size() > N) {
        for (int i = 0; i < host::groups.front(); ++i) {
            host::land(host::inflight.front());
            host::inflight.erase(host::inflight.begin());
        }
        host::groups.erase(host::groups.begin());
    }
}

template <class T>
inline T load_shared(u32 addr, const char* misaligned) {
    if (addr % sizeof(T)) host::die(misaligned);
    host::check_shared(addr, sizeof(T));
    T v;
    std::memcpy(&v, host::shared() + addr, sizeof(T));
    return v;
}

inline u32x4 lds128(u32 addr) { return load_shared<u32x4>(addr, "ld.shared.v4 from a misaligned address"); }
inline float lds32f(u32 addr) { return load_shared<float>(addr, "ld.shared.f32 from a misaligned address"); }

inline u32 prmt(u32 a, u32 b, u32 sel) {
    const unsigned long long src = ((unsigned long long)b << 32) | a;
    u32 d = 0;
    for (int i = 0; i < 4; ++i) {
        const u32 nib = (sel >> (4 * i)) & 0xf;
        u32 byte = (src >> (8 * (nib & 7))) & 0xff;
        if (nib & 8) byte = (byte & 0x80) ? 0xff : 0;  // sign replication
        d |= byte << (8 * i);
    }
    return d;
}

// cvt.rn.f16x2.e4m3x2: the low byte becomes the low half
inline void e4m3x4_to_f16x2x2(u32 x, u32& lo, u32& hi) {
    auto pair = [](u32 two) {
        return host::float_to_f16(host::e4m3_to_float(two & 0xff)) |
               (host::float_to_f16(host::e4m3_to_float((two >> 8) & 0xff)) << 16);
    };
    lo = pair(x & 0xffff);
    hi = pair(x >> 16);
}

inline u32 pack_f16x2(float lo, float hi) { return host::float_to_f16(lo) | (host::float_to_f16(hi) << 16); }
inline u32 pack_bf16x2(float lo, float hi) { return host::float_to_bf16(lo) | (host::float_to_bf16(hi) << 16); }

inline float ex2(float x) { return std::exp2f(x); }

inline float shfl_xor(float x, int m) {
    const auto w = host::exchange(host::SHFL, {host::bits(x)});
    const float y = host::from_bits(w[(threadIdx.x & 31) ^ (m & 31)][0]);
    host::release();
    return y;
}

inline float shfl_idx(float x, int lane) {
    const auto w = host::exchange(host::SHFL, {host::bits(x)});
    const float y = host::from_bits(w[lane & 31][0]);
    host::release();
    return y;
}

inline bool any_sync(bool p) {
    const auto w = host::exchange(host::VOTE, {(u32)p});
    bool any = false;
    for (int l = 0; l < 32; ++l) any |= w[l][0] != 0;
    host::release();
    return any;
}

template <int FP8>
inline void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const auto w = host::exchange(FP8 ? host::MMA_F16 : host::MMA_BF16, {a0, a1, a2, a3, b0, b1});
    auto half = [](u32 word, int k) {
        const u32 h = (k & 1) ? word >> 16 : word & 0xffff;
        return FP8 ? host::f16_to_float(h) : host::from_bits(h << 16);
    };
    // A[r][k]: lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8); B[k][n]: lane
    // 4n + (k % 8) / 2, register 4 + (k >= 8)
    auto A = [&](int r, int k) { return half(w[4 * (r & 7) + ((k & 7) >> 1)][(r >= 8) + 2 * (k >= 8)], k); };
    auto B = [&](int k, int n) { return half(w[4 * n + ((k & 7) >> 1)][4 + (k >= 8)], k); };
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float d[4];
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        float sum = c[i];
        for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
        d[i] = sum;
    }
    host::release();
    for (int i = 0; i < 4; ++i) c[i] = d[i];
}
