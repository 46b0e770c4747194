"""Mixture of experts on one GPU, the MoE issue's three measurements in one run:

* engine: Qwen3-30B-A3B's shape (random bf16 weights, 30.5B parameters) at each
  `--batches` size, B prompts x `--new-tokens` at temperature 1, against HF `generate`
  in the same run and against the weight-read roofline (a decode step reads every weight
  once: at batch 64 with 8 of 128 experts per token, 98% of the experts are hit); one
  engine row per `--moe-backends` value (`engine.moe_runner_backend`: `auto`, the
  engine's Triton experts; `model`, the model's own blocks), HF once;
* learner: that shape's first `--cut-layers` layers (the 8-layer cut: 5.6B parameters,
  the whole LM head), one optimizer step per mini-batch of `--learner-tokens` tokens.
  Rows: HF's own forward and backward (the model's `grouped_mm` experts, bf16 autocast
  over float32 weights, the log-probs of the sampled tokens from the logits, AdamW) and
  polyrl's `Learner` (its default path for the model), without and with routing replay
  (R3, with random engine routes). Tokens/s counts every token; peak memory is torch's
  max allocated over the row;
* bytes: a version's bytes after real optimizer steps (the learner row's, at `--lr`):
  bf16 raw against the lossless delta to the version before (`polyrl.transfer.delta`;
  one more step after the timed ones, untimed),
  for the experts, the attention and the rest, with the share of 16-bit words changed.

    python benchmarks/moe.py --device cuda --json "$OUT/moe.json" [--parts engine,learner,bytes]
        [--batches 64,256] [--new-tokens 256] [--baselines grouped,dynamic] [--moe-backends auto,model]
    python benchmarks/moe.py --device cpu      # tiny shapes: proves the script

HF baselines: `dynamic` is plain `generate`, which switches the experts to `batched_mm`
for decoding; `grouped` keeps `grouped_mm` (the faster at batch 64 on an H100 in the
issue's measurement: 537 against 248 tok/s); `static` as in benchmarks/engine.py. Every
part and row runs in its own try/except: a failure prints, and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model, copy_bandwidth, measure, preset_config, profile_engine  # noqa: E402  (benchmarks/engine.py)
from learner import make_items  # noqa: E402  (benchmarks/learner.py: random tokens and log-probs)

from polyrl.config import AlgoConfig, EngineConfig, TrainerConfig  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.trainer.learner import Learner, build_optimizer  # noqa: E402
from polyrl.transfer.delta import apply_delta, encode_delta  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


def engine_part(args: argparse.Namespace) -> list[dict]:
    preset = "qwen3-30b-a3b" if args.device.type == "cuda" else "tiny-moe"
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    model = build_model(preset, args.device, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"engine: {preset}, {params / 1e9:.2f}B parameters, {dtype}", flush=True)
    bandwidth = copy_bandwidth(args.device) if args.device.type == "cuda" else None
    vocab = model.config.vocab_size
    rows = []
    for i, backend in enumerate(args.moe_backends.split(",")):
        engine = Engine(
            model,
            EngineConfig(
                max_num_seqs=max(args.batches),
                max_num_batched_tokens=8192,
                max_model_len=args.prompt_len + args.new_tokens,
                kv_cache_memory_fraction=0.5,
                moe_runner_backend=backend,
            ),
        )
        graphs = engine.runner.decode_graphs
        for batch in args.batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=g).tolist()
            print(f"  batch {batch} x {args.new_tokens} new tokens, moe_runner_backend={backend} ...", flush=True)
            baselines = args.baselines if i == 0 else []  # HF once: the same model and work for every backend
            try:
                row = measure(model, engine, prompts, args.new_tokens, 1, True, args.repeats, baselines, bandwidth)
            except Exception:
                traceback.print_exc()
                row = {"sequences": batch, "error": traceback.format_exc(limit=2)[-300:]}
            rows.append(
                {"part": "engine", "preset": preset, "batch": batch, "moe_runner_backend": backend,
                 "cuda_graphs": bool(graphs), **row}
            )  # fmt: skip
            if args.profile:
                rows[-1]["profile"] = profile_engine(engine, prompts, args.device, args.profile_tokens)
        engine.sleep()  # frees the KV cache and the graphs
        del engine
        free()
    del model
    free()
    return rows


# ---------------------------------------------------------------------------------------------
# Learner and bytes
# ---------------------------------------------------------------------------------------------


def cut_config(args: argparse.Namespace) -> Qwen3MoeConfig:
    """The 30B-A3B shape cut to `--cut-layers` layers (the tiny MoE on CPU)."""
    preset = "qwen3-30b-a3b" if args.device.type == "cuda" else "tiny-moe"
    return preset_config(preset, num_layers=args.cut_layers, max_positions=8192)


def build_cut(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(args.device):
        return AutoModelForCausalLM.from_config(cut_config(args), dtype=torch.float32).train()


def batch_items(args: argparse.Namespace, config: Qwen3MoeConfig, with_routes: bool):
    seqs = max(1, args.learner_tokens // args.seq_len)
    items = make_items([args.seq_len] * seqs, args.prompt_len, config.vocab_size, seed=0)
    if with_routes:  # what an engine reports: k distinct experts per position and MoE layer
        rng = np.random.default_rng(0)
        k, experts = config.num_experts_per_tok, config.num_experts
        for it in items:
            rows = len(it.token_ids) - 1
            picks = np.argsort(rng.random((rows, config.num_hidden_layers, experts)), axis=-1)[..., :k]
            it.routes = picks.reshape(rows, -1).astype(np.int32)
    return items


def hf_row(args: argparse.Namespace) -> dict:
    """HF's forward and backward: the whole batch in micro-batches of `--micro-tokens`,
    the sampled tokens' log-probs from the logits, mean over tokens, then AdamW."""
    model = build_cut(args)
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.device.type == "cuda")
    items = batch_items(args, config, with_routes=False)
    ids = torch.tensor([it.token_ids for it in items], device=args.device)
    per_micro = max(1, args.micro_tokens // args.seq_len)
    autocast = torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.device.type == "cuda")

    def step() -> float:
        total = torch.zeros((), device=args.device)
        for part in ids.split(per_micro):
            with autocast:
                logits = model(input_ids=part).logits[:, args.prompt_len - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, part[:, args.prompt_len :, None])
            loss = -logp.sum() / (ids.shape[0] * (args.seq_len - args.prompt_len))
            loss.backward()
            total += loss.detach()  # read back once, after the step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total.item()

    return timed_row("hf grouped_mm fwd+bwd", step, ids.numel(), args)  # the caller frees the model


