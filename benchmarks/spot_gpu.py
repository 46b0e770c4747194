"""The headline experiment on a 2-GPU host: a trainer on GPU 0, with and without a "spot"
rollout worker on GPU 1.

    python benchmarks/spot_gpu.py --json out.json                 # every part, one run
    python benchmarks/spot_gpu.py --one-gpu --prompts 8 --n 4 --new-tokens 256 --tail-median 32 \
        --tail-p99 320 --warmup 1 --steps 1 --only colocated,hybrid,best_kill    # a check on one GPU

Throughput parts, each a real `polyrl train` process on GPU 0 (plus a real `polyrl worker`
on GPU 1 that joins like a spot VM would, by hand with the manager's URL and token), on
the long-tail workload:
* colocated: rollout.mode=local, the veRL-style baseline: generate, then train, one GPU;
* hybrid: rollout.mode=hybrid, on-policy;
* hybrid_ahead: hybrid with rollout.max_staleness=1: the worker generates step k+1's
  batch while the trainer's GPU trains on step k's;
* best_kill: the faster of hybrid and hybrid_ahead (of this run) again, with the worker
  killed (-9) in the middle of a measured step and a new one started a few seconds
  later: nothing may be lost;
* equal_colocated, equal_hybrid, equal_hybrid_ahead: the same with every response at
  full length (`--new-tokens`), for comparison;
* learn_colocated / learn_hybrid / learn_hybrid_ahead: the tiny default model learning
  the default task from scratch, wall-clock time to a target reward.

The long-tail workload gives each prompt its own `max_new_tokens`
(`data.max_new_tokens_key`), drawn from a log-normal distribution with median
`--tail-median` and 99th percentile `--tail-p99`, capped at `--new-tokens`: groups
finish at different times, as in reasoning RL. The shape (lengths roughly log-normal,
the 99th percentile about 10x the median: 500 and 5000 tokens) is the one described in
https://jiahuanglin.xyz/all_lessons/RL/lessons/22b_longtail_rollouts.html; the default
median is scaled down to 300 so that a step fits the device's time limit. All samples
of one prompt share its length: the group, not the sample, is what the learner waits on.

The throughput parts use a Qwen3-0.6B-shaped model with random weights. Its generation
config names `--stop-ids` extra token ids as end-of-sequence (default none: with random
weights a response runs to its budget). Prices are the seeds' H100x8 prices per GPU: the
trainer's GPU on-demand, the worker's spot. `--one-gpu` runs the worker on the trainer's
GPU (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from polyrl.chaos.harness import free_port  # noqa: E402
from polyrl.data.tasks import get_task, task_record  # noqa: E402
from polyrl.models.tiny import build_tokenizer  # noqa: E402

ON_DEMAND_USD_PER_GPU_HOUR = 83.79 / 8
SPOT_USD_PER_GPU_HOUR = 21.28 / 8
TOKEN = "spot-gpu-benchmark"


@dataclass
class Result:
    part: str
    workload: str = ""
    steps: int = 0
    s_per_step: float = 0.0
    tokens_per_s: float = 0.0
    """Prompt + completion tokens trained on per second (veRL's count)."""
    gen_tokens_per_s: float = 0.0
    usd_per_hour: float = 0.0
    tokens_per_usd: float = 0.0
    gen_s: float = 0.0
    update_actor_s: float = 0.0
    publish_s: float = 0.0
    weight_sync_s: float | None = None
    """Published -> the worker serving it (the slowest worker), mean over measured steps."""
    logprob_diff: float = 0.0
    """Max over measured steps (over the tokens sampled by the learner's own version)."""
    version_lag: float = 0.0
    """Versions the trained-on tokens lagged the learner, mean over measured steps."""
    samples_lost: int = 0
    migrated: int = 0
    local_share: float = 0.0
    mean_completion_len: float = 0.0
    max_completion_len: float = 0.0
    time_to_target_s: float | None = None
    final_reward: float | None = None
    wall_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    """Every step's seconds, warm-up included (compiles and recompiles show here)."""
    notes: list[str] = field(default_factory=list)


def longtail_budgets(count: int, median: float, p99: float, cap: int, seed: int = 0) -> list[int]:
    """`count` token budgets, log-normal with the given median and 99th percentile,
    each in [1, cap]."""
    if not 0 < median < p99:
        raise ValueError(f"need 0 < median < p99 (got {median}, {p99})")
    sigma = math.log(p99 / median) / 2.3263478740408408  # the standard normal's 99th percentile
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, count)
    return [int(v) for v in np.clip(np.rint(draws), 1, cap)]


