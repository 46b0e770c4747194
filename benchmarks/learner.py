"""One learner mini-batch step, today's padded path against the packed one, on one device.

    PYTHONPATH=src python benchmarks/learner.py --device cuda --json "$OUT/learner.json"
    PYTHONPATH=src python benchmarks/learner.py --device cpu      # tiny model, proves the script

Each row builds the model afresh (random weights from seed 0: Qwen3-0.6B's shape on CUDA,
a tiny Qwen3 on CPU; float32 master weights, bf16 compute on CUDA) and a real `Learner`,
then runs warm-up steps (their time, compile included, is reported apart) and timed steps
on one fixed mini-batch, one optimizer step each:
  * eq:   64 sequences x 1024 tokens (64 prompt + 960 completion);
  * tail: lognormal lengths (mean ~1k, the longest 8k, 64 prompt tokens each) until about
          the same 64k tokens: the padding a padded micro-batch carries is what differs.
Columns: tokens/s counts every token of the mini-batch, prompt and completion; MFU is
    (6 * N * tokens + 6 * layers * heads * head_dim * sum(len_i^2)) / step_s / peak,
with N the matmul parameters (decoder layers' linear weights plus the LM head, V x H), the
second term causal attention (forward + backward), peak 989 TFLOP/s (H100 dense bf16). The
same useful FLOPs for every row: padding and recomputation count as waste. Peak memory is
torch's max allocated over the row's steps. Loss is the policy-gradient term, as logged.
Then a numerics check: padded and packed, 3 optimizer steps each from the same weights on
16 of the equal-length sequences; per-step pg loss, entropy and grad norm and their largest
relative difference from padded-16k (the bf16 tolerance; tests/test_packed_gpu.py asserts it).
Every row runs in its own try/except: a failure prints and the next row runs; a packed row
with automatic attention (varlen on CUDA) that fails is retried with flex attention.

Variants: padded-16k / padded-8k are today's path (trainer.learner_impl=padded) with
16k / 8k-token micro-batches; packed* use trainer.learner_impl=packed with 16k tokens per
micro-batch, "+copy" trainer.working_copy, "+compile" trainer.compile_layers, "-flex"
trainer.packed_attention=flex, "-32k" 32k-token micro-batches, "+ckpt" activation
checkpointing. The packed+...+compile rows run the compiled path as first measured
(attention a graph break around each layer's graph, inductor's head tail); "fast" is the
default now: the varlen attention traced into the layers' graphs and the head's softmax
tail as Triton kernels in 4x larger chunks ("fast+attn": the first only; "-c1" / "-c2":
head chunks 1x / 2x). Every row sets working_copy and compile_layers to true or false
itself, never "auto" (the trainer's default, which picks "fast" on one GPU in bf16).

--profile [BATCH:]VARIANT (batch eq unless named) runs one more step of that row, after its
timed ones, under torch.profiler, and prints the 25 ops / kernels with the most self device
time (self CPU time on CPU) and how the kernels' time splits between matmuls, attention and
the rest; on CUDA also every place in one more step where the host waited for the device,
by the Python line that made it wait; --profile-out PATH keeps that text. Without --plan
only that row runs:

    PYTHONPATH=src python benchmarks/learner.py --device cpu --profile packed --profile-out /tmp/prof.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

import polyrl.trainer.learner as learner_mod
from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.trainer import lm_head
from polyrl.trainer.batching import SeqItem
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
PEAK_FLOPS = 989e12
"""H100 SXM dense bf16, the denominator of every row's MFU (also on other devices)."""


@dataclass(frozen=True)
class Variant:
    name: str
    impl: str = "packed"  # trainer.learner_impl
    max_tokens: int = 16384  # trainer.micro_batch_max_tokens (CPU: divided by 16)
    attention: str = "auto"  # trainer.packed_attention
    working_copy: bool = False
    compile_layers: bool = False
    checkpointing: bool = False
    traced_attention: bool = True  # the varlen op inside the compiled layers' graphs
    triton_head: bool = True  # the head's softmax tail as Triton kernels (else inductor's)
    head_chunk_factor: int = 4  # the fused head's chunk size over the unfused one's


FIRST_SESSION = {"traced_attention": False, "triton_head": False, "head_chunk_factor": 1}
"""The compiled path as it was first measured: attention as a graph break, inductor's head."""


