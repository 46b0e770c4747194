"""Elastic scaling on a 4-GPU host: the trainer on GPUs 0-1 (FSDP2 under torchrun, hybrid
rollout, so rank 0's GPU generates too) and spot rollout workers on GPUs 2 and 3 that
join and leave on the seeds' schedule (a worker every so often, then the oldest retires),
with one worker killed (-9) in the middle of a step.

    python benchmarks/elastic_gpu.py --json out.json                       # 4 GPUs
    python benchmarks/elastic_gpu.py --device cpu --phase-steps 1 ...      # the orchestration on CPU
    python benchmarks/elastic_gpu.py --trainer-gpus 0,1 --worker-gpus 1,1 ...  # a check on 2 GPUs (shared)

Phases, each `--phase-steps` measured steps. A step counts for a phase only if it started
after every change of that phase was in effect: a joining worker active in the manager, a
retired one gone.
* 0 workers: the trainer alone;
* 1 worker: w1 joins on GPU 2;
* 2 workers: w2 joins on GPU 3; both pull every new version at once;
* 1 worker, after a retirement: w1, the oldest, gets SIGTERM (drain, hand back);
* 1 worker, after a kill: w2 is killed -9 half way through a step's generation; w3 joins
  on GPU 2 a few seconds later, as a replacement spot VM would.

Reported per phase: trained tokens/s (prompt + completion, veRL's count), generated
tokens/s, tokens per dollar (trainer GPUs on-demand, workers spot, the seeds' H100x8
prices per GPU), published -> every worker serving (`timing_s/weight_sync`), and over the
whole run the samples lost (must be 0) and migrated. The seeds' analogue: ~12k, 14k, 16k,
18k tok/s for 1-4 workers with Qwen3-8B on 2x8 H100; this is the small-scale version.

The model is Qwen3-0.6B-shaped with random weights (`spot_gpu.make_model`); `--device cpu`
uses the tiny default model, two gloo ranks and CPU workers instead, to check the
schedule, the bookkeeping and the tables on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_gpu import (  # noqa: E402
    ON_DEMAND_USD_PER_GPU_HOUR,
    SPOT_USD_PER_GPU_HOUR,
    TOKEN,
    Result,
    Worker,
    add_workload_args,
    make_model,
    read_metrics,
    summarise,
)

from chaos_harness.harness import free_port  # noqa: E402  (importing spot_gpu put the repository root on sys.path)


@dataclass
class Phase:
    name: str
    workers: int
    """Spot workers serving in this phase."""
    steps: list[int] = field(default_factory=list)
    """The measured steps."""
    notes: list[str] = field(default_factory=list)
    stats: Result | None = None
    """Its measured steps, summed up as `spot_gpu` does a part's."""
    worker_gen_tokens_per_s: float | None = None
    """The workers' own generation rate (their heartbeats), mean over the phase's samples."""


