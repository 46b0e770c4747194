"""LoRA against full fine-tuning: learner speed and memory, bytes per version, and the time
from "adapter version published" to "worker serving it".

    PYTHONPATH=src python benchmarks/lora.py --device cuda --json "$OUT/lora.json"
    PYTHONPATH=src python benchmarks/lora.py --device cpu     # a tiny shape, proves the script

1. Learner (per shape: Qwen3-0.6B and Qwen3-8B on CUDA, a tiny Qwen3 on CPU; random
   weights from seed 0, float32 masters, bf16 compute on CUDA): one real `Learner` per row,
   full fine-tuning and LoRA at r = 1, 16, 64 on all linear layers, the same mini-batch
   (`--seqs` sequences of `--seq-len` tokens; activation checkpointing for the 8B shape),
   warm-up steps then timed steps; tokens/s
   (every token of the mini-batch) and torch's peak allocated memory. Full fine-tuning is
   skipped where its float32 weights, gradients and Adam state (16 bytes a parameter)
   cannot fit the device; any row that fails (OOM) prints and the next one runs. LoRA rows
   run the trainer's default on one GPU: the frozen base in bf16 (`trainer.working_copy`).
2. Wire bytes: an adapter version (bf16 on CUDA, as `RemoteRollout.publish` sends it;
   float32 on CPU) against the whole model's version in the same dtype; and "delta": what
   the lossless delta codec (`transfer.codec = delta`, or auto on a slow link) sends for
   each step's version against the one before, median over the row's steps (lr 1e-5).
3. Published -> serving through the real path (WeightPublisher -> manager -> PublisherSync
   -> a `polyrl worker` that pulls and merges), for the first shape at r = 16, over
   loopback TCP and (CUDA) on the same GPU: `--versions` adapter versions, each a fresh
   random adapter.
4. (CUDA) "fit": the last shape's LoRA r = 16 training step, adapter merge and a batch of
   generation in turn on the one GPU (`fit_together`), with the device memory they take.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from learner import QWEN3_06B, TINY, build_model, machine, make_items  # noqa: E402  (benchmarks/learner.py)
from publish_to_serve import announce_and_wait, state, wait  # noqa: E402

from polyrl.config import AlgoConfig, LoraConfig, ManagerConfig, TrainerConfig  # noqa: E402
from polyrl.manager.main import ManagerThread  # noqa: E402
from polyrl.manager.weight_sync import PublisherSync  # noqa: E402
from polyrl.trainer.learner import Learner, build_optimizer, enable_gradient_checkpointing  # noqa: E402
from polyrl.trainer.lora import adapter_version, adapters_off, apply_lora  # noqa: E402
from polyrl.transfer.delta import encode_delta  # noqa: E402
from polyrl.transfer.device import DeviceVersions  # noqa: E402
from polyrl.transfer.manifest import flatten, layout  # noqa: E402
from polyrl.transfer.publisher import WeightPublisher  # noqa: E402

QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
}
RANKS = (1, 16, 64)


def shapes(device: torch.device) -> dict[str, dict]:
    return {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B} if device.type == "cuda" else {"tiny": TINY}


def num_params(shape: dict) -> int:
    h, i, d, layers = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return layers * (2 * h * q + 2 * h * kv + 3 * h * i) + shape["vocab_size"] * h  # tied embeddings


def full_fits(shape: dict, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    return num_params(shape) * 16 < 0.9 * torch.cuda.get_device_properties(device).total_memory


def uses_checkpointing(shape: dict, args: argparse.Namespace) -> bool:
    """auto: on for the 8B shape, whose activations at 16k tokens a micro-batch would not fit
    80 GB beside its float32 weights (32 GiB) without it."""
    return args.checkpointing == "on" or (args.checkpointing == "auto" and shape["hidden_size"] >= 4096)


def build(shape: dict, rank: int | None, args: argparse.Namespace, compiled: bool) -> tuple[Learner, object]:
    model = build_model(shape, args.device)
    if uses_checkpointing(shape, args):
        enable_gradient_checkpointing(model)
    peft = apply_lora(model, LoraConfig(rank=rank, alpha=2 * rank)) if rank else None
    cfg = TrainerConfig(
        lr=1e-5,
        warmup_steps=0,
        train_batch_size=64,
        ppo_mini_batch_size=64,
        micro_batch_max_tokens=args.micro_batch_tokens,
        compile_layers="auto" if compiled else False,
    )
    optimizer, scheduler = build_optimizer(model, cfg, args.warmup + args.steps)
    off = (lambda: adapters_off(peft)) if peft is not None else None
    learner = Learner(
        model=model,
        ref_model=None,
        optimizer=optimizer,
        scheduler=scheduler,
        algo=AlgoConfig(),
        cfg=cfg,
        temperature=1.0,
        pad_id=0,
        compute_dtype=args.dtype,
        adapters_off=off,
    )
    return learner, peft


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def learner_row(name: str, shape: dict, rank: int | None, args: argparse.Namespace, compiled: bool = True) -> dict:
    """The trainer's defaults (on one GPU in bf16: packed, compiled layers; the bf16 working
    copy for full fine-tuning only); `compiled=False` is the retry when compiling fails."""
    learner, peft = build(shape, rank, args, compiled)
    items = make_items([args.seq_len] * args.seqs, min(64, args.seq_len // 2), shape["vocab_size"], seed=0)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    wire_dtype = args.dtype if args.device.type == "cuda" else torch.float32
    times, deltas, previous = [], [], None
    for i in range(args.warmup + args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        learner.train_mini_batch(items, weights_as_sampled=True)
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if peft is not None:  # each step is one version: what the delta codec would send for it
            current = wire_buffer(adapter_version(peft), wire_dtype)
            if previous is not None:
                deltas.append(len(encode_delta(previous, current)))
            previous = current
    step_s = sorted(times)[len(times) // 2]
    full_bytes = sum(p.numel() for p in learner.model.parameters()) * wire_dtype.itemsize
    row = {
        "shape": name,
        "mode": f"lora-r{rank}" if rank else "full",
        "tokens": args.seqs * args.seq_len,
        "step_s": step_s,
        "tokens_per_s": args.seqs * args.seq_len / step_s,
        "peak_gib": torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.type == "cuda" else None,
        "trainable": sum(p.numel() for p in learner.model.parameters() if p.requires_grad),
        "compiled": learner.is_compiled,
        "checkpointing": uses_checkpointing(shape, args),
        "working_copy": learner.work is not learner.model,
    }
    if peft is not None:
        version = {k: t.to(wire_dtype) if t.is_floating_point() else t for k, t in adapter_version(peft).items()}
        base = sum(p.numel() for n, p in learner.model.named_parameters() if ".lora_" not in n) * wire_dtype.itemsize
        row["wire_bytes"] = layout(version, 1).total_bytes
        row["full_version_bytes"] = base
        row["wire_fraction"] = row["wire_bytes"] / base
        row["delta_bytes"] = sorted(deltas)[len(deltas) // 2]  # median over the steps after the first
        row["delta_fraction"] = row["delta_bytes"] / base
    else:
        row["wire_bytes"] = row["full_version_bytes"] = full_bytes
        row["wire_fraction"] = 1.0
    return row


def wire_buffer(version: dict[str, torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """A version's bytes as the publisher lays them out (floating tensors in `dtype`)."""
    cast = {k: t.to(dtype) if t.is_floating_point() else t for k, t in version.items()}
    return flatten({k: t.cpu() for k, t in cast.items()}, 1)[0].numpy()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def publish_to_serving(
    name: str, shape: dict, rank: int, args: argparse.Namespace, same_gpu: bool = False
) -> list[dict]:
    """Adapter versions through the real path into one `polyrl worker` on this host: over
    loopback TCP, or (`same_gpu`) with the versions also held on this GPU, which the
    manager then tells the worker, on the same GPU, to copy over CUDA IPC (from its second
    version on: the first reply tells the manager where the worker's engine is)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(shape, torch.device("cpu"))
        model.to(torch.bfloat16 if args.device.type == "cuda" else torch.float32).save_pretrained(tmp)
        peft = apply_lora(model, LoraConfig(rank=rank, alpha=2 * rank))
        cfg = ManagerConfig(port=0, token="bench", heartbeat_interval_s=0.5)
        with ManagerThread(cfg) as mt, WeightPublisher() as pub:
            if same_gpu:
                pub.device = DeviceVersions(args.device, timeout_s=60)
            sync = PublisherSync(mt.manager, pub, pull_timeout_s=600, codec="raw")
            mt.add_sync_hook(sync)
            cmd = [
                sys.executable,
                "-m",
                "polyrl.cli",
                "worker",
                "--model",
                tmp,
                "--manager",
                mt.url,
                "--token",
                "bench",
                "--port",
                "0",
                "--worker-id",
                "w",
                "engine.max_num_seqs=8",
                f'engine.device="{args.device.type}"',
            ]
            worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait(lambda: state(mt) == ("active", 0), 600, worker)
                g = torch.Generator().manual_seed(0)
                for version in range(1, args.versions + 1):
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            if ".lora_" in n:
                                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
                    weights = {
                        k: t.to(model.dtype) if t.is_floating_point() else t for k, t in adapter_version(peft).items()
                    }
                    t0 = time.perf_counter()
                    info = pub.publish(weights, version)
                    if pub.device is not None:
                        pub.device.publish({k: t.to(args.device) for k, t in weights.items()}, version)
                    publish_s = time.perf_counter() - t0
                    announced_s, said = announce_and_wait(mt, sync, worker, version)
                    serve_s = publish_s + announced_s
                    rows.append(
                        {
                            "shape": name,
                            "rank": rank,
                            "same_gpu": same_gpu,
                            "version": version,
                            "bytes": info.manifest.total_bytes,
                            "published_to_serving_s": serve_s,
                            "publish_call_s": publish_s,
                            "worker_said": said,
                        }
                    )
                    print(
                        f"  v{version}: {info.manifest.total_bytes / 1e6:.2f} MB, published -> serving {1e3 * serve_s:.1f} ms "
                        f"(of which the publish call {1e3 * publish_s:.1f} ms; worker: {said})",
                        flush=True,
                    )
            finally:
                worker.terminate()
                worker.wait(timeout=60)
    return rows


def fit_together(name: str, shape: dict, rank: int, args: argparse.Namespace) -> dict:
    """A LoRA training step and generation on one GPU, in turn, as a hybrid run has them:
    the learner (16-bit frozen base, float32 adapters and their Adam state, activation
    checkpointing by `--checkpointing`) and an engine with its own bf16 weights, the exact
    base copy its merges start from, and a KV cache for `--gen-seqs` sequences of
    `--gen-prompt` + `--gen-new` tokens. Each round: one optimizer step, the new adapter
    merged into the engine, one batch generated. Both live in this process (the trainer
    and its local worker are two processes, which adds a CUDA context, ~0.5 GiB)."""
    from engine import engine_generate  # benchmarks/engine.py

    from polyrl.config import EngineConfig
    from polyrl.engine.engine import Engine

    device = args.device
    free(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine_model = build_model(shape, device).to(torch.bfloat16)  # float32 first, for the same weights as the learner's
    free(device)
    learner, peft = build(shape, rank, args, compiled=args.compile)
    seq_tokens = args.gen_prompt + args.gen_new
    blocks = args.gen_seqs * -(-seq_tokens // 16)
    engine = Engine(
        engine_model,
        EngineConfig(
            max_num_seqs=args.gen_seqs, max_model_len=seq_tokens, num_kv_blocks=blocks, max_num_batched_tokens=4096
        ),
    )
    items = make_items([args.seq_len] * args.seqs, min(64, args.seq_len // 2), shape["vocab_size"], seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, shape["vocab_size"], (args.gen_seqs, args.gen_prompt), generator=g).tolist()
    rounds = []
    for i in range(args.fit_rounds):
        times = {}
        for part, fn in (
            ("train_s", lambda: learner.train_mini_batch(items, weights_as_sampled=True)),
            (
                "merge_s",
                lambda v=i + 1: engine.update_weights(
                    {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in adapter_version(peft).items()},
                    v,
                ),
            ),
            ("generate_s", lambda: engine_generate(engine, prompts, args.gen_new, 1, True)),
        ):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[part] = time.perf_counter() - t0
        rounds.append(times)
        print(
            f"  round {i + 1}: train {times['train_s']:.2f} s, merge {1e3 * times['merge_s']:.0f} ms, "
            f"generate {times['generate_s']:.2f} s ({args.gen_seqs * args.gen_new / times['generate_s']:.0f} tokens/s)",
            flush=True,
        )
    free_b, total_b = torch.cuda.mem_get_info(device)
    row = {
        "shape": name,
        "rank": rank,
        "rounds": rounds,
        "train_tokens": args.seqs * args.seq_len,
        "generated_tokens": args.gen_seqs * args.gen_new,
        "kv_blocks": blocks,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "device_used_gib": (total_b - free_b) / 2**30,
        "device_total_gib": total_b / 2**30,
        "base_16bit": learner.is_base_16bit,
        "compiled": learner.is_compiled,
    }
    return row  # the caller frees the device once these locals are gone


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqs", type=int, default=None, help="sequences per mini-batch (default 16 CUDA, 4 CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024 CUDA, 64 CPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384 CUDA, 256 CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--only", choices=["learner", "serve", "fit"], help="run one part")
    p.add_argument("--fit-rounds", type=int, default=3, help="fit: train / merge / generate rounds (CUDA only)")
    p.add_argument("--gen-seqs", type=int, default=64, help="fit: sequences generated per round")
    p.add_argument("--gen-prompt", type=int, default=128, help="fit: prompt tokens per sequence")
    p.add_argument("--gen-new", type=int, default=512, help="fit: generated tokens per sequence")
    p.add_argument(
        "--checkpointing",
        choices=["auto", "on", "off"],
        default="auto",
        help="activation checkpointing in the learner (auto: on for the 8B shape)",
    )
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="never compile layers (default: the trainer's auto, retried uncompiled on failure)",
    )
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.seqs = args.seqs or (16 if cuda else 4)
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.micro_batch_tokens = args.micro_batch_tokens or (16384 if cuda else 256)

    rows, serve_rows, failures = [], [], []
    if args.only in (None, "learner"):
        print(
            f"{'shape':11s} {'mode':9s} {'tokens/s':>9s} {'peak GiB':>8s} {'step s':>7s} {'trainable':>12s} "
            f"{'wire MB':>9s} {'of full':>8s} {'delta MB':>9s} {'of full':>8s}"
        )
        for name, shape in shapes(args.device).items():
            for rank in (None, *RANKS):
                if rank is None and not full_fits(shape, args.device):
                    print(
                        f"{name:11s} full      skipped: {num_params(shape) * 16 / 2**30:.0f} GiB of weights, "
                        "gradients and Adam state do not fit",
                        flush=True,
                    )
                    continue
                r = None
                for compiled in (True, False) if args.compile else (False,):
                    try:
                        r = learner_row(name, shape, rank, args, compiled)
                        break
                    except Exception as e:  # noqa: BLE001 - a failed row is a result; the next one runs
                        traceback.print_exc()
                        failures.append(
                            {
                                "shape": name,
                                "rank": rank,
                                "compiled": compiled,
                                "error": f"{type(e).__name__}: {e}"[:500],
                            }
                        )
                        free(args.device)
                        if isinstance(e, torch.OutOfMemoryError):
                            break  # compiling does not change what fits
                if r is None:
                    continue
                rows.append(r)
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
                print(
                    f"{name:11s} {r['mode']:9s} {r['tokens_per_s']:9.0f} {peak:>8s} {r['step_s']:7.3f} "
                    f"{r['trainable']:12d} {r['wire_bytes'] / 1e6:9.3f} {100 * r['wire_fraction']:7.3f}%"
                    + (
                        f" {r['delta_bytes'] / 1e6:9.3f} {100 * r['delta_fraction']:7.3f}%"
                        if "delta_bytes" in r
                        else ""
                    ),
                    flush=True,
                )
                free(args.device)
    if args.only in (None, "serve"):
        name, shape = next(iter(shapes(args.device).items()))
        for same_gpu in (False, True) if cuda else (False,):
            print(f"published -> serving, {name}, LoRA r=16, {'same GPU' if same_gpu else 'loopback TCP'}:", flush=True)
            try:
                part = publish_to_serving(name, shape, 16, args, same_gpu)
            except Exception as e:  # noqa: BLE001 - the TCP rows stay
                traceback.print_exc()
                failures.append(
                    {"part": f"publish_to_serving same_gpu={same_gpu}", "error": f"{type(e).__name__}: {e}"[:500]}
                )
                continue
            serve_rows += part
            later = sorted(r["published_to_serving_s"] for r in part[1:]) or [part[0]["published_to_serving_s"]]
            print(f"  median of the later versions: {1e3 * later[len(later) // 2]:.1f} ms", flush=True)
    fit = None
    if cuda and args.only in (None, "fit"):
        name, shape = list(shapes(args.device).items())[-1]
        print(f"training and generation together on one GPU, {name}, LoRA r=16:", flush=True)
        try:
            fit = fit_together(name, shape, 16, args)
            free(args.device)
            print(
                f"  peak allocated {fit['peak_allocated_gib']:.1f} GiB, reserved {fit['peak_reserved_gib']:.1f} GiB, "
                f"device in use at the end {fit['device_used_gib']:.1f} of {fit['device_total_gib']:.1f} GiB",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - not fitting is the result
            traceback.print_exc()
            failures.append({"part": "fit", "error": f"{type(e).__name__}: {e}"[:500]})
    if args.json:
        out = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": machine(args.device),
            "learner": rows,
            "publish_to_serving": serve_rows,
            "fit": fit,
            "failures": failures,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
