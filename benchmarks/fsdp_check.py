"""Training on several GPUs (FSDP2), checked and timed. Run it under torchrun:

    PYTHONPATH=src python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/fsdp_check.py --json fsdp.json
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/fsdp_check.py --tiny    # CPU smoke test (gloo)

Every model is Qwen3-0.6B-shaped (hidden 1024, 28 layers, 16/8 heads, head_dim 128,
intermediate 3072, vocab 151936, tied embeddings) with random weights, the same on every
rank; `--tiny` shrinks it. Mini-batches are synthetic GRPO samples: random tokens,
behaviour log-probs near the random model's own (-log vocab +- 0.5, so the importance
weights, and with them the loss, depend on the model) and advantages in [0.5, 1.5] (so
the loss is far from 0 and its relative difference means something), trained by polyrl's
own Learner at lr 1e-6.

(a) agreement: the same mini-batches on rank 0 alone (one process: float32 weights under
    bf16 autocast) and on all ranks (FSDP: bf16 parameters, float32 gradient reduction),
    from the same weights: the per-step losses and their largest relative difference.
(b) publishing: whole tensors gathered to rank 0 and copied to pinned host memory (what
    polyrl does), versus each rank copying its own shard to pinned host memory.
(c) a training step (one mini-batch) per 1k tokens on 1 rank and on all, with and without
    activation checkpointing, and FSDP under autocast instead of the bf16 parameter policy.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.trainer.batching import SeqItem
from polyrl.trainer.distributed import DataParallel, full_parameters, shard_model
from polyrl.trainer.learner import Learner, build_optimizer, enable_gradient_checkpointing

QWEN3_06B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
}


class Lockstep(DataParallel):
    """Every rank of this script makes the same calls: nothing to tell the others."""

    @contextmanager
    def command(self, name: str, *args: object) -> Iterator[None]:
        yield


def sync(device: torch.device, group: dist.ProcessGroup | None) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def build_model(shape: dict, device: torch.device) -> PreTrainedModel:
    """Random weights from seed 0, on the device (the same on every rank)."""
    config = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def same_on_every_rank(model: PreTrainedModel, group: dist.ProcessGroup) -> None:
    """The ranks' random inits must agree, or (a) compares different models."""
    sums = [float(p.detach().double().sum()) for p in list(model.parameters())[:4]]
    every: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sums, group=group)
    assert all(s == every[0] for s in every), f"random init differs across ranks: {every}"


def mini_batches(num: int, rows: int, prompt_len: int, completion: tuple[int, int], vocab: int) -> list[list[SeqItem]]:
    rng = random.Random(0)
    out = []
    for _ in range(num):
        items = []
        for _ in range(rows):
            n = rng.randint(*completion)
            ids = [rng.randrange(3, vocab) for _ in range(prompt_len + n)]
            behav = [-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(n)]
            items.append(SeqItem(ids, prompt_len, behav, rng.uniform(0.5, 1.5)))
        out.append(items)
    return out


