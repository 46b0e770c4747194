"""The CUDA decode kernel (`engine.attention_backend`, `polyrl/engine/cuda_ops.py`).

On CPU: the kernel's source ships with the package and compiles (NVRTC, from the test
extra's nvidia-cuda-nvrtc) for Hopper and Ada with nothing spilled, the reasons it gives
for what it does not serve, and the refusals. On a GPU (`gpu` tests, skipped elsewhere): its output against
a float32 attention over the same (dequantized) cache, at the contexts where a tile is
partial or empty, and an engine on it against an engine on Triton's kernel."""

from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fp8 import bf16_logprobs, generate  # noqa: E402  (benchmarks/fp8.py)

from polyrl.config import ConfigError, EngineConfig, TinyModelConfig, load_config
from polyrl.engine import cuda_ops, triton_ops
from polyrl.engine.engine import Engine
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.sampling import SamplingParams

HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU of compute capability 8.9+")


def _has_nvrtc() -> bool:
    try:
        cuda_ops.nvrtc()
    except OSError:
        return False
    return True


nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="needs NVRTC (the test extra's nvidia-cuda-nvrtc)")


def test_the_kernel_source_ships_with_the_package() -> None:
    text = cuda_ops.source()
    assert "paged_decode(" in text and "mma.sync.aligned.m16n8k16" in text


@nvrtc
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_the_kernel_compiles_for_hopper_and_ada_with_nothing_spilled(fp8: bool, group: int) -> None:
    """What the engine compiles at start (its tile, and four warps a sequence), for the
    architectures `unsupported` lets through."""
    for warps, stages in (cuda_ops.TILES[fp8], (4, 3)):
        for arch in ("90", "89") if fp8 else ("90", "89", "80"):
            compiled = cuda_ops.compile_cubin(cuda_ops.kernel_name(fp8, group, 8, 16, warps, stages), arch)
            assert compiled.cubin[:4] == b"\x7fELF" and compiled.symbol.startswith("_Z12paged_decode")
            spills = [line for line in compiled.log.splitlines() if "spill" in line]
            assert spills and all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), spills


@nvrtc
def test_an_instantiation_the_kernel_does_not_serve_fails_to_compile_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match="1 to 8 query heads a KV head"):
        cuda_ops.compile_cubin(cuda_ops.kernel_name(True, 16, 2, 16, 1, 3), "90")
    with pytest.raises(RuntimeError, match="block size a multiple of 16"):
        cuda_ops.compile_cubin(cuda_ops.kernel_name(False, 2, 8, 8, 1, 3), "90")


@pytest.mark.parametrize(
    "head_dim,heads,kv_heads,block_size,dtype,why",
    [
        (64, 8, 4, 16, torch.bfloat16, "head size of 128"),
        (128, 32, 2, 16, torch.bfloat16, "1 to 8 query heads a KV head"),
        (128, 6, 4, 16, torch.bfloat16, "1 to 8 query heads a KV head"),
        (128, 8, 4, 8, torch.bfloat16, "multiple of 16"),
        (128, 8, 4, 16, torch.float16, "bf16 or FP8"),
    ],
)
def test_what_the_kernel_does_not_serve_is_named(head_dim, heads, kv_heads, block_size, dtype, why) -> None:
    # the shape is checked before the device is asked anything, so a CPU box can check it
    assert why in cuda_ops.unsupported(torch.device("cuda"), head_dim, heads, kv_heads, block_size, dtype)
    assert "CUDA devices" in cuda_ops.unsupported(torch.device("cpu"), 128, 8, 4, 16, torch.bfloat16)


def test_the_config_refuses_the_cuda_kernel_on_a_cpu_engine() -> None:
    with pytest.raises(ConfigError, match="attention_backend"):
        load_config(None, ["engine.device=cpu", "engine.attention_backend=cuda"])
    with pytest.raises(ConfigError, match="attention_backend"):
        load_config(None, ["engine.attention_backend=flashinfer"])
    assert load_config(None, ["engine.attention_backend=cuda"]).engine.attention_backend == "cuda"
    assert EngineConfig().attention_backend == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine's device resolves to CUDA here")
