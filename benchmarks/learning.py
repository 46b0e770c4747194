"""Does the default main job learn? Runs `polyrl train` (default config unless overridden)
and prints the reward curve's summary against the foundation issue's targets:
mean reward over the last 20% of steps >= 0.8, and >= 0.4 above the first step's; in
remote and hybrid modes also no sample lost (e.g. under churn:
`fleet.churn_interval_s=10 fleet.kill_interval_s=15`).

    .venv/bin/python benchmarks/learning.py [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from polyrl.config import load_config
from polyrl.trainer.loop import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(None, ["logging.console=false", "logging.tensorboard=false", "manager.port=0", *args.overrides])
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="polyrl-learning-"))
    t0 = time.perf_counter()
    train(cfg, run_dir)
    wall_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = np.array([r["critic/score/mean"] for r in rows])
    tail = rewards[-max(1, len(rewards) // 5) :]
    result = {
        "task": cfg.data.task,
        "steps": len(rows),
        "first_step_reward": float(rewards[0]),
        "last_20pct_mean_reward": float(tail.mean()),
        "gain": float(tail.mean() - rewards[0]),
        "wall_s": wall_s,
        "mean_step_s": float(np.mean([r["perf/time_per_step"] for r in rows])),
        "max_logprob_diff": float(max(r.get("rollout/logprob_diff", 0.0) for r in rows)),
        "mode": cfg.rollout.mode,
        "samples_lost": int(sum(r.get("rollout/samples_lost", 0) for r in rows)),
        "samples_migrated": int(sum(r.get("rollout/migrated_samples", 0) for r in rows)),
        "samples_local": int(sum(r.get("rollout/local_samples", 0) for r in rows)),
        "workers_killed": int(rows[-1].get("fleet/killed", 0)),
        "workers_retired": int(rows[-1].get("fleet/retired", 0)),
        "workers_launched": int(rows[-1].get("fleet/launched", 0)),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    checks = [
        (
            "last-20% mean reward",
            f"{result['last_20pct_mean_reward']:.3f}",
            ">= 0.8",
            result["last_20pct_mean_reward"] >= 0.8,
        ),
        ("gain over first step", f"{result['gain']:.3f}", ">= 0.4", result["gain"] >= 0.4),
        ("wall time (s)", f"{wall_s:.0f}", "<= 300", wall_s <= 300),
        ("samples lost", str(result["samples_lost"]), "0", result["samples_lost"] == 0),
    ]
    print(
        f"\ntask {result['task']}, {result['steps']} steps, first-step reward {result['first_step_reward']:.3f}, "
        f"{result['mean_step_s']:.2f} s/step, max logprob_diff {result['max_logprob_diff']:.1e}; {result['machine']}"
    )
    print(
        f"mode {result['mode']}: samples migrated {result['samples_migrated']}, from the trainer's engine "
        f"{result['samples_local']}; workers launched {result['workers_launched']}, retired "
        f"{result['workers_retired']}, killed {result['workers_killed']}"
    )
    print(f"{'measure':<24}{'value':>10}{'target':>10}  ok")
    for name, value, target, ok in checks:
        print(f"{name:<24}{value:>10}{target:>10}  {'yes' if ok else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