def write_workload(path: Path, count: int, budgets: list[int] | None, seed: int = 0) -> Path:
    """A prompt file for `data.task=dataset`: the copy task's prompts and answers, and a
    `max_new_tokens` column when `budgets` are given."""
    task = get_task("copy")
    with path.open("w") as f:
        for i in range(count):
            row = task_record(task, seed, i)
            if budgets is not None:
                row["max_new_tokens"] = budgets[i % len(budgets)]
            f.write(json.dumps(row) + "\n")
    return path


def make_model(out: Path, num_stop_ids: int, max_positions: int) -> Path:
    """Qwen3-0.6B's shape (28 layers, hidden 1024, GQA 16/8, head 128, vocab 151936),
    random weights, the project's tiny tokenizer (ids past it decode to nothing)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    tokenizer = build_tokenizer()
    vocab = 151936
    stop_ids = sorted({tokenizer.eos_token_id, *range(vocab - num_stop_ids, vocab)})
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


class Worker:
    """A `polyrl worker` on its own GPU that joins the trainer's manager, as a spot VM would."""

    def __init__(
        self, model: Path, manager_url: str, worker_id: str, gpu: str, log_dir: Path, fraction: float,
        extra: tuple[str, ...] = ("engine.max_num_seqs=512",),
    ) -> None:  # fmt: skip
        """`gpu`: CUDA_VISIBLE_DEVICES for it ("" hides every GPU); `extra`: more config overrides."""
        env = os.environ | {"CUDA_VISIBLE_DEVICES": gpu, "POLYRL_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
                            "PYTHONFAULTHANDLER": "1"}  # fmt: skip
        self.worker_id = worker_id
        self.log = open(log_dir / f"{worker_id}.log", "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "polyrl.cli", "worker", "--model", str(model), "--port", "0",
               "--manager", manager_url, "--worker-id", worker_id, f"engine.kv_cache_memory_fraction={fraction}",
               "worker.heartbeat_interval_s=0.5", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def train_command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides]


def throughput_overrides(
    args: argparse.Namespace, model: Path, mode: str, port: int, data: Path, has_budgets: bool
) -> list[str]:
    """`data`: the workload's prompt file; `has_budgets`: it has `write_workload`'s
    `max_new_tokens` column, each prompt's own budget."""
    budget = ["data.max_new_tokens_key=max_new_tokens"] if has_budgets else []
    return [
        f"model.path={model}", "model.dtype=bfloat16", "trainer.device=cuda", f"rollout.mode={mode}",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.new_tokens}", "data.task=dataset", f"data.path={data}",
        "data.format=plain", "reward.functions=['polyrl.data.tasks:char_match_reward']", *budget,
        f"trainer.train_batch_size={args.prompts}", f"trainer.ppo_mini_batch_size={args.prompts // args.mini_batches}",
        f"trainer.total_steps={args.warmup + args.steps}", "trainer.lr=1e-6", "trainer.warmup_steps=0",
        f"trainer.micro_batch_max_tokens={args.micro_batch_tokens}", "trainer.save_every=0",
        "engine.max_num_seqs=512", f"engine.kv_cache_memory_fraction={args.kv_fraction}",
        "logging.console=false", "logging.tensorboard=false", "fleet.num_workers=0",
        f"manager.port={port}", f"manager.token={TOKEN}", "manager.heartbeat_interval_s=0.5",
        f"cost.trainer_usd_per_hour={ON_DEMAND_USD_PER_GPU_HOUR}", f"cost.worker_usd_per_hour={SPOT_USD_PER_GPU_HOUR}",
    ]  # fmt: skip


