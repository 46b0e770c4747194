"""The fleet model (`polyrl plan`) against measured runs on this machine.

Calibrates (`polyrl plan calibrate --served`: decoding timed through a real worker's HTTP
stream, the learner alone), then runs the default main job in remote mode with
each fleet size of `--workers` (every response `--length` tokens, `rollout.ignore_eos`),
and prints each run's measured step time beside the model's prediction for it; 0
workers is the colocated run (`rollout.mode=local`). The first two steps of each run are
left out (start-up, the first compile).

    python benchmarks/plan.py --workers 0 1 2 4 --steps 12 --json plan.json

`--work DIR` keeps the runs and the calibration, and reads back what is there: with
`--calibration FILE`, another run's calibration predicts DIR's runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale import calibrate, quiet_run, run  # noqa: E402  (benchmarks/autoscale.py: a `polyrl train` run, read back)

from polyrl.config import load_config  # noqa: E402
from polyrl.plan.calibration import Calibration  # noqa: E402
from polyrl.plan.command import fleet_of, workload_of  # noqa: E402
from polyrl.plan.fleet_model import predict  # noqa: E402


def measured(work: Path, n: int, overrides: list[str], steps: int) -> dict:
    fleet = ["rollout.mode=local"] if n == 0 else [f"fleet.num_workers={n}"]
    rows = run(f"w{n}", [*overrides, *fleet], work, steps)[2:]
    tokens = statistics.fmean(r["perf/total_num_tokens"] for r in rows)
    return {
        "step_s": statistics.fmean(r["perf/time_per_step"] for r in rows),
        "tokens_per_step": tokens,
        "fleet_idle_ratio": statistics.fmean(r.get("rollout/fleet_idle_ratio", 0.0) for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4], help="0: colocated")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--calibration",
        type=Path,
        help="predict with this calibration file instead of making one (another run's, to check one against another)",
    )
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="polyrl-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = quiet_run(args.steps, args.length)
    cal_path = args.calibration or calibrate(work, overrides)
    cal = Calibration.load(cal_path)
    rows = []
    for n in args.workers:
        cfg = load_config(None, [*overrides, *(["rollout.mode=local"] if n == 0 else [])])
        real = measured(work, n, overrides, args.steps)
        prompt_tokens = round(real["tokens_per_step"] / (cfg.trainer.train_batch_size * cfg.rollout.n)) - args.length
        model = predict(cal, workload_of(cfg, args.length, None, prompt_tokens), fleet_of(cfg, n))
        rows.append(
            {
                "workers": n,
                "measured_step_s": real["step_s"],
                "predicted_step_s": model.step_s,
                "error": model.step_s / real["step_s"] - 1,
                "measured_fleet_idle": real["fleet_idle_ratio"],
                "predicted_fleet_idle": model.fleet_idle_ratio,
            }
        )
        print(f"{n} workers: measured {real['step_s']:.2f} s/step, predicted {model.step_s:.2f}", flush=True)
    print(f"\ncalibration: {cal_path}; runs in {work}")
    print("| workers | measured s/step | predicted s/step | error | measured fleet idle | predicted fleet idle |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['measured_step_s']:.2f} | {r['predicted_step_s']:.2f} | {r['error']:+.0%} | "
            f"{r['measured_fleet_idle']:.0%} | {r['predicted_fleet_idle']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"calibration": cal.model_dump(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
