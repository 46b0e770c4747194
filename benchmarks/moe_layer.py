"""One mixture-of-experts layer at decode batch sizes: the engine's Triton experts
(`polyrl/engine/fused_moe.py`) against transformers' own block with its `grouped_mm`
experts, in the same run, next to the layer's weight-read roofline.

    python benchmarks/moe_layer.py --device cuda [--tokens 64 256 512] [--sweep 256 [--sweep-block-m 32]] [--json PATH]
    python benchmarks/moe_layer.py --device cpu   # tiny shape, Triton's interpreter: proves the script

The layer is Qwen3-30B-A3B's (2048 wide, 128 experts of 768, top 8; random bf16 weights)
on CUDA. Each row times a CUDA graph of `--calls` forwards of the layer (as the engine
replays its decode steps) and reports the mean per forward. The roofline reads, once,
the weights of every expert the batch's tokens hit (and the router's), at the copy
bandwidth measured in the run. "max diff" is the largest |Triton - transformers| over the
outputs, against their largest magnitude, and "routes" the share of token-expert pairs
both pick. `--sweep T...` also times each GEMM kernel over tile shapes (`fused_moe.Tiles`)
at those token counts and prints the fastest, which is how `fused_moe.tiles_for`'s table
was chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter, set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
from engine import copy_bandwidth, preset_config  # noqa: E402  (benchmarks/engine.py)
from transformers import AutoModelForCausalLM  # noqa: E402

from polyrl.engine import fused_moe  # noqa: E402


def build_block(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's first MoE block, random weights (std 0.02, as the initialiser's)."""
    config = preset_config(preset, num_layers=1)
    config.vocab_size = 32  # the block alone: no need for the 151k-row embedding
    torch.manual_seed(0)
    with torch.device(device):
        mlp = AutoModelForCausalLM.from_config(config, dtype=dtype).model.layers[0].mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.02)
    return mlp.eval()


def graph_time(fn, device: torch.device, calls: int) -> float:
    """Seconds per call: a CUDA graph of `calls` calls, replayed (best of 3); on CPU, a loop."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / calls


def hit_bytes(mlp: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes a forward must read: the router and every expert some token picks."""
    with torch.no_grad():
        _, _, ids = mlp.gate(x)
    experts = mlp.experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.gate_up_proj.element_size()
    return int(ids.unique().numel()) * per_expert + mlp.gate.weight.numel() * mlp.gate.weight.element_size()


def compare(mlp: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        want = mlp(x[None])[0].float()
        routes: list[torch.Tensor] = []
        got = fused_moe.moe_forward(mlp, x, routes).float()
        _, _, want_ids = mlp.gate(x)
    same = sum(len(set(a) & set(b)) for a, b in zip(routes[0].tolist(), want_ids.tolist(), strict=True))
    return (got - want).abs().max().item() / want.abs().max().item(), same / want_ids.numel()


def sweep(mlp: torch.nn.Module, x: torch.Tensor, block_ms: list[int]) -> list[dict]:
    """Each GEMM kernel alone over tile shapes (`do_bench`); the five fastest of each."""
    import triton.testing

    experts, top_k = mlp.experts, mlp.gate.top_k
    with torch.no_grad():
        routed = fused_moe.route(torch.nn.functional.linear(x, mlp.gate.weight), top_k, mlp.gate.norm_topk_prob)
    weights = routed.weights
    rows = []
    for block_m in block_ms:
        order, blocks = fused_moe.group_by_expert(routed, block_m)
        inter = fused_moe.expert_gate_up(x, order, blocks, experts.gate_up_proj, top_k, fused_moe.Tiles(block_m))
        for block_n, block_k, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4, 5)):
            tiles = fused_moe.Tiles(block_m, block_n, block_k, warps, stages)
            for kernel, fn in (
                ("gate_up", lambda t=tiles: fused_moe.expert_gate_up(x, order, blocks, experts.gate_up_proj, top_k, t)),
                ("down", lambda t=tiles: fused_moe.expert_down(inter, order, blocks, experts.down_proj, weights, t)),
            ):
                try:
                    ms = triton.testing.do_bench(fn, warmup=5, rep=20)
                except Exception as e:  # out of shared memory for this tile: skip it
                    print(f"    {kernel} {tiles}: {type(e).__name__}", flush=True)
                    continue
                rows.append({"tokens": x.shape[0], "kernel": kernel, **tiles.__dict__, "us": ms * 1e3})
    best = []
    for kernel in ("gate_up", "down"):
        mine = sorted((r for r in rows if r["kernel"] == kernel), key=lambda r: r["us"])
        for r in mine[:5]:
            print(f"    {kernel:8s} {r['us']:8.1f} us  m{r['block_m']} n{r['block_n']} k{r['block_k']} "
                  f"w{r['num_warps']} s{r['num_stages']}", flush=True)  # fmt: skip
        best.extend(mine[:5])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--calls", type=int, default=20, help="forwards per timed CUDA graph")
    ap.add_argument("--sweep", type=int, nargs="*", help="at these token counts, time each GEMM kernel over tiles")
    ap.add_argument("--sweep-block-m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        args.tokens, args.calls = [min(t, 16) for t in args.tokens], 1
    preset = "qwen3-30b-a3b" if device.type == "cuda" else "tiny-moe"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mlp = build_block(preset, device, dtype)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    print(f"{preset} MoE layer, {dtype}; copy bandwidth {bandwidth / 1e12 if bandwidth else 0:.2f} TB/s", flush=True)
    print("| tokens | transformers us | Triton us | Triton / transformers | roofline us | of roofline | "
          "Triton TB/s | max diff | routes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, mlp.gate.weight.shape[1], device=device, dtype=dtype)
        diff, same = compare(mlp, x)
        with torch.no_grad():
            hf_s = graph_time(lambda x=x: mlp(x[None]), device, args.calls)
            ours_s = graph_time(lambda x=x: fused_moe.moe_forward(mlp, x), device, args.calls)
        need = hit_bytes(mlp, x)
        roof_s = need / bandwidth if bandwidth else None
        row = {
            "tokens": tokens,
            "hf_us": hf_s * 1e6,
            "triton_us": ours_s * 1e6,
            "speedup": hf_s / ours_s,
            "roofline_us": roof_s * 1e6 if roof_s else None,
            "of_roofline": roof_s / ours_s if roof_s else None,
            "triton_tb_s": need / ours_s / 1e12,
            "max_rel_diff": diff,
            "routes_agree": same,
        }
        rows.append(row)
        roof = f"{row['roofline_us']:.0f} | {row['of_roofline']:.0%}" if roof_s else "- | -"
        print(f"| {tokens} | {row['hf_us']:.0f} | {row['triton_us']:.0f} | {row['speedup']:.2f}x | {roof} | "
              f"{row['triton_tb_s']:.2f} | {diff:.1e} | {same:.3f} |", flush=True)  # fmt: skip
        if args.sweep and tokens in args.sweep and device.type == "cuda":
            row["sweep"] = sweep(mlp, x, args.sweep_block_m)
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()}
        args.json.write_text(json.dumps({"meta": {**meta, "torch": torch.__version__}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
