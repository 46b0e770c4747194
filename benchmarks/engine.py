"""Generation throughput: the embedded engine vs HF `generate`, same model, same batch,
measured in one run. Three shapes: B prompts of equal length (HF's best case: no
padding), B prompts of mixed lengths (HF left-pads them), and the GRPO shape (B/n prompts
x n samples; the engine prefills each prompt once, HF expands it n times).

    .venv/bin/python benchmarks/engine.py [--preset tiny|small|qwen3-0.6b] [--batch 64]
        [--prompt-len 64] [--new-tokens 128] [--n 8] [--device auto] [--json PATH]

Models are random-init from a config (no hub): the shape, not the weights, sets the speed.
Greedy for the first two (the token agreement with HF is printed as a sanity check),
temperature 1 for the GRPO shape. EOS is ignored so every sequence makes all its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from polyrl.config import EngineConfig
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest, EngineSampling

PRESETS = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (96, 2, 4, 2, 192, 64),
    "small": (256, 4, 8, 4, 768, 1024),
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936),
}


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    hidden, layers, heads, kv, inter, vocab = PRESETS[preset]
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, head_dim=128 if preset == "qwen3-0.6b" else hidden // heads,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()


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


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, n: int, sample: bool) -> tuple[float, torch.Tensor]:
    device = model.device
    gen = GenerationConfig(
        do_sample=sample, temperature=1.0 if sample else None, top_p=None, top_k=None, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, num_return_sequences=n,
    )
    sync(device)
    t0 = time.perf_counter()
    ids, mask = left_pad(prompts, device)  # HF needs a rectangle: left padding + attention mask
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1] :].cpu()


def engine_generate(engine: Engine, prompts: list[list[int]], new_tokens: int, n: int, sample: bool) -> tuple[float, list[list[int]]]:
    sampling = EngineSampling(max_new_tokens=new_tokens, temperature=1.0 if sample else 0.0, ignore_eos=True, n=n, seed=0)
    outputs: dict[tuple[int, int], list[int]] = {}
    sync(engine.device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, sampling))
    while engine.has_work:
        for d in engine.step():
            outputs.setdefault((int(d.rid), d.index), []).extend(d.token_ids)
    sync(engine.device)
    return time.perf_counter() - t0, [outputs[k] for k in sorted(outputs)]


def measure(model, engine: Engine, prompts: list[list[int]], new_tokens: int, n: int, sample: bool, repeats: int) -> dict:
    hf_generate(model, prompts[:2], 4, n, sample)  # warm-up (allocator, kernels)
    engine_generate(engine, prompts[:2], 4, n, sample)
    hf_s = min(hf_generate(model, prompts, new_tokens, n, sample)[0] for _ in range(repeats))
    runs = [engine_generate(engine, prompts, new_tokens, n, sample) for _ in range(repeats)]
    eng_s = min(r[0] for r in runs)
    num_tokens = len(prompts) * n * new_tokens
    row = {"sequences": len(prompts) * n, "new_tokens": new_tokens, "hf_tok_s": num_tokens / hf_s,
           "engine_tok_s": num_tokens / eng_s, "speedup": hf_s / eng_s}
    if not sample:
        _, hf_out = hf_generate(model, prompts, new_tokens, n, sample)
        eng_out = torch.tensor(runs[0][1])
        row["greedy_token_agreement"] = (hf_out == eng_out).float().mean().item()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch", type=int, default=64, help="sequences per run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--n", type=int, default=8, help="samples per prompt in the GRPO shape")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(args.preset, device, dtype)
    engine = Engine(model, EngineConfig(max_num_seqs=max(256, args.batch), max_num_batched_tokens=4096))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    equal = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    # RL prompts differ in length: between a quarter of and the full --prompt-len.
    lengths = torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (args.batch,), generator=g).tolist()
    mixed = [p[:n] for p, n in zip(equal, lengths)]
    grouped = mixed[: max(1, args.batch // args.n)]
    rows = {
        "equal lengths, greedy": measure(model, engine, equal, args.new_tokens, 1, False, args.repeats),
        "mixed lengths, greedy": measure(model, engine, mixed, args.new_tokens, 1, False, args.repeats),
        f"{len(grouped)} prompts x n={args.n}, T=1": measure(model, engine, grouped, args.new_tokens, args.n, True, args.repeats),
    }
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores") + f", torch {torch.__version__}"
    print(f"\npreset {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}), "
          f"prompts up to {args.prompt_len} tokens, {args.new_tokens} new tokens each, {machine}")
    print(f"{'shape':<28}{'seqs':>6}{'HF tok/s':>12}{'engine tok/s':>14}{'engine/HF':>11}{'greedy agree':>14}")
    for name, r in rows.items():
        agree = f"{r['greedy_token_agreement']:.3f}" if "greedy_token_agreement" in r else "-"
        print(f"{name:<28}{r['sequences']:>6}{r['hf_tok_s']:>12.0f}{r['engine_tok_s']:>14.0f}{r['speedup']:>10.2f}x{agree:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "dtype": str(dtype), "prompt_len": args.prompt_len, "machine": machine, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
