"""FP8 rollout weights and KV cache against bf16, in the same run: throughput and log-prob gap.

    python benchmarks/fp8.py --preset qwen3-8b --batch 256 --new-tokens 256 [--json PATH]
    python benchmarks/fp8.py --preset qwen3-0.6b --batch 512 --new-tokens 1024 --configs "bf16,fp8 kv"

One model in the preset's shape (random weights), decoded by the engine on the same
prompts (`--batch` sequences, `--prompt-len` tokens, `--new-tokens` sampled with EOS
ignored) once per `--configs` entry: bf16 first, then FP8 weights (`engine.weight_dtype`),
an FP8 KV cache (`engine.kv_cache_dtype`) or both. The table gives tokens/s for each,
the ratio to bf16, and the roofline: the bytes a decode step must read (weights and KV
cache at the mean context, each at its stored width) over the GPU's measured copy
bandwidth. The log-prob gap is what `rollout/logprob_diff` would
show: each engine's log-prob of each token it sampled against the bf16 model's on the
same tokens (transformers, one forward), for the first `--score` sequences; the bf16
engine's row is the floor (kernels that round differently).

Each engine's KV cache takes `--kv-fraction` of the free memory (0.9 by default, so
that a bf16 cache holds the whole batch at full length wherever the GPU can: the
roofline assumes it does). The table gives each cache's size in whole sequences and the
preemptions it caused: a row that preempted recomputed sequences for want of room, and
is not measuring the kernels. With the engine's own default (0.5, which leaves room for
a trainer beside it), 512 x 1024 on an 80 GB H100 holds about two thirds of the batch in
bf16 (half of ~78 GiB, against 64 GB for the batch) and all of it in FP8.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from engine import best_time, build_model, copy_bandwidth  # noqa: E402  (benchmarks/engine.py)

from polyrl.config import EngineConfig  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.engine.model_runner import kv_bytes_per_token  # noqa: E402
from polyrl.engine.types import EngineRequest  # noqa: E402
from polyrl.protocol.sampling import SamplingParams  # noqa: E402


def generate(
    engine: Engine, prompts: list[list[int]], sampling: SamplingParams
) -> list[list[tuple[list[int], list[float]]]]:
    """Every prompt run to its end: per prompt, per sample, (tokens, log-probs)."""
    out: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, sampling))
    while engine.has_work:
        for d in engine.step():
            ids, lps = out.setdefault((int(d.rid), d.index), ([], []))
            ids += d.token_ids
            lps += d.logprobs
    return [[out[i, j] for j in range(sampling.n)] for i in range(len(prompts))]


def engine_config(args: argparse.Namespace, weight_dtype: str = "auto", kv_dtype: str = "auto") -> EngineConfig:
    """The engine these benchmarks run: room for the whole batch at full length, the KV
    cache at `--kv-fraction` of the free memory."""
    return EngineConfig(
        max_num_seqs=args.batch,
        max_num_batched_tokens=4096,
        max_model_len=args.prompt_len + args.new_tokens,
        kv_cache_memory_fraction=args.kv_fraction,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_dtype,
        attention_backend=getattr(args, "attention_backend", "triton"),
    )


def roofline(model: nn.Module, weight_bytes: int, batch: int, context: float, bandwidth: float, fp8_kv: bool) -> float:
    kv_bytes = kv_bytes_per_token(model, torch.bfloat16, fp8_kv)  # as the engine sizes its cache
    return batch / ((weight_bytes + batch * context * kv_bytes) / bandwidth)


def stored_bytes(model: nn.Module, fp8: bool) -> int:
    """Bytes a decode step reads for the weights: the projections at one byte each with FP8."""
    total = 0
    for name, p in model.named_parameters():
        quantized = fp8 and name.endswith("_proj.weight") and ".layers." in name
        total += p.numel() * (1 if quantized else p.element_size())
    return total


@torch.no_grad()
def bf16_logprobs(model: nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    """The (bf16) model's log-probs of `ids` after `prompt`, in one transformers forward."""
    tokens = torch.tensor([prompt + ids], device=model.device)
    logits = model(tokens).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids, device=model.device)[:, None])[:, 0].tolist()


