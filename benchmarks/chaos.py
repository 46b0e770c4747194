"""Fault injection at scale: every fault kind against a real rollout system (the rollout
manager, the weight publisher, `polyrl worker` processes on a tiny model, a misbehaving
TCP proxy on every link), and what each cost.

    python benchmarks/chaos.py                         # every fault, 3 injections each
    python benchmarks/chaos.py --injections 10 --json chaos.json
    python benchmarks/chaos.py --only "kill -9 while generating" --injections 20

Columns: fault; times injected; samples the batches asked for; samples lost, duplicated
or cut short (all must be 0); samples that migrated between workers; recovery time
(median and worst; see chaos_harness/scenarios.py for what it measures); wall time.
The process-level faults of the trainer and the standalone manager (kill -9 and restart),
and of `polyrl train`'s own role processes (its manager, its local worker) killed
mid-step, are rows too (chaos_harness/restarts.py, roles.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

# the fault-injection harness lives at the repository root (chaos_harness/): the installed package does not ship it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chaos_harness.restarts import RESTART_SCENARIOS  # noqa: E402
from chaos_harness.roles import ROLE_SCENARIOS  # noqa: E402
from chaos_harness.scenarios import SCENARIOS, FaultRow, Scale, run_fleet_scenarios  # noqa: E402
from polyrl.config import TinyModelConfig  # noqa: E402
from polyrl.models.tiny import save_tiny_model  # noqa: E402


def version_weights(model_dir: Path):  # type: ignore[no-untyped-def]
    """Version v's weights: the initial ones nudged by v (every version different)."""
    from transformers import AutoModelForCausalLM

    base = {k: p.detach().clone() for k, p in AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters()}

    def weights(version: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(version)
        return {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}

    return weights


def fmt(value: object) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(rows: list[FaultRow]) -> None:
    header = ["fault", "injected", "samples", "lost", "dup", "short", "migrated", "recovery p50 s", "worst s", "wall s"]
    lines = []
    for row in rows:
        s = row.summary()
        lines.append(
            [
                row.fault,
                row.injected,
                row.samples,
                row.lost,
                row.duplicated,
                row.wrong_length,
                row.migrated,
                s["recovery_median_s"],
                s["recovery_max_s"],
                row.wall_s,
            ]
        )
    widths = [max(len(fmt(x)) for x in col) for col in zip(header, *lines, strict=False)]
    for line in [header, *lines]:
        print("  ".join(fmt(x).ljust(w) if i == 0 else fmt(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths))))
    for row in rows:
        for error in row.errors:
            print(f"  ! {row.fault}: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--injections", type=int, default=3, help="faults of each kind")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only this fault (repeatable)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--keep-logs", type=Path, help="keep worker and trainer logs in this directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    process_scenarios = RESTART_SCENARIOS | ROLE_SCENARIOS
    known = list(SCENARIOS) + list(process_scenarios)
    for name in args.only or []:
        if name not in known:
            parser.error(f"unknown fault {name!r}; one of: {', '.join(known)}")
    scale = Scale(args.prompts, args.n, args.max_new_tokens, args.injections, args.workers)
    work = Path(tempfile.mkdtemp(prefix="polyrl-chaos-")) if args.keep_logs is None else args.keep_logs
    model_dir = save_tiny_model(work / "model", TinyModelConfig(max_position_embeddings=2048))
    rows: list[FaultRow] = []
    started = time.monotonic()
    fleet_names = [n for n in SCENARIOS if not args.only or n in args.only]
    if fleet_names:
        for row in run_fleet_scenarios(model_dir, work / "logs", version_weights(model_dir), scale, fleet_names):
            print(f"[{time.monotonic() - started:7.1f}s] {row.fault}: {'ok' if row.ok else 'FAILED'}", flush=True)
            rows.append(row)
    for name, scenario in process_scenarios.items():
        if args.only and name not in args.only:
            continue
        row = scenario(model_dir, work / name.replace(" ", "_"), scale)
        print(f"[{time.monotonic() - started:7.1f}s] {row.fault}: {'ok' if row.ok else 'FAILED'}", flush=True)
        rows.append(row)
    print()
    print_table(rows)
    if args.json:
        machine = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__}
        result = {
            "scale": vars(args) | {"json": str(args.json), "keep_logs": str(args.keep_logs)},
            "machine": machine,
            "rows": [r.summary() for r in rows],
        }
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