def train_variant(
    args: argparse.Namespace,
    all_ranks: Lockstep,
    on_all: bool,
    checkpointing: bool,
    cast_params: bool,
    batches: list[list[SeqItem]],
    device: torch.device,
    dtype: torch.dtype,
) -> dict | None:
    """One learner through `batches` (the first is warm-up); None on ranks that sit it out."""
    if not on_all and all_ranks.rank != 0:
        dist.barrier(group=all_ranks.control)  # rank 0 trains alone meanwhile
        return None
    dp = all_ranks if on_all else DataParallel()
    group = all_ranks.control if on_all else None
    model = build_model(args.shape, device)
    if on_all:
        same_on_every_rank(model, all_ranks.control)
    if checkpointing:
        enable_gradient_checkpointing(model)
    autocast_dtype = shard_model(model, dtype, cast_params) if on_all else dtype
    tcfg = TrainerConfig(
        lr=1e-6,
        warmup_steps=0,
        train_batch_size=16,
        ppo_mini_batch_size=16,
        micro_batch_max_tokens=args.micro_batch_max_tokens,
    )
    optimizer, scheduler = build_optimizer(model, tcfg, len(batches))
    learner = Learner(
        model=model,
        ref_model=None,
        optimizer=optimizer,
        scheduler=scheduler,
        algo=AlgoConfig(),
        cfg=tcfg,
        temperature=1.0,
        pad_id=0,
        compute_dtype=autocast_dtype,
        dp=dp,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics = [], []
    for i, items in enumerate(batches):
        sync(device, group)
        t0 = time.perf_counter()
        metrics.append(learner.train_mini_batch(items, weights_as_sampled=i == 0))
        sync(device, group)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    is_cast = on_all and cast_params and dtype != torch.float32
    precision = "bf16 params (FSDP policy)" if is_cast else f"autocast {str(dtype).removeprefix('torch.')}"
    num_tokens = statistics.mean(sum(len(it.token_ids) for it in b) for b in batches)
    row = {
        "ranks": all_ranks.world_size if on_all else 1,
        "checkpointing": checkpointing,
        "precision": precision,
        "step_s": step_s,
        "tokens_per_step": num_tokens,
        "ms_per_1k_tokens": 1000 * step_s / (num_tokens / 1000),
        "peak_gib_rank0": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "metrics": metrics,
    }
    del learner, optimizer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not on_all:
        dist.barrier(group=all_ranks.control)
    return row


def agreement(one: dict, many: dict) -> dict:
    """Largest relative difference per metric over the steps."""
    keys = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout/logprob_diff")
    pairs = list(zip(one["metrics"], many["metrics"], strict=True))
    rel = {k: max(abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-12) for a, b in pairs if k in a) for k in keys}
    steps = [{"pg_loss_1": a["actor/pg_loss"], f"pg_loss_{many['ranks']}": b["actor/pg_loss"]} for a, b in pairs]
    return {"max_rel_diff": rel, "steps": steps}