def polyrl_row(args: argparse.Namespace, replay: str, keep_versions: bool) -> tuple[dict, dict | None]:
    model = build_cut(args)
    total = args.warmup + args.steps
    cfg = TrainerConfig(
        lr=args.lr,
        warmup_steps=0,
        train_batch_size=64,
        ppo_mini_batch_size=64,
        micro_batch_max_tokens=args.micro_tokens,
    )
    optimizer, scheduler = build_optimizer(model, cfg, total)
    learner = Learner(
        model=model,
        ref_model=None,
        optimizer=optimizer,
        scheduler=scheduler,
        algo=AlgoConfig(router_replay=replay),
        cfg=cfg,
        temperature=1.0,
        pad_id=0,
        compute_dtype=torch.bfloat16 if args.device.type == "cuda" else torch.float32,
    )
    items = batch_items(args, model.config, with_routes=replay == "R3")
    tokens = sum(len(it.token_ids) for it in items)

    def step() -> float:
        return learner.train_mini_batch(items, weights_as_sampled=True)["actor/pg_loss"]

    row = timed_row(f"polyrl learner{', R3' if replay == 'R3' else ''}", step, tokens, args)
    delta = None
    if keep_versions:  # one more step, untimed: the version before it, as a worker holds it, and after
        before = version(learner.model)
        step()
        delta = version_bytes(before, version(learner.model))
    return row, delta  # the caller frees the model


