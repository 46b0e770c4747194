// Runs src/polyrl/engine/kernels/paged_decode.cu on the host: one launch read from a file,
// every CTA in turn, each of its lanes a thread (paged_decode_host.h has the instructions).
// Built by tests/test_cuda_ops.py with the address sanitizer and the variants it needs:
//   g++ -std=c++20 -pthread -fsanitize=address,undefined -I<kernels> -I<this folder>
//       -DPAGED_DECODE_HOST '-DVARIANTS=V(1, 2, 2, 16, 1, 3) ...' run_paged_decode.cpp
// Usage: run_paged_decode IN OUT. IN: 14 int64 (fp8, group, KV heads, block size, warps,
// stages, sequences, query heads, blocks, table width, q's sequence and head strides,
// shared bytes, heads first), the float64 scale_log2, then q (bf16, sequences x its stride), the keys
// and the values ([blocks, block size, KV heads, 128]), the tables (int32), the context
// lengths (int32) and for FP8 the key and value scales (float32). OUT: [sequences, query
// heads, 128] bf16.

#include <sanitizer/asan_interface.h>

#include <cstdint>
#include <cstdio>
#include <new>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__
#define __align__(n) alignas(n)

#include "paged_decode.cu"

namespace {

struct Launch {
    int64_t fp8, group, kv_heads, block_size, warps, stages, seqs, heads, blocks, table_width, stride_qb, stride_qh,
        smem, heads_first;
    double scale_log2;
};

// an exact-size heap buffer (the sanitizer then reports a read one byte past it), 16-byte aligned
template <class T>
T* read(FILE* f, size_t count) {
    T* p = static_cast<T*>(::operator new[](count * sizeof(T) + (count == 0), std::align_val_t(16)));
    if (count && std::fread(p, sizeof(T), count, f) != count) {
        std::fprintf(stderr, "run_paged_decode: the input ends early\n");
        std::exit(2);
    }
    return p;
}

template <int FP8, int G, int KVH, int BS, int NW, int ST>
void run(const Launch& L, const u16* q, const unsigned char* k, const unsigned char* v, u16* out, const int* tables,
         const int* ctx, const float* ks, const float* vs) {
    host::shared_bytes = (int)L.smem;
    for (int b = 0; b < L.seqs; ++b) {
        for (int h = 0; h < KVH; ++h) {
            host::Cta cta(NW * 32);
            host::cta = &cta;
            ASAN_UNPOISON_MEMORY_REGION(smem, host::SHARED_MAX);
            std::memset(smem, 0xff, host::SHARED_MAX);  // what was left by another CTA
            ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(smem) + L.smem, host::SHARED_MAX - L.smem);
            std::vector<std::thread> lanes;
            for (int i = 0; i < NW * 32; ++i) {
                lanes.emplace_back([&, i] {
                    threadIdx.x = i;
                    blockIdx.x = L.heads_first ? h : b;
                    blockIdx.y = L.heads_first ? b : h;
                    paged_decode<FP8, G, KVH, BS, NW, ST>(q, k, v, out, tables, ctx, ks, vs, L.scale_log2,
                                                          (int)L.stride_qb, (int)L.stride_qh, (int)(L.heads * 128),
                                                          128, (int)L.table_width, (int)L.heads_first);
                    if (!host::inflight.empty() || host::uncommitted) host::die("copies still in flight at the end");
                });
            }
            for (auto& t : lanes) t.join();
        }
    }
    ASAN_UNPOISON_MEMORY_REGION(smem, host::SHARED_MAX);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: run_paged_decode IN OUT\n");
        return 2;
    }
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    Launch L;
    if (std::fread(&L, 8, 15, f) != 15) return 2;
    if (L.smem > host::SHARED_MAX) {
        std::fprintf(stderr, "run_paged_decode: %lld bytes of shared memory, over the host's %d\n", (long long)L.smem,
                     host::SHARED_MAX);
        return 2;
    }
    const size_t elem = L.fp8 ? 1 : 2, slots = (size_t)L.blocks * L.block_size * L.kv_heads;
    const u16* q = read<u16>(f, (size_t)L.seqs * L.stride_qb);
    const unsigned char* k = read<unsigned char>(f, slots * 128 * elem);
    const unsigned char* v = read<unsigned char>(f, slots * 128 * elem);
    const int* tables = read<int>(f, (size_t)L.seqs * L.table_width);
    const int* ctx = read<int>(f, (size_t)L.seqs);
    // a bf16 cache has no scales: the kernel gets q's address there, as from cuda_ops, and reads nothing
    const float* ks = L.fp8 ? read<float>(f, slots) : reinterpret_cast<const float*>(q);
    const float* vs = L.fp8 ? read<float>(f, slots) : reinterpret_cast<const float*>(q);
    std::fclose(f);
    const size_t n_out = (size_t)L.seqs * L.heads * 128;
    u16* out = static_cast<u16*>(::operator new[](n_out * 2, std::align_val_t(16)));
    std::memset(out, 0xff, n_out * 2);  // NaN where the kernel writes nothing

    bool found = false;
#define V(FP8, G, KVH, BS, NW, ST)                                                                              \
    if (!found && L.fp8 == FP8 && L.group == G && L.kv_heads == KVH && L.block_size == BS && L.warps == NW && \
        L.stages == ST) {                                                                                       \
        found = true;                                                                                           \
        run<FP8, G, KVH, BS, NW, ST>(L, q, k, v, out, tables, ctx, ks, vs);                                     \
    }
    VARIANTS
#undef V
    if (!found) {
        std::fprintf(stderr, "run_paged_decode: this variant was not compiled in\n");
        return 2;
    }
    FILE* o = std::fopen(argv[2], "wb");
    if (!o || std::fwrite(out, 2, n_out, o) != n_out) return 2;
    std::fclose(o);
    return 0;
}
