"""Paged decode attention as a CUDA C++ kernel (`kernels/paged_decode.cu`), compiled when
the engine starts by NVRTC: no compiler, CUDA toolkit or build step on the machine, only
the NVRTC library that CUDA builds of torch depend on (and load). The kernel includes no
header, so it compiles where torch's own entry point (`torch.cuda._compile_kernel`, which
asks for a toolkit's headers) would not; the compiled cubin is loaded through torch.

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

import ctypes
import functools
import importlib.resources
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch

HEAD_DIM = 128
MAX_GROUP = 8

TILES: dict[bool, tuple[int, int]] = {False: (1, 3), True: (1, 3)}
"""(warps, stages) by FP8 cache: the warps of a (sequence, KV head) program, each reading
every warps-th tile of 16 tokens, and the tiles a warp has in flight plus one."""


HEADS_FIRST = False
"""Launch the programs each sequence's KV heads side by side (grid (KV heads, sequences)),
as `triton_ops.DECODE_HEADS_FIRST` does for Triton's kernel."""


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
    return None


def smem_bytes(fp8: bool, warps: int, stages: int) -> int:
    """A program's shared memory: each warp's stages of copied tiles, or, once the loop is
    done, each warp's softmax state and [8 heads, 128] output to combine (the larger)."""
    chunks = 4 if fp8 else 8  # 16-byte pieces of keys a lane copies a tile (and of values)
    scales = 8 if fp8 else 0
    stage = (2 * chunks * 16 + scales * 4) * 32
    return warps * max(stages * stage, (16 + 8 * HEAD_DIM) * 4)


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library: the one torch loaded (CUDA builds of torch load it and its
    builtins at import), else the nvidia-cuda-nvrtc wheel's (a box without a GPU that only
    compiles, as the tests do)."""
    major = (torch.version.cuda or "13").split(".")[0]
    try:
        return ctypes.CDLL(f"libnvrtc.so.{major}")
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for folder in (Path(root) / f"cu{major}" / "lib", Path(root) / "cuda_nvrtc" / "lib"):
            if (folder / f"libnvrtc.so.{major}").exists():
                # NVRTC opens its builtins by name, which finds them once they are loaded
                for builtins in sorted(folder.glob(f"libnvrtc-builtins.so.{major}.*")):
                    if ".alt." not in builtins.name:
                        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(str(folder / f"libnvrtc.so.{major}"))
    raise OSError(f"no NVRTC library (libnvrtc.so.{major}): CUDA builds of torch bring one")


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    symbol: str  # the instantiation's mangled name in the cubin
    log: str  # NVRTC's and ptxas's messages (registers, spills)


def kernel_name(fp8: bool, group: int, num_kv_heads: int, block_size: int, warps: int, stages: int) -> str:
    return f"paged_decode<{int(fp8)}, {group}, {num_kv_heads}, {block_size}, {warps}, {stages}>"


def compile_cubin(name: str, arch: str) -> Compiled:
    """One instantiation (`kernel_name`) compiled for `arch` ("90" for sm_90)."""
    lib = nvrtc()

    def check(result: int) -> None:
        if result:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(result).decode()}")

    program = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(program), source().encode(), b"paged_decode.cu", 0, None, None))
    try:
        check(lib.nvrtcAddNameExpression(program, name.encode()))
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
        result = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if result:
            raise RuntimeError(f"NVRTC could not compile {name} for sm_{arch}:\n{log.value.decode()}")
        check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(program, cubin))
        symbol = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(symbol)))
        return Compiled(cubin.raw, symbol.value.decode(), log.value.decode())
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@functools.cache
def _kernel(device: int, fp8: bool, group: int, num_kv_heads: int, block_size: int, warps: int, stages: int):
    """One variant, compiled for and loaded on GPU `device` (a module belongs to one)."""
    from torch.cuda._utils import _cuda_load_module

    major, minor = torch.cuda.get_device_capability(device)
    compiled = compile_cubin(kernel_name(fp8, group, num_kv_heads, block_size, warps, stages), f"{major}{minor}")
    with torch.cuda.device(device):
        kernel = _cuda_load_module(compiled.cubin, [compiled.symbol])[compiled.symbol]
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
    heads_first: bool | None = None,
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
    heads_first = HEADS_FIRST if heads_first is None else heads_first
    heads_first = heads_first and num_seqs < 2**16  # a grid's second size is at most 65,535
    kernel(
        grid=(num_kv_heads, num_seqs, 1) if heads_first else (num_seqs, num_kv_heads, 1),
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
            int(heads_first),
        ],
    )
    return out