def timed_row(name: str, step, tokens: int, args: argparse.Namespace) -> dict:
    print(f"  {name} ...", flush=True)
    reset_peak(args.device)
    warm = []
    for _ in range(args.warmup):
        sync(args.device)
        t0 = time.perf_counter()
        step()
        sync(args.device)
        warm.append(time.perf_counter() - t0)
    times, loss = [], None
    for _ in range(args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        loss = step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    row = {
        "part": "learner",
        "row": name,
        "tokens": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_gib": peak_gib(args.device),
        "warmup_s": sum(warm),
        "loss": loss,
    }
    print(f"    {row}", flush=True)
    return row


def version(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The bf16 bytes a worker would hold, by parameter name."""
    return {
        name: p.detach().to(torch.bfloat16).cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
        for name, p in model.named_parameters()
    }


def kind_of(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if ".mlp.gate." in name:
        return "router"
    if ".self_attn." in name:
        return "attention"
    return "embeddings, norms, head"


def version_bytes(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> dict:
    """Raw bf16 bytes against the lossless delta, per kind of parameter; every delta is
    applied back and checked bit for bit."""
    out: dict[str, dict[str, float]] = {}
    for name, buf in new.items():
        payload = encode_delta(old[name], buf)
        check = np.empty_like(buf)
        changed = apply_delta(old[name], payload, check)
        if not np.array_equal(check, buf):
            raise AssertionError(f"delta of {name} is not bit-exact")
        acc = out.setdefault(kind_of(name), {"raw_bytes": 0, "delta_bytes": 0, "changed_words": 0})
        acc["raw_bytes"] += buf.size
        acc["delta_bytes"] += len(payload)
        acc["changed_words"] += changed
    total = {k: sum(v[k] for v in out.values()) for k in ("raw_bytes", "delta_bytes", "changed_words")}
    out["all"] = total
    for v in out.values():
        v["delta_of_raw"] = v["delta_bytes"] / v["raw_bytes"]
        v["changed_share"] = v["changed_words"] / (v["raw_bytes"] / 2)
    return out


def learner_part(args: argparse.Namespace, want_bytes: bool) -> tuple[list[dict], dict | None]:
    rows, delta = [], None
    config = cut_config(args)
    print(
        f"learner: {args.cut_layers}-layer cut, {config.num_experts} experts x top-{config.num_experts_per_tok}, "
        f"{args.learner_tokens} tokens per step ({args.seq_len} per sequence)",
        flush=True,
    )
    plan = [("hf", None), ("polyrl", "disabled"), ("polyrl", "R3")]
    for kind, replay in plan:
        try:
            if kind == "hf":
                rows.append(hf_row(args))
            else:
                keep = want_bytes and delta is None
                row, got = polyrl_row(args, replay, keep)
                rows.append(row)
                delta = got if got is not None else delta
        except Exception:
            traceback.print_exc()
            rows.append(
                {"part": "learner", "row": f"{kind} {replay or ''}".strip(), "error": traceback.format_exc()[-300:]}
            )
            free()
    return rows, delta


# ---------------------------------------------------------------------------------------------


def print_tables(engine_rows: list[dict], learner_rows: list[dict], delta: dict | None) -> None:
    if engine_rows:
        cols = [c for c in ("grouped", "dynamic", "static") if any(f"{c}_tok_s" in r for r in engine_rows)]
        hf_best = {  # HF ran once per batch (with the first backend); every engine row is held to it
            r["batch"]: max(r[f"{c}_tok_s"] for c in cols if f"{c}_tok_s" in r)
            for r in engine_rows
            if any(f"{c}_tok_s" in r for c in cols)
        }
        print(
            "\n| batch | experts | engine tok/s | "
            + " | ".join(f"HF {c} tok/s" for c in cols)
            + " | vs best HF | roofline tok/s | of roofline |"
        )
        print("|---|---|---|" + "---|" * (len(cols) + 3))
        for r in engine_rows:
            cells = [f"{r[f'{c}_tok_s']:.0f}" if f"{c}_tok_s" in r else "-" for c in cols]
            engine = f"{r['engine_tok_s']:.0f}" if "engine_tok_s" in r else "failed"
            best = hf_best.get(r["batch"])
            speed = f"{r['engine_tok_s'] / best:.2f}x" if best and "engine_tok_s" in r else "-"
            roof = f"{r['roofline_tok_s']:.0f} | {r['fraction_of_roofline']:.0%}" if "roofline_tok_s" in r else "- | -"
            experts = r.get("moe_runner_backend", "-")
            print(f"| {r['batch']} | {experts} | {engine} | " + " | ".join(cells) + f" | {speed} | {roof} |")
    if learner_rows:
        base = next(
            (r["tokens_per_s"] for r in learner_rows if r["row"].startswith("hf") and "tokens_per_s" in r), None
        )
        print("\n| learner row | step s | tokens/s | vs HF | peak GiB | warm-up s |")
        print("|---|---|---|---|---|---|")
        for r in learner_rows:
            if "error" in r:
                print(f"| {r['row']} | failed | | | | |")
                continue
            vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            print(f"| {r['row']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {vs} | {peak} | {r['warmup_s']:.1f} |")
    if delta:
        print("\n| parameters | raw MB | delta MB | delta / raw | words changed |")
        print("|---|---|---|---|---|")
        for kind, v in delta.items():
            print(
                f"| {kind} | {v['raw_bytes'] / 1e6:.1f} | {v['delta_bytes'] / 1e6:.2f} | {v['delta_of_raw']:.1%} "
                f"| {v['changed_share']:.2%} |"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default="engine,learner,bytes")
    p.add_argument("--batches", default=None, help="engine batch sizes (default: 64,256 on CUDA, 8 on CPU)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None, help="default: 256 on CUDA, 16 on CPU")
    p.add_argument("--baselines", default="grouped,dynamic", help="HF generate baselines: grouped,dynamic,static")
    p.add_argument("--moe-backends", default="auto,model", help="engine.moe_runner_backend values, each an engine row")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up, best of")
    p.add_argument("--cut-layers", type=int, default=None, help="learner layers (default: 8 on CUDA, 2 on CPU)")
    p.add_argument(
        "--learner-tokens", type=int, default=None, help="tokens per step (default: 32768 on CUDA, 512 on CPU)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 2048 on CUDA, 128 on CPU)")
    p.add_argument(
        "--micro-tokens", type=int, default=None, help="micro-batch tokens (default: 8192 on CUDA, 256 on CPU)"
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="engine: also profile each batch's decode (top kernels)")
    p.add_argument("--profile-tokens", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args()
    args.device = torch.device(args.device)
    gpu = args.device.type == "cuda"
    args.batches = [int(b) for b in (args.batches or ("64,256" if gpu else "8")).split(",")]
    args.new_tokens = args.new_tokens or (256 if gpu else 16)
    args.cut_layers = args.cut_layers or (8 if gpu else 2)
    args.learner_tokens = args.learner_tokens or (32768 if gpu else 512)
    args.seq_len = args.seq_len or (2048 if gpu else 128)
    args.micro_tokens = args.micro_tokens or (8192 if gpu else 256)
    args.baselines = [b for b in args.baselines.split(",") if b]
    parts = set(args.parts.split(","))
    if unknown := parts - {"engine", "learner", "bytes"}:
        p.error(f"unknown parts: {sorted(unknown)}")
    if unknown := set(args.baselines) - {"grouped", "dynamic", "static"}:
        p.error(f"unknown baselines: {sorted(unknown)}")

    engine_rows = engine_part(args) if "engine" in parts else []
    learner_rows, delta = learner_part(args, "bytes" in parts) if parts & {"learner", "bytes"} else ([], None)
    machine = (
        torch.cuda.get_device_name(args.device) if gpu else f"{platform.machine()}, CPU"
    ) + f", torch {torch.__version__}"
    print(f"\n{machine}; learning rate {args.lr:g}, {args.steps} timed steps after {args.warmup}")
    print_tables(engine_rows, learner_rows, delta)
    if args.json:
        args_out = {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items()}
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine, "args": args_out, "engine": engine_rows, "learner": learner_rows, "bytes": delta},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
