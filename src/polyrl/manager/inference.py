"""The manager's backend for the OpenAI- and vLLM-compatible endpoints: the elastic fleet.

A request becomes a one-prompt batch of `n` samples, submitted like the trainer's own
(`RolloutManager.submit`), so placement, the split of `n` over workers and token-level
migration when a worker dies are the batches' own; the batch's `progress` queue streams
each sample's tokens as the manager receives them. Closing the stream early (stop
strings matched, client gone) closes the batch, and the workers abort its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from polyrl.engine.types import SampleDelta
from polyrl.httpapi import ApiError
from polyrl.inference.protocol import MAX_N
from polyrl.inference.routes import Served, model_names
from polyrl.manager.manager import RolloutManager
from polyrl.protocol.manager_api import BatchFailed, BatchPrompt, BatchRequest
from polyrl.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger("polyrl.manager")

POLL_S = 0.1


class ManagerBackend:
    def __init__(self, manager: RolloutManager) -> None:
        self.manager = manager
        self._tokenizers: dict[str, Any] = {}

    def _serving_model(self) -> tuple[str, int] | None:
        """(model path, smallest context) of the workers that can take work now."""
        records = [r for r in self.manager.registry if r.state == "active"]
        if not records:
            return None
        return records[0].model_path, min(r.max_model_len for r in records)

    async def served(self) -> Served:
        """What serves now; with no active worker, wait for one (up to `inference_wait_s`)
        unless the manager shuts down: a request left waiting there held the shutdown for
        uvicorn's graceful timeout, then died with a CancelledError traceback."""
        deadline = time.monotonic() + self.manager.cfg.inference_wait_s
        while (model := self._serving_model()) is None:
            if self.manager.closed:
                raise _shutting_down()
            if time.monotonic() >= deadline:
                counts = self.manager.registry.counts()
                raise ApiError(
                    503,
                    f"no rollout worker is active after {self.manager.cfg.inference_wait_s:g}s "
                    f"({counts['registering']} registering, {counts['syncing']} syncing); retry later",
                    "service_unavailable",
                    None,
                    "no_workers",
                )
            await asyncio.sleep(POLL_S)
        model_path, max_model_len = model
        tokenizer = await self._tokenizer(self.manager.cfg.tokenizer or model_path)
        return Served(model_names(model_path), tokenizer, max_model_len, MAX_N, MAX_TOP_LOGPROBS)

    async def _tokenizer(self, path: str) -> Any | None:
        """Loaded once per path; None when the path is not a local directory (token ids
        still work through /generate)."""
        if path not in self._tokenizers:
            tokenizer = None
            if Path(path).is_dir():
                from transformers import AutoTokenizer

                try:
                    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
                except (OSError, ValueError) as e:
                    log.warning("no tokenizer in %s (%s): text endpoints are refused", path, e)
            else:
                log.warning("tokenizer %s is not a directory here: set manager.tokenizer for text endpoints", path)
            self._tokenizers[path] = tokenizer
        return self._tokenizers[path]

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[list[SampleDelta]]:
        request = BatchRequest(prompts=[BatchPrompt(id="request", input_ids=prompt_ids)], sampling=sampling)
        if self.manager.closed:
            raise _shutting_down()
        batch = self.manager.submit(request, watch=True)
        assert batch.progress is not None
        remaining = set(range(sampling.n))
        try:
            while remaining:
                items = [await batch.progress.get()]
                while not batch.progress.empty():
                    items.append(batch.progress.get_nowait())
                deltas = [item for item in items if isinstance(item, SampleDelta)]
                if deltas:
                    remaining.difference_update(d.index for d in deltas if d.finished)
                    yield deltas
                failure = next((item for item in items if isinstance(item, BatchFailed)), None)
                if failure is not None:
                    raise _as_api_error(failure)
        finally:
            self.manager.close_batch(batch)


def _shutting_down() -> ApiError:
    return ApiError(503, "the rollout manager is shutting down", "service_unavailable", None, "shutting_down")


def _as_api_error(failure: BatchFailed) -> ApiError:
    if failure.kind == "invalid_request":
        return ApiError(400, failure.message, "invalid_request_error", None, "refused_by_worker")
    return ApiError(503, failure.message, "service_unavailable", None, failure.kind)
