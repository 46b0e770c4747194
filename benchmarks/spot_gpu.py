"""The headline experiment: a trainer's GPU, with and without a "spot" rollout worker on a
second GPU, on the long-tail workload where a synchronous step waits for its longest
response.

    python benchmarks/spot_gpu.py --split mps --json out.json     # one H100 split in two halves by MPS
    python benchmarks/spot_gpu.py --split gpus --json out.json    # a 2-GPU host: trainer GPU 0, spot GPU 1
    python benchmarks/spot_gpu.py --device cpu --only colocated,fully_async_k2,best_kill   # the orchestration on CPU

Where the processes run (`--split`):
* `mps`: one GPU stands in for two. Each row starts its own CUDA MPS control daemon (its
  own pipe directory, its logs in the row's directory) and stops it at the row's end and on
  any failure; every process runs at `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50` (the trainer
  and its own engine on the "trainer's half", the spot worker on the other), except the
  `colocated_whole` row at 100%. Measured 2026-11-25 on an H100: two such processes at once
  ran bf16 matmuls at 325 + 322 TFLOP/s and copied at 1.52 + 1.54 TB/s, against 441 and
  2.78 alone. The `standin` row measures what the stand-in costs the spot half.
* `gpus`: the trainer on GPU 0, the spot worker on GPU 1 (a 2-GPU host).
* `one`: the worker shares GPU 0 without MPS (a check of the script, not a measurement).

Throughput rows, each a real `polyrl train` process (plus, for the spot rows, a real
`polyrl worker` that joins by hand with the manager's URL and token, as a spot VM would):
* colocated: rollout.mode=local, the veRL-style baseline on the trainer's half: generate,
  then train; colocated_whole: the same on the whole GPU (`--split mps` only);
* hybrid: rollout.mode=hybrid, on-policy; hybrid_ahead: with rollout.max_staleness=1,
  the next step's batch generated while the learner trains;
* fully_async_k1 / fully_async_k2: rollout.fully_async with max_staleness 1 / 2 (hybrid:
  the trainer's engine generates whenever its learner waits);
* fully_async_k3 / fully_async_k4: the same with max_staleness 3 / 4. `--async-set
  rollout.hybrid_local_until=always` gives these rows (and best_kill and learn_fully_async_*
  when they repeat one) the trainer's engine as a worker all the time, which the other
  rows refuse;
* best_kill: the fastest spot row of this run again (or the row `--kill-as` names), with
  the worker killed (-9) in the middle of a measured step and a new one started a few
  seconds later: nothing may be lost;
* equal_*: the same with every response at full length (`--new-tokens`), for comparison;
* learn_*: a small model learning from scratch to repeat the prompt's word for as long
  as the long-tail workload's budget for it (every response runs to its budget, every
  character is scored): wall-clock time to a target reward; learn_fully_async_k1 .. k4
  take the settings of fully_async_k1 .. k4. `--learn-shape` sets the model's sizes. The
  default (hidden 128, 2 layers) is so light that its engines are bound by their Python
  work, not the GPU, and a second engine adds little; 28 layers of hidden 512 with 8 KV
  heads (95M parameters, 57 KB of KV cache a token) decode GPU-bound, as a real model
  does. `--learn-prewarm-steps` first runs a few unreported colocated steps, so that no
  row pays the learner's compile alone;
* standin: a single sequence's decode latency on the spot half, with the other half idle
  and with it training (the 0.6B shape's forward and backward in a loop).

The long-tail workload gives each prompt its own `max_new_tokens`
(`data.max_new_tokens_key`), drawn from a log-normal distribution with median
`--tail-median` and 99th percentile `--tail-p99`, capped at `--new-tokens`: groups
finish at different times, as in reasoning RL. The shape (lengths roughly log-normal,
the 99th percentile about 10x the median: 500 and 5000 tokens) is the one described in
https://jiahuanglin.xyz/all_lessons/RL/lessons/22b_longtail_rollouts.html; the default
median is scaled down to 300 so that a step fits the device's time limit. All samples
of one prompt share its length: the group, not the sample, is what the learner waits on.

The throughput rows use a Qwen3-0.6B-shaped model with random weights. Its generation
config names `--stop-ids` extra token ids as end-of-sequence (default none: with random
weights a response runs to its budget). Each engine's KV cache is a fixed block count
(`--kv-blocks` for the trainer's engine, `--worker-kv-blocks` for the spot worker), so a
process that starts later does not get a fraction of what is left. Prices are the
seeds' H100x8 prices per GPU: the trainer's GPU on-demand, the worker's spot.
`--device cpu` runs the rows on the tiny model and CPU engines, to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the checkout's polyrl, and its test-only chaos_harness/

from chaos_harness.harness import free_port  # noqa: E402
from polyrl.config import TinyModelConfig, load_config  # noqa: E402
from polyrl.data.tasks import get_task, task_record  # noqa: E402
from polyrl.models.tiny import build_tokenizer, save_tiny_model  # noqa: E402

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
    delivered_tokens_per_s: float | None = None
    """Fully asynchronous rows: prompt + completion tokens the fleet delivered per second
    (`async/arrived_tokens`); lumpy, and held back by the staleness bound when the fleet
    is ahead."""
    produced_tokens_per_s: float | None = None
    """Fully asynchronous rows: tokens the engines generated per second in the measured
    steps (their own counters, read at each step's end), plus the prompts' share."""
    steady_tokens_per_s: float = 0.0
    """What the run keeps up: the slower of the learner (`tokens_per_s`) and the fleet
    (`produced_tokens_per_s`). A backlog of finished groups built during the warm-up (the
    learner's first step compiles for a while, the fleet does not wait) lets the learner
    train faster than the fleet produces for many steps; a run cannot keep that up. The
    comparisons use this."""
    backlog_used: float = 0.0
    """Finished groups waiting at the window's start less those waiting after it."""
    local_made: float | None = None
    """Share of the produced tokens that the trainer's own engine generated."""
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
    version_lag_max: float = 0.0
    multi_version: float = 0.0
    """Share of the trained samples whose tokens came from more than one version."""
    learner_idle_s: float = 0.0
    """Seconds a step's learner waited for groups, mean over measured steps."""
    fleet_idle: float | None = None
    """Share of the spot workers' time with nothing to run, mean over measured steps."""
    due_groups: float = 0.0
    held_back: float = 0.0
    ready_start: float | None = None
    """Finished groups waiting for the learner when the first measured step began (async)."""
    ready_end: float | None = None
    local_share: float = 0.0
    mean_completion_len: float = 0.0
    max_completion_len: float = 0.0
    capacity: dict[str, dict] | None = None
    """standin: generation tok/s, preemptions and mean batch by sequences in flight, with the
    other half idle and training."""
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
        vocab_size=vocab,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


class Placement:
    """Where the trainer and the spot worker run, and with what share of the GPU."""

    def __init__(self, split: str, device: str, mps_env: dict[str, str] | None = None) -> None:
        self.split, self.device, self.mps_env = split, device, mps_env

    def env(self, role: str, whole: bool = False) -> dict[str, str]:
        """`role`: "trainer" or "worker"; `whole`: the trainer gets the whole GPU."""
        base = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        if self.device == "cpu":
            return base | {"CUDA_VISIBLE_DEVICES": ""}
        gpu = "1" if role == "worker" and self.split == "gpus" else "0"
        base["CUDA_VISIBLE_DEVICES"] = gpu
        if self.mps_env is not None:
            base |= self.mps_env | {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100" if whole else "50"}
        return base


@contextlib.contextmanager
def mps_daemon(root: Path) -> Iterator[dict[str, str]]:
    """A CUDA MPS control daemon of our own (its logs under `root`, its pipes in a short
    temporary directory: a socket path has a length limit), stopped when the block ends,
    however it ends; yields the environment its clients need."""
    with tempfile.TemporaryDirectory(prefix="mps-") as pipes:
        env = {"CUDA_MPS_PIPE_DIRECTORY": pipes, "CUDA_MPS_LOG_DIRECTORY": str(root / "mps-log")}
        Path(env["CUDA_MPS_LOG_DIRECTORY"]).mkdir(parents=True, exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=os.environ | env, check=True, timeout=30)
        print(f"MPS control daemon started (logs in {env['CUDA_MPS_LOG_DIRECTORY']})", flush=True)
        try:
            yield env
        finally:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=os.environ | env, timeout=60, check=False)
            print("MPS control daemon stopped", flush=True)


class Worker:
    """A `polyrl worker` that joins the trainer's manager, as a spot VM would."""

    def __init__(
        self,
        model: Path,
        manager_url: str,
        worker_id: str,
        gpu: str,
        log_dir: Path,
        fraction: float | None,
        extra: tuple[str, ...] = ("engine.max_num_seqs=512",),
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """`gpu`: CUDA_VISIBLE_DEVICES for it ("" hides every GPU); `fraction`: its KV cache's
        share of the free GPU memory (None: `extra` sizes it); `extra`: more config overrides;
        `env`: more environment (MPS); `prefix`: a command to run it under (a profiler)."""
        env = (
            os.environ
            | {"CUDA_VISIBLE_DEVICES": gpu, "POLYRL_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
            | (env or {})
        )
        self.worker_id = worker_id
        self.log = open(log_dir / f"{worker_id}.log", "ab")  # noqa: SIM115 - closed in stop()
        kv = [f"engine.kv_cache_memory_fraction={fraction}"] if fraction is not None else []
        cmd = [
            *(prefix or []),
            sys.executable,
            "-m",
            "polyrl.cli",
            "worker",
            "--model",
            str(model),
            "--port",
            "0",
            "--manager",
            manager_url,
            "--worker-id",
            worker_id,
            *kv,
            "worker.heartbeat_interval_s=0.5",
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: the worker under a prefix too
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            # the worker drains on SIGTERM; under a prefix (a profiler) the worker is its child,
            # and the prefix ends, writing its output, when the worker does
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            pids = [int(p) for p in children.read_text().split()] if children.exists() else []
            for pid in pids or [self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
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


class FleetTokens:
    """Tokens every engine of the run has generated (the workers' own counters, from
    `/get_server_info`), read at each step's end: the fleet's production per step, counted
    as it decodes rather than when groups finish (which comes in waves)."""

    def __init__(self, manager_url: str) -> None:
        import httpx

        self.client = httpx.Client(timeout=2.0, headers={"Authorization": f"Bearer {TOKEN}"})
        self.manager_url = manager_url
        self.last: dict[str, int] = {}
        self.by_step: dict[int, dict[str, int]] = {}
        """step -> worker -> tokens generated since the previous step's reading."""

    def read(self, step: int) -> None:
        import httpx

        got: dict[str, int] = {}
        try:
            fleet = self.client.get(f"{self.manager_url}/v1/workers").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return
        for w in fleet:
            try:
                info = self.client.get(f"{w['url']}/get_server_info").json()
            except (httpx.HTTPError, ValueError):
                continue  # a worker gone: what it made before its last reading is counted
            total = int(info["num_generated_tokens"])
            got[w["worker_id"]] = max(0, total - self.last.get(w["worker_id"], 0))
            self.last[w["worker_id"]] = total
        self.by_step[step] = got

    def close(self) -> None:
        self.client.close()


def train_command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides]


def engine_overrides(args: argparse.Namespace, blocks: int) -> list[str]:
    """An engine's batch and KV cache: a fixed block count when `blocks`, else a fraction."""
    if args.device == "cpu":
        return ['engine.device="cpu"', "engine.max_num_seqs=64", f"engine.num_kv_blocks={blocks or 512}"]
    kv = f"engine.num_kv_blocks={blocks}" if blocks else f"engine.kv_cache_memory_fraction={args.kv_fraction}"
    return ["engine.max_num_seqs=512", kv]


def throughput_overrides(
    args: argparse.Namespace, model: Path, mode: str, port: int, data: Path, has_budgets: bool, cooldown: int = 0
) -> list[str]:
    """`data`: the workload's prompt file; `has_budgets`: it has `write_workload`'s
    `max_new_tokens` column, each prompt's own budget; `cooldown`: steps run after the
    measured ones and not counted."""
    budget = ["data.max_new_tokens_key=max_new_tokens"] if has_budgets else []
    cuda = args.device == "cuda"
    return [
        f"model.path={model}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}",
        f"trainer.device={args.device}",
        f"rollout.mode={mode}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "data.task=dataset",
        f"data.path={data}",
        "data.format=plain",
        "reward.functions=['polyrl.data.tasks:char_match_reward']",
        *budget,
        f"trainer.train_batch_size={args.prompts}",
        f"trainer.ppo_mini_batch_size={args.prompts // args.mini_batches}",
        f"trainer.total_steps={args.warmup + args.steps + cooldown}",
        "trainer.lr=1e-6",
        "trainer.warmup_steps=0",
        f"trainer.micro_batch_max_tokens={args.micro_batch_tokens}",
        "trainer.save_every=0",
        *engine_overrides(args, args.kv_blocks),
        "logging.console=false",
        "logging.tensorboard=false",
        "fleet.num_workers=0",
        f"manager.port={port}",
        f"manager.token={TOKEN}",
        "manager.heartbeat_interval_s=0.5",
        f"manager.max_inflight_per_worker={512 if cuda else 64}",
        f"cost.trainer_usd_per_hour={ON_DEMAND_USD_PER_GPU_HOUR}",
        f"cost.worker_usd_per_hour={SPOT_USD_PER_GPU_HOUR}",
    ]


def run_part(
    part: str,
    overrides: list[str],
    run_dir: Path,
    model: Path | None,
    port: int,
    args: argparse.Namespace,
    spot: bool,
    kill_step: int | None = None,
    timeout_s: float = 900,
    whole: bool = False,
    worker_kv_blocks: int | None = None,
) -> tuple[list[dict[str, float]], float, list[str]]:
    """Run one trainer (and its worker); returns its metrics rows, wall seconds, notes.
    `worker_kv_blocks`: the spot worker's KV cache (default `--worker-kv-blocks`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    workers: list[Worker] = []
    url = f"http://127.0.0.1:{port}"
    place: Placement = args.placement
    worker_env = place.env("worker")

    def start_worker(worker_id: str) -> Worker:
        extra = (*engine_overrides(args, worker_kv_blocks or args.worker_kv_blocks), *args.worker_set)
        prefix = shlex.split(args.worker_prefix.format(part=part, worker=worker_id))
        return Worker(
            model, url, worker_id, worker_env["CUDA_VISIBLE_DEVICES"], run_dir, None, extra, worker_env, prefix
        )

    if spot:  # started first: it retries registering until the trainer's manager is up
        workers.append(start_worker("spot0"))
        overrides = [*overrides, "fleet.min_workers=1"]  # the first step waits for it, not the trainer's engine
    t0 = time.monotonic()
    counter = FleetTokens(url)
    seen = 0
    with open(run_dir / "trainer.log", "ab") as log:
        trainer = subprocess.Popen(
            [*shlex.split(args.trainer_prefix.format(part=part)), *train_command(run_dir, overrides)],
            env=os.environ | place.env("trainer", whole),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its group: the trainer under --trainer-prefix's command too
        )
        killed = False
        try:
            while trainer.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    for pid in [trainer.pid, *(w.proc.pid for w in workers)]:  # every thread's stack into the logs
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGABRT)
                    time.sleep(3)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(trainer.pid, signal.SIGKILL)
                    notes.append(f"timed out after {timeout_s:.0f}s (stacks in the logs)")
                    break
                rows = read_metrics(run_dir / "metrics.jsonl")
                if len(rows) > seen:
                    seen = len(rows)
                    counter.read(int(rows[-1]["step"]))
                if kill_step is not None and not killed and len(rows) >= kill_step - 1:
                    # mid-step: half the previous step's time into step `kill_step`
                    step_s = rows[-1].get("perf/time_per_step", 1.0) if rows else 1.0
                    time.sleep(max(step_s / 2, 0.2))
                    workers[-1].kill()
                    notes.append(f"spot0 killed -9 in step {kill_step}")
                    killed = True
                    time.sleep(args.restart_after_s)
                    workers.append(start_worker("spot1"))
                    notes.append(f"spot1 started {args.restart_after_s:.0f}s later")
                time.sleep(0.2)
        finally:
            if trainer.poll() is None:  # timed out, or this script is stopping (an error, Ctrl-C)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(trainer.pid, signal.SIGTERM)
                trainer.wait()
            for w in workers:
                w.stop()
            counter.close()
    wall = time.monotonic() - t0
    (run_dir / "fleet_tokens.json").write_text(json.dumps(counter.by_step))
    for path in sorted(run_dir.glob("*.log")):  # the engine logs its preemptions at 1, 10, 100, ...
        counts = re.findall(r"KV cache full.*?\((\d+) so far", path.read_text(errors="replace"))
        if counts:
            notes.append(f"{path.stem}: over {counts[-1]} KV preemptions (recomputed sequences)")
    if any(n.startswith("timed out") for n in notes):  # its SIGABRT reads "Fatal Python error: Aborted"
        print(f"[{part}] stopped at the part limit ({timeout_s:.0f} s); the stacks are in its logs", flush=True)
    elif trainer.returncode != 0:
        tail = (run_dir / "trainer.log").read_text(errors="replace")[-3000:]
        notes.append(f"trainer exit {trainer.returncode}")
        print(f"[{part}] trainer failed:\n{tail}", flush=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    read_at = sorted(int(k) for k in counter.by_step)
    for r in rows:
        made = counter.by_step.get(int(r["step"]))
        if made is None and read_at and read_at[-1] > r["step"]:
            made = {}  # steps that ended between two readings: the later one counts their tokens
        if made is not None:
            r["bench/fleet_tokens"] = float(sum(made.values()))
            r["bench/fleet_tokens_local"] = float(made.get("local", 0))
    return rows, wall, notes


def summarise(
    part: str, rows: list[dict[str, float]], warmup: int, wall: float, notes: list[str], last: int | None = None
) -> Result:
    """The measured steps (after `warmup`, up to `last`) summed up."""
    measured = [r for r in rows if warmup < r["step"] <= (last or r["step"])]
    res = Result(part=part, steps=len(measured), wall_s=wall, notes=notes)
    res.step_s = [round(r["perf/time_per_step"], 3) for r in rows]
    if not measured:
        return res
    step_s = sum(r["perf/time_per_step"] for r in measured)
    tokens = sum(r["perf/total_num_tokens"] for r in measured)
    gen_tokens = sum(r["response_length/mean"] * r["rollout/samples_received"] for r in measured)
    res.s_per_step = step_s / len(measured)
    res.tokens_per_s = tokens / step_s
    res.steady_tokens_per_s = res.tokens_per_s
    if all("async/arrived_tokens" in r for r in measured):
        res.delivered_tokens_per_s = sum(r["async/arrived_tokens"] for r in measured) / step_s
    after = [r for r in rows if r["step"] == measured[-1]["step"] + 1]
    if "async/ready_groups" in measured[0] and after:
        res.backlog_used = measured[0]["async/ready_groups"] - after[0]["async/ready_groups"]
    if "async/ready_groups" in measured[0] and all("bench/fleet_tokens" in r for r in measured) and gen_tokens:
        # the engines' completion tokens, with the prompts' share of what was trained
        made = sum(r["bench/fleet_tokens"] for r in measured) * tokens / gen_tokens
        res.produced_tokens_per_s = made / step_s
        res.steady_tokens_per_s = min(res.tokens_per_s, res.produced_tokens_per_s)
        res.local_made = sum(r["bench/fleet_tokens_local"] for r in measured) / max(
            sum(r["bench/fleet_tokens"] for r in measured), 1
        )
    res.gen_tokens_per_s = gen_tokens / step_s
    res.usd_per_hour = sum(r["cost/usd_per_hour"] for r in measured) / len(measured)
    res.tokens_per_usd = res.steady_tokens_per_s * 3600 / res.usd_per_hour
    mean = lambda key: sum(r.get(key, 0.0) for r in measured) / len(measured)  # noqa: E731
    res.gen_s, res.update_actor_s, res.publish_s = (
        mean("timing_s/gen"),
        mean("timing_s/update_actor"),
        mean("timing_s/update_weights"),
    )
    syncs = [r["timing_s/weight_sync"] for r in measured if "timing_s/weight_sync" in r]
    res.weight_sync_s = sum(syncs) / len(syncs) if syncs else None
    res.logprob_diff = max(r.get("rollout/logprob_diff", 0.0) for r in measured)
    res.version_lag = mean("rollout/version_lag/mean")
    res.version_lag_max = max(r.get("rollout/version_lag/max", 0.0) for r in measured)
    res.multi_version = mean("rollout/multi_version_ratio")
    res.learner_idle_s = mean("timing_s/learner_idle")
    idles = [r["rollout/fleet_idle_ratio"] for r in measured if "rollout/fleet_idle_ratio" in r]
    res.fleet_idle = sum(idles) / len(idles) if idles else None
    res.due_groups, res.held_back = mean("async/due_groups"), mean("async/held_back_samples")
    if "async/ready_groups" in measured[0]:
        res.ready_start, res.ready_end = measured[0]["async/ready_groups"], measured[-1]["async/ready_groups"]
    res.samples_lost = int(sum(r["rollout/samples_lost"] for r in rows))
    res.migrated = int(sum(r["rollout/migrated_samples"] for r in rows))
    res.local_share = sum(r["rollout/local_samples"] for r in measured) / max(
        sum(r["rollout/samples_received"] for r in measured), 1
    )
    res.mean_completion_len = mean("response_length/mean")
    res.max_completion_len = max(r.get("response_length/max", 0.0) for r in measured)
    return res


def learning_part(
    part: str,
    mode: str,
    args: argparse.Namespace,
    work: Path,
    extra: list[str],
    model: Path,
    data: Path,
    steps: int | None = None,
) -> Result:
    """A small model (`--learn-shape`) learning from scratch to repeat the prompt's word
    ("ab>" -> "ababab...") on the long-tail workload: every response runs to its prompt's
    budget (`rollout.ignore_eos`) and every character of it is scored
    (`repeat_match_reward`), so a step costs what a long-tail step costs, and all of it is
    something to learn. `steps`: the run's steps (default `--learn-steps`).
    Reported: wall-clock seconds (the steps' own, start-up left out) until the mean reward
    of 5 steps in a row reaches the target."""
    port = free_port()
    cuda = args.device == "cuda"
    overrides = [
        f"model.path={model}",
        f"model.dtype={args.learn_dtype if cuda else 'float32'}",
        f"trainer.device={args.device}",
        f"rollout.mode={mode}",
        f"rollout.n={args.learn_n}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.ignore_eos=true",
        "data.task=dataset",
        f"data.path={data}",
        "data.format=plain",
        "data.max_new_tokens_key=max_new_tokens",
        "reward.functions=['polyrl.data.tasks:repeat_match_reward']",
        f"trainer.train_batch_size={args.prompts}",
        f"trainer.ppo_mini_batch_size={args.prompts // args.mini_batches}",
        f"trainer.total_steps={steps or args.learn_steps}",
        f"trainer.lr={args.learn_lr}",
        f"trainer.seed={args.learn_seed}",
        f"trainer.micro_batch_max_tokens={args.learn_micro_batch_tokens}",
        "trainer.save_every=0",
        *engine_overrides(args, args.learn_kv_blocks),
        "logging.console=false",
        "logging.tensorboard=false",
        "fleet.num_workers=0",
        f"manager.port={port}",
        f"manager.token={TOKEN}",
        "manager.heartbeat_interval_s=0.5",
        f"manager.max_inflight_per_worker={512 if cuda else 64}",
        f"cost.trainer_usd_per_hour={ON_DEMAND_USD_PER_GPU_HOUR}",
        f"cost.worker_usd_per_hour={SPOT_USD_PER_GPU_HOUR}",
        *extra,
    ]
    if "rollout.fully_async=true" in extra:
        overrides += args.async_set
    rows, wall, notes = run_part(
        part,
        overrides,
        work / part,
        model,
        port,
        args,
        mode != "local",
        None,
        args.part_timeout_s,
        worker_kv_blocks=args.learn_kv_blocks,
    )
    res = summarise(part, rows, 0, wall, notes)
    res.workload = "learn"  # its own model and task: no throughput row to compare with
    reached = time_to(rows, args.target_reward)
    res.time_to_target_s = reached[0] if reached else None
    last = [r["critic/score/mean"] for r in rows[-5:]]
    res.final_reward = sum(last) / len(last) if last else None
    for target in LEARN_TARGETS:  # the curve, coarsely
        at = time_to(rows, target)
        res.notes.append(f"to {target:g}: " + (f"{at[0]:.1f} s ({at[1]} steps)" if at else "not reached"))
    return res


LEARN_TARGETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4)


def time_to(rows: list[dict[str, float]], target: float) -> tuple[float, int] | None:
    """The steps' seconds, and the steps, until the mean reward of 5 steps in a row reaches
    `target` (None: never)."""
    elapsed, window = 0.0, []
    for i, r in enumerate(rows, 1):
        elapsed += r["perf/time_per_step"]
        window = (window + [r["critic/score/mean"]])[-5:]
        if len(window) == 5 and sum(window) / 5 >= target:
            return elapsed, i
    return None


def parse_shape(text: str) -> dict[str, int]:
    """`--learn-shape`'s "hidden_size=128,num_layers=2" as `model.tiny` settings, checked by
    `TinyModelConfig` itself (names, bounds, heads that divide) before any row runs."""
    shape = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"--learn-shape: {item!r} is not KEY=INT")
        shape[key] = int(value)
    try:
        TinyModelConfig(**shape)
    except ValidationError as e:
        raise SystemExit(f"--learn-shape: {e}") from None
    return shape


def tiny_model(out: Path, max_positions: int, **shape: int) -> Path:
    """The project's tiny model (random weights), with room for `max_positions` tokens;
    `shape`: more `model.tiny` settings."""
    if not (out / "config.json").exists():
        save_tiny_model(out, TinyModelConfig(max_position_embeddings=max_positions, **shape))
    return out


# ----------------------------------------------------------------------- the stand-in's penalty


def decode_latency(model: Path, num_tokens: int) -> float:
    """Milliseconds per decode step of one sequence on polyrl's engine (CUDA graphs)."""
    from polyrl.config import EngineConfig
    from polyrl.engine.engine import Engine
    from polyrl.engine.types import EngineRequest
    from polyrl.protocol.sampling import SamplingParams

    engine = Engine.from_pretrained(str(model), EngineConfig(max_num_seqs=8, num_kv_blocks=512))
    times = []
    for i in range(3):  # the first is a warm-up
        sampling = SamplingParams(max_new_tokens=num_tokens, temperature=1.0, ignore_eos=True, seed=i)
        engine.add_request(EngineRequest(f"r{i}", [1, 2, 3, 4], sampling))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_work:
            engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000 / num_tokens)
    return float(np.median(times[1:]))


def decode_capacity(
    model: Path, blocks: int, levels: list[int], budgets: list[int], warm_s: float = 3.0, measure_s: float = 6.0
) -> dict[int, dict[str, float]]:
    """Generated tokens/s of one engine kept at `c` sequences in flight for each `c` in
    `levels` (each finished sequence replaced at once by one with the next long-tail
    budget), with the spot worker's KV cache (`blocks`): the most a spot worker of this
    shape can give the fleet, whatever the scheduling above it."""
    from engine_fed import fed_run  # benchmarks/engine_fed.py: the same loop, one level at a time

    from polyrl.config import EngineConfig
    from polyrl.engine.engine import Engine

    engine = Engine.from_pretrained(str(model), EngineConfig(max_num_seqs=max(levels), num_kv_blocks=blocks))
    return {c: fed_run(engine, c, measure_s, budgets, prompt_len=8, fixed_budget=0, warm_s=warm_s) for c in levels}


def train_loop(model: Path, seconds: float) -> None:
    """The 0.6B shape's forward and backward (bf16, 4 x 2048 tokens) in a loop: a training half
    (the spot half's KV cache must fit beside it)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
    ids = torch.randint(0, 150000, (4, 2048), device="cuda")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def standin_part(args: argparse.Namespace, model: Path, work: Path) -> Result:
    """The spot half with the other half idle, then with it training: a single sequence's
    decode latency, and the generation throughput at several batch sizes (long-tail
    budgets, the spot worker's KV cache). What the one-GPU stand-in costs a spot worker
    that a second GPU would not, and the most generation a spot half can give."""
    res = Result(part="standin")
    place: Placement = args.placement
    budgets = longtail_budgets(4096, args.tail_median, args.tail_p99, args.new_tokens, seed=1)
    (work / "standin_budgets.json").write_text(json.dumps(budgets))
    role = f"decode:{model}:{args.worker_kv_blocks}:{args.capacity_levels}:{work / 'standin_budgets.json'}"
    me = [sys.executable, __file__, "--_role"]

    def measure() -> dict:
        out = subprocess.run(
            [*me, role], env=os.environ | place.env("worker"), capture_output=True, text=True, timeout=400
        )
        if out.returncode != 0:
            raise RuntimeError(f"standin child failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    idle = measure()
    trainer = subprocess.Popen(
        [*me, f"train:{model}"],
        env=os.environ | place.env("trainer"),
        stdout=subprocess.DEVNULL,
        stderr=open(work / "standin_train.log", "ab"),
    )  # noqa: SIM115
    try:
        time.sleep(15)  # its model loaded and its loop running
        busy = measure()
    finally:
        trainer.kill()
        trainer.wait()
    idle_ms, busy_ms = idle["latency_ms"], busy["latency_ms"]
    res.notes = [
        f"decode step, 1 sequence: {idle_ms:.2f} ms with the other half idle, {busy_ms:.2f} ms with it "
        f"training ({busy_ms / idle_ms:.2f}x)"
    ]
    for c, alone in idle["capacity"].items():
        beside = busy["capacity"][c]
        res.notes.append(
            f"{c} sequences in flight: {alone['tok_s']:.0f} tok/s alone, {beside['tok_s']:.0f} beside "
            f"training ({alone['tok_s'] / max(beside['tok_s'], 1):.2f}x); mean running "
            f"{alone['mean_running']:.0f}/{beside['mean_running']:.0f}; preemptions "
            f"{alone['preemptions']}/{beside['preemptions']}"
        )
    res.gen_s, res.update_actor_s = idle_ms, busy_ms
    res.capacity = {"idle": idle["capacity"], "training": busy["capacity"]}
    return res


def child_role(role: str) -> None:
    kind, model, *rest = role.split(":")
    if kind == "decode":
        blocks, levels, budgets = (
            int(rest[0]),
            [int(c) for c in rest[1].split(",")],
            json.loads(Path(rest[2]).read_text()),
        )
        latency = decode_latency(Path(model), 256)
        gc.collect()
        torch.cuda.empty_cache()
        capacity = decode_capacity(Path(model), blocks, levels, budgets)
        print(json.dumps({"latency_ms": latency, "capacity": capacity}), flush=True)
    else:
        train_loop(Path(model), seconds=120)


# ---------------------------------------------------------------------------------------- main


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The batch, learner and engine options this script shares with elastic_gpu.py."""
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument(
        "--stop-ids", type=int, default=0, help="extra end-of-sequence ids (0: every response is full length)"
    )
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--kv-fraction", type=float, default=0.45, help="the trainer's engine on its (first) GPU (fixed split)"
    )
    p.add_argument("--worker-kv-fraction", type=float, default=0.8)
    p.add_argument("--restart-after-s", type=float, default=3.0)


THROUGHPUT_PARTS: dict[str, tuple[str, str, list[str]]] = {  # part: (workload, rollout mode, overrides)
    "colocated": ("longtail", "local", []),
    "colocated_whole": ("longtail", "local", []),
    "hybrid": ("longtail", "hybrid", []),
    "hybrid_ahead": ("longtail", "hybrid", ["rollout.max_staleness=1"]),
    "fully_async_k1": ("longtail", "hybrid", ["rollout.fully_async=true", "rollout.max_staleness=1"]),
    "fully_async_k2": ("longtail", "hybrid", ["rollout.fully_async=true", "rollout.max_staleness=2"]),
    "fully_async_k3": ("longtail", "hybrid", ["rollout.fully_async=true", "rollout.max_staleness=3"]),
    "fully_async_k4": ("longtail", "hybrid", ["rollout.fully_async=true", "rollout.max_staleness=4"]),
    "equal_colocated": ("equal", "local", []),
    "equal_hybrid": ("equal", "hybrid", []),
    "equal_hybrid_ahead": ("equal", "hybrid", ["rollout.max_staleness=1"]),
    "equal_fully_async": ("equal", "hybrid", ["rollout.fully_async=true", "rollout.max_staleness=2"]),
}
LEARN_PARTS = {  # part: (rollout mode, overrides)
    "learn_colocated": ("local", []),
    "learn_hybrid": ("hybrid", []),
    "learn_hybrid_ahead": ("hybrid", ["rollout.max_staleness=1"]),
    **{f"learn_fully_async_k{k}": ("hybrid", THROUGHPUT_PARTS[f"fully_async_k{k}"][2]) for k in (1, 2, 3, 4)},
}
KILLABLE = ("hybrid", "hybrid_ahead", "fully_async_k1", "fully_async_k2", "fully_async_k3", "fully_async_k4")
DEFAULT_PARTS = (
    "colocated,colocated_whole,hybrid,hybrid_ahead,fully_async_k1,fully_async_k2,best_kill,equal_colocated,"
    "equal_fully_async,learn_colocated,learn_fully_async_k2,standin"
)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_role":  # a child of the standin row
        child_role(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--only", default=DEFAULT_PARTS, help="comma-separated rows (default: %(default)s)")
    add_workload_args(p)
    p.add_argument("--split", choices=("mps", "gpus", "one"), default="gpus")
    p.add_argument("--one-gpu", action="store_true", help="the same as --split one")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--kv-blocks", type=int, default=8192, help="the trainer's engine (16-token blocks; 0: --kv-fraction)"
    )
    p.add_argument(
        "--worker-kv-blocks", type=int, default=12288, help="the spot worker's engine (0: --worker-kv-fraction)"
    )
    p.add_argument("--tail-median", type=float, default=300, help="long-tail workload: median budget (tokens)")
    p.add_argument("--tail-p99", type=float, default=3000, help="long-tail workload: 99th-percentile budget")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--cooldown",
        type=int,
        default=2,
        help="fully asynchronous rows: steps after the measured ones (at least the row's max_staleness)",
    )
    p.add_argument("--learn-steps", type=int, default=80)
    p.add_argument("--learn-n", type=int, default=16, help="learn_*: samples per prompt")
    p.add_argument("--learn-lr", type=float, default=3e-3, help="learn_*: the learning rate")
    p.add_argument("--learn-seed", type=int, default=0, help="learn_*: trainer.seed (sampling and prompt order)")
    p.add_argument(
        "--learn-shape",
        default="hidden_size=128,intermediate_size=256",
        help="learn_*: the model's model.tiny sizes, KEY=INT,... (the default is GPU-light: its engines are "
        "bound by their per-token Python work; a head size that is a power of two keeps the Triton kernels "
        "and CUDA graphs on)",
    )
    p.add_argument(
        "--learn-prewarm-steps",
        type=int,
        default=0,
        help="learn_*: first run this many colocated steps, not reported, so that every learning row finds the "
        "learner's compiled kernels in the on-disk cache (else the first row alone pays the compile)",
    )
    p.add_argument(
        "--learn-dtype", default="float32", choices=["float32", "bfloat16"], help="learn_*: model.dtype on CUDA"
    )
    p.add_argument(
        "--learn-micro-batch-tokens",
        type=int,
        default=65536,
        help="learn_*: the learner's micro-batch tokens (the run's default, 4096, holds only 4 rows of "
        "a 1024-token response: a learning step of some 200k tokens would take over 100 micro-batches)",
    )
    p.add_argument(
        "--learn-kv-blocks", type=int, default=32768, help="learn_*: each engine's KV cache (the tiny model's)"
    )
    p.add_argument("--part-timeout-s", type=float, default=900, help="a part still running then is stopped")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more trainer overrides")
    p.add_argument(
        "--async-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more trainer overrides for the fully asynchronous rows only (best_kill included), "
        "e.g. rollout.hybrid_local_until=always, which the other rows refuse",
    )
    p.add_argument("--worker-set", action="append", default=[], metavar="KEY=VALUE", help="more spot-worker overrides")
    p.add_argument("--keep", type=Path, help="keep the logs and run directories here")
    p.add_argument(
        "--model",
        type=Path,
        help="the throughput rows' model, made by an earlier run of this script "
        "(its --keep directory's qwen3-0.6b-shape; default: made anew)",
    )
    p.add_argument(
        "--kill-as",
        choices=KILLABLE,
        help="best_kill: the row to repeat with a kill (default: the fastest such row of this run)",
    )
    p.add_argument("--target-reward", type=float, default=0.3, help="learn_*: the mean reward of 5 steps in a row")
    p.add_argument(
        "--trainer-prefix",
        default="",
        help="a command to run each trainer under, {part} replaced by the row's name, e.g. "
        "'py-spy record -f raw -r 50 --subprocesses --nonblocking -o prof-{part}.txt --'",
    )
    p.add_argument(
        "--worker-prefix",
        default="",
        help="the same for each spot worker, {part} and {worker} replaced",
    )
    p.add_argument("--capacity-levels", default="128,256,512", help="standin: sequences in flight to measure")
    p.add_argument(
        "--plan",
        action="store_true",
        help="first calibrate the fleet model (`polyrl plan calibrate`) under the rows' own split, then print "
        "its prediction of each throughput row beside the measured one",
    )
    p.add_argument(
        "--plan-pull-gbps",
        type=float,
        default=100.0,
        help="--plan: the spot worker's pull rate over loopback (benchmarks/transfer.py: 12-17 GB/s on such hosts)",
    )
    p.add_argument(
        "--plan-calibrations",
        type=Path,
        help="--plan: take calibration_half.json / calibration_whole.json from this directory where they are "
        "(an earlier run's, on the same kind of machine) and make only the missing one",
    )
    p.add_argument(
        "--replay",
        type=Path,
        metavar="JSON",
        help="run nothing: print the fleet model's prediction of the rows an earlier `--plan --json` run "
        "wrote (with its calibrations), step by step, with this checkout's model",
    )
    args = p.parse_args()
    if args.replay:
        replay(args.replay)
        return
    args.plan_rows = {}
    if args.one_gpu:
        args.split = "one"
    parts = args.only.split(",")
    known = {*THROUGHPUT_PARTS, *LEARN_PARTS, "best_kill", "standin"}
    unknown = [x for x in parts if x not in known]
    if unknown:
        sys.exit(f"unknown parts {unknown}; known: {sorted(known)}")
    if args.device == "cuda" and torch.cuda.device_count() < (2 if args.split == "gpus" else 1):
        sys.exit(
            f"--split {args.split} needs {2 if args.split == 'gpus' else 1} GPUs, found {torch.cuda.device_count()}"
        )
    if args.device == "cpu":
        parts = [x for x in parts if x not in ("standin", "colocated_whole")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still runs the clean-ups (the MPS daemon's)
    with tempfile.TemporaryDirectory(prefix="spot_gpu_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run_parts(parts, args, work)
        report(results, args)
        if args.plan:
            plan = plan_report(results, args)
            if args.json:
                out = json.loads(args.json.read_text())
                out["plan"] = plan
                out["calibrations"] = {k: json.loads(v.read_text()) for k, v in args.calibrations.items()}
                args.json.write_text(json.dumps(out, indent=1, default=str))


def replay(path: Path) -> None:
    """The fleet model against the rows of an earlier `--plan --json` run, with no process
    and no GPU: the model can be changed and checked against kept GPU rows on any machine
    (`benchmarks/results/` keeps some)."""
    from polyrl.plan.calibration import Calibration

    data = json.loads(path.read_text())
    missing = [k for k in ("plan_rows", "budgets", "calibrations") if not data.get(k)]
    if missing:
        sys.exit(
            f"{path}: no {', '.join(missing)}: written by a run without --plan, or by an older version of this script"
        )
    args = argparse.Namespace(**data["args"])
    args.plan_rows, args.budgets = data["plan_rows"], data["budgets"]
    fields = set(Result.__dataclass_fields__)
    results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in data["results"]]
    cals = {k: Calibration.model_validate(v) for k, v in data["calibrations"].items()}
    print(f"{path}: {len(results)} rows, {args.warmup} warm-up + {args.steps} measured steps")
    plan_report(results, args, cals, steps=True)


def run_parts(parts: list[str], args: argparse.Namespace, work: Path) -> list[Result]:
    results: list[Result] = []
    model = learn_model = None
    if any(x in THROUGHPUT_PARTS or x in ("best_kill", "standin") for x in parts):
        if args.model is not None:
            model = args.model
        elif args.device == "cuda":
            model = make_model(work / "qwen3-0.6b-shape", args.stop_ids, args.new_tokens + 512)
        else:  # the tiny model, long enough for the budgets
            model = tiny_model(work / "tiny", args.new_tokens + 128)
    count = args.prompts * (args.warmup + args.steps + max(args.cooldown, 4) + 4)  # one pass (fully async runs ahead)
    budgets = longtail_budgets(count, args.tail_median, args.tail_p99, args.new_tokens)
    data = {
        "longtail": write_workload(work / "longtail.jsonl", count, budgets),
        "equal": write_workload(work / "equal.jsonl", count, None),
    }
    if any(x in LEARN_PARTS for x in parts):  # the same budget distribution, enough prompts for every step
        count = args.prompts * (args.learn_steps + 6)
        data["learn"] = write_workload(
            work / "learn.jsonl", count, longtail_budgets(count, args.tail_median, args.tail_p99, args.new_tokens)
        )
        shape = parse_shape(args.learn_shape)
        name = "learn_" + "_".join(f"{k}{v}" for k, v in sorted(shape.items()))
        learn_model = tiny_model(work / name, args.new_tokens + 128, **shape)
    args.budgets = budgets
    if args.plan:
        args.calibrations = plan_calibrations(parts, args, work, model, data)
    print(
        f"long-tail budgets: median {np.median(budgets):.0f}, p90 {np.percentile(budgets, 90):.0f}, "
        f"p99 {np.percentile(budgets, 99):.0f}, max {max(budgets)}, mean {np.mean(budgets):.0f}",
        flush=True,
    )
    if learn_model is not None and args.learn_prewarm_steps:
        # The first step of a run compiles the learner (tens of seconds), and later runs
        # load it from the compiler's on-disk cache: without this, whichever learning row
        # runs first pays the compile in its time to the target and the others do not.
        print("== learn_prewarm (not reported)", flush=True)
        with part_placement(args, work / "learn_prewarm"):
            learning_part(
                "learn_prewarm", "local", args, work, [], learn_model, data["learn"], args.learn_prewarm_steps
            )
    for part in parts:
        print(f"== {part}", flush=True)
        with part_placement(args, work / part):
            res = run_one(part, args, work, model, data, results, learn_model)
        if res is not None:
            results.append(res)
            print(json.dumps(asdict(res)), flush=True)
    return results


@contextlib.contextmanager
def part_placement(args: argparse.Namespace, mps_root: Path) -> Iterator[None]:
    """`args.placement` for one part. Under `--split mps` each part gets an MPS control
    daemon of its own: a part then starts on a server no earlier part's clients touched
    (a kill -9 row after other rows had its trainer torn down by the server's fatal-error
    handling twice, while the same row run alone lost nothing)."""
    if args.split == "mps" and args.device == "cuda":
        with mps_daemon(mps_root) as env:
            args.placement = Placement(args.split, args.device, env)
            yield
    else:
        args.placement = Placement(args.split, args.device)
        yield


def run_one(
    part: str,
    args: argparse.Namespace,
    work: Path,
    model: Path | None,
    data: dict[str, Path],
    done: list[Result],
    learn_model: Path | None,
) -> Result | None:
    if part == "standin":
        try:
            return standin_part(args, model, work)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other rows still count
            return Result(part="standin", notes=[f"failed: {e}"])
    if part in LEARN_PARTS:
        mode, extra = LEARN_PARTS[part]
        return learning_part(part, mode, args, work, extra, learn_model, data["learn"])
    return throughput_part(part, args, work, model, data, done)


def throughput_part(
    part: str, args: argparse.Namespace, work: Path, model: Path, data: dict[str, Path], done: list[Result]
) -> Result | None:
    kill = None
    if part == "best_kill":  # the fastest spot row of this run (or --kill-as), with a kill
        spot_rows = [r for r in done if r.part in KILLABLE and r.steps]
        if args.kill_as:
            best_part = args.kill_as
        elif spot_rows:
            best_part = max(spot_rows, key=lambda r: r.steady_tokens_per_s).part
        else:
            print("best_kill: run one of " + ", ".join(KILLABLE) + " first, or name one with --kill-as", flush=True)
            return None
        workload, mode, extra = THROUGHPUT_PARTS[best_part]
        kill = args.warmup + 2 if args.steps >= 2 else args.warmup + 1
    else:
        workload, mode, extra = THROUGHPUT_PARTS[part]
    port = free_port()
    # Fully asynchronous runs submit less over their last k steps (prompts for the steps
    # left, not k + 1 steps' worth): at least k steps after the measured ones keep those in
    # the steady state. (With k = 4 and 2 such steps, the fleet made 58k and 7k tokens in
    # the last two measured steps, against 82k-165k in the four before.)
    fully_async = "rollout.fully_async=true" in extra
    k = max([int(x.split("=")[1]) for x in extra if x.startswith("rollout.max_staleness=")] or [0])
    cooldown = max(args.cooldown, k) if fully_async else 0
    overrides = [
        *throughput_overrides(args, model, mode, port, data[workload], workload == "longtail", cooldown),
        *extra,
        *args.set,
        *(args.async_set if fully_async else []),
    ]
    whole = part == "colocated_whole"
    rows, wall, notes = run_part(
        part, overrides, work / part, model, port, args, mode != "local", kill, args.part_timeout_s, whole
    )
    if part == "best_kill":
        notes.insert(0, f"as {best_part}")
    for saved in ("checkpoints", "final_model"):  # gigabytes per row at this size: the disk would fill
        shutil.rmtree(work / part / saved, ignore_errors=True)
    res = summarise(part, rows, args.warmup, wall, notes, args.warmup + args.steps)
    res.workload = workload
    prompts = [r["prompt_length/mean"] for r in rows if "prompt_length/mean" in r]
    config = work / part / "config.toml"  # the trainer's resolved config: what a replay loads
    if config.exists():
        args.plan_rows[part] = (config.read_text(), kill, float(np.mean(prompts)) if prompts else 8.0)
    return res


# ------------------------------------------------------------------------------ the fleet model


def plan_calibrations(
    parts: list[str], args: argparse.Namespace, work: Path, model: Path, data: dict[str, Path]
) -> dict[str, Path]:
    """`polyrl plan calibrate` for the rows: `half` as the trainer's half and the spot
    worker run (under this split's MPS, each at 50%: the worker served, its context cost,
    and the two halves busy at once), `whole` as `colocated_whole` runs."""
    base = [*throughput_overrides(args, model, "local", free_port(), data["longtail"], True), *args.set]
    mean_len = int(np.mean(args.budgets))
    common = ["--context", "512", "--batches", "1", "16", "64", "256", "512", "--learner-tokens", str(mean_len + 8)]
    common += ["--context-batch", str(load_config(None, base).engine.max_num_seqs)]  # the rows' batch
    out = {}
    for name, whole in (("half", False), ("whole", True)):
        if whole and "colocated_whole" not in parts:
            continue
        path = work / f"calibration_{name}.json"
        given = args.plan_calibrations / path.name if args.plan_calibrations else None
        if given is not None and given.exists():
            out[name] = given
            print(f"== calibrate ({name}): {given}", flush=True)
            continue
        extra = [] if whole else ["--served", *(["--corun"] if args.device == "cuda" else [])]
        cmd = [sys.executable, "-m", "polyrl.cli", "plan", "calibrate", "--out", str(path), *common, *extra]
        cmd += ["--pull-gbps", str(args.plan_pull_gbps), *base]
        print(f"== calibrate ({name})", flush=True)
        with part_placement(args, work / f"calibrate_{name}"):
            env = os.environ | args.placement.env("trainer", whole)
            with open(work / f"calibrate_{name}.log", "wb") as log:
                done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        if done.returncode != 0:
            print((work / f"calibrate_{name}.log").read_text(errors="replace")[-3000:], flush=True)
            raise SystemExit(f"calibrate ({name}) failed")
        out[name] = path
    return out


def plan_report(
    results: list[Result], args: argparse.Namespace, cals: dict | None = None, steps: bool = False
) -> list[dict]:
    """Each throughput row's s/step beside the fleet model's prediction of it: the row's
    own config (`fleet_of`), the engines' KV caches, its kill, the budgets it drew.
    `cals`: the calibrations by name (default: read from `args.calibrations`); `steps`:
    also print each measured step beside the model's."""
    import dataclasses
    import tomllib

    from polyrl.config import RunConfig
    from polyrl.plan.calibration import Calibration
    from polyrl.plan.command import fleet_of
    from polyrl.plan.fleet_model import Workload, predict

    cals = cals or {k: Calibration.load(v) for k, v in args.calibrations.items()}
    out = []
    for r in results:
        if r.part not in args.plan_rows or not r.steps:
            continue
        config, kill, prompt = args.plan_rows[r.part]
        cal = cals["whole" if r.part == "colocated_whole" else "half"]
        cfg = RunConfig.model_validate(tomllib.loads(config))
        workers = 0 if cfg.rollout.mode == "local" else 1
        spot = load_config(None, [*engine_overrides(args, args.worker_kv_blocks), *args.worker_set]).engine
        fleet = dataclasses.replace(
            fleet_of(cfg, workers, on_cpu=args.device == "cpu"),
            max_num_seqs=min(spot.max_num_seqs, cfg.manager.max_inflight_per_worker),  # the spot's own engine
            batched_tokens=spot.max_num_batched_tokens,
            kv_tokens=args.worker_kv_blocks * cfg.engine.block_size if args.worker_kv_blocks else None,
            trainer_kv_tokens=cfg.engine.num_kv_blocks * cfg.engine.block_size or None,
            kill_in_step=kill,
            restart_s=args.restart_after_s + cal.worker_start_s,
        )
        t = cfg.trainer
        work = Workload(
            t.train_batch_size,
            cfg.rollout.n,
            round(prompt),
            tuple(args.budgets),
            t.train_batch_size // t.ppo_mini_batch_size,
        )
        p = predict(cal, work, fleet, steps=args.steps, warmup=args.warmup)
        out.append(
            {"part": r.part, "measured_s": r.s_per_step, "predicted_s": p.step_s, "error": p.step_s / r.s_per_step - 1}
        )
        if steps:
            measured = r.step_s[args.warmup : args.warmup + args.steps]
            print(f"{r.part}, measured steps {args.warmup + 1}-{args.warmup + len(measured)}, s (model):")
            print("  " + "  ".join(f"{m:.2f} ({q:.2f})" for m, q in zip(measured, p.steps, strict=False)))
    print("\nthe fleet model (polyrl plan) against the rows:")
    print("| row | measured s/step | predicted s/step | error |\n|---|---|---|---|")
    for row in out:
        print(f"| {row['part']} | {row['measured_s']:.2f} | {row['predicted_s']:.2f} | {row['error']:+.0%} |")
    return out


def report(results: list[Result], args: argparse.Namespace) -> None:
    """One table; each throughput row is compared with the colocated rows of its workload
    (on the trainer's half, and on the whole GPU)."""
    bases = {r.workload: r for r in results if r.part in ("colocated", "equal_colocated") and r.steps}
    whole = next((r for r in results if r.part == "colocated_whole" and r.steps), None)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    split = {
        "mps": "ONE GPU split in two halves by MPS (50% of the SMs each)",
        "gpus": "trainer GPU 0, spot GPU 1",
        "one": "ONE GPU shared without MPS: a check, not a result",
    }[args.split]
    print(
        f"\n{device}, torch {torch.__version__}, {platform.node()}; {split}; {args.prompts} prompts x {args.n}, "
        f"<= {args.new_tokens} new tokens, long tail: median {args.tail_median:g}, p99 {args.tail_p99:g}; "
        f"{args.warmup} warm-up + {args.steps} measured steps"
    )
    head = (
        "part",
        "workload",
        "s/step",
        "trained tok/s",
        "produced tok/s",
        "steady tok/s",
        "vs coloc",
        "vs whole",
        "$/h",
        "tok/$",
        "tok/$ gain",
        "gen s",
        "train s",
        "learner idle s",
        "fleet idle",
        "lag mean/max",
        "multi-version",
        "due",
        "held back",
        "ready",
        "sync s",
        "lp diff",
        "lost",
        "migr",
        "local",
        "resp len",
        "to target s",
        "final reward",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in results:
        base = bases.get(r.workload)
        speed = (
            r.steady_tokens_per_s / base.steady_tokens_per_s
            if base and base.steady_tokens_per_s and r.steady_tokens_per_s
            else None
        )
        vs_whole = (
            r.steady_tokens_per_s / whole.steady_tokens_per_s
            if whole and r.workload == "longtail" and r.steady_tokens_per_s
            else None
        )
        gain = r.tokens_per_usd / base.tokens_per_usd - 1 if base and base.tokens_per_usd and r.tokens_per_usd else None
        ready = "-" if r.ready_start is None else f"{r.ready_start:.0f}->{r.ready_end:.0f}"
        cells = (
            r.part,
            r.workload or "-",
            fmt(r.s_per_step, ".2f"),
            fmt(r.tokens_per_s, ".0f"),
            fmt(r.produced_tokens_per_s, ".0f"),
            fmt(r.steady_tokens_per_s, ".0f"),
            fmt(speed, ".2f"),
            fmt(vs_whole, ".2f"),
            fmt(r.usd_per_hour, ".2f"),
            fmt(r.tokens_per_usd, ".3g"),
            "-" if gain is None else f"{100 * gain:+.0f}%",
            fmt(r.gen_s, ".2f"),
            fmt(r.update_actor_s, ".2f"),
            fmt(r.learner_idle_s, ".2f"),
            fmt(r.fleet_idle, ".2f"),
            f"{r.version_lag:.2f}/{r.version_lag_max:.0f}",
            fmt(r.multi_version, ".2f"),
            fmt(r.due_groups, ".1f"),
            fmt(r.held_back, ".0f"),
            ready,
            fmt(r.weight_sync_s, ".2f"),
            fmt(r.logprob_diff, ".2g"),
            str(r.samples_lost),
            str(r.migrated),
            fmt(r.local_share, ".2f") + ("" if r.local_made is None else f" ({r.local_made:.2f})"),
            fmt(r.mean_completion_len, ".0f"),
            fmt(r.time_to_target_s, ".0f"),
            fmt(r.final_reward, ".2f"),
        )
        print("| " + " | ".join(cells) + " |")
        for note in r.notes:
            print(f"    {r.part}: {note}")
    if args.json:
        skip = ("placement", "plan_rows", "budgets", "calibrations")
        out = {k: v for k, v in vars(args).items() if k not in skip}
        kept = {"plan_rows": args.plan_rows, "budgets": [int(b) for b in getattr(args, "budgets", [])]}
        body = {"args": out, "results": [asdict(r) for r in results], **kept}
        args.json.write_text(json.dumps(body, indent=1, default=str))


if __name__ == "__main__":
    main()
