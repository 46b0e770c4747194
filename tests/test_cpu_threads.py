"""A busy CPU costs the learner and the CPU engines about its share, not 20x
(`polyrl/cpu_threads.py`): torch's threads follow what the other processes leave free."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from polyrl.cpu_threads import CpuThreads, _Sample

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
needs_cores = pytest.mark.skipif(
    CORES < 2 or not Path("/proc/self/task").exists(), reason="needs 2 cores and Linux's /proc"
)


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes that spin, as another user's job would."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _work() -> None:
    """A few hundred small ops, as a tiny model's step is: each ends when every thread has."""
    x = torch.randn(64, 96)
    w = torch.randn(96, 96)
    for _ in range(300):
        x = torch.tanh(x @ w) * 0.5


@needs_cores
def test_threads_leave_the_cores_others_keep_busy() -> None:
    before = torch.get_num_threads()
    threads = CpuThreads(max_threads=2)
    torch.set_num_threads(2)
    threads.threads = 2
    try:
        with busy_cores(CORES - 1):  # one core left: two threads take turns on it
            for _ in range(20):
                with threads.measure():
                    _work()
                if threads.threads == 1:
                    break
        assert threads.threads == 1 and torch.get_num_threads() == 1, (threads.last_wait_ratio, threads.last_idle_cores)
    finally:
        torch.set_num_threads(before)


@needs_cores
def test_each_micro_batch_is_checked_so_the_count_moves_within_a_mini_batch() -> None:
    """The learner checks its measurement after each micro-batch (`checked_each`), so a
    worker that starts decoding beside it takes a thread within the mini-batch, not after."""
    from polyrl.cpu_threads import checked_each, process_threads

    before = torch.get_num_threads()
    governor = process_threads()
    try:
        governor.__init__(max_threads=2)
        torch.set_num_threads(2)
        governor.threads = 2
        counts = []
        with busy_cores(CORES - 1), governor.measure():  # one mini-batch
            for _ in checked_each(range(150), torch.device("cpu")):
                _work()
                counts.append(torch.get_num_threads())
        assert counts[0] == 2 and counts[-1] == 1, counts
    finally:
        governor.__init__()
        torch.set_num_threads(before)


def test_threads_come_back_when_cores_idle_and_go_when_they_wait() -> None:
    """The rule on given measurements (a real idle core can't be promised on a shared
    machine): idle cores add a thread up to the start's count, run-queue wait takes one."""
    before = torch.get_num_threads()
    threads = CpuThreads(max_threads=3)
    threads.is_adaptive, threads.threads = True, 1
    try:
        for wait_s, idle_s, expected in ((0.0, 1.0, 2), (0.0, 1.0, 3), (0.0, 2.0, 3), (0.9, 0.0, 2), (0.1, 0.5, 2)):
            threads._adjust(
                _Sample(wall_s=time.monotonic() - 1.0, idle_s=0.0, wait_s=0.0),
                _Sample(wall_s=time.monotonic(), idle_s=idle_s, wait_s=wait_s * threads.threads),
            )
            assert threads.threads == torch.get_num_threads() == expected, (wait_s, idle_s)
    finally:
        torch.set_num_threads(before)


def test_a_chosen_count_is_kept() -> None:
    before = torch.get_num_threads()
    try:
        threads = CpuThreads()
        threads.fix(1)
        assert not threads.is_adaptive and torch.get_num_threads() == 1
        with threads.measure():
            _work()
        assert threads.threads == torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _update_s(run_dir: Path, extra: list[str]) -> tuple[float, list[float]]:
    """The main job (its CPU learner, and workers of one thread each), a few steps: the
    median update time after the first step, and the thread counts it logged."""
    overrides = [
        "trainer.total_steps=4",
        "trainer.save_every=0",
        "logging.console=false",
        "logging.tensorboard=false",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["timing_s/update_actor"] for r in rows[1:]), [r["perf/cpu_threads"] for r in rows]


@pytest.mark.slow
@needs_cores
def test_a_busy_cpu_costs_the_learner_its_share(tmp_path: Path) -> None:
    """Beside processes that keep all cores but one busy, the update takes about what one
    core less costs (the issue saw 20x: 0.25 s became 5-7 s on 2 cores with one other job).
    On the idle 2-core box: 1.14x with the governor, 4.5x with a fixed 2 threads.

    The suite's other worker loads the same cores at times (on 2026-12-05 the pair took
    3.2x once, beside the CUDA kernel's host runs), so a pair over the bound is measured
    again, up to three pairs: a fixed thread count is over it in every one."""
    pairs = []
    for attempt in range(3):
        idle_s, _ = _update_s(tmp_path / f"idle{attempt}", [])
        with busy_cores(CORES - 1):
            busy_s, busy_threads = _update_s(tmp_path / f"busy{attempt}", [])
        assert min(busy_threads) < CORES, busy_threads  # it let the busy cores go
        pairs.append((busy_s, idle_s, busy_threads))
        if busy_s < 2.5 * idle_s:
            break
    else:
        pytest.fail(f"the update took more than 2.5x its idle time beside busy cores in every pair: {pairs}")


def test_runs_that_promise_their_bits_keep_one_count() -> None:
    """Local mode and `rollout.deterministic`: a reduction's rounding depends on how many
    threads split it, so the count is not left to the machine's load."""
    from polyrl.config import load_config
    from polyrl.cpu_threads import process_threads
    from polyrl.trainer.policy import prepare_process

    before = torch.get_num_threads()
    governor = process_threads()
    try:
        for overrides, adaptive in (
            (["rollout.mode=local"], False),
            (["rollout.deterministic=true"], False),
            (["trainer.num_threads=1"], False),
            ([], CORES > 1),
        ):
            governor.__init__(max_threads=CORES)  # as a fresh process starts
            prepare_process(load_config(None, overrides))
            assert governor.is_adaptive == adaptive, overrides
    finally:
        governor.__init__()
        torch.set_num_threads(before)
