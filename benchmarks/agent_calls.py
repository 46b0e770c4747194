"""An agent run's cost with the calls on a worker batched into one request, and with one
request per call (`manager.batch_calls`), in the same run on the same box.

Each row trains an agent example (`examples/agent_tool.py` or `agent_game.py`) for
`--steps` steps the way the main job does (two workers, the manager, the tiny model),
and reads its metrics: the median time per step and of its generation
(`timing_s/gen`, every episode of the step played), after the first step, and the
episodes played per second of generation.

    python benchmarks/agent_calls.py [--example tool|game] [--items 64] [--steps 14] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(example: str, batch_calls: bool, items: int, steps: int, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agent_calls_") as tmp:
        command = [
            sys.executable,
            str(EXAMPLES / f"agent_{example}.py"),
            "--run-dir",
            tmp,
            f"manager.batch_calls={str(batch_calls).lower()}",
            f"trainer.train_batch_size={items}",
            f"trainer.ppo_mini_batch_size={max(1, items // 2)}",
            f"rollout.n={n}",
            f"trainer.total_steps={steps}",
        ]
        t0 = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    gen = statistics.median(r["timing_s/gen"] for r in later)
    return {
        "example": example,
        "batch_calls": batch_calls,
        "episodes_per_step": items * n,
        "steps": len(rows),
        "step_s": statistics.median(r["perf/time_per_step"] for r in later),
        "gen_s": gen,
        "episodes_per_gen_s": items * n / gen if gen else float("nan"),  # (no remote generation timed)
        "lost": sum(r.get("rollout/samples_lost", 0) for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", choices=["tool", "game"], default="tool")
    parser.add_argument("--items", type=int, default=64, help="items a step (trainer.train_batch_size)")
    parser.add_argument("--n", type=int, default=16, help="episodes per item (rollout.n)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = [run(args.example, mode, args.items, args.steps, args.n) for mode in (False, True)]
    print(
        f"{args.example} example, {args.items} items x {args.n} episodes a step, {args.steps} steps, {os.cpu_count()} cores"
    )
    print(f"{'requests':<22} {'s/step':>8} {'gen s/step':>11} {'episodes/s':>11} {'lost':>5}")
    for r in rows:
        label = "batched per worker" if r["batch_calls"] else "one per call"
        print(f"{label:<22} {r['step_s']:>8.2f} {r['gen_s']:>11.2f} {r['episodes_per_gen_s']:>11.0f} {r['lost']:>5.0f}")
    print(f"generation, batched vs one per call: {rows[0]['gen_s'] / rows[1]['gen_s']:.2f}x faster")
    if args.json:
        meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
