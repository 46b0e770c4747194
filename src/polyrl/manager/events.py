"""The workers' lifecycle transitions (joined, syncing, active, draining, gone), kept so the
operator page (`fleet.py`) can draw a timeline without having watched from the start.

The registry writes one event wherever it changes a worker's state; this module sits below
both, so the registry does not depend on the operator's view it feeds. Capped: a manager
runs for days and syncs every worker every step.
"""

from __future__ import annotations

import time
from collections import deque

from pydantic import BaseModel, ConfigDict

from polyrl.protocol.manager_api import WorkerState

MAX_EVENTS = 2000
"""About 60 steps of a 16-worker fleet that syncs every step (two events per sync)."""


class WorkerEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    t: float
    """Unix time."""
    worker_id: str
    state: WorkerState
    detail: str = ""
    """Why, for `gone` (left, no heartbeat, ...), or the weight version reached."""


class EventLog:
    """The latest MAX_EVENTS lifecycle transitions, oldest first."""

    def __init__(self, maxlen: int = MAX_EVENTS) -> None:
        self.events: deque[WorkerEvent] = deque(maxlen=maxlen)

    def add(self, worker_id: str, state: WorkerState, detail: str = "") -> None:
        self.events.append(WorkerEvent(t=time.time(), worker_id=worker_id, state=state, detail=detail))
