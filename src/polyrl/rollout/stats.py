"""What one step's generation did, for the step's metrics (any rollout mode)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from polyrl.manager.registry import LOCAL_WORKER_ID


@dataclass
class RolloutStats:
    """What one step's generation took, for the step's metrics."""

    gen_s: float = 0.0
    """Submission to the last group."""
    first_group_s: float = 0.0
    num_requested: int = 0
    num_received: int = 0
    num_migrated: int = 0
    """Samples that moved between workers at least once (failure, hand-back, window close)."""
    num_local: int = 0
    """Samples with tokens from the trainer's own engine."""
    tokens_by_worker: Counter[str] = field(default_factory=Counter)
    window_s: float | None = None
    window_closed_by: str = ""
    weight_sync_s: float | None = None
    """From publishing the step's version to the slowest remote worker serving it."""

    def metrics(self) -> dict[str, float]:
        out = {
            "rollout/samples_requested": float(self.num_requested),
            "rollout/samples_received": float(self.num_received),
            "rollout/samples_lost": float(self.num_requested - self.num_received),
            "rollout/migrated_samples": float(self.num_migrated),
            "rollout/local_samples": float(self.num_local),
            "timing_s/first_group": self.first_group_s,
        }
        remote = {w: n for w, n in self.tokens_by_worker.items() if w != LOCAL_WORKER_ID}
        if remote and self.gen_s > 0:
            out["perf/tokens_per_s_per_worker"] = sum(remote.values()) / self.gen_s / len(remote)
        if self.window_s is not None:
            out["timing_s/local_window"] = self.window_s
        if self.weight_sync_s is not None:
            out["timing_s/weight_sync"] = self.weight_sync_s
        return out