VARIANTS = {
    v.name: v
    for v in [
        Variant("padded-16k", impl="padded"),
        Variant("padded-8k", impl="padded", max_tokens=8192),
        Variant("packed"),
        Variant("packed+copy", working_copy=True),
        Variant("packed-flex+copy", attention="flex", working_copy=True),
        Variant("packed+copy+compile", working_copy=True, compile_layers=True, **FIRST_SESSION),
        Variant("packed+compile", compile_layers=True, **FIRST_SESSION),
        Variant("packed+copy+compile-32k", max_tokens=32768, working_copy=True, compile_layers=True, **FIRST_SESSION),
        Variant("fast+ckpt", working_copy=True, compile_layers=True, checkpointing=True),
        Variant(
            "fast+attn",
            working_copy=True,
            compile_layers=True,
            traced_attention=True,
            triton_head=False,
            head_chunk_factor=1,
        ),
        Variant("fast", working_copy=True, compile_layers=True),
        Variant("fast-8k", max_tokens=8192, working_copy=True, compile_layers=True),
        Variant("fast-24k", max_tokens=24576, working_copy=True, compile_layers=True),
        Variant("fast-32k", max_tokens=32768, working_copy=True, compile_layers=True),
        Variant("fast-32k-c2", max_tokens=32768, working_copy=True, compile_layers=True, head_chunk_factor=2),
        Variant("fast-32k-c1", max_tokens=32768, working_copy=True, compile_layers=True, head_chunk_factor=1),
    ]
}
PLAN = [
    "eq:padded-16k",
    "eq:padded-8k",
    "eq:packed",
    "eq:packed+copy",
    "eq:packed+copy+compile",
    "eq:fast",
    "tail:padded-16k",
    "tail:packed+copy",
    "tail:fast",
    "numerics",
    "eq:fast-32k-c1",
    "eq:fast-32k",
    "eq:packed-flex+copy",
    "eq:packed+compile",
    "eq:fast+ckpt",
    "tail:packed",
]
"""The rows that decide first (today's path, the packed variants, on both batches, and the
numerics check), then the alternatives, which --budget-s may cut."""
NUMERICS = ["padded-16k", "packed", "packed+copy", "packed+copy+compile", "fast"]


# ---------------------------------------------------------------------------------------------
# Batches and FLOPs
# ---------------------------------------------------------------------------------------------


def make_items(lengths: list[int], prompt_len: int, vocab: int, seed: int) -> list[SeqItem]:
    """Random tokens; behaviour log-probs near a random model's own (-log V +- 0.5) so the
    importance weights and the loss depend on the model; advantages in [0.5, 1.5]."""
    rng = random.Random(seed)
    items = []
    for n in lengths:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        behav = [-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(n - prompt_len)]
        items.append(SeqItem(ids, prompt_len, behav, rng.uniform(0.5, 1.5)))
    return items


def tail_lengths(total: int, mean: int, longest: int, prompt_len: int, seed: int) -> list[int]:
    """Lognormal (sigma 1) lengths of the given mean, clipped to [prompt + 16, longest], until
    `total` tokens; one sequence is exactly `longest`, as a long tail has."""
    rng = random.Random(seed)
    mu = math.log(mean) - 0.5
    lengths = [longest]
    while sum(lengths) < total:
        lengths.append(int(min(longest, max(prompt_len + 16, rng.lognormvariate(mu, 1.0)))))
    rng.shuffle(lengths)
    return lengths


def matmul_params(config: Qwen3Config) -> int:
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return config.num_hidden_layers * per_layer + config.vocab_size * h


def step_flops(config: Qwen3Config, lengths: list[int]) -> float:
    dense = 6 * matmul_params(config) * sum(lengths)
    attn = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * sum(n * n for n in lengths)
    return float(dense + attn)


# ---------------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------------


