"""The worker's stream plumbing: a generation's deltas, merged while their reader is busy.

Shared by `/generate` (`server.py`) and the OpenAI- and vLLM-compatible endpoints
(`inference.py`), and below both, so neither imports the other for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any, Generic, TypeVar

from polyrl.engine.types import SampleDelta

T = TypeVar("T")

_END = object()


class Coalesced(Generic[T]):
    """Re-yields `source`, merging every list that arrived while the consumer was busy.

    A slow stream client then gets one chunk per sample covering many engine steps
    instead of falling further behind one event per token. `wait` sleeps between reads
    but ends as soon as an item for which `is_urgent` holds is queued, or the source
    ends or fails. Closing the iterator cancels the pump, whose cancellation runs the
    source's cleanup (the engine abort).
    """

    def __init__(self, source: AsyncIterator[list[T]], is_urgent: Callable[[list[T]], bool] | None = None) -> None:
        self._urgent = asyncio.Event()
        self._urgent_queued = False
        """An urgent item (or the end) is queued and not yet read."""
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pump = asyncio.ensure_future(self._run_pump(source, is_urgent))
        self._items = self._merged()

    async def _run_pump(self, source: AsyncIterator[list[T]], is_urgent: Callable[[list[T]], bool] | None) -> None:
        try:
            async for item in source:
                self._queue.put_nowait(item)
                if is_urgent is not None and is_urgent(item):
                    self._wake()
        except Exception as e:  # handed to the consumer, which re-raises it in its own task
            self._queue.put_nowait(e)
        else:
            self._queue.put_nowait(_END)
        self._wake()

    def _wake(self) -> None:
        self._urgent_queued = True
        self._urgent.set()

    async def _merged(self) -> AsyncIterator[list[T]]:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            self._urgent_queued = False
            merged = [x for item in items if isinstance(item, list) for x in item]
            if merged:
                yield merged
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            if _END in items:
                return

    def __aiter__(self) -> AsyncIterator[list[T]]:
        return self

    async def __anext__(self) -> list[T]:
        return await anext(self._items)

    async def wait(self, timeout_s: float) -> None:
        """Sleep `timeout_s`, or less if something urgent arrives meanwhile. (Not
        `asyncio.wait_for`: on Python 3.11 it can swallow a cancellation that coincides
        with the wake-up.)"""
        if self._urgent_queued or self._pump.done():
            return
        self._urgent.clear()
        woken = asyncio.ensure_future(self._urgent.wait())
        try:
            await asyncio.wait({woken}, timeout=timeout_s)
        finally:
            woken.cancel()

    async def aclose(self) -> None:
        self._pump.cancel()
        with suppress(asyncio.CancelledError):
            await self._pump
        await self._items.aclose()


def coalesce(source: AsyncIterator[list[SampleDelta]]) -> Coalesced[SampleDelta]:
    """A request's deltas, merged while the consumer is busy; a finished sample is urgent."""
    return Coalesced(source, lambda deltas: any(d.finished for d in deltas))
