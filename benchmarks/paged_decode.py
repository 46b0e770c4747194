"""The paged decode attention kernels alone, against the bytes they must read.

    python benchmarks/paged_decode.py [--tiles 16/2/4,16/2/4h,cuda:1/3,cuda:1/3h] [--json PATH]
    ncu --kernel-name regex:paged_decode --metrics dram__bytes_read.sum,gpu__time_duration.sum \\
        python benchmarks/paged_decode.py --once   # one launch of each, for a profiler's DRAM bytes
    python benchmarks/paged_decode.py --device cpu   # tiny shape in Triton's interpreter: proves the script

Each shape is a batch of sequences with random contexts in a range, their blocks shuffled
through the cache, at Qwen3-0.6B's heads (16 query, 8 KV, head size 128) or Qwen3-8B's
(32 over 8), read from a bf16 and an FP8 cache. A tile is `decode_tiles.py`'s: Triton's
`block_n/warps/stages` or the CUDA kernel's `cuda:warps/stages` (`engine.attention_backend
= "cuda"`), an `h` after either launching each sequence's KV heads side by side; `default`
is Triton's tile for the loop that reads the shape's cache (`triton_ops.DECODE_TILES`),
`defaulth` the same heads first.
Every figure is a CUDA graph of `--calls` launches, replayed (best of 3), per launch. The
counted bytes are those a kernel cannot avoid: each context token's keys and values (and,
for FP8, their two float32 scales) for every KV head, plus q, the output and the block
tables; "of copy" is their rate over a large device copy's, measured in the same run.
"error" is the largest |kernel - float32 attention over the dequantized cache| over the
largest |reference|, each row's worst.

Why the kernel alone when `decode_tiles.py` compares tiles in the engine, where they are
chosen: this answers where a kernel's time goes (an FP8 cache read at 3.1 TB/s where a bf16
one reads 4.2 on an H200, BENCHMARKS.md), and `--once` gives a profiler one launch of each
to count DRAM bytes against the counted ones (an FP8 cache's scales of a slot share one
32-byte sector, which one grid order may fetch more than once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter, set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
from decode_tiles import Tile, parse_tiles  # noqa: E402
from engine import copy_bandwidth  # noqa: E402  (benchmarks/engine.py)
from moe_layer import graph_time  # noqa: E402

from polyrl.engine import cuda_ops, triton_ops  # noqa: E402

HEAD_DIM = 128
FP8_MAX = 448.0  # e4m3's largest finite value


@dataclass(frozen=True)
class Shape:
    name: str
    sequences: int
    heads: int
    kv_heads: int
    contexts: tuple[int, int]  # each sequence's context, drawn uniformly in [lo, hi]


SHAPES = {
    s.name: s
    for s in (
        Shape("0.6b 512 x 544-1088", 512, 16, 8, (544, 1088)),  # 512 x 1024's second half
        Shape("0.6b 256 x 130-260", 256, 16, 8, (130, 260)),  # 256 x 256's second half
        Shape("8b 256 x 130-260", 256, 32, 8, (130, 260)),
        Shape("0.6b 32 x 1500-2048", 32, 16, 8, (1500, 2048)),  # few long sequences
        Shape("cpu", 4, 4, 2, (0, 40)),  # Triton's interpreter; partial blocks
    )
}


def make_cache(shape: Shape, fp8: bool, block_size: int, device: torch.device, seed: int = 0) -> dict:
    """q, a paged cache holding the shape's contexts in shuffled blocks (e4m3 with a float32
    scale per slot and KV head, as the engine's RoPE kernel stores them, or bf16), and the
    float32 keys and values the cache stands for."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = shape.contexts
    contexts = torch.randint(lo, hi + 1, (shape.sequences,), generator=g)
    blocks = (contexts + block_size - 1) // block_size
    num_blocks = int(blocks.sum()) + 1
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(shape.sequences, max(int(blocks.max()), 1), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = order[start : start + n]
        start += n
    cache_shape = (num_blocks, block_size, shape.kv_heads, HEAD_DIM)
    keys = torch.randn(cache_shape, generator=g).to(device) * 1.5
    values = torch.randn(cache_shape, generator=g).to(device)
    # a 16-bit cache on the CPU is float32, which Triton's interpreter computes in (it has no bf16)
    dtype = torch.bfloat16 if fp8 or device.type == "cuda" else torch.float32
    out = {"q": torch.randn(shape.sequences, shape.heads, HEAD_DIM, generator=g).to(device, dtype)}
    out |= {"tables": tables.to(device), "contexts": contexts.to(device, torch.int32)}
    for name, full in (("k", keys), ("v", values)):
        if fp8:
            scales = full.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
            stored = (full / scales[..., None]).to(torch.float8_e4m3fn)
            out[name], out[f"{name}_scales"] = stored, scales
            out[f"{name}_full"] = stored.float() * scales[..., None]
        else:
            out[name], out[f"{name}_scales"] = full.to(dtype), None
            out[f"{name}_full"] = out[name].float()
    return out


def reference(x: dict, scale: float) -> torch.Tensor:
    """Float32 attention of each sequence's q over its context in the dequantized cache."""
    q, tables, contexts = x["q"].float(), x["tables"], x["contexts"]
    block_size, kv_heads = x["k_full"].shape[1], x["k_full"].shape[2]
    out = torch.zeros_like(q)
    for b, n in enumerate(contexts.tolist()):
        if n == 0:
            continue
        tokens = torch.arange(n, device=q.device)
        where = (tables[b, tokens // block_size].long(), tokens % block_size)
        group = q.shape[1] // kv_heads
        keys = x["k_full"][where].repeat_interleave(group, dim=1)  # [n, H, D]
        values = x["v_full"][where].repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[b], keys) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, values)
    return out


def counted_bytes(x: dict) -> int:
    tokens = int(x["contexts"].sum()) * x["k"].shape[2]  # token-KV heads
    per_token = 2 * HEAD_DIM * x["k"].element_size() + (8 if x["k_scales"] is not None else 0)
    return tokens * per_token + 2 * x["q"].numel() * 2 + x["tables"].numel() * 4


def tiles_for(texts: list[str], loop: str) -> list[Tile]:
    """`decode_tiles.py`'s tiles, "default" being Triton's for `loop` (and "defaulth" the same
    heads first)."""
    return [
        Tile(triton_ops.DECODE_TILES[loop], heads_first=t.endswith("h"))
        if t.removesuffix("h") == "default"
        else parse_tiles(t)[0]
        for t in texts
    ]


def launcher(tile: Tile, x: dict, scale: float):
    """A call of the tile's kernel on the cache, or why it cannot run here."""
    args = (x["q"], x["k"], x["v"], x["tables"], x["contexts"], scale)
    scales = {"k_scales": x["k_scales"], "v_scales": x["v_scales"]}
    if not tile.cuda:
        block_n, warps, stages = tile.sizes
        return lambda: triton_ops.paged_decode_attention(
            *args, block_n, warps, stages, heads_first=tile.heads_first, **scales
        )
    block_size, kv_heads = x["k"].shape[1], x["k"].shape[2]
    why = cuda_ops.unsupported(x["q"].device, HEAD_DIM, x["q"].shape[1], kv_heads, block_size, x["k"].dtype)
    if why:
        return why
    warps, stages = tile.sizes
    return lambda: cuda_ops.paged_decode_attention(
        *args, warps=warps, stages=stages, heads_first=tile.heads_first, **scales
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", help=f"comma-separated from {sorted(SHAPES)}; default: all but cpu (cpu on a CPU)")
    ap.add_argument("--kv", default="bf16,fp8", help="the caches: bf16 (float32 on a CPU), fp8 or both")
    ap.add_argument(
        "--tiles",
        default="default,defaulth,cuda:1/3,cuda:1/3h",
        help="comma-separated, decode_tiles.py's; default: Triton's for the shape's loop (defaulth: heads first)",
    )
    ap.add_argument("--block-size", type=int, default=16, help="engine.block_size")
    ap.add_argument("--calls", type=int, default=20, help="launches per timed CUDA graph")
    ap.add_argument("--once", action="store_true", help="one launch of each, untimed (for a profiler)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    names = args.shapes.split(",") if args.shapes else [n for n in SHAPES if (n == "cpu") != cuda]
    if unknown := set(names) - set(SHAPES):
        ap.error(f"unknown shapes {sorted(unknown)}: choose from {sorted(SHAPES)}")
    kinds = args.kv.split(",")
    if set(kinds) - {"bf16", "fp8"}:
        ap.error(f"--kv takes bf16, fp8 or both: got {args.kv!r}")
    tile_texts = [t.strip() for t in args.tiles.split(",")]
    try:
        tiles_for(tile_texts, "16-bit")
    except ValueError as e:
        ap.error(str(e))
    bandwidth = copy_bandwidth(device) if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()} (CPU)"
    scale = HEAD_DIM**-0.5
    print(f"{name}; copy bandwidth {bandwidth / 1e12 if bandwidth else 0:.2f} TB/s; torch {torch.__version__}")
    print("| shape | KV | tile | us | counted MB | TB/s | of copy | error |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape_name in names:
        shape = SHAPES[shape_name]
        for kind in kinds:
            fp8 = kind == "fp8"
            x = make_cache(shape, fp8, args.block_size, device)
            nbytes = counted_bytes(x)
            want = None if args.once else reference(x, scale)
            tiles = tiles_for(tile_texts, triton_ops.decode_loop(fp8, shape.heads // shape.kv_heads))
            for tile in tiles:
                row = {"shape": shape_name, "kv": kind, "tile": str(tile), "counted_bytes": nbytes}
                call = launcher(tile, x, scale)
                if isinstance(call, str):
                    row["skipped"] = call
                    print(f"| {shape_name} | {kind} | {tile} | - | | | | skipped: {call} |", flush=True)
                    rows.append(row)
                    continue
                got = call()
                if args.once:
                    if cuda:
                        torch.cuda.synchronize()
                    print(f"| {shape_name} | {kind} | {tile} | - | {nbytes / 1e6:.2f} | | | |", flush=True)
                    rows.append(row)
                    continue
                row["error"] = ((got.float() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)).max().item()
                seconds = graph_time(call, device, args.calls if cuda else 1)
                row |= {"us": seconds * 1e6, "tb_s": nbytes / seconds / 1e12}
                row["of_copy"] = nbytes / seconds / bandwidth if bandwidth else None
                share = f"{row['of_copy']:.0%}" if bandwidth else "-"
                print(
                    f"| {shape_name} | {kind} | {tile} | {row['us']:.1f} | {nbytes / 1e6:.2f} | {row['tb_s']:.2f} "
                    f"| {share} | {row['error']:.2%} |",
                    flush=True,
                )
                rows.append(row)
    if args.json:
        meta = {"device": name, "torch": torch.__version__, "bandwidth": bandwidth, "calls": args.calls}
        meta |= {"block_size": args.block_size, "once": args.once}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