class Manager:
    """The trainer's manager, read through its worker list (with the run's token)."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=5.0, headers={"Authorization": f"Bearer {TOKEN}"})

    def workers(self) -> dict[str, dict]:
        try:
            reply = self.client.get("/v1/workers")
            reply.raise_for_status()
        except httpx.HTTPError:  # not up yet, or busy: the caller polls again
            return {}
        return {w["worker_id"]: w for w in reply.json()["workers"]}


class Run:
    """One trainer under torchrun and the spot workers around it; the step clock is the
    trainer's metrics file (a row appears as each step ends)."""

    def __init__(self, args: argparse.Namespace, work: Path, model: Path) -> None:
        self.args, self.work, self.model = args, work, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.manager = Manager(self.url)
        self.run_dir = work / "run"
        self.metrics = self.run_dir / "metrics.jsonl"
        self.step_end: dict[int, float] = {}
        self.rows: dict[int, dict] = {}
        self.workers: list[Worker] = []
        self.gen_rates: dict[int, list[float]] = {}
        """Phase index -> the spot workers' reported generation rates, sampled as we poll."""
        self.t0 = time.monotonic()
        cpu = args.device == "cpu"
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        env |= {"CUDA_VISIBLE_DEVICES": "" if cpu else args.trainer_gpus, "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.ranks),
            "-m",
            "polyrl.cli",
            "train",
            "--run-dir",
            str(self.run_dir),
            *self.overrides(),
        ]
        self.log = open(work / "trainer.log", "ab")  # noqa: SIM115 - closed in stop()
        self.trainer = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def overrides(self) -> list[str]:
        a = self.args
        common = [
            f"model.path={self.model}",
            "rollout.mode=hybrid",
            f"rollout.n={a.n}",
            f"rollout.max_new_tokens={a.new_tokens}",
            f"trainer.train_batch_size={a.prompts}",
            f"trainer.ppo_mini_batch_size={a.prompts // a.mini_batches}",
            "trainer.total_steps=100000",
            "trainer.save_every=0",
            "trainer.warmup_steps=0",
            "logging.console=false",
            "logging.tensorboard=false",
            "fleet.num_workers=0",
            f"manager.port={self.port}",
            f"manager.token={TOKEN}",
            "manager.heartbeat_interval_s=0.5",
            f"manager.transfer.gpu_paths={'true' if a.weight_path == 'auto' else 'false'}",
            f"cost.trainer_usd_per_hour={ON_DEMAND_USD_PER_GPU_HOUR}",
            f"cost.worker_usd_per_hour={SPOT_USD_PER_GPU_HOUR}",
        ]
        if a.device == "cpu":
            return [*common, "data.task=copy", "trainer.device=cpu", "trainer.num_threads=1", "engine.max_num_seqs=64"]
        return [
            *common,
            "data.task=copy",
            "model.dtype=bfloat16",
            "trainer.device=cuda",
            "trainer.lr=1e-6",
            f"trainer.micro_batch_max_tokens={a.micro_batch_tokens}",
            "engine.max_num_seqs=512",
            f"engine.kv_cache_memory_fraction={a.kv_fraction}",
        ]

    # ---------------------------------------------------------------- the step clock

    def poll(self, phase: int) -> None:
        """Read new metrics rows, note when each appeared, sample the workers' rates; stop
        the whole run if the trainer died."""
        for row in read_metrics(self.metrics):
            step = int(row["step"])
            if step not in self.rows:
                self.rows[step], self.step_end[step] = row, time.monotonic()
                print(
                    f"  step {step}: {row['perf/time_per_step']:.2f}s, {row['perf/throughput_all_gpus']:.0f} tok/s, "
                    f"{int(row.get('training/num_workers', 0))} workers",
                    flush=True,
                )
        ours = {w.worker_id for w in self.workers}
        rates = [w["gen_throughput"] for i, w in self.manager.workers().items() if i in ours and w["state"] == "active"]
        if rates:
            self.gen_rates.setdefault(phase, []).extend(rates)
        if self.trainer.poll() is not None:
            tail = (self.work / "trainer.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the trainer exited ({self.trainer.returncode}):\n{tail}")
        if time.monotonic() - self.t0 > self.args.timeout_s:
            raise TimeoutError(f"the run took over {self.args.timeout_s:.0f}s")

    def last_step(self) -> int:
        return max(self.rows, default=0)

    def wait(self, predicate, phase: int, what: str, timeout_s: float = 600) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            self.poll(phase)
            time.sleep(0.2)

    def measure(self, phase: Phase, index: int, since: float) -> None:
        """Wait for `--phase-steps` steps that started after `since` (a step starts when the
        one before it ends)."""

        def counted() -> list[int]:
            return [s for s in sorted(self.rows) if s - 1 in self.step_end and self.step_end[s - 1] >= since]

        self.wait(
            lambda: len(counted()) >= self.args.phase_steps, index, f"{self.args.phase_steps} steps of {phase.name}"
        )
        phase.steps = counted()[: self.args.phase_steps]

    # ---------------------------------------------------------------- the fleet

    def join(self, worker_id: str, gpu: str, index: int) -> float:
        """Start a spot worker; returns when the manager has it active."""
        extra = (
            ("engine.max_num_seqs=512",)
            if self.args.device == "cuda"
            else ('engine.device="cpu"', "engine.max_num_seqs=64")
        )
        self.workers.append(
            Worker(self.model, self.url, worker_id, gpu, self.work, self.args.worker_kv_fraction, extra)
        )
        started = time.monotonic()
        self.wait(
            lambda: self.manager.workers().get(worker_id, {}).get("state") == "active", index, f"{worker_id} active"
        )
        print(
            f"  {worker_id} joined on {'GPU ' + gpu if gpu else 'CPU'}: active after {time.monotonic() - started:.1f}s"
        )
        return time.monotonic()

    def retire(self, worker_id: str, index: int) -> float:
        """SIGTERM: the worker drains and hands back; returns once the manager lost it."""
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        threading.Thread(target=worker.stop, daemon=True).start()
        self.wait(lambda: worker_id not in self.manager.workers(), index, f"{worker_id} gone")
        print(f"  {worker_id} retired (SIGTERM)")
        return time.monotonic()

    def kill_mid_step(self, worker_id: str, index: int) -> int:
        """kill -9 half way through the next step's generation; returns that step."""
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        step = self.last_step()
        self.wait(lambda: self.last_step() > step, index, "a step boundary")
        gen_s = self.rows[self.last_step()].get("timing_s/gen", 1.0)
        time.sleep(max(gen_s / 2, 0.2))
        worker.kill()
        print(f"  {worker_id} killed -9 in step {self.last_step() + 1}", flush=True)
        return self.last_step() + 1

    def stop(self) -> None:
        if self.trainer.poll() is None:  # torchrun passes SIGTERM to every rank
            os.killpg(self.trainer.pid, signal.SIGTERM)
            try:
                self.trainer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.trainer.pid, signal.SIGKILL)
                self.trainer.wait()
        for w in self.workers:
            w.stop()
        self.log.close()


