"""What reading workers' streams costs the trainer's own Python: the manager runs in the
trainer's process, so every stream chunk it parses holds the GIL the learner needs to
launch its kernels.

The learner stands in as a dispatch-bound loop (tiny torch ops, each a few microseconds
of Python and dispatcher with the GIL held, as a GPU learner's kernel launches are). Its
op rate is measured alone, then while a real `polyrl worker` (tiny model, CPU) streams a
batch into the in-process manager. Variants: `manager.stream_interval_s` (the worker
sends each request's tokens at most that often) and the interpreter's switch interval
(the trainer's local engine sets 0.5 ms; Python's default is 5 ms); they alternate over
the repeats. Other threads' CPU time over the window, per generated token, is the
manager's ingest cost.

    python benchmarks/ingest_interference.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from polyrl.config import ManagerConfig, TinyModelConfig
from polyrl.manager.main import ManagerThread
from polyrl.manager.protocol import BatchPrompt, BatchRequest, BatchSampling
from polyrl.models.tiny import save_tiny_model


@dataclass
class Window:
    ops_per_s: float
    other_threads_cpu_s: float
    seconds: float


def dispatch_loop(seconds: float) -> Window:
    """Tiny torch ops for `seconds`; also the CPU time the process's other threads used."""
    x = torch.zeros(8)
    ops = 0
    t0, cpu0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            x = x.add(1.0)
        ops += 50
    elapsed = time.perf_counter() - t0
    other = (time.process_time() - cpu0) - (time.thread_time() - own0)
    return Window(ops / elapsed, other, elapsed)


@dataclass
class Row:
    stream_interval_s: float
    switch_interval_s: float
    alone_ops_per_s: float
    streaming_ops_per_s: float
    slowdown: float
    tokens_per_s: float
    ingest_cpu_us_per_token: float
    batch_outlasted_window: bool


def measure(mt: ManagerThread, args: argparse.Namespace, seed: int) -> tuple[Window, Window, float, bool]:
    """(alone, while streaming, the batch's tokens/s, whether it was still running when
    the window ended)."""
    alone = dispatch_loop(args.window_s)
    prompts = [BatchPrompt(id=f"{seed}-{i}", input_ids=[1, 2, 3], seed=seed * 1000 + i) for i in range(args.prompts)]
    request = BatchRequest(prompts=prompts, n=args.n, sampling=BatchSampling(max_new_tokens=args.new_tokens,
                                                                             ignore_eos=True))  # fmt: skip
    done: list[tuple[int, float]] = []

    def consume() -> None:
        t0 = time.perf_counter()
        tokens = sum(len(s.output_ids) for g in mt.generate(request) for s in g.samples)
        done.append((tokens, time.perf_counter() - t0))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(args.ramp_s)  # every request admitted and streaming
    streaming = dispatch_loop(args.window_s)
    outlasted = consumer.is_alive()
    consumer.join(600)
    if not done:
        raise RuntimeError("the batch did not finish")
    tokens, seconds = done[0]
    return alone, streaming, tokens / seconds, outlasted


def start_worker(mt: ManagerThread, model: Path, slots: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "polyrl.cli", "worker", "--model", str(model), "--manager", mt.url, "--token", "bench",
           "--port", "0", "--worker-id", "w", f"engine.max_num_seqs={slots}"]  # fmt: skip
    worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(w.state == "active" for w in mt.call(mt.manager.worker_list).workers):
        if time.monotonic() > deadline or worker.poll() is not None:
            worker.kill()
            raise RuntimeError("the worker did not become active")
        time.sleep(0.2)
    return worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=800)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--ramp-s", type=float, default=0.5)
    p.add_argument("--stream-intervals", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.2],
                   help="manager.stream_interval_s values")
    p.add_argument("--switch-intervals", type=float, nargs="+", default=[0.005, 0.0005])
    p.add_argument("--repeats", type=int, default=2, help="median of N (the variants alternate)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    torch.set_num_threads(1)
    variants = [(si, sw) for si in args.stream_intervals for sw in args.switch_intervals]
    runs: dict[tuple[float, float], list[tuple[Window, Window, float, bool]]] = {v: [] for v in variants}
    default_switch = sys.getswitchinterval()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "model", TinyModelConfig(
            hidden_size=64, intermediate_size=128, max_position_embeddings=args.new_tokens + 64))  # fmt: skip
        with ManagerThread(ManagerConfig(port=0, token="bench")) as mt:
            worker = start_worker(mt, model, args.prompts * args.n)
            try:
                for r in range(args.repeats):
                    for k, (stream_interval, switch) in enumerate(variants):
                        mt.call(setattr, mt.manager.remote, "stream_interval_s", stream_interval)
                        sys.setswitchinterval(switch)
                        try:
                            runs[(stream_interval, switch)].append(measure(mt, args, seed=r * 100 + k))
                        finally:
                            sys.setswitchinterval(default_switch)
            finally:
                worker.terminate()
                worker.wait(timeout=30)

    rows: list[Row] = []
    for (stream_interval, switch), results in runs.items():
        alone = statistics.median(a.ops_per_s for a, _, _, _ in results)
        streaming = statistics.median(s.ops_per_s for _, s, _, _ in results)
        tok_s = statistics.median(t for _, _, t, _ in results)
        cpu = statistics.median(s.other_threads_cpu_s / s.seconds for _, s, _, _ in results)
        rows.append(Row(stream_interval, switch, alone, streaming, alone / streaming, tok_s, 1e6 * cpu / tok_s,
                        all(o for *_, o in results)))  # fmt: skip
        print_row(rows[-1], header=len(rows) == 1)
    if not all(r.batch_outlasted_window for r in rows):
        print("note: some batches ended before their window did: raise --new-tokens")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=2))


def print_row(r: Row, header: bool) -> None:
    if header:
        print(f"{'stream interval':>15} {'switch':>7} {'ops/s alone':>12} {'ops/s streaming':>16} {'slowdown':>9} "
              f"{'tokens/s':>9} {'ingest us/token':>16}")  # fmt: skip
    print(f"{r.stream_interval_s:>14g}s {r.switch_interval_s * 1e3:>5.1f}ms {r.alone_ops_per_s:>12.0f} "
          f"{r.streaming_ops_per_s:>16.0f} {r.slowdown:>8.2f}x {r.tokens_per_s:>9.0f} {r.ingest_cpu_us_per_token:>16.1f}",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