def run_part(
    part: str, overrides: list[str], run_dir: Path, model: Path | None, port: int, args: argparse.Namespace,
    spot: bool, kill_step: int | None = None, timeout_s: float = 900,
) -> tuple[list[dict[str, float]], float, list[str]]:
    """Run one trainer (and its worker); returns its metrics rows, wall seconds, notes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    workers: list[Worker] = []
    url = f"http://127.0.0.1:{port}"
    if spot:  # started first: it retries registering until the trainer's manager is up
        workers.append(Worker(model, url, "spot0", args.worker_gpu, run_dir, args.worker_kv_fraction))
    t0 = time.monotonic()
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    with open(run_dir / "trainer.log", "ab") as log:
        trainer = subprocess.Popen(train_command(run_dir, overrides), env=env, stdout=log, stderr=subprocess.STDOUT)
        killed = False
        try:
            while trainer.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    for proc in [trainer, *(w.proc for w in workers)]:  # every thread's stack into the logs
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(signal.SIGABRT)
                    time.sleep(3)
                    trainer.kill()
                    notes.append(f"timed out after {timeout_s:.0f}s (stacks in the logs)")
                    break
                rows = read_metrics(run_dir / "metrics.jsonl")
                if kill_step is not None and not killed and len(rows) >= kill_step - 1:
                    # mid-step: half the previous step's generation time into step `kill_step`
                    gen = rows[-1].get("timing_s/gen", 1.0) if rows else 1.0
                    time.sleep(max(gen / 2, 0.2))
                    workers[-1].kill()
                    notes.append(f"spot0 killed -9 in step {kill_step}")
                    killed = True
                    time.sleep(args.restart_after_s)
                    workers.append(Worker(model, url, "spot1", args.worker_gpu, run_dir, args.worker_kv_fraction))
                    notes.append(f"spot1 started {args.restart_after_s:.0f}s later")
                time.sleep(0.2)
        finally:
            if trainer.poll() is None:
                trainer.wait()
            for w in workers:
                w.stop()
    wall = time.monotonic() - t0
    if trainer.returncode != 0:
        tail = (run_dir / "trainer.log").read_text(errors="replace")[-3000:]
        notes.append(f"trainer exit {trainer.returncode}")
        print(f"[{part}] trainer failed:\n{tail}", flush=True)
    return read_metrics(run_dir / "metrics.jsonl"), wall, notes


def summarise(part: str, rows: list[dict[str, float]], warmup: int, wall: float, notes: list[str]) -> Result:
    measured = [r for r in rows if r["step"] > warmup]
    res = Result(part=part, steps=len(measured), wall_s=wall, notes=notes)
    res.step_s = [round(r["perf/time_per_step"], 3) for r in rows]
    if not measured:
        return res
    step_s = sum(r["perf/time_per_step"] for r in measured)
    tokens = sum(r["perf/total_num_tokens"] for r in measured)
    gen_tokens = sum(r["response_length/mean"] * r["rollout/samples_received"] for r in measured)
    res.s_per_step = step_s / len(measured)
    res.tokens_per_s = tokens / step_s
    res.gen_tokens_per_s = gen_tokens / step_s
    res.usd_per_hour = sum(r["cost/usd_per_hour"] for r in measured) / len(measured)
    res.tokens_per_usd = tokens / (step_s * res.usd_per_hour / 3600)
    mean = lambda key: sum(r.get(key, 0.0) for r in measured) / len(measured)  # noqa: E731
    res.gen_s, res.update_actor_s, res.publish_s = mean("timing_s/gen"), mean("timing_s/update_actor"), mean("timing_s/update_weights")
    syncs = [r["timing_s/weight_sync"] for r in measured if "timing_s/weight_sync" in r]
    res.weight_sync_s = sum(syncs) / len(syncs) if syncs else None
    res.logprob_diff = max(r.get("rollout/logprob_diff", 0.0) for r in measured)
    res.version_lag = mean("rollout/version_lag/mean")
    res.samples_lost = int(sum(r["rollout/samples_lost"] for r in rows))
    res.migrated = int(sum(r["rollout/migrated_samples"] for r in rows))
    res.local_share = sum(r["rollout/local_samples"] for r in measured) / max(sum(r["rollout/samples_received"] for r in measured), 1)
    res.mean_completion_len = mean("response_length/mean")
    res.max_completion_len = max(r.get("response_length/max", 0.0) for r in measured)
    return res


def learning_part(part: str, mode: str, args: argparse.Namespace, work: Path, extra: list[str]) -> Result:
    """The default task and tiny model, from scratch, on GPU: time to the target reward."""
    port = free_port()
    overrides = [*extra,
        "trainer.device=cuda", f"rollout.mode={mode}", f"trainer.total_steps={args.learn_steps}",
        "logging.console=false", "logging.tensorboard=false", "fleet.num_workers=0", "trainer.save_every=0",
        f"manager.port={port}", f"manager.token={TOKEN}", "manager.heartbeat_interval_s=0.5",
        "engine.kv_cache_memory_fraction=0.2",
    ]  # fmt: skip
    run_dir = work / part
    model = None
    if mode != "local":  # the worker needs the model directory before the trainer writes it
        model = work / f"{part}_model"  # outside the run directory, which must start empty
        subprocess.run([sys.executable, "-m", "polyrl.cli", "tiny-model", "--out", str(model)], check=True,
                       capture_output=True)  # fmt: skip
        overrides.append(f"model.path={model}")
    rows, wall, notes = run_part(part, overrides, run_dir, model, port, args, mode != "local", None, args.part_timeout_s)
    res = summarise(part, rows, 0, wall, notes)
    elapsed = 0.0
    window: list[float] = []
    for r in rows:
        elapsed += r["perf/time_per_step"]
        window = (window + [r["critic/score/mean"]])[-5:]
        if res.time_to_target_s is None and len(window) == 5 and sum(window) / 5 >= args.target_reward:
            res.time_to_target_s = elapsed
    res.final_reward = sum(window) / len(window) if window else None
    return res


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The batch, learner and engine options this script shares with elastic_gpu.py."""
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--stop-ids", type=int, default=0, help="extra end-of-sequence ids (0: every response is full length)")
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kv-fraction", type=float, default=0.45, help="the trainer's engine on its (first) GPU (fixed split)")
    p.add_argument("--worker-kv-fraction", type=float, default=0.8)
    p.add_argument("--restart-after-s", type=float, default=3.0)