def test_a_cpu_engine_on_auto_decodes_and_on_cuda_is_refused(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model", TinyModelConfig())
    engine = Engine.from_pretrained(str(model_dir), EngineConfig(num_kv_blocks=16, attention_backend="auto"))
    assert engine.runner.decode_attention is triton_ops.paged_decode_attention
    [[(ids, _)]] = generate(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(ids) == 4
    # engine.device = "auto" resolves to the CPU only when the engine starts
    with pytest.raises(ValueError, match="attention_backend = 'cuda'.*CUDA devices"):
        Engine.from_pretrained(str(model_dir), EngineConfig(num_kv_blocks=16, attention_backend="cuda"))


def _cache(
    heads: int,
    kv_heads: int,
    contexts: list[int],
    fp8: bool,
    block_size: int,
    seed: int,
    device: str = "cuda",
    value_size: float = 1.0,
    q_rows: int = 0,
):
    """A random cache in the engine's layout, each sequence's blocks scattered, and the
    float32 values it stands for. `value_size`: the values' standard deviation; `q_rows`:
    the query's rows of each sequence (q a view of its first `heads`, as of a fused
    projection's output), at least `heads`."""
    num_seqs = len(contexts)
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks) + 4
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(num_seqs, max(blocks) + 2, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    q = (torch.randn(num_seqs, max(q_rows, heads), 128, generator=g) * 2).to(device, torch.bfloat16)[:, :heads]
    k = torch.randn(num_blocks, block_size, kv_heads, 128, generator=g).to(device) * 1.5
    v = torch.randn(num_blocks, block_size, kv_heads, 128, generator=g).to(device) * value_size
    scales = {}
    if fp8:
        ks, vs = k.abs().amax(-1) / 448, v.abs().amax(-1) / 448
        k, v = (k / ks[..., None]).to(torch.float8_e4m3fn), (v / vs[..., None]).to(torch.float8_e4m3fn)
        kf, vf = k.float() * ks[..., None], v.float() * vs[..., None]
        scales = {"k_scales": ks, "v_scales": vs}
    else:
        k, v = k.bfloat16(), v.bfloat16()
        kf, vf = k.float(), v.float()
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k, v, tables.to(device), ctx, scales, kf, vf


def _reference(q, kf, vf, tables, contexts, scale):
    out = torch.zeros(q.shape, device=q.device)
    block_size, kv_heads = kf.shape[1], kf.shape[2]
    group = q.shape[1] // kv_heads
    for b, n in enumerate(contexts):
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        blocks = tables[b, tok // block_size].long()
        keys = kf[blocks, tok % block_size].repeat_interleave(group, dim=1)  # [n, H, D]
        values = vf[blocks, tok % block_size].repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, values)
    return out


# The kernel's own source run on the CPU (tests/cuda_host/): each lane a thread, the
# warp-wide instructions gathering their lanes, the copies landing only when waited for,
# under the address and undefined-behaviour sanitizers (and the thread sanitizer for the
# warps' merge). It checks the indexing, fragments, copies and the merge of every variant
# below on a box without a GPU; what it cannot check is the hardware's own behaviour (the
# instructions' semantics are taken from the PTX manual) and the speed.

HOST_TILES = [(1, 1), (1, 3), (2, 2), (4, 4)]  # (warps, stages): none ahead, the engine's, merged warps
HOST_SHAPES = [(2, 16), (8, 32), (2, 48)]  # (query heads a KV head, block size) run in the fast tier
HOST_SHAPES_SLOW = [(1, 16), (4, 16), (8, 16), (1, 32), (2, 32), (4, 32)]
HOST_VARIANTS = [
    (fp8, group, 2, block_size, warps, stages)
    for fp8 in (False, True)
    for group, block_size in HOST_SHAPES + HOST_SHAPES_SLOW
    for warps, stages in HOST_TILES
]
HOST_VARIANTS_RACES = [(True, 2, 2, 16, 4, 4), (False, 8, 2, 32, 2, 2)]  # several warps, merged through shared memory
HOST_DIR = Path(__file__).resolve().parent / "cuda_host"


def _build_on_host(folder: Path, variants: list[tuple], sanitizers: list[str]) -> Path:
    """run_paged_decode.cpp built with `variants` under `sanitizers` (g++'s -fsanitize=...)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to build the kernel's source for the host")
    binary = folder / "run_paged_decode"
    listed = " ".join(f"V({int(f)}, {g}, {h}, {bs}, {w}, {st})" for f, g, h, bs, w, st in variants)
    command = [
        compiler,
        "-std=c++20",
        "-O1" if "thread" in sanitizers else "-O0",
        "-pthread",
        *[f"-fsanitize={name}" for name in sanitizers],
        "-fno-sanitize-recover=all",
        f"-I{Path(cuda_ops.__file__).parent / 'kernels'}",
        f"-I{HOST_DIR}",
        "-DPAGED_DECODE_HOST",
        f"-DVARIANTS={listed}",
        str(HOST_DIR / "run_paged_decode.cpp"),
        "-o",
        str(binary),
    ]
    built = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if built.returncode and any(lib in built.stderr.lower() for lib in ("asan", "tsan", "ubsan")):
        pytest.skip(f"g++ here lacks a sanitizer's library: {built.stderr[-300:]}")
    assert built.returncode == 0, built.stderr[-3000:]
    return binary


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant of HOST_VARIANTS, with the address and undefined-behaviour sanitizers
    (14 s on 2 cores): a read past a buffer or shared memory's size stops the run."""
    return _build_on_host(tmp_path_factory.mktemp("cuda_host"), HOST_VARIANTS, ["address", "undefined"])


@pytest.fixture(scope="module")
def host_kernel_races(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HOST_VARIANTS_RACES with the thread sanitizer: lanes of different warps touching the
    same shared memory with no barrier between them stop the run (without the kernel's
    first __syncthreads, it stopped at the first launch)."""
    return _build_on_host(tmp_path_factory.mktemp("cuda_host_races"), HOST_VARIANTS_RACES, ["thread"])


def _run_on_host(
    binary: Path, q, k, v, tables, ctx, scale: float, scales: dict, warps: int, stages: int, heads_first: bool = False
):
    """One launch of the kernel's source on the host (run_paged_decode.cpp's file format)."""
    fp8 = bool(scales)
    num_seqs, heads, _ = q.shape
    num_blocks, block_size, kv_heads, _ = k.shape
    storage = q.as_strided((num_seqs, q.stride(0)), (q.stride(0), 1))  # the rows with what lies between them
    header = struct.pack(
        "<14qd",
        fp8,
        heads // kv_heads,
        kv_heads,
        block_size,
        warps,
        stages,
        num_seqs,
        heads,
        num_blocks,
        tables.shape[1],
        q.stride(0),
        q.stride(1),
        cuda_ops.smem_bytes(fp8, warps, stages),
        heads_first,
        scale / math.log(2.0),
    )
    parts = [storage, k, v, tables, ctx] + ([scales["k_scales"], scales["v_scales"]] if fp8 else [])
    blob = header + b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in", Path(tmp) / "out"
        src.write_bytes(blob)
        env = dict(
            os.environ,
            ASAN_OPTIONS="detect_leaks=0",
            UBSAN_OPTIONS="print_stacktrace=1",
            TSAN_OPTIONS="halt_on_error=1",
        )
        ran = subprocess.run([str(binary), str(src), str(dst)], capture_output=True, text=True, timeout=300, env=env)
        assert ran.returncode == 0, ran.stderr[-3000:]
        return torch.frombuffer(bytearray(dst.read_bytes()), dtype=torch.bfloat16).view(num_seqs, heads, 128)


def _row_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of a (sequence, head) row over that row's largest value: the
    output's bf16 rounding alone is up to 2^-9 of it."""
    return ((out.float() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)).max().item()


HOST_CONTEXTS = [0, 1, 15, 16, 17, 33, 100, 257, 1000]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "group,block_size", HOST_SHAPES + [pytest.param(g, bs, marks=pytest.mark.slow) for g, bs in HOST_SHAPES_SLOW]
)
def test_the_kernels_source_on_the_host_matches_a_float32_attention(
    host_kernel: Path, fp8: bool, group: int, block_size: int
) -> None:
    """Contexts with no tile, a partial tile, exactly full tiles and many; q a view with
    rows between the sequences' heads; one to four warps on a sequence, none to three tiles
    in flight; either grid order."""
    q, k, v, tables, ctx, scales, kf, vf = _cache(
        2 * group, 2, HOST_CONTEXTS, fp8, block_size, group, "cpu", q_rows=3 * group
    )
    want = _reference(q, kf, vf, tables, HOST_CONTEXTS, 0.0884)
    for warps, stages, heads_first in [(w, s, False) for w, s in HOST_TILES] + [(1, 3, True)]:
        out = _run_on_host(host_kernel, q, k, v, tables, ctx, 0.0884, scales, warps, stages, heads_first)
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # a padding row
        assert _row_error(out[1:], want[1:]) < 8e-3, (warps, stages, heads_first)


@pytest.mark.parametrize("variant", HOST_VARIANTS_RACES, ids=["fp8 4 warps", "bf16 2 warps"])
def test_the_kernels_warps_share_shared_memory_only_across_barriers(host_kernel_races: Path, variant: tuple) -> None:
    fp8, group, kv_heads, block_size, warps, stages = variant
    contexts = [0, 1, 17, 100, 257]
    q, k, v, tables, ctx, scales, kf, vf = _cache(group * kv_heads, kv_heads, contexts, fp8, block_size, 3, "cpu")
    out = _run_on_host(host_kernel_races, q, k, v, tables, ctx, 0.0884, scales, warps, stages)
    assert _row_error(out[1:], _reference(q, kf, vf, tables, contexts, 0.0884)[1:]) < 8e-3


@pytest.mark.parametrize("value_size", [1e-6, 1e-3, 1e3])
def test_the_fp8_kernels_error_does_not_grow_with_small_values(host_kernel: Path, value_size: float) -> None:
    """The FP8 cache's value weights (probability times scale) enter an f16 product; taken
    over a power of two near the largest scale, they stay in f16's normal range. Taken as
    they are, values of size 1e-4 gave errors of 6% of a row and 1e-5 of 30%."""
    contexts = [1, 17, 100, 257, 1000]
    q, k, v, tables, ctx, scales, kf, vf = _cache(4, 2, contexts, True, 16, 7, "cpu", value_size=value_size)
    # tokens whose values are 1,000 times the rest, so that the reference power of two grows mid-sequence
    big = torch.rand(scales["v_scales"].shape, generator=torch.Generator().manual_seed(1)) < 0.02
    scales["v_scales"] = torch.where(big, scales["v_scales"] * 1000, scales["v_scales"])
    vf = v.float() * scales["v_scales"][..., None]
    want = _reference(q, kf, vf, tables, contexts, 0.0884)
    for warps, stages in [(1, 3), (4, 4)]:
        out = _run_on_host(host_kernel, q, k, v, tables, ctx, 0.0884, scales, warps, stages)
        assert _row_error(out, want) < 8e-3, (warps, stages)


@gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_kernel_matches_a_float32_attention(fp8: bool, group: int, block_size: int) -> None:
    """Contexts with no tile, a partial tile, exactly full tiles and many tiles, with one
    to four warps sharing a sequence's tiles and one to four tiles in flight."""
    contexts = [0, 1, 15, 16, 17, 33, 100, 257, 1000]
    q, k, v, tables, ctx, scales, kf, vf = _cache(2 * group, 2, contexts, fp8, block_size, group)
    want = _reference(q, kf, vf, tables, contexts, 0.0884)
    for warps, stages, heads_first in [(1, 1, False), (1, 3, False), (2, 2, False), (4, 4, False), (1, 3, True)]:
        out = cuda_ops.paged_decode_attention(
            q, k, v, tables, ctx, 0.0884, warps=warps, stages=stages, heads_first=heads_first, **scales
        )
        err = (out.float() - want).abs().max().item()
        assert err < 2e-2, (warps, stages, heads_first, err)
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # a padding row


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_an_engine_on_the_cuda_kernel_scores_as_one_on_triton_does(tmp_path: Path, kv: str) -> None:
    """Each engine samples; the bf16 model scores the same tokens in one forward. The CUDA
    kernel's engine stays as near that model as the Triton kernel's does (they sum the
    same products in different orders, so their tokens may part at near ties)."""
    shape = TinyModelConfig(hidden_size=512, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
    model_dir = save_tiny_model(tmp_path / "model", shape)  # head size 128, 2 query heads a KV head
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 40, (8, 40), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True, seed=0)
    gaps = {}
    for backend in ("triton", "cuda"):
        engine = Engine.from_pretrained(
            str(model_dir), EngineConfig(num_kv_blocks=128, kv_cache_dtype=kv, attention_backend=backend)
        )
        expected = cuda_ops.paged_decode_attention if backend == "cuda" else triton_ops.paged_decode_attention
        assert engine.runner.decode_attention is expected
        diffs = []
        for p, [(ids, lps)] in zip(prompts, generate(engine, prompts, sampling), strict=True):
            diffs += [abs(a - b) for a, b in zip(lps, bf16_logprobs(engine.model, p, ids), strict=True)]
        gaps[backend] = sum(diffs) / len(diffs)
        engine.sleep()
    assert gaps["cuda"] <= 1.5 * gaps["triton"] + 2e-3, gaps
