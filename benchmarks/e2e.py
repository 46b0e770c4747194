"""Rollout modes end to end: tokens/s and time per step of `local`, `remote` and `hybrid`
training with 0, 1 and 2 launched workers, in one run, on the default task and model.

Each configuration is a real `polyrl train` run (in this process, one after another);
the first `--warmup` steps are left out of the figures. `local` with 0 workers is the
colocated baseline every other row is compared with; `remote`/`hybrid` with 0 workers
is the zero-worker fallback (the trainer's own engine through the manager).

    .venv/bin/python benchmarks/e2e.py [--steps 12] [--warmup 3] [--json PATH] [key=value ...]
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

CASES = [("local", 0), ("remote", 0), ("remote", 1), ("remote", 2), ("hybrid", 0), ("hybrid", 1), ("hybrid", 2)]


def run_case(mode: str, workers: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    cfg = load_config(
        None,
        [
            "logging.console=false",
            "logging.tensorboard=false",
            "manager.port=0",
            "trainer.save_every=0",
            f"trainer.total_steps={warmup + steps}",
            f"rollout.mode={mode}",
            f"fleet.num_workers={workers}",
            *overrides,
        ],
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"polyrl-e2e-{mode}{workers}-"))
    t0 = time.perf_counter()
    train(cfg, run_dir)
    wall_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]

    def med(key: str) -> float:
        return float(np.median([r.get(key, 0.0) for r in rows]))

    requested = sum(r.get("rollout/samples_requested", 0) for r in rows)
    return {
        "mode": mode,
        "workers": workers,
        "time_per_step_s": med("perf/time_per_step"),
        "tokens_per_s": med("perf/throughput_all_gpus"),
        "gen_s": med("timing_s/gen"),
        "update_actor_s": med("timing_s/update_actor"),
        "local_sample_share": sum(r.get("rollout/local_samples", 0) for r in rows) / max(requested, 1),
        "samples_lost": int(sum(r.get("rollout/samples_lost", 0) for r in rows)),
        "tokens_per_usd": med("cost/tokens_per_usd"),
        "max_logprob_diff": float(max(r.get("rollout/logprob_diff", 0.0) for r in rows)),
        "wall_s_with_startup": wall_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out at the start of each run")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    rows = []
    for mode, workers in CASES:
        print(f"running {mode} with {workers} workers ...", file=sys.stderr, flush=True)
        rows.append(run_case(mode, workers, args.steps, args.warmup, args.overrides))
    base = rows[0]["tokens_per_s"]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"\n{machine}; median over {args.steps} steps after {args.warmup} warm-up steps")
    print(
        "| mode | workers | s/step | tokens/s | vs local | gen s | update s | local share | lost | tokens/$ "
        "| max logprob_diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['time_per_step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['gen_s']:.2f} | {r['update_actor_s']:.2f} | "
            f"{r['local_sample_share']:.2f} | {r['samples_lost']} | {r['tokens_per_usd']:.3g} | "
            f"{r['max_logprob_diff']:.1e} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return 0 if all(r["samples_lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
