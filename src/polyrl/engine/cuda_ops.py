"""Paged decode attention as a CUDA C++ kernel (`kernels/paged_decode.cu`), compiled when
the engine starts by NVRTC through torch (`torch.cuda._compile_kernel`): no compiler and
no build step on the machine, only the NVRTC library that CUDA builds of torch depend on.

Why a kernel beside Triton's (`triton_ops.paged_decode_attention`): reading an FP8 cache,
the Triton loops pad a KV head's one or two query heads to a 16-row tensor-core tile or do
every product on the CUDA cores, and their loads hang off the block table unpipelined;
they read an FP8 cache at 2.0-3.1 TB/s on an H200 where the bf16 loop reads 3.8-4.3
(BENCHMARKS.md). This kernel puts the tokens on the tiles' long side instead (keys as the
score product's B operand, values transposed through the fragments' registers), converts
e4m3 pairs to f16 pairs in one instruction each, and copies each tile into shared memory
several tiles ahead (cp.async). It serves head size 128, up to 8 query heads a KV head,
block sizes that are multiples of 16, and bf16 or e4m3 caches laid out as the engine's;
`unsupported` says why not otherwise, and the engine then keeps Triton's kernel.
"""

from __future__ import annotations

import functools
import importlib.resources
import math

import torch

HEAD_DIM = 128
MAX_GROUP = 8

TILES: dict[bool, tuple[int, int]] = {False: (1, 3), True: (1, 3)}
"""(warps, stages) by FP8 cache: the warps of a (sequence, KV head) program, each reading
every warps-th tile of 16 tokens, and the tiles a warp has in flight plus one."""


def source() -> str:
    return importlib.resources.files("polyrl.engine").joinpath("kernels/paged_decode.cu").read_text()


def unsupported(
    device: torch.device, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, cache_dtype: torch.dtype
) -> str | None:
    """Why the kernel cannot serve this model's attention and cache here, or None."""
    if device.type != "cuda":
        return f"it runs on CUDA devices, not {device.type}"
    if head_dim != HEAD_DIM:
        return f"it needs a head size of {HEAD_DIM} (the model's is {head_dim})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"it serves 1 to {MAX_GROUP} query heads a KV head (the model has {num_heads} over {num_kv_heads})"
    if block_size % 16:
        return f"it needs engine.block_size a multiple of 16 (it is {block_size})"
    if cache_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return f"it reads bf16 or FP8 (e4m3) caches, not {cache_dtype}"
    capability = torch.cuda.get_device_capability(device)
    needed = (8, 9) if cache_dtype == torch.float8_e4m3fn else (8, 0)
    if capability < needed:
        return (
            f"it needs compute capability {needed[0]}.{needed[1]} or newer for this cache (the GPU's is {capability})"
        )
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no NVRTC entry point (torch.cuda._compile_kernel, torch 2.8+)"
    return None


def smem_bytes(fp8: bool, warps: int, stages: int) -> int:
    """A program's shared memory: each warp's stages of copied tiles, or, once the loop is
    done, each warp's softmax state and [8 heads, 128] output to combine (the larger)."""
    chunks = 4 if fp8 else 8  # 16-byte pieces of keys a lane copies a tile (and of values)
    scales = 8 if fp8 else 0
    stage = (2 * chunks * 16 + scales * 4) * 32
    return warps * max(stages * stage, (16 + 8 * HEAD_DIM) * 4)


@functools.cache
def _kernel(device: int, fp8: bool, group: int, num_kv_heads: int, block_size: int, warps: int, stages: int):
    """One variant, compiled for and loaded on GPU `device` (a module belongs to one)."""
    name = f"paged_decode<{int(fp8)}, {group}, {num_kv_heads}, {block_size}, {warps}, {stages}>"
    with torch.cuda.device(device):
        kernel = torch.cuda._compile_kernel(source(), name)
        smem = smem_bytes(fp8, warps, stages)
        kernel.set_shared_memory_config(smem)
    return kernel, smem


def compile_for(device: torch.device, fp8: bool, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """Compile the engine's variant now (under a second), so that a failure shows at start
    and nothing compiles while CUDA graphs are captured."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _kernel(index, fp8, num_heads // num_kv_heads, num_kv_heads, block_size, *TILES[fp8])


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, 128]
    k_cache: torch.Tensor,  # [NBLK, BS, KVH, 128] bf16 or e4m3, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= max blocks] int32
    context_lens: torch.Tensor,  # [B] int32; 0 = a padding row (output zeros)
    scale: float,
    k_scales: torch.Tensor | None = None,  # [NBLK, BS, KVH] float32, contiguous: an FP8 cache's scales
    v_scales: torch.Tensor | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> torch.Tensor:  # [B, H, 128] bf16
    """`triton_ops.paged_decode_attention`'s contract, for what `unsupported` accepts."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fp8 = k_scales is not None
    default_warps, default_stages = TILES[fp8]
    warps, stages = warps or default_warps, stages or default_stages
    q = q.to(torch.bfloat16)
    if q.stride(-1) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        q = q.contiguous()  # the kernel reads each row as 16-byte vectors
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.bfloat16, device=q.device)
    if num_seqs == 0:
        return out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the CUDA decode kernel reads contiguous [blocks, block_size, KV heads, 128] caches")
    if fp8 and not (k_scales.is_contiguous() and v_scales.is_contiguous()):
        raise ValueError("the CUDA decode kernel reads contiguous [blocks, block_size, KV heads] scales")
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    kernel, smem = _kernel(device, fp8, num_heads // num_kv_heads, num_kv_heads, block_size, warps, stages)
    kernel(
        grid=(num_seqs, num_kv_heads, 1),
        block=(warps * 32, 1, 1),
        shared_mem=smem,
        stream=torch.cuda.current_stream(q.device),
        args=[
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            context_lens,
            k_scales if fp8 else q,  # never read for a bf16 cache
            v_scales if fp8 else q,
            float(scale / math.log(2.0)),  # the kernel's exponentials are base 2
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
        ],
    )
    return out
