"""How many intra-op threads a CPU process uses on a machine it may share.

torch's CPU pool has a thread per core, and every parallel op ends when its slowest thread
does. When another process holds one of the cores, each op waits for a thread the kernel
has not run yet; the tiny model's ops take microseconds and a scheduler slice takes
milliseconds, so on 2 cores one other busy process made the main job's update step 5-7 s
instead of 0.25 s (20x, not the 2x of losing a core). Fewer threads than the cores the
other processes leave free cost only the share those processes take.

`CpuThreads` watches the process while it works (`with threads.measure(): ...`):
  * time its threads spent runnable but not running (the kernel's run-queue wait,
    /proc/self/task/*/schedstat) means the cores are oversubscribed: one thread goes;
  * cores left idle meanwhile (/proc/stat) mean room: one thread comes back, up to the
    number it started with.
One step at a time, each after a measured stretch of work, so that a short burst of
load moves it by one thread at most. Linux only; elsewhere the count stays as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

OVERSUBSCRIBED = 0.2
"""Run-queue wait per thread, as a share of the measured wall time, above which a thread
goes (idle: under 0.02 on 2 cores; beside one busy process at 2 threads: about 0.5)."""
ROOM = 0.8
"""Idle cores during the measurement from which a thread comes back."""
MIN_MEASURE_S = 0.05
"""Shorter stretches of work add up to one measurement: /proc/stat counts in 10 ms."""
CHECK_S = 0.2
"""A `checkpoint` inside a stretch reads it once this long: /proc/stat counts idle time
in 10 ms ticks, so a shorter window mistakes a pause between ops for an idle core."""
RAISE_S = 0.3
"""A `checkpoint` gives a thread back only after this long: a worker that pauses between
two calls leaves a core idle for a moment, and the thread given back then would share it
once the worker resumes, for as long as the learner's next read takes."""
MAX_GAP_S = 0.005
"""Stretches further apart than this do not add up (an engine's steps do)."""


@dataclass
class _Sample:
    wall_s: float
    idle_s: float
    """All cores' idle time since boot (/proc/stat), in seconds."""
    wait_s: float
    """This process's threads' run-queue wait since they started, in seconds."""


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _sample(ticks: int) -> _Sample | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        idle = (int(fields[4]) + int(fields[5])) / ticks  # idle + iowait
        wait_ns = 0
        for task in Path("/proc/self/task").iterdir():
            try:
                wait_ns += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended meanwhile
    except (OSError, IndexError, ValueError):
        return None
    return _Sample(time.monotonic(), idle, wait_ns / 1e9)


class CpuThreads:
    """torch's intra-op thread count for this process, kept to what the machine leaves it."""

    def __init__(self, max_threads: int | None = None) -> None:
        import torch  # here, not at the top: the fleet model reads this module's thresholds without torch

        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = torch.get_num_threads()
        self._ticks = _clock_ticks()
        self._start: _Sample | None = None
        self._last_exit = 0.0
        self.is_adaptive = self.max_threads > 1 and _sample(self._ticks) is not None
        """False where nothing can move: one thread at most, a fixed count, or no /proc."""
        self.last_wait_ratio = 0.0
        """Run-queue wait per thread over wall time, in the latest measurement."""
        self.last_idle_cores = 0.0

    def fix(self, threads: int) -> None:
        """A count the user chose (`trainer.num_threads`): set, and left alone."""
        import torch

        torch.set_num_threads(threads)
        self.threads = self.max_threads = threads
        self.is_adaptive = False

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Work inside counts; after it, the thread count may move by one."""
        if not self.is_adaptive:
            yield
            return
        if self._start is None or time.monotonic() - self._last_exit > MAX_GAP_S:
            self._start = _sample(self._ticks)  # (a pause between stretches would count as idle cores)
        try:
            yield
        finally:
            self._last_exit = time.monotonic()
            if self._start is not None and self._last_exit - self._start.wall_s >= MIN_MEASURE_S:
                self._adjust(self._start, _sample(self._ticks))  # shorter: the next stretch adds to it

    def checkpoint(self) -> None:
        """Inside `measure()`: once the stretch so far is long enough to read, adjust now
        and measure on from here, so that long work (a mini-batch of many micro-batches)
        follows a load that changes in its middle."""
        if self._start is None or time.monotonic() - self._start.wall_s < CHECK_S:
            return
        end = _sample(self._ticks)
        self._adjust(self._start, end, may_add=end is not None and end.wall_s - self._start.wall_s >= RAISE_S)
        self._start = end

    def _adjust(self, start: _Sample, end: _Sample | None, may_add: bool = True) -> None:
        self._start = None
        if end is None:
            return
        wall = end.wall_s - start.wall_s
        self.last_wait_ratio = (end.wait_s - start.wait_s) / (wall * self.threads)
        self.last_idle_cores = max(0.0, (end.idle_s - start.idle_s) / wall)
        before = self.threads
        self.threads = next_count(self.threads, self.max_threads, self.last_wait_ratio, self.last_idle_cores, may_add)
        if self.threads != before:
            import torch

            torch.set_num_threads(self.threads)
            log.debug(
                "cpu threads %d -> %d (run-queue wait %.0f%% of each thread's time, %.1f cores idle)",
                before,
                self.threads,
                100 * self.last_wait_ratio,
                self.last_idle_cores,
            )


def next_count(threads: int, max_threads: int, wait_ratio: float, idle_cores: float, may_add: bool = True) -> int:
    """The governor's rule, after a measurement: one thread fewer when each thread waited
    for a core over `OVERSUBSCRIBED` of the time, one more (where `may_add`) when
    `ROOM` cores sat idle. The fleet model plays the same rule on its modelled load."""
    if wait_ratio > OVERSUBSCRIBED and threads > 1:
        return threads - 1
    if may_add and idle_cores >= ROOM and threads < max_threads:
        return threads + 1
    return threads


_process: CpuThreads | None = None


def process_threads() -> CpuThreads:
    """The process's one governor: the learner and an engine in the same process share
    torch's one thread pool, so they must not steer it apart."""
    global _process
    if _process is None:
        _process = CpuThreads()
    return _process


def measured(device: torch.device) -> contextlib.AbstractContextManager:
    """`process_threads().measure()` for work on the CPU; nothing for work on a GPU."""
    return process_threads().measure() if device.type == "cpu" else contextlib.nullcontext()


T = TypeVar("T")


def checked_each(items: Iterable[T], device: torch.device) -> Iterator[T]:
    """`items`, with a `checkpoint` of the process's measurement after the loop body that
    gets each one: the learner's micro-batches, inside the mini-batch's `measured`. Read
    once per mini-batch, the count was one mini-batch behind on a shared host: two
    threads while a worker held one of the 2 cores, and one after the worker had stopped
    (the one-worker main job's step, 3.2 s; BENCHMARKS.md)."""
    for item in items:
        yield item
        if device.type == "cpu":
            process_threads().checkpoint()
