"""The local window: when the trainer's own engine (the `local` worker) may take work.

RLBoost's adaptive local rollout: right after a new version is published, the remote
workers are busy pulling it, and the trainer's device would idle until they serve it.
The local worker, which gets the version first (on the trainer's own device), generates
meanwhile. This module decides when the window opens and closes; the manager places
work by it and moves the local worker's unfinished samples on when it closes.

Modes (`manager.local_window`):
* `synced`: opens at each publish; closes when every remote worker serves the version,
  after twice the measured sync time (a slow sync should not stall the step; at least a
  second, at most `local_window_max_s`), or when the learner starts. What the local
  worker holds then moves to the remote workers (a stopgap hands its work on).
* `learner`: opens at each publish as a peer: the local worker takes only its share of
  each batch, so that workers still syncing find theirs waiting; closes when the learner
  starts, and the local worker finishes what it holds (moving it would cost a prefill).
* `idle` (fully asynchronous training): opens whenever the learner waits for groups, for
  the groups it waits for only: their samples move to the local worker, which has the
  trainer's device to itself and decodes the few of them at a small batch's latency
  instead of inside a full remote batch; closes when the learner trains again, and the
  local worker finishes what it holds (handing it back would cost a re-prefill and the
  tokens not yet streamed, and it would come back at the next wait). Measured on one H100
  split by MPS: letting it take any work while open, and hand it back at each close, made
  steps 2-5x slower than not using it at all (BENCHMARKS.md).
* `always` (fully asynchronous training, on request): open from the start and never
  closed: the local worker is one more peer of the fleet, generating beside the learner
  in its own process on the trainer's device. It takes work when the remote workers have
  no free slot, up to its engine's `max_num_seqs`, and keeps it. That pays when the
  fleet is slower than the learner; it slows the learner, by 1.5x per token on an H200
  (BENCHMARKS.md), which costs where the learner is the slower.
* `off`: never opens (remote mode); the local worker still serves when no remote worker
  is left, or a batch has waited `local_fallback_s` with none serving its version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from polyrl.protocol.manager_api import LocalWindowReport

WindowMode = Literal["off", "synced", "learner", "idle", "always"]

SYNC_EMA = 0.5
"""Weight of the newest measured sync time in the window's length estimate."""

SYNCED = "remote workers synced"


@dataclass(frozen=True)
class Opening:
    """How a window opens: its timer (None: none) and what else closes it."""

    max_s: float | None
    until_synced: bool
    """Closes once every remote worker serves the version (else: a peer until the learner starts)."""
    hand_back: bool
    """When it closes, the local worker's unfinished samples move to remote workers."""
    peer: bool = False
    """The local worker takes only its share of each batch (the rest waits for the others)."""
    moved_only: bool = False
    """The local worker takes only the samples moved to it (`SampleState.to_local`)."""


class LocalWindow:
    """The window's state and policy; pure, no I/O (the manager owns the timer)."""

    def __init__(self, mode: WindowMode, max_s: float) -> None:
        self.mode, self.max_s = mode, max_s
        self.is_open = False
        self.opening: Opening | None = None
        self.opened_at = 0.0
        self.sync_estimate_s: float | None = None
        self.last: LocalWindowReport | None = None
        if mode == "always":
            self._open(Opening(None, until_synced=False, hand_back=False))

    def on_publish(self) -> Opening | None:
        """The window to open now that a version is published (None: none)."""
        if self.mode in ("off", "idle", "always"):
            return None
        if self.mode == "learner":
            return self._open(Opening(None, until_synced=False, hand_back=False, peer=True))
        estimate = self.sync_estimate_s if self.sync_estimate_s is not None else self.max_s
        return self._open(Opening(min(max(2 * estimate, 1.0), self.max_s), until_synced=True, hand_back=True))

    def on_learner_waiting(self) -> Opening | None:
        """The window to open now that the learner waits for groups (None: none, or open)."""
        if self.mode != "idle" or self.is_open:
            return None
        return self._open(Opening(None, until_synced=False, hand_back=False, moved_only=True))

    def open_now(self, opening: Opening) -> Opening:
        """Open a window of the caller's choosing (tests, benchmarks)."""
        return self._open(opening)

    def _open(self, opening: Opening) -> Opening:
        self.is_open, self.opening, self.opened_at = True, opening, time.monotonic()
        return opening

    def close(self, why: str) -> Opening | None:
        """Close it (no-op when closed); returns how it was opened. A window that the remote
        workers' sync closed measured that sync: the next window's length follows it."""
        if not self.is_open or self.mode == "always":
            return None
        open_s = time.monotonic() - self.opened_at
        self.is_open = False
        self.last = LocalWindowReport(open_s=round(open_s, 6), closed_by=why)
        if why == SYNCED:
            prev = self.sync_estimate_s
            self.sync_estimate_s = open_s if prev is None else SYNC_EMA * open_s + (1 - SYNC_EMA) * prev
        return self.opening

    @property
    def is_peer(self) -> bool:
        """Open as a peer: the local worker takes only its share of each batch."""
        return self.is_open and self.opening is not None and self.opening.peer

    @property
    def moves_waited_for(self) -> bool:
        """Open for the groups the learner waits for (`idle`): their samples move here."""
        return self.is_open and self.opening is not None and self.opening.moved_only

    @property
    def takes_any(self) -> bool:
        """Open, and the local worker takes any work (not only what was moved to it)."""
        return self.is_open and self.opening is not None and not self.opening.moved_only

    @property
    def closes_when_synced(self) -> bool:
        return self.is_open and self.opening is not None and self.opening.until_synced