def schedule(run: Run, args: argparse.Namespace) -> list[Phase]:
    cpu = args.device == "cpu"
    gpu2, gpu3 = ("", "") if cpu else args.worker_gpus.split(",")
    phases = [
        Phase("0 workers", 0),
        Phase("1 worker", 1),
        Phase("2 workers", 2),
        Phase("1 worker, oldest retired", 1),
        Phase("1 worker, after a kill -9", 1),
    ]
    run.wait(lambda: run.last_step() >= args.warmup, 0, f"{args.warmup} warm-up steps")
    run.measure(phases[0], 0, time.monotonic())
    run.measure(phases[1], 1, run.join("w1", gpu2, 1))
    run.measure(phases[2], 2, run.join("w2", gpu3, 2))
    run.measure(phases[3], 3, run.retire("w1", 3))
    killed = run.kill_mid_step("w2", 4)
    phases[4].notes.append(f"w2 killed -9 in step {killed}")
    time.sleep(args.restart_after_s)
    ready = run.join("w3", gpu2, 4)
    phases[4].notes.append(f"w3 joined {args.restart_after_s:.0f}s later, active by step {run.last_step() + 1}")
    run.measure(phases[4], 4, ready)
    return phases


def report(phases: list[Phase], run: Run, args: argparse.Namespace, wall: float) -> dict:
    rows = list(run.rows.values())
    lost = int(sum(r["rollout/samples_lost"] for r in rows))
    migrated = int(sum(r["rollout/migrated_samples"] for r in rows))
    base = phases[0].stats or Result(phases[0].name)
    where = (
        f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        if args.device == "cuda"
        else f"CPU ({os.cpu_count()} cores)"
    )
    print(
        f"\n{where}, torch {torch.__version__}, {platform.node()}; {args.prompts} prompts x {args.n}, "
        f"<= {args.new_tokens} new tokens; trainer FSDP2 on {args.ranks} ranks (GPUs {args.trainer_gpus}), hybrid; "
        f"workers on GPUs {args.worker_gpus}; weight path {args.weight_path}"
    )
    head = (
        "phase",
        "steps",
        "s/step",
        "tok/s",
        "vs 0 workers",
        "gen tok/s",
        "worker gen tok/s",
        "$/h",
        "tok/$",
        "tok/$ vs 0 workers",
        "local share",
        "sync s",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for p in phases:
        r = p.stats or Result(p.name)
        speed = r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None
        gain = r.tokens_per_usd / base.tokens_per_usd - 1 if base.tokens_per_usd else None
        cells = (
            p.name,
            ",".join(map(str, p.steps)),
            fmt(r.s_per_step, ".2f"),
            fmt(r.tokens_per_s, ".0f"),
            fmt(speed, ".2f"),
            fmt(r.gen_tokens_per_s, ".0f"),
            fmt(p.worker_gen_tokens_per_s, ".0f"),
            fmt(r.usd_per_hour, ".2f"),
            fmt(r.tokens_per_usd, ".3g"),
            "-" if gain is None else f"{100 * gain:+.0f}%",
            fmt(r.local_share, ".2f"),
            fmt(r.weight_sync_s, ".2f"),
        )
        print("| " + " | ".join(cells) + " |")
        for note in p.notes:
            print(f"    {p.name}: {note}")
    print(f"samples lost: {lost}, migrated: {migrated}, steps: {len(rows)}, wall {wall:.0f}s")
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "phases": [asdict(p) for p in phases],
        "samples_lost": lost,
        "migrated": migrated,
        "steps": len(rows),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json", type=Path)
    add_workload_args(p)
    p.add_argument("--phase-steps", type=int, default=3)
    p.add_argument(
        "--weight-path",
        choices=["auto", "tcp"],
        default="auto",
        help="auto: same-host workers get NCCL after their first pull; tcp: TCP only",
    )
    p.add_argument("--timeout-s", type=float, default=1500)
    p.add_argument("--trainer-gpus", default="0,1", help="CUDA devices of the trainer's ranks (one rank each)")
    p.add_argument(
        "--worker-gpus", default="2,3", help="the two worker GPUs (w1 and w3 on the first, w2 on the second)"
    )
    p.add_argument("--keep", type=Path, help="keep logs and the run directory here")
    args = p.parse_args()
    args.ranks = 2 if args.device == "cpu" else len(args.trainer_gpus.split(","))
    if len(args.worker_gpus.split(",")) != 2:
        sys.exit(f"--worker-gpus takes two devices, got {args.worker_gpus!r}")
    needed = 1 + max(int(g) for g in f"{args.trainer_gpus},{args.worker_gpus}".split(","))
    if args.device == "cuda" and torch.cuda.device_count() < needed:
        sys.exit(f"needs {needed} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="elastic_gpu_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.device == "cpu":
            model = work / "tiny"
            subprocess.run(
                [sys.executable, "-m", "polyrl.cli", "tiny-model", "--out", str(model)], check=True, capture_output=True
            )
        else:
            model = make_model(work / "qwen3-0.6b-shape", args.stop_ids, args.new_tokens + 512)
        run = Run(args, work, model)
        try:
            phases = schedule(run, args)
        finally:
            run.stop()
        wall = time.monotonic() - run.t0
        for index, phase in enumerate(phases):
            phase.stats = summarise(phase.name, [run.rows[s] for s in phase.steps], 0, 0.0, [])
            rates = run.gen_rates.get(index, [])
            phase.worker_gen_tokens_per_s = sum(rates) / len(rates) if rates and phase.workers else None
        result = report(phases, run, args, wall)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
