"""The rollout manager under load with a churning fleet: lost / duplicated / corrupted
samples, migrations, control-path latency and the manager's memory growth.

Rounds of concurrent batches (every other one over HTTP, the rest in-process) go through
a fleet of fake engines (tests/fake_fleet.py: one server, one process) that keeps losing
engines (killed mid-stream, or drained and leaving) and gaining fresh ones. Every sample
is checked token for token against what an uninterrupted run gives. Latency is measured
from a thread of the manager's process while the load runs: GET /health, a real
heartbeat, and the manager loop's lag (how late a 10 ms sleep wakes). tests/test_load.py
runs the same code at CI scale.

    python benchmarks/load.py                                  # 48 workers, 8 x 256 x 4 samples
    python benchmarks/load.py --workers 32 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_fleet import Churn  # noqa: E402  (tests/: the fake fleet is a test helper)
from load_harness import run_load, table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=48, help="fake engines at the start")
    p.add_argument("--batches", type=int, default=8, help="concurrent batches per round")
    p.add_argument("--prompts", type=int, default=256, help="prompts per batch")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="memory growth needs 3 or more (the first warms up)")
    p.add_argument("--churn-events", type=int, default=200, help="per round, at most")
    p.add_argument("--churn-interval-s", type=float, default=0.1)
    p.add_argument("--min-alive", type=int, default=16)
    p.add_argument("--max-alive", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8, help="slots per fake engine")
    p.add_argument("--token-delay-s", type=float, default=0.02, help="per token, per fake stream")
    p.add_argument("--no-churn", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    churn = Churn(args.churn_interval_s, args.churn_events, args.min_alive, args.max_alive)
    result = run_load(
        args.workers,
        args.batches,
        args.prompts,
        args.n,
        args.max_new_tokens,
        args.rounds,
        None if args.no_churn else churn,
        max_num_seqs=args.max_num_seqs,
        token_delay_s=args.token_delay_s,
        measure_memory=True,
        seed=args.seed,
    )
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"\nmanager under load ({machine})")
    rows = table(result)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for problem in result["problems"][:10] + result["errors"][:10]:
        print(f"  ! {problem}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine, "result": result}, indent=2))
    if result["lost"] or result["duplicated"] or result["corrupted"] or result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