def publish_timings(args: argparse.Namespace, dp: Lockstep, device: torch.device, dtype: torch.dtype) -> dict:
    """Median seconds of the two ways to get a new version to host memory (after a warm-up),
    in the dtype the rollout publishes (bf16 on CUDA)."""
    model = build_model(args.shape, device)
    shard_model(model, dtype)
    params = [p for _, p in model.named_parameters()]
    pinned = device.type == "cuda"
    whole_bytes = sum(p.numel() for p in params) * dtype.itemsize
    shard_bytes = sum(p.to_local().numel() for p in params) * dtype.itemsize
    whole_host = torch.empty(whole_bytes if dp.is_main else 0, dtype=torch.uint8, pin_memory=pinned)
    shard_host = torch.empty(shard_bytes, dtype=torch.uint8, pin_memory=pinned)

    def copy_to(host: torch.Tensor, tensors: Iterator[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            flat = t.to(dtype).contiguous().view(-1).view(torch.uint8)
            host[offset : offset + flat.numel()].copy_(flat, non_blocking=pinned)
            offset += flat.numel()

    def gathered() -> None:
        weights = full_parameters(model)  # every rank joins each gather
        if dp.is_main:
            copy_to(host=whole_host, tensors=iter(weights.values()))

    def per_rank() -> None:
        copy_to(host=shard_host, tensors=(p.to_local() for p in params))

    def median_s(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(1 + args.repeats):
            sync(device, dp.control)
            t0 = time.perf_counter()
            fn()
            sync(device, dp.control)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    out = {"bytes": whole_bytes, "dtype": str(dtype).removeprefix("torch.")}
    for name, fn in (("gather_to_rank0_then_host", gathered), ("each_rank_shard_to_host", per_rank)):
        s = median_s(fn)
        out[name] = {"s": s, "gb_per_s": whole_bytes / s / 1e9}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batches (CPU smoke test)")
    parser.add_argument("--steps", type=int, default=4, help="mini-batches per variant, the first a warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each publishing method")
    args = parser.parse_args()
    t_start = time.perf_counter()
    is_cuda = torch.cuda.is_available() and not args.tiny
    if is_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if is_cuda else "gloo")
    if dist.get_world_size() < 2:
        raise SystemExit("run under torchrun with --nproc_per_node 2 (or more)")
    dp = Lockstep(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))
    device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    args.shape = TINY if args.tiny else QWEN3_06B
    args.micro_batch_max_tokens = 256 if args.tiny else 4096
    rows, prompt_len, completion = (8, 8, (4, 24)) if args.tiny else (16, 128, (256, 384))
    batches = mini_batches(args.steps, rows, prompt_len, completion, args.shape["vocab_size"])

    # (on all ranks, activation checkpointing, FSDP casts parameters to bf16)
    variants = [
        (False, False, True),
        (False, True, True),
        (True, False, True),
        (True, True, True),
        (True, False, False),
    ]
    train_rows = []
    for on_all, checkpointing, cast_params in variants:
        row = train_variant(args, dp, on_all, checkpointing, cast_params, batches, device, dtype)
        train_rows.append(row)
        if dp.is_main:
            print(
                f"[{time.perf_counter() - t_start:5.1f}s] trained {row['ranks']} rank(s), "
                f"checkpointing {checkpointing}, {row['precision']}",
                flush=True,
            )
    publish = publish_timings(args, dp, device, dtype)
    if dp.is_main:
        report(args, dp, train_rows, publish, dtype, time.perf_counter() - t_start)
    dist.destroy_process_group()
    return 0


def report(
    args: argparse.Namespace, dp: Lockstep, rows: list[dict], publish: dict, dtype: torch.dtype, wall_s: float
) -> None:
    one, many = rows[0], rows[2]
    agree = agreement(one, many)
    n = dp.world_size
    name = str(dtype).removeprefix("torch.")
    print(f"\n(a) {name} agreement, 1 rank vs {n} ranks, same weights and mini-batches (step 1 is the warm-up)")
    print(f"| step | pg_loss 1 rank | pg_loss {n} ranks |")
    print("|---|---|---|")
    for i, s in enumerate(agree["steps"], 1):
        print(f"| {i} | {s['pg_loss_1']:.6f} | {s[f'pg_loss_{n}']:.6f} |")
    print("max relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in agree["max_rel_diff"].items()))
    print(f"\n(b) publishing {publish['bytes'] / 1e9:.2f} GB ({publish['dtype']}), median of {args.repeats}")
    print("| method | s | GB/s |")
    print("|---|---|---|")
    for name in ("gather_to_rank0_then_host", "each_rank_shard_to_host"):
        print(f"| {name} | {publish[name]['s']:.3f} | {publish[name]['gb_per_s']:.1f} |")
    print(f"\n(c) one training step (mini-batch of ~{one['tokens_per_step']:.0f} tokens), median of {args.steps - 1}")
    print("| ranks | checkpointing | precision | s/step | ms per 1k tokens | peak GiB (rank 0) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_gib_rank0']:.1f}" if r["peak_gib_rank0"] is not None else "-"
        print(
            f"| {r['ranks']} | {r['checkpointing']} | {r['precision']} | {r['step_s']:.3f} | "
            f"{r['ms_per_1k_tokens']:.1f} | {peak} |"
        )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else platform.machine()
    machine = f"{n} x {gpu}, torch {torch.__version__}"
    print(f"\n{machine}; {wall_s:.0f} s in all")
    if args.json:
        result = {
            "machine": machine,
            "world_size": n,
            "tiny": args.tiny,
            "agreement": agree,
            "publish": publish,
            "train": rows,
            "wall_s": wall_s,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
