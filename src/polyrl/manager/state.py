"""The state every part of the rollout manager shares. One asyncio loop owns it, so
nothing locks; each part (membership.py, placement.py, settlement.py) is a mixin of
`RolloutManager` that reads and changes it."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from polyrl.config import ManagerConfig
from polyrl.manager.registry import WorkerRecord

if TYPE_CHECKING:
    from polyrl.manager.backends import RemoteBackend
    from polyrl.manager.batch import Batch, WorkUnit
    from polyrl.manager.metrics import ManagerMetrics
    from polyrl.manager.registry import Registry
    from polyrl.manager.window import LocalWindow
    from polyrl.protocol.manager_api import LostWorker

SyncHook = Callable[[WorkerRecord, int], Awaitable[int | None] | int | None]
"""Called with (worker, version) when a worker needs weights `version` (the transfer
layer); returns the version the worker serves once it has it (None: not delivered). The
manager marks the worker synced itself."""


class Cancel:
    """Why a generation task was cancelled; no reason means its batch ended. Here, beside
    the `_cancels` that hold it: membership.py cancels tasks and settlement.py reads why,
    and this module must not import the mixins built on it."""

    def __init__(self, why: str, is_failure: bool) -> None:
        self.why, self.is_failure = why, is_failure


class ManagerState:
    cfg: ManagerConfig
    registry: Registry
    metrics: ManagerMetrics
    remote: RemoteBackend
    pending: deque[WorkUnit]
    """Work waiting for a worker, oldest first."""
    batches: dict[str, Batch]
    sync_hooks: list[SyncHook]
    window: LocalWindow
    sync_s: dict[str, float]
    """Worker id -> seconds from `publish_version` of the latest version to the worker
    serving it (the weight update as the trainer sees it)."""
    _cancels: dict[asyncio.Task[None], Cancel]
    units: dict[asyncio.Task[None], WorkUnit]
    """The work of each running generation call."""
    _failed_before: dict[str, tuple[int, float]]
    """Worker id or URL -> (failures in a row, back-off end) of a worker that failed
    lately, for when it registers again."""
    lost_workers: deque[LostWorker]
    """The latest workers gone without leaving, for the trainer's log (`WorkerList`)."""
    num_lost_workers: int
    local_wanted: bool
    """Placement has needed the local worker (no local window: it syncs only from then on)."""
    _ids: itertools.count[int]
    _wake: asyncio.Event | None
    _window_timer: asyncio.TimerHandle | None
    _published_at: float
