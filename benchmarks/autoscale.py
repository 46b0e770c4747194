"""The autoscaler against fixed fleets, on a run whose workload changes halfway.

Each row is a real `polyrl train` run (the default tiny model and task, remote mode,
launched workers) with a length curriculum: every sample is `--long` tokens for the
first half of the steps, then `--short` tokens (`rollout.max_new_tokens_schedule`,
`rollout.ignore_eos`, so the lengths are known). Fixed fleets of each size in
`--fixed` run it, then an autoscaled one (`fleet.autoscale`, starting at the smallest
size), once on the fleet model over a calibration made first (`polyrl plan calibrate
--served`, `fleet.autoscale.calibration`) and once on Amdahl's law (`--scalers`; `target`
adds a run that keeps the step under `--target-step-s` instead). Per half: tokens
per dollar (the run's own `cost/*` metrics: the trainer's and each worker's price), the
mean step time and the mean number of workers. The last lines compare each autoscaled
run with the best fixed size of each half.

    python benchmarks/autoscale.py --steps 40 --fixed 1 2 3 --json autoscale.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def quiet_run(steps: int, tokens: int) -> list[str]:
    """Overrides of a measured run: no console or TensorBoard, no checkpoints, `steps`
    steps of `tokens`-token responses (`ignore_eos`, so the lengths are known)."""
    return [
        "logging.console=false",
        "logging.tensorboard=false",
        "trainer.save_every=0",
        f"trainer.total_steps={steps}",
        f"rollout.max_new_tokens={tokens}",
        "rollout.ignore_eos=true",
    ]


def run(name: str, overrides: list[str], work: Path, steps: int) -> list[dict]:
    """The run's metrics; a finished run of `steps` already in `work` is read again."""
    run_dir = work / name
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and len(metrics.read_text().splitlines()) == steps:
        print(f"{name}: read from {run_dir}", flush=True)
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides]
    t0 = time.monotonic()
    with open(work / f"{name}.log", "wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode
    if code != 0:
        raise RuntimeError(f"{name}: polyrl train exited with {code}; see {work / f'{name}.log'}")
    print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def calibrate(work: Path, overrides: list[str]) -> Path:
    """`polyrl plan calibrate --served` for the run `overrides` describe (kept in `work`)."""
    path = work / "calibration.json"
    if not path.exists():
        cmd = [sys.executable, "-m", "polyrl.cli", "plan", "calibrate", "--served", "--out", str(path), *overrides]
        subprocess.run(cmd, check=True)
    return path


def halves(rows: list[dict], half: int) -> list[dict]:
    out = []
    for part in (rows[:half], rows[half:]):
        part = part[1:]  # each half's first step pays the change of lengths (and the run's start)
        tokens = sum(r["perf/total_num_tokens"] for r in part)
        usd = sum(r["cost/usd_per_step"] for r in part)
        out.append(
            {
                "tokens_per_usd": tokens / usd,
                "step_s": sum(r["perf/time_per_step"] for r in part) / len(part),
                "workers": sum(r["training/num_workers"] for r in part) / len(part),
                "workers_at_end": part[-1]["training/num_workers"],
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="in all: half long, half short")
    p.add_argument("--long", type=int, default=48, help="tokens per sample in the first half")
    p.add_argument("--short", type=int, default=4, help="tokens per sample in the second half")
    p.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 3], help="fixed fleet sizes to compare")
    p.add_argument("--interval-steps", type=int, default=3, help="fleet.autoscale.interval_steps")
    p.add_argument(
        "--scalers",
        nargs="+",
        choices=["model", "amdahl", "target"],
        default=["model", "amdahl"],
        help="model: the fleet model over a calibration made first (fleet.autoscale.calibration); amdahl: "
        "without; target: the fleet model keeping the step under --target-step-s with the fewest workers",
    )
    p.add_argument("--target-step-s", type=float, default=2.5, help="fleet.autoscale.target_step_s of `target`")
    p.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    half = args.steps // 2
    work = args.work or Path(tempfile.mkdtemp(prefix="polyrl-autoscale-"))
    work.mkdir(parents=True, exist_ok=True)
    common = [
        *quiet_run(args.steps, args.long),
        f"rollout.max_new_tokens_schedule=[[1, {args.long}], [{half + 1}, {args.short}]]",
        "fleet.drain_timeout_s=1",
    ]
    results: dict[str, list[dict]] = {}
    trajectory: list[float] = []
    for n in args.fixed:
        results[f"fixed {n}"] = halves(run(f"fixed{n}", [*common, f"fleet.num_workers={n}"], work, args.steps), half)
    auto = [
        *common,
        f"fleet.num_workers={min(args.fixed)}",
        "fleet.autoscale.enabled=true",
        f"fleet.autoscale.min_workers={min(args.fixed)}",
        f"fleet.autoscale.max_workers={max(args.fixed)}",
        f"fleet.autoscale.interval_steps={args.interval_steps}",
    ]
    trajectories: dict[str, list[float]] = {}
    for scaler in args.scalers:
        name = {
            "model": "autoscaled, fleet model",
            "amdahl": "autoscaled, Amdahl",
            "target": f"autoscaled, fleet model, step <= {args.target_step_s:g} s",
        }[scaler]
        extra = [] if scaler == "amdahl" else [f"fleet.autoscale.calibration={calibrate(work, common)}"]
        if scaler == "target":
            extra.append(f"fleet.autoscale.target_step_s={args.target_step_s}")
        rows = run(f"autoscaled_{scaler}", [*auto, *extra], work, args.steps)
        results[name] = halves(rows, half)
        trajectories[name] = [r["training/num_workers"] for r in rows]

    print(f"\n{args.steps} steps: {args.long}-token samples, then {args.short} from step {half + 1}; runs in {work}")
    print("| fleet | long half tokens/$ | step s | workers | short half tokens/$ | step s | workers |")
    print("|---|---|---|---|---|---|---|")
    for name, (a, b) in results.items():
        print(
            f"| {name} | {a['tokens_per_usd']:,.0f} | {a['step_s']:.2f} | {a['workers']:.1f} | "
            f"{b['tokens_per_usd']:,.0f} | {b['step_s']:.2f} | {b['workers']:.1f} |"
        )
    for name, trajectory in trajectories.items():
        print(f"\n{name}: workers per step: {' '.join(str(int(w)) for w in trajectory)}")
    compare = []
    fixed = [k for k in results if k.startswith("fixed")]
    for i, label in enumerate(("long", "short")):
        best_name = max(fixed, key=lambda k: results[k][i]["tokens_per_usd"])
        best = results[best_name][i]["tokens_per_usd"]
        for name in trajectories:
            ratio = results[name][i]["tokens_per_usd"] / best
            compare.append({"half": label, "scaler": name, "best_fixed": best_name, "autoscaled_vs_best": ratio})
            print(f"{label} half: best fixed is {best_name}; {name} gets {ratio:.2f}x its tokens per dollar")
    if args.json:
        out = {"steps": args.steps, "long": args.long, "short": args.short, "results": results}
        args.json.write_text(json.dumps(out | {"trajectories": trajectories, "compare": compare}, indent=1))


if __name__ == "__main__":
    main()
