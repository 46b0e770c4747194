"""The training loop: generate, score, learn, publish, repeat.

Every rollout mode runs this loop. Colocated (`local`), the engine shares the learner's
weights, so the whole batch is generated before the first update. Remote and hybrid
stream: groups are scored and trained on in completion order while workers finish the
rest of the step's batch with the step's weights (all of a step's samples come from one
version, as with PPO's mini-batches). Fully asynchronous (`rollout.fully_async`), only
`next_batch` differs: the step takes the first groups to finish of those kept in flight,
and samples span versions (rollout/feed.py).

Departures from textbook GRPO (each switchable in `[algo]`):
* clip-higher: separate low/high PPO clip bounds (DAPO);
* the old policy is recomputed by the trainer, and a truncated importance weight
  corrects for engine/trainer mismatch (decoupled PPO, as in AReaL);
* loss aggregation is configurable; the default `token-mean` weights every token alike.

Under torchrun rank 0 runs this loop; the other ranks `follow` it (see distributed.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich import get_console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from polyrl.config import RunConfig
from polyrl.lifetime import HURRY
from polyrl.metrics.tracker import format_step_line
from polyrl.trainer.checkpoint import TrainState
from polyrl.trainer.distributed import DataParallel, gather_state, gather_weights
from polyrl.trainer.learner import Learner
from polyrl.trainer.policy import load_learner
from polyrl.trainer.run import Run
from polyrl.trainer.step_metrics import Timer
from polyrl.trainer.stream import learn_from_stream

log = logging.getLogger(__name__)


def train(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool = False,
    on_step_end: Callable[[int, dict[str, float]], None] | None = None,
    dp: DataParallel | None = None,
) -> TrainState:
    tcfg = cfg.trainer
    with StopRequest() as stop:
        run = Run.create(cfg, run_dir, resume, dp or DataParallel())
        stop.started = True
        try:
            with _progress(cfg.logging.console) as progress:
                bar = progress.add_task("train", total=tcfg.total_steps, completed=run.state.step)
                for step in range(run.state.step + 1, tcfg.total_steps + 1):
                    timer = Timer()
                    t0 = time.perf_counter()
                    groups = run.next_batch(step)
                    if run.rollout.shares_weights:
                        with timer("learner_idle"):
                            groups = list(groups)  # generated in full before the learner changes the weights
                    result = learn_from_stream(
                        groups,
                        run.scorer,
                        run.learner,
                        cfg.algo,
                        tcfg.ppo_mini_batch_size,
                        run.state.weight_version,
                        run.learner_started,
                    )
                    with timer("update_weights"):
                        run.publish_weights()
                    timer.spans["step"] = time.perf_counter() - t0
                    run.end_step(step)
                    metrics = run.step_metrics(result.groups, result, timer.spans)
                    run.scale_fleet(metrics)
                    run.tracker.log(step, metrics)
                    if cfg.logging.console:
                        progress.console.print(format_step_line(step, tcfg.total_steps, metrics), soft_wrap=True)
                    progress.update(bar, completed=step)
                    # Between steps, model, optimizer, RNG and cursor agree: a safe save point. The
                    # last step is saved after the loop, so neither case saves it twice.
                    stopping = stop.requested and step < tcfg.total_steps
                    periodic = tcfg.save_every and step % tcfg.save_every == 0 and step < tcfg.total_steps
                    if stopping or periodic:
                        run.save()
                    if on_step_end is not None:
                        on_step_end(step, metrics)
                    if stopping:
                        log.warning("stopped after step %d; continue with --resume", step)
                        raise KeyboardInterrupt
            final = run.save_final(run.save())
            log.info("training done: %d steps; final model in %s", run.state.step, final)
        finally:
            stop.closing = True  # from now on Ctrl-C hurries the cleanup, it does not cut it short
            run.close()
    return run.state


def follow(dp: DataParallel) -> None:
    """Ranks > 0: build the learner that rank 0 starts, then run its commands until it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun passes Ctrl-C to every rank; rank 0 decides
    name, args = dp.receive()
    if name == "start":
        run_commands(load_learner(dp, *args), dp)


def run_commands(learner: Learner, dp: DataParallel) -> None:
    """Each of rank 0's collective calls, on this rank's shard, until "stop"."""
    commands: dict[str, Callable[..., object]] = {
        "train": learner.train_mini_batch,
        "weights": lambda: gather_weights(learner.model, dp),
        "state": lambda: gather_state(learner.model, learner.optimizer, dp),
    }
    while True:
        name, args = dp.receive()
        if name == "stop":
            return
        commands[name](*args)


class StopRequest:
    """First Ctrl-C: finish the current step, save, stop. Second: stop at once, no save (a
    save mid-step would mix two steps' state and break exact resume; the last checkpoint on
    disk stays whole, as each is renamed into place), and the run's children are killed
    rather than drained (`lifetime.HURRY`). During the start-up nothing is trained yet: the
    first Ctrl-C stops at once. In a cleanup (after the loop, or of a start-up cut short),
    Ctrl-C only hurries it: a cleanup cut short would leave children to their parent-death
    signal. A third Ctrl-C gets out anyway."""

    def __init__(self) -> None:
        self.requested = False
        self.started = False
        """Set once the run is built: from then on the first Ctrl-C waits for the step."""
        self.closing = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if not self.requested and not self.closing:
            self.requested = True
            if not self.started:
                self.closing = True  # what runs next is the start-up's cleanup
                log.warning("Ctrl-C: stopping the start-up (Ctrl-C again to kill what it started)")
                raise KeyboardInterrupt
            log.warning("Ctrl-C: finishing this step, then saving (Ctrl-C again to stop without saving)")
            return
        if not HURRY.is_set():
            HURRY.set()
            log.warning(
                "Ctrl-C%s: stopping now%s; the run's processes are killed, not drained",
                " again" if self.requested else "",
                "" if self.closing else " without saving this step",
            )
            if self.closing:
                return
        raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        HURRY.clear()  # a run earlier in this process may have been hurried
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _progress(enabled: bool) -> Progress:
    """The step bar, for a terminal only: to a file, rich prints the bar once when it
    stops, a stray line after the run's last."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not (enabled and get_console().is_terminal),
    )