THROUGHPUT_PARTS = {  # part: (workload, rollout mode, generating one step ahead)
    "colocated": ("longtail", "local", False),
    "hybrid": ("longtail", "hybrid", False),
    "hybrid_ahead": ("longtail", "hybrid", True),
    "equal_colocated": ("equal", "local", False),
    "equal_hybrid": ("equal", "hybrid", False),
    "equal_hybrid_ahead": ("equal", "hybrid", True),
}
LEARN_PARTS = {"learn_colocated": ("local", False), "learn_hybrid": ("hybrid", False), "learn_hybrid_ahead": ("hybrid", True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--only", default="colocated,hybrid,hybrid_ahead,best_kill,equal_colocated,equal_hybrid,"
                   "equal_hybrid_ahead,learn_colocated,learn_hybrid,learn_hybrid_ahead")  # fmt: skip
    add_workload_args(p)
    p.add_argument("--tail-median", type=float, default=300, help="long-tail workload: median budget (tokens)")
    p.add_argument("--tail-p99", type=float, default=3000, help="long-tail workload: 99th-percentile budget")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--learn-steps", type=int, default=80)
    p.add_argument("--part-timeout-s", type=float, default=900, help="a part still running then is stopped")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more trainer overrides")
    p.add_argument("--keep", type=Path, help="keep the logs and run directories here")
    p.add_argument("--target-reward", type=float, default=0.8)
    p.add_argument("--one-gpu", action="store_true", help="the worker shares GPU 0 (checks the script; no headline)")
    args = p.parse_args()
    args.worker_gpu = "0" if args.one_gpu else "1"
    if torch.cuda.device_count() < (1 if args.one_gpu else 2):
        sys.exit(f"needs 2 GPUs (or --one-gpu), found {torch.cuda.device_count()}")
    parts = args.only.split(",")
    unknown = [x for x in parts if x not in THROUGHPUT_PARTS and x not in LEARN_PARTS and x != "best_kill"]
    if unknown:
        sys.exit(f"unknown parts {unknown}")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="spot_gpu_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = None
        if any(not part.startswith("learn") for part in parts):
            model = make_model(work / "qwen3-0.6b-shape", args.stop_ids, args.new_tokens + 512)
        count = args.prompts * (args.warmup + args.steps)  # one pass: no prompt repeats
        budgets = longtail_budgets(count, args.tail_median, args.tail_p99, args.new_tokens)
        data = {"longtail": write_workload(work / "longtail.jsonl", count, budgets),
                "equal": write_workload(work / "equal.jsonl", count, None)}  # fmt: skip
        print(f"long-tail budgets: median {np.median(budgets):.0f}, p90 {np.percentile(budgets, 90):.0f}, "
              f"p99 {np.percentile(budgets, 99):.0f}, max {max(budgets)}, mean {np.mean(budgets):.0f}", flush=True)
        for part in parts:
            print(f"== {part}", flush=True)
            if part in LEARN_PARTS:
                mode, ahead = LEARN_PARTS[part]
                res = learning_part(part, mode, args, work, ["rollout.max_staleness=1"] if ahead else [])
                results.append(res)
                print(json.dumps(asdict(res)), flush=True)
                continue
            kill = None
            if part == "best_kill":  # the faster hybrid row of this run, with a kill
                hybrids = [r for r in results if r.part in ("hybrid", "hybrid_ahead") and r.steps]
                if not hybrids:
                    print("best_kill: run hybrid and/or hybrid_ahead first", flush=True)
                    continue
                best = max(hybrids, key=lambda r: r.tokens_per_s)
                workload, mode, ahead = THROUGHPUT_PARTS[best.part]
                kill = args.warmup + 2 if args.steps >= 2 else args.warmup + 1
            else:
                workload, mode, ahead = THROUGHPUT_PARTS[part]
            port = free_port()
            overrides = throughput_overrides(args, model, mode, port, data[workload], workload == "longtail") + args.set
            overrides += ["rollout.max_staleness=1"] if ahead else []
            rows, wall, notes = run_part(part, overrides, work / part, model, port, args, mode != "local", kill,
                                         args.part_timeout_s)  # fmt: skip
            if part == "best_kill":
                notes.insert(0, f"as {best.part}")
            res = summarise(part, rows, args.warmup, wall, notes)
            res.workload = workload
            results.append(res)
            print(json.dumps(asdict(res)), flush=True)
    report(results, args)


def report(results: list[Result], args: argparse.Namespace) -> None:
    """One table; each throughput row is compared with the colocated row of its workload."""
    bases = {r.workload: r for r in results if r.part in ("colocated", "equal_colocated") and r.steps}
    print(f"\n{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
          f"{platform.node()}; {args.prompts} prompts x {args.n}, <= {args.new_tokens} new tokens, long tail: median "
          f"{args.tail_median:g}, p99 {args.tail_p99:g}; {args.stop_ids} extra stop ids"
          f"{'; ONE GPU (worker shares GPU 0): a check, not a result' if args.one_gpu else ''}")  # fmt: skip
    head = ("part", "workload", "s/step", "tok/s", "gen tok/s", "vs coloc", "$/h", "tok/$", "tok/$ gain", "gen s", "train s",
            "publish s", "sync s", "lp diff", "lag", "lost", "migr", "local", "resp len", "max len", "to target s",
            "final reward")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in results:
        base = bases.get(r.workload)
        speed = r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s and r.tokens_per_s else None
        gain = r.tokens_per_usd / base.tokens_per_usd - 1 if base and base.tokens_per_usd and r.tokens_per_usd else None
        cells = (r.part, r.workload or "-", fmt(r.s_per_step, ".2f"), fmt(r.tokens_per_s, ".0f"), fmt(r.gen_tokens_per_s, ".0f"),
                 fmt(speed, ".2f"), fmt(r.usd_per_hour, ".2f"), fmt(r.tokens_per_usd, ".3g"),
                 "-" if gain is None else f"{100 * gain:+.0f}%", fmt(r.gen_s, ".2f"), fmt(r.update_actor_s, ".2f"),
                 fmt(r.publish_s, ".2f"), fmt(r.weight_sync_s, ".2f"), fmt(r.logprob_diff, ".2g"),
                 fmt(r.version_lag, ".2f"), str(r.samples_lost),
                 str(r.migrated), fmt(r.local_share, ".2f"), fmt(r.mean_completion_len, ".0f"),
                 fmt(r.max_completion_len, ".0f"), fmt(r.time_to_target_s, ".0f"), fmt(r.final_reward, ".2f"))  # fmt: skip
        print("| " + " | ".join(cells) + " |")
        for note in r.notes:
            print(f"    {r.part}: {note}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]}, indent=1, default=str))


if __name__ == "__main__":
    main()