CONFIGS = {  # name: (engine.weight_dtype, engine.kv_cache_dtype)
    "bf16": ("auto", "auto"),
    "fp8 weights": ("fp8", "auto"),
    "fp8 kv": ("auto", "fp8"),
    "fp8 weights+kv": ("fp8", "fp8"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--score", type=int, default=16, help="sequences whose log-probs are compared")
    p.add_argument("--configs", default="bf16,fp8 weights", help=f"comma-separated from {sorted(CONFIGS)}")
    p.add_argument("--kv-fraction", type=float, default=0.9, help="engine.kv_cache_memory_fraction")
    p.add_argument(
        "--attention-backend", choices=["auto", "triton", "cuda"], default="triton", help="engine.attention_backend"
    )
    p.add_argument("--json")
    args = p.parse_args()
    names = args.configs.split(",")
    if unknown := set(names) - set(CONFIGS):
        p.error(f"unknown configs: {sorted(unknown)}")
    if names[0] != "bf16":
        p.error("the first config is the baseline: bf16")
    if not torch.cuda.is_available():
        print("FP8 needs a CUDA GPU (compute capability 8.9+); nothing to measure here")
        return 0
    device = torch.device("cuda")
    model = build_model(args.preset, device, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    bandwidth = copy_bandwidth(device)
    context = args.prompt_len + args.new_tokens / 2
    max_len = args.prompt_len + args.new_tokens
    rows = []
    for name in names:
        weight_dtype, kv_dtype = CONFIGS[name]
        engine = Engine(model, engine_config(args, weight_dtype, kv_dtype))
        sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
        seconds, out = best_time(lambda e=engine: generate(e, prompts, sampling), device, args.repeats)
        tok_s = args.batch * args.new_tokens / seconds
        stats = engine.stats()
        kv_sequences = stats.num_total_blocks * engine.cfg.block_size / max_len
        weights = stored_bytes(model, weight_dtype == "fp8")
        ceiling = roofline(model, weights, args.batch, context, bandwidth, kv_dtype == "fp8")
        engine.sleep()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        diffs = []
        for prompt, [(ids, lps)] in zip(prompts[: args.score], out[: args.score], strict=True):
            diffs += [abs(a - b) for a, b in zip(lps, bf16_logprobs(model, prompt, ids), strict=True)]
        rows.append(
            {
                "config": name,
                "weight_dtype": weight_dtype,
                "kv_cache_dtype": kv_dtype,
                "tok_s": tok_s,
                "roofline_tok_s": ceiling,
                "vs_bf16": tok_s / (rows[0]["tok_s"] if rows else tok_s),
                "logprob_diff": sum(diffs) / len(diffs),
                "kv_cache_sequences": kv_sequences,
                "preemptions": stats.num_preemptions,
            }
        )
    name = torch.cuda.get_device_name(device)
    print(f"\n{args.preset}, {args.batch} x {args.new_tokens} new tokens (prompts of {args.prompt_len}), {name}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}")
    print("| config | tok/s | roofline tok/s | share | vs bf16 | logprob diff | KV cache (sequences) | preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = r["tok_s"] / r["roofline_tok_s"]
        print(
            f"| {r['config']} | {r['tok_s']:,.0f} | {r['roofline_tok_s']:,.0f} | {share:.0%} "
            f"| {r['vs_bf16']:.2f}x | {r['logprob_diff']:.4f} | {r['kv_cache_sequences']:,.0f} | {r['preemptions']} |"
        )
    if any(r["preemptions"] for r in rows):
        print(
            f"a row with preemptions held fewer than {args.batch} sequences in its KV cache at some point: "
            "more --kv-fraction measures the kernels instead"
        )
    print(
        f"logprob diff: mean |engine's log-prob - the bf16 model's (transformers, one forward)| over the "
        f"{args.score} first sequences' sampled tokens"
    )
    if args.json:
        meta = {"preset": args.preset, "batch": args.batch, "new_tokens": args.new_tokens, "device": name}
        meta |= {"prompt_len": args.prompt_len, "torch": torch.__version__, "python": platform.python_version()}
        meta |= {"bandwidth": bandwidth, "kv_fraction": args.kv_fraction, "attention_backend": args.attention_backend}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
