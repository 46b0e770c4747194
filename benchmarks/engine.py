"""Generation throughput: the embedded engine vs transformers' own generation paths, same
model, same work, measured in one run, next to the decode roofline on GPU.

    .venv/bin/python benchmarks/engine.py [--preset tiny|small|qwen3-0.6b|tiny-moe|qwen3-30b-a3b] [--batch 64]
        [--prompt-len 64] [--new-tokens 128] [--n 8] [--device auto]
        [--baselines dynamic,static,cb,grouped|none] [--profile] [--json PATH]
    # the GPU target: python benchmarks/engine.py --device cuda --preset qwen3-0.6b --batch 256 --new-tokens 256

Shapes: B prompts of equal length at temperature 1; the GRPO shape (B/n prompts x n
samples at temperature 1: the engine prefills each prompt once, HF expands it n times);
B prompts of mixed lengths, greedy (HF left-pads them; the token agreement with HF is a
sanity check; only `dynamic` runs there). Baselines: `dynamic` is HF `generate` (dynamic cache), `static` the same
with `cache_implementation="static"` (which transformers compiles), `cb` transformers'
continuous batching (`generate_batch`); default: dynamic on CPU, all three on CUDA.

Roofline (CUDA): a decode step must read every weight once and each sequence's cached
K/V; with the copy bandwidth measured in this run, B sequences at mean context L decode at
most B / ((weight bytes + B * L * KV bytes per token) / bandwidth) tokens/s.

Models are random-init from a config (no hub): the shape, not the weights, sets the speed.
EOS is ignored so every sequence makes all its tokens. Each timing is the best of
`--repeats` after a warm-up run of the same work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig

from polyrl.config import EngineConfig
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest
from polyrl.protocol.sampling import SamplingParams

PRESETS = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (96, 2, 4, 2, 192, 64),
    "small": (256, 4, 8, 4, 768, 1024),
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 12288, 151936),
}
MOE_PRESETS = {  # hidden, layers, heads, kv heads, expert intermediate, vocab, experts, experts per token
    "tiny-moe": (128, 2, 4, 2, 64, 64, 8, 2),  # head size 32: the fused kernels take powers of two
    # Qwen3-30B-A3B's shape: 30.5B parameters, 3.35B active per token
    "qwen3-30b-a3b": (2048, 48, 32, 4, 768, 151936, 128, 8),
}
LARGE = {"qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"}  # Qwen's head size of 128 and untied embeddings where Qwen unties


def preset_config(
    preset: str, num_layers: int | None = None, max_positions: int = 4096
) -> Qwen3Config | Qwen3MoeConfig:
    """The preset's model config; `num_layers` cuts it to its first layers."""
    if preset in MOE_PRESETS:
        hidden, layers, heads, kv, expert_inter, vocab, experts, top_k = MOE_PRESETS[preset]
        return Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=num_layers or layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=3 * expert_inter,
            moe_intermediate_size=expert_inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            head_dim=128 if preset in LARGE else hidden // heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=preset not in LARGE,
        )
    hidden, layers, heads, kv, inter, vocab = PRESETS[preset]
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=num_layers or layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        head_dim=128 if preset in LARGE else hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights in the preset's shape, made on `device` (30B parameters would not
    be initialised on the host in reasonable time)."""
    torch.manual_seed(0)
    with torch.device(device):  # inference only, as a worker's engine loads it (its projections packed)
        return AutoModelForCausalLM.from_config(preset_config(preset), dtype=dtype).eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def gen_config(new_tokens: int, sample: bool, **extra) -> GenerationConfig:
    return GenerationConfig(
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_p=None,
        top_k=None,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )


@torch.inference_mode()
def hf_generate(
    model, prompts: list[list[int]], new_tokens: int, n: int, sample: bool, static: bool = False, grouped: bool = False
) -> torch.Tensor:
    """`grouped` (a mixture of experts): keep the `grouped_mm` experts while decoding, where
    `generate` would switch to `batched_mm` (slower at batch 64 on an H100: 537 against 248
    tok/s at Qwen3-30B-A3B's shape, the MoE issue's measurement)."""
    extra = {"num_return_sequences": n} | ({"cache_implementation": "static"} if static else {})
    ids, mask = left_pad(prompts, model.device)  # HF needs a rectangle: left padding + attention mask
    if grouped:
        model._optimize_model_for_decode = contextlib.nullcontext  # an instance attribute over the method
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=gen_config(new_tokens, sample, **extra)
        )
    finally:
        if grouped:
            del model._optimize_model_for_decode
    return out[:, ids.shape[1] :].cpu()


def hf_continuous_batching(model, prompts: list[list[int]], new_tokens: int, n: int, sample: bool) -> list[list[int]]:
    # Not under inference_mode: generate_batch's worker thread updates its tensors in place.
    inputs = [p for p in prompts for _ in range(n)]  # n samples = the prompt n times
    out = model.generate_batch(inputs=inputs, generation_config=gen_config(new_tokens, sample), progress_bar=False)
    tokens = [list(r.generated_tokens) for r in out.values()]
    if len(tokens) != len(inputs) or any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"generate_batch returned {len(tokens)} of {len(inputs)} requests, not all complete")
    return tokens


def engine_generate(engine: Engine, prompts: list[list[int]], new_tokens: int, n: int, sample: bool) -> list[list[int]]:
    sampling = SamplingParams(
        max_new_tokens=new_tokens, temperature=1.0 if sample else 0.0, ignore_eos=True, n=n, seed=0
    )
    outputs: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, sampling))
    while engine.has_work:
        for d in engine.step():
            outputs.setdefault((int(d.rid), d.index), []).extend(d.token_ids)
    return [outputs[k] for k in sorted(outputs)]


def best_time(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    timed(fn, device)  # warm-up on the same work: allocator, kernels, graphs, compilation
    runs = [timed(fn, device) for _ in range(repeats)]
    return min(t for t, _ in runs), runs[0][1]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the decode step's ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    return 2 * src.numel() / seconds


def roofline_tok_s(model, sequences: int, mean_context: float, bandwidth: float) -> float:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv_bytes = (
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).element_size()
    )
    return sequences / ((weight_bytes + sequences * mean_context * kv_bytes) / bandwidth)


def measure(
    model,
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    n: int,
    sample: bool,
    repeats: int,
    baselines: list[str],
    bandwidth: float | None,
) -> dict:
    device = model.device
    num_tokens = len(prompts) * n * new_tokens
    eng_s, eng_out = best_time(lambda: engine_generate(engine, prompts, new_tokens, n, sample), device, repeats)
    row = {"sequences": len(prompts) * n, "new_tokens": new_tokens, "engine_tok_s": num_tokens / eng_s}
    runs = {
        "dynamic": lambda: hf_generate(model, prompts, new_tokens, n, sample),
        "static": lambda: hf_generate(model, prompts, new_tokens, n, sample, static=True),
        "grouped": lambda: hf_generate(model, prompts, new_tokens, n, sample, grouped=True),
        "cb": lambda: hf_continuous_batching(model, prompts, new_tokens, n, sample),
    }
    for name in baselines:
        try:
            seconds, out = best_time(runs[name], device, repeats)
        except Exception as e:  # a baseline that cannot run here is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            print(f"  baseline {name} failed: {row[f'{name}_error']}", flush=True)
            continue
        row[f"{name}_tok_s"] = num_tokens / seconds
        if name == "dynamic" and not sample:
            row["greedy_token_agreement"] = (out == torch.tensor(eng_out)).float().mean().item()
    hf_best = max((row[f"{b}_tok_s"] for b in baselines if f"{b}_tok_s" in row), default=None)
    if hf_best:
        row["speedup_vs_best_hf"] = row["engine_tok_s"] / hf_best
    if bandwidth:
        mean_ctx = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2
        row["roofline_tok_s"] = roofline_tok_s(model, row["sequences"], mean_ctx, bandwidth)
        row["fraction_of_roofline"] = row["engine_tok_s"] / row["roofline_tok_s"]
    print(f"  {row}", flush=True)
    return row


def fmt(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else ("failed" if key.replace("_tok_s", "_error") in row else "-")


def profile_engine(engine: Engine, prompts: list[list[int]], device: torch.device, tokens: int) -> list[dict]:
    """Where a decode-heavy run's device time goes: `tokens` new tokens for the
    batch under torch's profiler (kernels inside CUDA graphs are seen through CUPTI), the
    top kernels by their own device time, printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine_generate(engine, prompts, tokens, 1, True)
        sync(device)
    events = prof.key_averages()
    own = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, own) for e in events) or 1.0
    top = sorted(events, key=lambda e: getattr(e, own), reverse=True)[:25]
    out = [
        {"name": e.key[:90], "calls": e.count, "ms": getattr(e, own) / 1e3, "share": getattr(e, own) / total}
        for e in top
    ]
    print(f"  profile, {len(prompts)} x {tokens} new tokens, by own {own}:", flush=True)
    for r in out:
        print(f"    {r['share']:6.1%} {r['ms']:9.1f} ms {r['calls']:7d}x  {r['name']}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS | MOE_PRESETS), default="small")
    p.add_argument("--batch", type=int, default=64, help="sequences per run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--n", type=int, default=8, help="samples per prompt in the GRPO shape")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--weight-dtype", choices=["auto", "fp8"], default="auto", help="engine.weight_dtype")
    p.add_argument(
        "--attention-backend", choices=["auto", "triton", "cuda"], default="triton", help="engine.attention_backend"
    )
    p.add_argument("--baselines", default=None, help="comma-separated from dynamic,static,cb,grouped (MoE), or none")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also profile the first shape's decode (top kernels)")
    p.add_argument("--profile-tokens", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    baselines = (args.baselines or ("dynamic,static,cb" if device.type == "cuda" else "dynamic")).split(",")
    baselines = [] if baselines == ["none"] else baselines
    if unknown := set(baselines) - {"dynamic", "static", "cb", "grouped"}:
        p.error(f"unknown baselines: {sorted(unknown)}")
    model = build_model(args.preset, device, dtype)
    max_len = args.prompt_len + args.new_tokens
    engine = Engine(
        model,
        EngineConfig(
            max_num_seqs=max(256, args.batch),
            max_num_batched_tokens=4096,
            max_model_len=max_len,
            kv_cache_memory_fraction=0.5,
            weight_dtype=args.weight_dtype,
            attention_backend=args.attention_backend,
        ),
    )
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    equal = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    # RL prompts differ in length: between a quarter of and the full --prompt-len.
    lengths = torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (args.batch,), generator=g).tolist()
    mixed = [p[:n] for p, n in zip(equal, lengths)]
    grouped = equal[: max(1, args.batch // args.n)]
    shapes = {
        f"{args.batch} x 1, T=1": (equal, 1, True),
        f"{len(grouped)} prompts x n={args.n}, T=1": (grouped, args.n, True),
        f"{args.batch} mixed lengths, greedy": (mixed, 1, False),
    }
    rows = {}
    for name, (prompts, n, sample) in shapes.items():
        print(f"{name} ...", flush=True)
        # The greedy row is there for the agreement check: HF `generate` alone serves it.
        row_baselines = baselines if sample else [b for b in baselines if b == "dynamic"]
        rows[name] = measure(model, engine, prompts, args.new_tokens, n, sample, args.repeats, row_baselines, bandwidth)
    profiled = profile_engine(engine, equal, device, args.profile_tokens) if args.profile else None
    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    ) + f", torch {torch.__version__}"
    graphs = engine.runner.decode_graphs
    print(
        f"\npreset {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}), "
        f"prompts {args.prompt_len} tokens (mixed: {min(lengths)}-{max(lengths)}), {args.new_tokens} new tokens each, {machine}"
    )
    if bandwidth:
        print(
            f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; CUDA graphs: "
            f"{len(graphs.graphs) if graphs else 0} captured in {graphs.capture_s if graphs else 0:.1f} s"
        )
    cols = ["engine"] + baselines
    print(
        f"{'shape':<30}{'seqs':>6}"
        + "".join(f"{c + ' tok/s':>15}" for c in cols)
        + f"{'vs best HF':>12}{'roofline':>10}{'of roof':>9}{'greedy agree':>14}"
    )
    for name, r in rows.items():
        agree = f"{r['greedy_token_agreement']:.3f}" if "greedy_token_agreement" in r else "-"
        speed = f"{r['speedup_vs_best_hf']:.2f}x" if "speedup_vs_best_hf" in r else "-"
        roof = (
            (f"{r['roofline_tok_s']:>10.0f}{r['fraction_of_roofline']:>9.0%}")
            if "roofline_tok_s" in r
            else f"{'-':>10}{'-':>9}"
        )
        print(
            f"{name:<30}{r['sequences']:>6}"
            + "".join(f"{fmt(r, c + '_tok_s'):>15}" for c in cols)
            + f"{speed:>12}{roof}{agree:>14}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "dtype": str(dtype),
                    "prompt_len": args.prompt_len,
                    "machine": machine,
                    "copy_bandwidth_bytes_s": bandwidth,
                    "attention_backend": args.attention_backend,
                    "baselines": baselines,
                    "rows": rows,
                    "profile": profiled,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
