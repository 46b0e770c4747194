"""Generation throughput of one engine kept topped up, as a fully asynchronous worker is:
C sequences in flight, each finished one replaced at once by a new request with the next
long-tail budget. Rows, measured in one run on the same model and engine:

* closed: C sequences started together, no refill, each with the budget that lets all
  of them fit the KV cache (at most 1000 tokens): captured decodes with nothing arriving,
  for reference (its contexts differ from the fed rows');
* fed, admit at once (`engine.admit_wait_steps=0`): every arrival stops the chain of
  overlapped captured decodes for one eager step that also prefills it;
* fed, default: arrivals wait up to `admit_wait_steps` overlapped steps (or until
  `admit_batch` samples wait) and are admitted together.

    python benchmarks/engine_fed.py [--preset qwen3-0.6b] [--levels 256,512] [--seconds 8] [--json PATH]

Models are random-init from a config (no hub); EOS is ignored, so every sequence makes
its whole budget. A first fed run, not reported, compiles the kernels and captures the
graphs; each row then warms up for 2 s before it measures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import build_model, sync  # noqa: E402  (benchmarks/engine.py)
from spot_gpu import longtail_budgets  # noqa: E402

from polyrl.config import EngineConfig  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.engine.types import EngineRequest  # noqa: E402
from polyrl.protocol.sampling import SamplingParams  # noqa: E402


def fed_run(
    engine: Engine,
    level: int,
    seconds: float,
    budgets: list[int] | None,
    prompt_len: int,
    fixed_budget: int,
    warm_s: float = 2.0,
) -> dict[str, float]:
    """Generated tokens/s, steps/s, mean running sequences and KV preemptions with `level`
    sequences in flight, each finished one replaced at once by the next budget's; `budgets`
    None: `fixed_budget` each, no refill."""
    ids = itertools.count()
    active: set[str] = set()

    def add() -> None:
        i = next(ids)
        budget = fixed_budget if budgets is None else budgets[i % len(budgets)]
        sampling = SamplingParams(max_new_tokens=budget, ignore_eos=True, seed=i)
        vocab = engine.vocab_size
        engine.add_request(EngineRequest(f"r{i}", [(i + j) % (vocab - 1) + 1 for j in range(prompt_len)], sampling))
        active.add(f"r{i}")

    for _ in range(level):
        add()
    t0, start, steps, running = time.monotonic(), None, 0, 0
    while time.monotonic() - t0 < warm_s + seconds:
        for delta in engine.step():
            if delta.finish_reason is not None:
                active.discard(delta.rid)
        if budgets is not None:
            while len(active) < level:
                add()
        if start is None and time.monotonic() - t0 >= warm_s:
            sync(engine.device)
            stats = engine.stats()
            start = (time.monotonic(), stats.num_generated_tokens, stats.num_preemptions)
            steps = running = 0
        steps += 1
        running += len(engine.scheduler.running)
        if budgets is None and not engine.has_work:
            break  # a closed batch is measured until its last sequence ends
    if start is None:  # it ended within the warm-up: nothing measured
        return {"tok_s": float("nan"), "steps_s": float("nan"), "mean_running": float("nan"), "preemptions": 0}
    sync(engine.device)
    span = time.monotonic() - start[0]
    stats = engine.stats()
    engine.abort_all()
    while engine.has_work:
        engine.step()
    return {
        "tok_s": (stats.num_generated_tokens - start[1]) / span,
        "steps_s": steps / span,
        "mean_running": running / max(steps, 1),
        "preemptions": stats.num_preemptions - start[2],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="engine.py's presets (default: qwen3-0.6b on CUDA, tiny on CPU)")
    p.add_argument("--levels", default=None, help="sequences in flight (default: 256,512 on CUDA, 8 on CPU)")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per row")
    p.add_argument("--kv-blocks", type=int, default=12288, help="16-token KV blocks (the spot worker's in spot_gpu.py)")
    p.add_argument("--tail-median", type=float, default=300)
    p.add_argument("--tail-p99", type=float, default=3000)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--json")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = args.preset or ("qwen3-0.6b" if cuda else "tiny")
    levels = [int(x) for x in (args.levels or ("256,512" if cuda else "8")).split(",")]
    model = build_model(preset, device, torch.bfloat16 if cuda else torch.float32)
    engine = Engine(model, EngineConfig(max_num_seqs=max(levels), num_kv_blocks=args.kv_blocks, max_model_len=1536))
    default_wait = engine.cfg.admit_wait_steps
    budgets = longtail_budgets(8192, args.tail_median, args.tail_p99, args.new_tokens)
    rows: list[dict[str, object]] = []
    fed_run(engine, max(levels), 3.0, budgets, 24, 0)  # Triton compiles, graphs captured: not measured
    prompt_len = 24
    for level in levels:
        fits = min(1000, args.kv_blocks * 16 // level - prompt_len - 16)
        for name, wait, fed in (
            ("closed", default_wait, False),
            ("fed, admit at once", 0, True),
            (f"fed, admit_wait_steps={default_wait}", default_wait, True),
        ):
            engine.cfg.admit_wait_steps = wait
            r = fed_run(engine, level, args.seconds, budgets if fed else None, prompt_len, fits)
            rows.append({"level": level, "row": name, **r})
            print(
                f"{level:>5} {name:<28} {r['tok_s']:>9.0f} tok/s {r['steps_s']:>7.1f} steps/s "
                f"{r['mean_running']:>6.0f} running",
                flush=True,
            )
    machine = (
        torch.cuda.get_device_name() if cuda else f"{platform.machine()}, {os.cpu_count()} cores"
    ) + f", torch {torch.__version__}"
    print(
        f"\npreset {preset}, {machine}, KV {args.kv_blocks} x 16 tokens; long tail: median {args.tail_median:.0f}, "
        f"p99 {args.tail_p99:.0f}, cap {args.new_tokens}"
    )
    print(f"{'seqs':>5} | {'row':<28} | {'tok/s':>8} | {'vs admit at once':>16} | {'steps/s':>7} | {'running':>7}")
    for r in rows:
        base = next(x for x in rows if x["level"] == r["level"] and x["row"] == "fed, admit at once")
        print(
            f"{r['level']:>5} | {r['row']:<28} | {r['tok_s']:>8.0f} | {r['tok_s'] / base['tok_s']:>15.2f}x | "
            f"{r['steps_s']:>7.1f} | {r['mean_running']:>7.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": preset, "machine": machine, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
