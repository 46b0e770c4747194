"""Per-step metrics to every sink: console line, metrics.jsonl, TensorBoard, wandb (opt-in).

Names follow veRL's (`perf/throughput`, `actor/pg_loss`, `critic/score/mean`, ...) so
dashboards built for veRL carry over.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from polyrl.config import LoggingConfig

log = logging.getLogger(__name__)

CONSOLE_KEYS = {
    "critic/score/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy",
    "actor/grad_norm": "grad_norm",
    "response_length/mean": "resp_len",
    "rollout/logprob_diff": "lp_diff",
    "perf/time_per_step": "step_s",
    "perf/throughput": "tok/s",
}


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step. On resume, lines past the checkpoint are dropped first, so a
    step replayed after a crash appears once."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text().splitlines() if _step_of(ln) <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        self._file = path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> float:
    """The step of a metrics line; a torn last line (crash mid-write) counts as past any step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class TensorBoardSink:
    def __init__(self, log_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a crashed run wrote past the checkpoint we resume from.
        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(str(log_dir), purge_step=purge)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict) -> None:
        import wandb  # optional dependency: only imported when asked for

        self._run = wandb.init(project=project, name=name, config=config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def format_step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, short in CONSOLE_KEYS.items():
        if key in metrics:
            value = metrics[key]
            parts.append(f"{short} {value:.3g}" if abs(value) < 1e4 else f"{short} {value:.0f}")
    return " | ".join(parts)


class Tracker:
    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        resume_step: int | None,
        run_name: str,
        config_dict: dict,
    ) -> None:
        self.sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        if cfg.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
        if cfg.wandb:
            try:
                self.sinks.append(WandbSink(cfg.wandb_project, run_name, config_dict))
            except ImportError:
                log.warning("logging.wandb is on but wandb is not installed; skipping it")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
