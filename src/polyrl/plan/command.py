"""`polyrl plan`: calibrate on this machine, predict a fleet, or the seeds' own setup.

    polyrl plan calibrate --out cal.json [--config run.toml] [key=value ...]
    polyrl plan fleet --calibration cal.json --workers 1 2 4 [--config run.toml] [key=value ...]
    polyrl plan seeds

`fleet` takes the workload and the schedule from the run's config (train_batch_size,
rollout.n, the mini-batches, rollout.mode, rollout.fully_async and max_staleness, the
engines' max_num_seqs, the prices), and the response lengths from `--length` (default
rollout.max_new_tokens, every response that long, as with `rollout.ignore_eos`) or
`--tail MEDIAN P99` (lognormal, capped at rollout.max_new_tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polyrl.config import RunConfig, load_config
from polyrl.plan.calibration import Calibration
from polyrl.plan.fleet_model import Fleet, Prediction, Workload, predict
from polyrl.plan.seeds import seeds_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict step time and tokens per dollar for a fleet (a discrete-event model)")
    plan = p.add_subparsers(dest="plan_command", required=True)

    c = plan.add_parser("calibrate", help="measure this machine's engine and learner rates into a calibration file")
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--config", help="TOML config file of the run to calibrate for")
    c.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256], help="decode batch sizes to time")
    c.add_argument(
        "--served", action="store_true", help="time decoding through a real worker process and its HTTP stream"
    )
    c.add_argument(
        "--context", type=int, default=0, help="also time prompts this much longer: the decode step's cost of context"
    )
    c.add_argument(
        "--context-batch",
        type=int,
        default=64,
        help="with --context: the batch (of --batches, the nearest) whose context cost is timed, and --corun's",
    )
    c.add_argument(
        "--corun",
        action="store_true",
        help="with --served on a GPU: time the worker beside the learner (partitions of one GPU, e.g. MPS)",
    )
    c.add_argument("--pull-gbps", type=float, default=10.0, help="the workers' link to the trainer (Gbit/s)")
    c.add_argument(
        "--learner-tokens", type=int, help="time the learner on sequences this long (default: the run's longest)"
    )
    c.add_argument(
        "--repeats", type=int, default=3, help="timings of each point, the fastest kept (more: steadier on a busy host)"
    )
    c.add_argument(
        "--served-workers",
        type=int,
        help="with --served: worker processes to time, one after another, the median kept (default 3 on a CPU, 1 on a GPU)",
    )
    c.add_argument("overrides", nargs="*", metavar="key=value")

    f = plan.add_parser("fleet", help="predict a run's steps for several fleet sizes")
    f.add_argument("--calibration", required=True, type=Path)
    f.add_argument("--config", help="TOML config file of the run")
    f.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    f.add_argument("--length", type=int, help="every response this long (default rollout.max_new_tokens)")
    f.add_argument("--tail", type=int, nargs=2, metavar=("MEDIAN", "P99"), help="lognormal response lengths")
    f.add_argument("--prompt-tokens", type=int, default=5, help="mean prompt length")
    f.add_argument("--preempt-per-hour", type=float, default=0.0, help="each worker's preemption rate")
    f.add_argument("--steps", type=int, default=8, help="steps to average, after 2 left out")
    f.add_argument("--json", type=Path)
    f.add_argument("overrides", nargs="*", metavar="key=value")

    plan.add_parser("seeds", help="the seeds' setup (Qwen3-8B, 8xH100 trainer, 1-4 spot workers) beside their numbers")
    p.set_defaults(func=main)


def workload_of(cfg: RunConfig, length: int | None, tail: tuple[int, int] | None, prompt_tokens: int) -> Workload:
    t = cfg.trainer
    mini = t.train_batch_size // t.ppo_mini_batch_size * cfg.algo.ppo_epochs
    if tail:
        return Workload.long_tail(
            t.train_batch_size,
            cfg.rollout.n,
            prompt_tokens,
            *tail,
            cfg.rollout.max_new_tokens,
            mini,
            micro_batch_tokens=t.micro_batch_max_tokens,
        )
    length = length or cfg.rollout.max_new_tokens
    return Workload.fixed(
        t.train_batch_size, cfg.rollout.n, prompt_tokens, length, mini, micro_batch_tokens=t.micro_batch_max_tokens
    )


def fleet_of(cfg: RunConfig, workers: int, preempt_per_hour: float = 0.0, on_cpu: bool = True) -> Fleet:
    """`on_cpu`: the trainer runs on a CPU (how `hybrid_local_until = auto` resolves)."""
    r = cfg.rollout
    mode = "colocated" if r.mode == "local" else ("fully_async" if r.fully_async else "remote")
    until = r.local_window(on_cuda=not on_cpu)
    e = cfg.engine
    overlaps = e.overlap_decode == "on" or (e.overlap_decode == "auto" and not on_cpu)
    # not played: `synced` (the trainer's engine only while the workers sync) and `idle`
    return Fleet(
        workers=workers,
        mode=mode,
        staleness=max(1, r.max_staleness),
        trainer_engine=until in ("always", "learner"),
        trainer_until="learner" if until == "learner" else "always",
        max_num_seqs=min(cfg.engine.max_num_seqs, cfg.manager.max_inflight_per_worker),
        trainer_max_num_seqs=cfg.engine.max_num_seqs,
        batched_tokens=cfg.engine.max_num_batched_tokens,
        trainer_batched_tokens=cfg.engine.max_num_batched_tokens,
        admit_wait_steps=e.admit_wait_steps if overlaps else 0,
        admit_batch=e.admit_batch,
        trainer_usd_per_hour=cfg.cost.trainer_usd_per_hour,
        worker_usd_per_hour=cfg.cost.worker_usd_per_hour,
        preempt_per_hour=preempt_per_hour,
    )


def row(name: str, p: Prediction) -> dict:
    return {
        "fleet": name,
        "step_s": p.step_s,
        "tokens_per_s": p.tokens_per_s,
        "tokens_per_usd": p.tokens_per_usd,
        "usd_per_hour": p.usd_per_hour,
        "learner_idle_s": p.learner_idle_s,
        "fleet_idle_ratio": p.fleet_idle_ratio,
        "lag_mean": p.lag_mean,
        "lag_max": p.lag_max,
    }


def print_rows(rows: list[dict]) -> None:
    print("| fleet | step s | tokens/s | tokens/$ | $/h | learner idle s | fleet idle | lag mean/max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['fleet']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_usd']:,.0f} | "
            f"{r['usd_per_hour']:.2f} | {r['learner_idle_s']:.2f} | {r['fleet_idle_ratio']:.0%} | "
            f"{r['lag_mean']:.2f}/{r['lag_max']} |"
        )


def main(args: argparse.Namespace) -> int:
    if args.plan_command == "seeds":
        print(seeds_table())
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.plan_command == "calibrate":
        from polyrl.plan.calibrate import calibrate  # torch: only here

        if args.corun and not args.served:
            print("polyrl plan calibrate: --corun needs --served (the worker it times beside the learner)")
            return 2
        per_mini = cfg.trainer.ppo_mini_batch_size * cfg.rollout.n
        cal = calibrate(
            cfg,
            batches=tuple(args.batches),
            served=args.served,
            context=args.context,
            context_batch=args.context_batch,
            corun=args.corun,
            pull_gbps=args.pull_gbps,
            learner_lengths=tuple([args.learner_tokens] * per_mini) if args.learner_tokens else (),
            repeats=args.repeats,
            served_workers=args.served_workers,
        )
        cal.save(args.out)
        print(f"calibration written to {args.out}")
        return 0
    try:
        cal = Calibration.load(args.calibration)
    except ValueError as e:
        print(f"polyrl plan: {e}")
        return 2
    work = workload_of(cfg, args.length, tuple(args.tail) if args.tail else None, args.prompt_tokens)
    rows = []
    for n in args.workers:
        fleet = fleet_of(cfg, n, args.preempt_per_hour, on_cpu=cal.host_cores is not None)
        name = "colocated" if fleet.mode == "colocated" else f"{n} worker{'s' * (n != 1)}"
        rows.append(row(name, predict(cal, work, fleet, steps=args.steps)))
        if fleet.mode == "colocated":
            break
    print(f"calibration: {cal.device}; {cal.model[:60]}")
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"calibration": cal.model_dump(), "rows": rows}, indent=1))
    return 0
