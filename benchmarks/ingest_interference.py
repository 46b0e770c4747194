"""What reading workers' streams costs the trainer's own Python. With the manager in the
trainer's process (`--placement in-process`, how polyrl ran until the process redesign)
every stream chunk it parses holds the GIL the learner needs to launch its kernels; with
the manager in its own process (`process`, how `polyrl train` runs now) the trainer
reads only finished groups, through `rollout/manager_link.py`.

The learner stands in as a dispatch-bound loop (tiny torch ops, each a few microseconds
of Python and dispatcher with the GIL held, as a GPU learner's kernel launches are). Its
op rate is measured alone, then while a real `polyrl worker` (tiny model, CPU) streams a
batch into the in-process manager. Variants: `manager.stream_interval_s` (the worker
sends each request's tokens at most that often) and the interpreter's switch interval
(the trainer's local engine sets 0.5 ms; Python's default is 5 ms); they alternate over
the repeats. Other threads' CPU time from the batch's submission to its last group, per
generated token, is the trainer process's ingest cost: what it spends outside the
learner.

    python benchmarks/ingest_interference.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import socket
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
from polyrl.launch.manager_process import ManagerProcess
from polyrl.manager.main import ManagerThread
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.manager_api import BatchPrompt, BatchRequest, GroupResult, WorkerList
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.manager_link import ManagerLink

TOKEN = "bench"


class InProcess:
    """The manager on a thread of this process (the old trainer)."""

    def __init__(self, cfg: ManagerConfig) -> None:
        self.mt = ManagerThread(cfg).start()

    def generate(self, request: BatchRequest) -> list[GroupResult]:
        return list(self.mt.generate(request))

    def workers(self) -> WorkerList:
        return self.mt.worker_list()

    def stop(self) -> None:
        self.mt.stop()


class OwnProcess:
    """`polyrl manager` in a child process, read as the trainer reads it now."""

    def __init__(self, cfg: ManagerConfig, run_dir: Path) -> None:
        self.proc = ManagerProcess(cfg, TOKEN, run_dir)
        self.link = ManagerLink(self.proc.start(), TOKEN)

    def generate(self, request: BatchRequest) -> list[GroupResult]:
        return list(self.link.open_batch(request))

    def workers(self) -> WorkerList:
        return self.link.workers()

    def stop(self) -> None:
        self.link.close()
        self.proc.stop()


@dataclass
class Window:
    ops_per_s: float
    other_threads_cpu_s: float
    seconds: float


def dispatch_loop(seconds: float, until: threading.Thread | None = None) -> Window:
    """Tiny torch ops for `seconds` (or, given `until`, until that thread ends); also the
    CPU time the process's other threads used meanwhile."""
    x = torch.zeros(8)
    ops = 0
    t0, cpu0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
    while until.is_alive() if until is not None else time.perf_counter() - t0 < seconds:
        for _ in range(50):
            x = x.add(1.0)
        ops += 50
    elapsed = time.perf_counter() - t0
    other = (time.process_time() - cpu0) - (time.thread_time() - own0)
    return Window(ops / elapsed, other, elapsed)


@dataclass
class Row:
    placement: str
    stream_interval_s: float
    switch_interval_s: float
    alone_ops_per_s: float
    streaming_ops_per_s: float
    slowdown: float
    tokens_per_s: float
    ingest_cpu_us_per_token: float


def measure(manager: InProcess | OwnProcess, args: argparse.Namespace, seed: int) -> tuple[Window, Window, float]:
    """(alone, from the batch's submission to its last group, the batch's tokens/s)."""
    alone = dispatch_loop(args.window_s)
    prompts = [BatchPrompt(id=f"{seed}-{i}", input_ids=[1, 2, 3], seed=seed * 1000 + i) for i in range(args.prompts)]
    request = BatchRequest(
        prompts=prompts, sampling=SamplingParams(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True)
    )
    done: list[tuple[int, float]] = []

    def consume() -> None:
        t0 = time.perf_counter()
        tokens = sum(len(s.output_ids) for g in manager.generate(request) for s in g.samples)
        done.append((tokens, time.perf_counter() - t0))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    # From submission to the last group: with the manager in its own process the trainer's
    # cost comes as whole groups, mostly at the end of a batch of equal lengths.
    streaming = dispatch_loop(args.window_s, until=consumer)
    consumer.join(600)
    if not done:
        raise RuntimeError("the batch did not finish")
    tokens, seconds = done[0]
    return alone, streaming, tokens / seconds


