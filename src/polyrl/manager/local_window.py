"""The local window on the manager's loop: its timer, and what moves when it opens or
closes. When it opens and closes is window.py's policy (pure, no I/O); this part acts on
it: it closes the window when its time is up, when the remote fleet has synced, or when
the learner starts, and takes the local worker's work off it (or moves the groups the
learner waits for onto it) by cancelling their calls with a reason that settlement reads;
what of those groups is still queued goes to the front of the queue."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from polyrl.manager.batch import WorkUnit
from polyrl.manager.state import Cancel, ManagerState
from polyrl.manager.window import SYNCED, Opening

log = logging.getLogger("polyrl.manager")


class WindowControl:
    def __init__(self, state: ManagerState) -> None:
        self.state = state
        self.window = state.window
        self._timer: asyncio.TimerHandle | None = None

    def on_publish(self) -> None:
        """A version was published: open the window if the policy says so."""
        opening = self.window.on_publish()
        if opening is not None:
            self.open(opening)

    def open_now(self, max_s: float | None, until_synced: bool = True) -> None:
        """Open the window whatever the policy says (`RolloutManager.open_local_window`)."""
        self.open(self.window.open_now(Opening(max_s, until_synced, hand_back=until_synced, peer=not until_synced)))

    def open(self, opening: Opening) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if opening.max_s is not None:
            self._timer = asyncio.get_running_loop().call_later(opening.max_s, self.close, "window elapsed")
        if opening.until_synced and self.state.registry.fleet_synced():
            self.close(SYNCED)
        self.state.wake()

    def close_if_synced(self) -> None:
        """A worker's version changed: a window open until the fleet syncs may close."""
        if self.window.closes_when_synced and self.state.registry.fleet_synced():
            self.close(SYNCED)

    def close(self, why: str, hand_back: bool | None = None) -> None:
        """No new work for the local worker beyond the fallbacks; with `hand_back` (default:
        as the window was opened) its unfinished samples move to the remote workers
        (re-prefilled there), else it finishes them."""
        opening = self.window.close(why)
        if opening is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        local = self.state.registry.local()
        if hand_back is None:
            hand_back = opening.hand_back
        if hand_back and local is not None and local.tasks and self.state.registry.alive_remote():
            log.debug("local window closed (%s): handing %d samples to remote workers", why, local.inflight)
            for task in list(local.tasks):
                self.state.cancels[task] = Cancel(f"local window closed ({why})", is_failure=False)
                task.cancel()
        self.state.wake()

    def learner_waiting(self, prompt_ids: list[str] | None) -> None:
        """The learner waits for groups: the `idle` window opens, and the unfinished
        samples of `prompt_ids` move to the trainer's engine (see
        `RolloutManager.learner_waiting`)."""
        opening = self.window.on_learner_waiting()
        if opening is not None:
            self.open(opening)
        local = self.state.registry.local()
        if not prompt_ids or not self.window.moves_waited_for or local is None or local.state != "active":
            return
        wanted = set(prompt_ids)
        queued: list[WorkUnit] = []  # not placed yet: to the front of the queue, for the trainer's engine
        others: deque[WorkUnit] = deque()
        for unit in self.state.pending:
            (queued if unit.group.prompt.id in wanted else others).append(unit)
        if queued:
            for unit in queued:
                for sample in unit.samples:
                    sample.to_local = True
            self.state.pending = others
            self.state.requeue(queued)
        moved = sum(len(u.samples) for u in queued)
        cancels = self.state.cancels
        for task, unit in list(self.state.units.items()):
            if unit.group.prompt.id not in wanted or task in local.tasks or task in cancels:
                continue
            for sample in unit.samples:
                sample.to_local = True
            cancels[task] = Cancel("the learner waits for it: moved to the trainer's engine", is_failure=False)
            task.cancel()
            moved += len(unit.samples)
        if moved:
            log.debug("learner waits: %d samples move to the trainer's engine", moved)
            self.state.wake()