def build_model(shape: dict, device: torch.device) -> PreTrainedModel:
    try:
        config = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e6)
    except TypeError:  # a transformers that wants rope_parameters; theta does not change the speed
        config = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def build_learner(v: Variant, args: argparse.Namespace, total_steps: int) -> Learner:
    model = build_model(args.shape, args.device)
    if v.checkpointing:
        enable_gradient_checkpointing(model)
    max_tokens = v.max_tokens if args.device.type == "cuda" else v.max_tokens // 16
    cfg = TrainerConfig(
        lr=1e-6,
        warmup_steps=0,
        train_batch_size=64,
        ppo_mini_batch_size=64,
        micro_batch_max_tokens=max_tokens,
        learner_impl=v.impl,
        packed_attention=v.attention,
        working_copy=v.working_copy,
        compile_layers=v.compile_layers,
    )
    optimizer, scheduler = build_optimizer(model, cfg, total_steps)
    learner_mod.TRACE_ATTENTION = v.traced_attention
    lm_head.USE_TRITON, lm_head.FUSED_CHUNK_FACTOR = v.triton_head, v.head_chunk_factor
    return Learner(
        model=model,
        ref_model=None,
        optimizer=optimizer,
        scheduler=scheduler,
        algo=AlgoConfig(),
        cfg=cfg,
        temperature=1.0,
        pad_id=0,
        compute_dtype=args.dtype,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(learner: Learner, items: list[SeqItem], n: int, device: torch.device) -> tuple[list[float], list[dict]]:
    times, metrics = [], []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        metrics.append(learner.train_mini_batch(items, weights_as_sampled=True))
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, metrics


def run_row(v: Variant, batch: str, items: list[SeqItem], args: argparse.Namespace) -> dict:
    is_profiled = f"{batch}:{v.name.removesuffix('[flex]')}" == args.profile
    learner = build_learner(v, args, args.warmup + args.steps + is_profiled)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    warm_s, _ = timed_steps(learner, items, args.warmup, args.device)
    times, metrics = timed_steps(learner, items, args.steps, args.device)
    step_s = sorted(times)[len(times) // 2]
    lengths = [len(it.token_ids) for it in items]
    config = learner.model.config
    row = {
        "batch": batch,
        "variant": v.name,
        **asdict(v),
        "tokens": sum(lengths),
        "step_s": step_s,
        "tokens_per_s": sum(lengths) / step_s,
        "mfu": step_flops(config, lengths) / step_s / PEAK_FLOPS,
        "peak_gib": torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.type == "cuda" else None,
        "warmup_s": sum(warm_s),
        "loss": metrics[-1]["actor/pg_loss"],
        "grad_norm": metrics[-1]["actor/grad_norm"],
        "step_times_s": times,
    }
    if is_profiled:  # after the row's numbers, so the profiler's overhead touches none of them
        args.profile_text = profile_step(learner, items, f"{batch}:{v.name}", args)
        if args.device.type == "cuda":
            args.profile_text += wait_sites(learner, items, args)
    return row


def wait_sites(learner: Learner, items: list[SeqItem], args: argparse.Namespace) -> str:
    """One more step with torch's sync debug mode on: every operation that made the host
    wait for the device, by the Python line that called it. Each such wait empties the
    device's queue, so the host's next launches run with the GPU idle: they are where host
    load (other processes, other threads) turns into learner time."""
    sync(args.device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            learner.train_mini_batch(items, weights_as_sampled=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    listed = ", ".join(f"{site} x{n}" for site, n in sites.most_common(12)) or "none"
    return f"host waits for the device in one step ({sum(sites.values())}): {listed}\n"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Profile: where one step's time goes
# ---------------------------------------------------------------------------------------------

MATMUL_MARKS = ("gemm", "sm90", "cutlass", "matmul", "nvjet", "cublas")  # nvjet: cuBLAS on Hopper
CPU_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_MARKS = ("flash", "fmha", "attention", "flex")


def kernel_kind(name: str) -> str:
    """matmul, attention or other, by the kernel's (or, on CPU, the op's) name. Attention
    first: cutlass-based attention kernels would otherwise count as matmuls."""
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKS):
        return "attention"
    if any(m in low for m in MATMUL_MARKS) or name in CPU_MATMUL_OPS:
        return "matmul"
    return "other"


def _is_kernel(event) -> bool:
    """A GPU kernel or copy; not an annotation (a compiled region's span on the GPU's timeline)."""
    return event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def profile_step(learner: Learner, items: list[SeqItem], title: str, args: argparse.Namespace) -> str:
    """One more (warm) step under torch.profiler: the top 25 by self device time, and the
    step's kernel time by kind. On CUDA only kernels count (their self times partition the
    GPU's busy time: the CPU ops that launched them would count it twice); on CPU, ops."""
    is_cuda = args.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    sync(args.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        learner.train_mini_batch(items, weights_as_sampled=True)
        sync(args.device)
        step_s = time.perf_counter() - t0
    events = prof.key_averages()
    sort_by = "self_cuda_time_total" if is_cuda else "self_cpu_time_total"
    if is_cuda:
        timed = [(e.key, e.self_device_time_total) for e in events if _is_kernel(e)]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    by_kind = defaultdict(float)
    for name, us in timed:
        by_kind[kernel_kind(name)] += us / 1e6
    busy_s = sum(by_kind.values())
    split = ", ".join(
        f"{k} {by_kind[k]:.3f} s ({100 * by_kind[k] / max(busy_s, 1e-12):.0f}%)"
        for k in ("matmul", "attention", "other")
    )
    what = "kernels" if is_cuda else "ops (self CPU time)"
    host = _host_side(prof) if is_cuda else ""
    return (
        f"profile {title}: step {step_s:.3f} s under the profiler; {what} {busy_s:.3f} s: {split}\n{host}"
        + events.table(sort_by=sort_by, row_limit=25)
    )


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _host_side(prof) -> str:
    """How long the GPU sat idle inside the step (gaps between kernels), how many kernels the
    host launched and how often it waited for the device: a launch-bound step shows idle gaps
    and launch counts, a sync-bound one shows waits."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if _is_kernel(e))
    idle, gaps, end = 0.0, [], None
    for start, stop in kernels:
        if end is not None and start > end:
            idle += start - end
            gaps.append(start - end)
        end = stop if end is None else max(end, stop)
    runtime = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name.startswith(("cuda", "cu")) and e.device_type == DeviceType.CPU:
            runtime[e.name][0] += 1
            runtime[e.name][1] += e.cpu_time_total
    launches = sum(runtime[n][0] for n in LAUNCH_CALLS)
    waits = {n: c for n, c in runtime.items() if n.startswith(SYNC_CALLS)}
    big = sorted(gaps, reverse=True)[:5]
    where = _gap_context(prof, kernels, big)
    calls = ", ".join(f"{n} x{c} {t / 1e3:.1f} ms" for n, (c, t) in sorted(runtime.items(), key=lambda x: -x[1][1])[:8])
    return (
        f"host: GPU idle {idle / 1e3:.1f} ms in {len(gaps)} gaps (largest {', '.join(f'{g / 1e3:.2f}' for g in big)} ms); "
        f"{launches} kernel launches; waits {dict(waits)}\nruntime calls: {calls}\n{where}"
    )


def _gap_context(prof, kernels: list[tuple[float, float]], sizes: list[float]) -> str:
    """For each of the largest idle gaps: when in the step it fell, and the longest CPU ops
    running during it (what the host was busy with while the GPU waited)."""
    if not kernels:
        return ""
    t0, lines, end = kernels[0][0], [], None
    spans = []
    for start, stop in kernels:
        if end is not None and start - end in sizes:
            spans.append((end, start))
        end = stop if end is None else max(end, stop)
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    for g0, g1 in spans:
        inside = sorted(
            (e for e in cpu if e.time_range.start < g1 and e.time_range.end > g0),
            key=lambda e: -(min(e.time_range.end, g1) - max(e.time_range.start, g0)),
        )[:6]
        ops = "; ".join(
            f"{e.name[:60]} {(min(e.time_range.end, g1) - max(e.time_range.start, g0)) / 1e3:.1f}" for e in inside
        )
        lines.append(f"  gap {(g1 - g0) / 1e3:.2f} ms at +{(g0 - t0) / 1e3:.1f} ms: {ops}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Numerics: padded vs packed over a few optimizer steps
# ---------------------------------------------------------------------------------------------


def numerics(items: list[SeqItem], args: argparse.Namespace) -> dict:
    """Per-step pg loss, entropy and grad norm of each variant over `args.numerics_steps` steps (lr
    1e-6 so the weights move), and the largest relative difference from padded-16k."""
    curves = {}
    for name in NUMERICS:
        if not _runnable(VARIANTS[name], args):
            continue
        for v in _with_fallback(VARIANTS[name]):
            try:
                learner = build_learner(v, args, args.numerics_steps)
                _, metrics = timed_steps(learner, items, args.numerics_steps, args.device)
                keys = ("pg_loss", "entropy", "grad_norm")
                curves[v.name] = {key: [m[f"actor/{key}"] for m in metrics] for key in keys}
                break
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"numerics {v.name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            finally:
                learner = None
                free(args.device)
    base = curves.get("padded-16k")
    for name, c in curves.items():
        if base is not None:
            for key in ("pg_loss", "entropy", "grad_norm"):
                c[f"max_rel_diff_{key}"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(c[key], base[key]))
        print(f"numerics {name:28s} " + " ".join(f"{k}={_fmt(x)}" for k, x in c.items()), flush=True)
    return curves


def _fmt(x) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(f"{y:.6g}" for y in x) + "]"
    return f"{x:.3g}"


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _with_fallback(v: Variant) -> list[Variant]:
    """The variant, then (packed, automatic attention: varlen on CUDA) the same with flex
    attention, in case this torch's varlen attention fails."""
    if v.impl != "packed" or v.attention != "auto":
        return [v]
    return [v, replace(v, name=f"{v.name}[flex]", attention="flex")]


def _runnable(v: Variant, args: argparse.Namespace) -> bool:
    """On CPU: no compile and no flex (inductor's C++ build takes minutes on a small box);
    the working copy needs bf16 compute, so on CPU it is the same as without."""
    return args.device.type == "cuda" or not (v.compile_layers or v.attention == "flex")


def batches(args: argparse.Namespace) -> dict[str, list[SeqItem]]:
    scale = 1 if args.device.type == "cuda" else 8  # CPU: 128-token sequences
    vocab, prompt = args.shape["vocab_size"], 64 // scale
    eq = make_items([1024 // scale] * 64, prompt, vocab, seed=1)
    tail = make_items(tail_lengths(65536 // scale, 1024 // scale, 8192 // scale, prompt, seed=2), prompt, vocab, 3)
    return {"eq": eq, "tail": tail}


HEADER = (
    f"{'batch':5s} {'variant':28s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>8s} {'step s':>7s} {'warm s':>7s} "
    f"{'loss':>10s} {'grad norm':>10s}"
)


def print_row(r: dict) -> None:
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    print(
        f"{r['batch']:5s} {r['variant']:28s} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}% {peak:>8s} "
        f"{r['step_s']:7.3f} {r['warmup_s']:7.1f} {r['loss']:10.6f} {r['grad_norm']:10.6f}",
        flush=True,
    )


def machine(device: torch.device) -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The rows to run: --plan's; with --profile and no --plan, only the profiled row; the
    profiled row is added at the end when --plan lacks it."""
    plan = args.plan.split(",") if args.plan else PLAN
    args.profile_text = None
    if args.profile:
        args.profile = args.profile if ":" in args.profile else f"eq:{args.profile}"
        batch, name = args.profile.split(":")
        if batch not in ("eq", "tail") or name not in VARIANTS:
            parser.error(f"--profile: no row {args.profile!r} (batches eq, tail; variants {', '.join(VARIANTS)})")
        plan = plan if args.plan else []
        plan = plan if args.profile in plan else [*plan, args.profile]
    return plan


def _report_profile(args: argparse.Namespace) -> None:
    text = args.profile_text or f"profile {args.profile}: not run (the row failed or was skipped)\n"
    print(text, end="", flush=True)
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            f.write(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write rows, numerics and machine here")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--numerics-steps", type=int, default=3)
    p.add_argument("--plan", help="batch:variant entries and 'numerics', in order (default: all, deciding first)")
    p.add_argument("--budget-s", type=float, default=300.0, help="rows starting after this are skipped")
    p.add_argument("--profile", metavar="[BATCH:]VARIANT", help="profile one more step of this row (default batch: eq)")
    p.add_argument("--profile-out", metavar="PATH", help="write the profile's text here")
    args = p.parse_args()
    plan = _plan(args, p)
    args.device = torch.device(args.device)
    args.shape = QWEN3_06B if args.device.type == "cuda" else TINY
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    start = time.perf_counter()
    data = batches(args)
    out = {"machine": machine(args.device), "peak_flops": PEAK_FLOPS, "rows": [], "errors": [], "numerics": {}}
    print(f"{out['machine']}\n{HEADER}", flush=True)
    for entry in plan:
        if entry == "numerics":
            out["numerics"] = numerics(data["eq"][:16], args)
            continue
        batch, name = entry.split(":")
        v = VARIANTS[name]
        if not _runnable(v, args) or time.perf_counter() - start > args.budget_s:
            print(f"{batch:5s} {name:28s} skipped ({'budget' if _runnable(v, args) else args.device.type})", flush=True)
            continue
        for attempt in _with_fallback(v):
            try:
                row = run_row(attempt, batch, data[batch], args)
                out["rows"].append(row)
                print_row(row)
                break
            except Exception as e:  # noqa: BLE001 - one failed variant must not lose the others
                print(f"{batch:5s} {attempt.name:28s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                out["errors"].append({"batch": batch, "variant": attempt.name, "error": traceback.format_exc()[-3000:]})
            finally:
                free(args.device)
    if args.profile:
        _report_profile(args)
        out["profile"] = args.profile_text
    out["total_s"] = time.perf_counter() - start
    print(f"total {out['total_s']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