def start_worker(url: str, model: Path, slots: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "worker",
        "--model",
        str(model),
        "--manager",
        url,
        "--token",
        TOKEN,
        "--port",
        "0",
        "--worker-id",
        "w",
        f"engine.max_num_seqs={slots}",
        "worker.heartbeat_interval_s=0.5",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_active(manager: InProcess | OwnProcess, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not any(w.state == "active" for w in manager.workers().workers):
        if time.monotonic() > deadline or worker.poll() is not None:
            raise RuntimeError("the worker did not become active")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=800)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--placements", nargs="+", default=["in-process", "process"], choices=["in-process", "process"])
    p.add_argument(
        "--stream-intervals", type=float, nargs="+", default=[0.0, 0.2], help="manager.stream_interval_s values"
    )
    p.add_argument(
        "--switch-intervals",
        type=float,
        nargs="+",
        default=[0.005],
        help="the interpreter's switch interval while measuring (in-process: the old local engine set 0.5 ms)",
    )
    p.add_argument("--repeats", type=int, default=2, help="median of N (the variants alternate)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    torch.set_num_threads(1)
    variants = [(pl, si, sw) for pl in args.placements for si in args.stream_intervals for sw in args.switch_intervals]
    runs: dict[tuple[str, float, float], list[tuple[Window, Window, float]]] = {v: [] for v in variants}
    default_switch = sys.getswitchinterval()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(
            Path(tmp) / "model",
            TinyModelConfig(hidden_size=64, intermediate_size=128, max_position_embeddings=args.new_tokens + 64),
        )
        worker = start_worker(f"http://127.0.0.1:{port}", model, args.prompts * args.n)
        try:
            for r in range(args.repeats):
                for k, (placement, stream_interval, switch) in enumerate(variants):
                    cfg = ManagerConfig(port=port, token=TOKEN, stream_interval_s=stream_interval)
                    manager = InProcess(cfg) if placement == "in-process" else OwnProcess(cfg, Path(tmp))
                    sys.setswitchinterval(switch)
                    try:
                        wait_active(manager, worker)
                        runs[(placement, stream_interval, switch)].append(measure(manager, args, seed=r * 100 + k))
                    finally:
                        sys.setswitchinterval(default_switch)
                        manager.stop()
        finally:
            worker.terminate()
            worker.wait(timeout=30)

    rows: list[Row] = []
    for (placement, stream_interval, switch), results in runs.items():
        alone = statistics.median(a.ops_per_s for a, _, _ in results)
        streaming = statistics.median(s.ops_per_s for _, s, _ in results)
        tok_s = statistics.median(t for _, _, t in results)
        cpu = statistics.median(s.other_threads_cpu_s / s.seconds for _, s, _ in results)
        rows.append(
            Row(placement, stream_interval, switch, alone, streaming, alone / streaming, tok_s, 1e6 * cpu / tok_s)
        )
        print_row(rows[-1], header=len(rows) == 1)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=2))


def print_row(r: Row, header: bool) -> None:
    if header:
        print(
            f"{'manager':>10} {'stream interval':>15} {'switch':>7} {'ops/s alone':>12} {'ops/s streaming':>16} "
            f"{'slowdown':>9} {'tokens/s':>9} {'ingest us/token':>16}"
        )
    print(
        f"{r.placement:>10} {r.stream_interval_s:>14g}s {r.switch_interval_s * 1e3:>5.1f}ms {r.alone_ops_per_s:>12.0f} "
        f"{r.streaming_ops_per_s:>16.0f} {r.slowdown:>8.2f}x {r.tokens_per_s:>9.0f} {r.ingest_cpu_us_per_token:>16.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
