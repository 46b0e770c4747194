"""The paged decode kernel's tiles compared inside the whole engine, in one run.

    python benchmarks/decode_tiles.py --preset qwen3-0.6b --batch 256 --new-tokens 256 --kv bf16 \\
        --tiles 64/4/2,16/2/4 [--rounds 2] [--json PATH]
    python benchmarks/decode_tiles.py ... --tiles 16/2/4,cuda:1/3,cuda:2/3

A tile is `block_n/warps/stages`: the tokens one loop iteration of the Triton kernel
reads, its warps and its pipeline stages (`triton_ops.DECODE_TILES`, whose entry for the
loop that reads this model's cache, `triton_ops.decode_loop`, each run sets), or
`cuda:warps/stages`: the CUDA kernel (`engine.attention_backend = "cuda"`) with that many
warps a (sequence, KV head) and tiles in flight plus one (`cuda_ops.TILES`). With an "h"
after either (`16/2/4h`, `cuda:1/3h`), the kernel's programs are launched each sequence's
KV heads side by side (`triton_ops.DECODE_HEADS_FIRST`, `cuda_ops.HEADS_FIRST`). One model in the preset's shape (random weights) decodes the
same batch (`--batch` random prompts of `--prompt-len` tokens, `--new-tokens` sampled at
temperature 1, EOS ignored) with a fresh engine per tile, so that its CUDA graphs are
captured with that tile. The tiles take turns for `--rounds` rounds, after one untimed run
of the first (the first run in a process was 5-20% slow on an H200, tile or not), so a
drift of the machine falls on every tile alike. The table gives each tile's tokens/s per
round, its median against the first tile's, and the share of the decode roofline (the
bytes a step reads, weights and the KV cache at the mean context, over the copy bandwidth
measured in the same run, as `benchmarks/fp8.py` computes it).

Why in the engine and not the kernel alone: bf16 tiles that a kernel-only probe found
4-15% faster at 512 x 1024 were no faster in the engine's step there, while the engine
gained 3-6% from a tile at 256 x 256 and 256 x 2048 (BENCHMARKS.md, "The paged kernel's
tiles chosen in the engine").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model, copy_bandwidth  # noqa: E402  (benchmarks/engine.py)
from fp8 import engine_config, generate, roofline, stored_bytes  # noqa: E402  (benchmarks/fp8.py)

from polyrl.engine import cuda_ops, triton_ops  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.protocol.sampling import SamplingParams  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Tile:
    sizes: tuple[int, ...]  # block_n, warps, stages (Triton); warps, stages (CUDA)
    heads_first: bool = False
    cuda: bool = False

    def __str__(self) -> str:
        return ("cuda:" if self.cuda else "") + "/".join(map(str, self.sizes)) + ("h" if self.heads_first else "")


def parse_tiles(text: str) -> list[Tile]:
    """'64/4/2,16/2/4h,cuda:1/3' -> [Tile((64, 4, 2)), Tile((16, 2, 4), heads_first=True),
    Tile((1, 3), cuda=True)]: a Triton tile's block_n (at least 16) and warps are powers of
    two; a CUDA one is warps/stages."""
    tiles = []
    for item in text.split(","):
        item = item.strip()
        heads_first, cuda = item.endswith("h"), item.startswith("cuda:")
        parts = item.removesuffix("h").removeprefix("cuda:").split("/")
        if len(parts) != (2 if cuda else 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"a tile is block_n/warps/stages, like 16/2/4, or cuda:warps/stages, with h after either: got {item!r}"
            )
        if cuda:
            tiles.append(Tile(tuple(int(p) for p in parts), heads_first, cuda=True))
            continue
        block_n, warps, stages = (int(p) for p in parts)
        if block_n < 16 or block_n & (block_n - 1) or warps & (warps - 1):
            raise ValueError(f"block_n (at least 16) and warps are powers of two: got {item!r}")
        tiles.append(Tile((block_n, warps, stages), heads_first))
    return tiles


def decode_once(model, prompts: list[list[int]], args, kind: str, tile: Tile) -> dict:
    """One engine captured with `tile` (on the CUDA kernel for a CUDA tile), one timed decode of the batch."""
    config = engine_config(args, kv_dtype="fp8" if args.kv == "fp8" else "auto")
    if tile.cuda:
        cuda_ops.TILES[args.kv == "fp8"], cuda_ops.HEADS_FIRST = tile.sizes, tile.heads_first
        config = config.model_copy(update={"attention_backend": "cuda"})
    else:
        triton_ops.DECODE_TILES[kind], triton_ops.DECODE_HEADS_FIRST = tile.sizes, tile.heads_first
    engine = Engine(model, config)
    try:
        # graphs for the batch's sizes are captured here, outside the timing
        generate(engine, prompts, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True, seed=1))
        sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(engine, prompts, sampling)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return {"tok_s": args.batch * args.new_tokens / seconds, "preemptions": engine.stats().num_preemptions}
    finally:
        engine.sleep()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="the KV cache's kind")
    p.add_argument(
        "--tiles", default="64/4/2,16/2/4", help="comma-separated block_n/warps/stages; the first is the baseline"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-fraction", type=float, default=0.9, help="engine.kv_cache_memory_fraction")
    p.add_argument("--json")
    args = p.parse_args()
    try:
        tiles = parse_tiles(args.tiles)
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        print("the paged decode kernel's tiles matter on a CUDA GPU only; nothing to measure here")
        return 0
    device = torch.device("cuda")
    model = build_model(args.preset, device, torch.bfloat16)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    kind = triton_ops.decode_loop(args.kv == "fp8", group)  # the loop this model's cache is read by
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    bandwidth = copy_bandwidth(device)
    ceiling = roofline(
        model,
        stored_bytes(model, False),
        args.batch,
        args.prompt_len + args.new_tokens / 2,
        bandwidth,
        args.kv == "fp8",
    )
    default = Tile(triton_ops.DECODE_TILES[kind], triton_ops.DECODE_HEADS_FIRST)
    cuda_default = Tile(cuda_ops.TILES[args.kv == "fp8"], cuda_ops.HEADS_FIRST, cuda=True)
    print(f"warm-up: {tiles[0]}", flush=True)
    decode_once(model, prompts, args, kind, tiles[0])
    runs: dict[Tile, list[dict]] = {t: [] for t in tiles}
    for r in range(args.rounds):
        for tile in tiles:
            run = decode_once(model, prompts, args, kind, tile)
            runs[tile].append(run)
            print(f"round {r + 1}, tile {tile}: {run['tok_s']:,.0f} tok/s", flush=True)
    triton_ops.DECODE_TILES[kind], triton_ops.DECODE_HEADS_FIRST = default.sizes, default.heads_first
    cuda_ops.TILES[args.kv == "fp8"], cuda_ops.HEADS_FIRST = cuda_default.sizes, cuda_default.heads_first
    base = statistics.median(x["tok_s"] for x in runs[tiles[0]])
    rows = []
    for tile in tiles:
        speeds = [x["tok_s"] for x in runs[tile]]
        median = statistics.median(speeds)
        rows.append(
            {
                "tile": str(tile),
                "default": tile in (default, cuda_default),
                "tok_s": speeds,
                "median_tok_s": median,
                "vs_first": median / base,
                "share": median / ceiling,
                "preemptions": sum(x["preemptions"] for x in runs[tile]),
            }
        )
    name = torch.cuda.get_device_name(device)
    print(
        f"\n{args.preset}, {args.batch} x {args.new_tokens} new tokens (prompts of {args.prompt_len}), "
        f"{args.kv} KV cache, {name}"
    )
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; roofline {ceiling:,.0f} tok/s; torch {torch.__version__}")
    print(
        "| tile (block_n/warps/stages; cuda:warps/stages; h: heads first) | tok/s by round | median | vs first | share of roofline "
        "| preemptions |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        mark = " (default)" if row["default"] else ""
        by_round = ", ".join(f"{x:,.0f}" for x in row["tok_s"])
        print(
            f"| {row['tile']}{mark} | {by_round} | {row['median_tok_s']:,.0f} | {row['vs_first']:.3f}x "
            f"| {row['share']:.0%} | {row['preemptions']} |"
        )
    if any(row["preemptions"] for row in rows):
        print("a row with preemptions recomputed sequences for want of KV room: more --kv-fraction measures the kernel")
    if args.json:
        meta = {
            "preset": args.preset,
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len,
            "kv": args.kv,
            "rounds": args.rounds,
            "device": name,
            "bandwidth": bandwidth,
            "roofline_tok_s": ceiling,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
