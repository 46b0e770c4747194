"""Every policy loss against every rollout correction, on built-in tasks, a few seeds each:
wall-clock time to a target reward, and the final reward. CPU, the tiny model, the main
job's config otherwise; each run is a real `polyrl train` process.

    .venv/bin/python benchmarks/algorithms.py --json algorithms.json
    .venv/bin/python benchmarks/algorithms.py --losses vanilla,gspo --corrections token --tasks copy --seeds 0

Losses (`algo.policy_loss`): vanilla (PPO's clip), gspo (with the paper's clip ratios,
3e-4 / 4e-4, and `seq-mean-token-mean`), cispo. Corrections (`algo.rollout_correction`):
token (truncated IS at 2, the default), sequence (sequence IS at 2), geometric (geometric
rejection outside [0.5, 2]), none. With one PPO epoch the ratio to the old policy is 1
and the three losses give the same gradient, so the runs take `--ppo-epochs` 2 by
default. In `local` mode the engine and the trainer share weights: the behaviour and
old log-probs differ by rounding only, so a correction has little to act on; `--mode
hybrid --set rollout.max_staleness=1` gives the learner one version of lag to correct.

Time to target: the steps' own seconds (`perf/time_per_step`, start-up left out) until
the mean reward of 5 steps in a row reaches the task's target. Final: the mean reward of
the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_gpu import ROOT, time_to  # noqa: E402  (the learning rows' time to a reward)

LOSSES: dict[str, list[str]] = {
    "vanilla": ["algo.policy_loss=vanilla"],
    "gspo": [
        "algo.policy_loss=gspo",
        "algo.clip_ratio_low=0.0003",
        "algo.clip_ratio_high=0.0004",
        "algo.loss_agg_mode=seq-mean-token-mean",
    ],
    "cispo": ["algo.policy_loss=cispo"],
}
CORRECTIONS: dict[str, list[str]] = {
    "token": ["algo.rollout_correction.rollout_is=token", "algo.rollout_correction.rollout_is_threshold=2.0"],
    "sequence": ["algo.rollout_correction.rollout_is=sequence", "algo.rollout_correction.rollout_is_threshold=2.0"],
    "geometric": [
        "algo.rollout_correction.rollout_is=none",
        "algo.rollout_correction.rollout_rs=geometric",
        "algo.rollout_correction.rollout_rs_threshold=2.0",
    ],
    "none": ["algo.rollout_correction.rollout_is=none"],
}
TARGETS = {"copy": 0.8, "reverse": 0.5, "digit_sum": 0.5, "addition": 0.5}
"""Per task, the mean reward of 5 steps in a row to reach (copy: the main job's bar)."""


@dataclass
class Run:
    loss: str
    correction: str
    task: str
    seed: int
    steps: int = 0
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    final_reward: float = 0.0
    wall_s: float = 0.0
    failed: str = ""
    rewards: list[float] = field(default_factory=list)


def run_one(loss: str, correction: str, task: str, seed: int, args: argparse.Namespace, work: Path) -> Run:
    run = Run(loss, correction, task, seed)
    run_dir = work / f"{task}-{loss}-{correction}-s{seed}"
    overrides = [
        f"data.task={task}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={args.steps}",
        f"algo.ppo_epochs={args.ppo_epochs}",
        f"rollout.mode={args.mode}",
        "trainer.save_every=0",
        "logging.console=false",
        "logging.tensorboard=false",
        "manager.port=0",
        *LOSSES[loss],
        *CORRECTIONS[correction],
        *args.set,
    ]
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(work / f"{run_dir.name}.log", "wb") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout_s)
    run.wall_s = time.perf_counter() - t0
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if done.returncode != 0:
        run.failed = f"exit {done.returncode} (log: {work / f'{run_dir.name}.log'})"
    run.steps = len(rows)
    run.rewards = [round(r["critic/score/mean"], 4) for r in rows]
    if rows:
        reached = time_to(rows, TARGETS[task])
        run.time_to_target_s, run.steps_to_target = reached if reached else (None, None)
        run.final_reward = float(np.mean(run.rewards[-10:]))
    return run


def report(runs: list[Run], args: argparse.Namespace) -> None:
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(
        f"\n{machine}; mode {args.mode}, {args.steps} steps, ppo_epochs {args.ppo_epochs}; "
        f"time to target: 5 steps in a row at the task's target ({', '.join(f'{t} {v}' for t, v in TARGETS.items())})"
    )
    print(
        "| task | loss | correction | seeds | reached | time to target s (mean, min-max) | steps to target | final reward (mean, min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cells: dict[tuple[str, str, str], list[Run]] = {}
    for r in runs:
        cells.setdefault((r.task, r.loss, r.correction), []).append(r)
    for (task, loss, correction), group in cells.items():
        reached = [r for r in group if r.time_to_target_s is not None]
        times = [r.time_to_target_s for r in reached]
        finals = [r.final_reward for r in group]
        time_cell = f"{np.mean(times):.1f} ({min(times):.1f}-{max(times):.1f})" if times else "-"
        steps_cell = f"{np.mean([r.steps_to_target for r in reached]):.0f}" if reached else "-"
        failed = sum(bool(r.failed) for r in group)
        print(
            f"| {task} | {loss} | {correction} | {len(group)}{f' ({failed} failed)' if failed else ''} | "
            f"{len(reached)}/{len(group)} | {time_cell} | {steps_cell} | "
            f"{np.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f}) |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--corrections", default=",".join(CORRECTIONS))
    p.add_argument("--tasks", default="copy,reverse")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=150, help="each run's steps (the main job's 150)")
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--mode", default="local", choices=("local", "remote", "hybrid"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--run-timeout-s", type=float, default=1800)
    p.add_argument("--keep", type=Path, help="keep the runs here")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    losses, corrections, tasks = args.losses.split(","), args.corrections.split(","), args.tasks.split(",")
    unknown = (
        [x for x in losses if x not in LOSSES]
        + [x for x in corrections if x not in CORRECTIONS]
        + [x for x in tasks if x not in TARGETS]
    )
    if unknown:
        sys.exit(f"unknown {unknown}: losses {list(LOSSES)}, corrections {list(CORRECTIONS)}, tasks {list(TARGETS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = [(t, lo, c, s) for t in tasks for lo in losses for c in corrections for s in seeds]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="polyrl-algorithms-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for i, (task, loss, correction, seed) in enumerate(grid, 1):
            run = run_one(loss, correction, task, seed, args, work)
            runs.append(run)
            reached = f"{run.time_to_target_s:.1f} s" if run.time_to_target_s is not None else "not reached"
            print(
                f"[{i}/{len(grid)}] {task} {loss} {correction} seed {seed}: to target {reached}, "
                f"final {run.final_reward:.3f}, {run.wall_s:.0f} s{'; ' + run.failed if run.failed else ''}",
                flush=True,
            )
    report(runs, args)
    if args.json:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(out, indent=1))
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
