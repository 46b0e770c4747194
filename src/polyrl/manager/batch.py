"""A batch's bookkeeping: every sample's tokens so far, where it ran, and when it is done.

A sample is built from segments, one per worker that worked on it. A segment's tokens
arrive as deltas (`extend`) and are committed when the segment ends, so a worker dying
mid-stream costs only what it produced after its last chunk reached us; the rest moves
on (prompt + committed tokens) to the next worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyrl.engine.types import SampleDelta
from polyrl.protocol.manager_api import (
    BatchFailed,
    BatchPrompt,
    BatchRequest,
    GroupResult,
    SampleResultOut,
    Segment,
)
from polyrl.protocol.routes import encode_routes, rows_through


@dataclass(eq=False, repr=False)
class SampleState:
    group: GroupState
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    num_failures: int = 0
    num_refusals: int = 0
    """Workers that answered this sample's request with a 4xx (see settlement.py)."""
    counted: bool = False
    """Reported to the batch as finished (exactly once)."""
    placed_at: float | None = None
    finished_at: float | None = None
    to_local: bool = False
    """The trainer's learner waits for this sample's group: it queues ahead of other work
    (`ManagerState.requeue`), and while the local window is open it runs on the trainer's
    engine (`RolloutManager.learner_waiting`)."""
    floor_version: int | None = None
    """The lowest weight version of a worker this sample was placed on: none of its tokens,
    those generated so far and those to come there, is older (an engine's version only
    grows). None: never placed. The trainer's staleness deadline reads it."""
    routes: list[np.ndarray] = field(default_factory=list)
    """Committed expert routes, when asked for: row p the experts of position p of prompt +
    tokens (`polyrl.protocol.routes`), kept from the worker that first computed it."""
    num_route_rows: int = 0
    # the running segment
    _seg_worker: str | None = None
    _seg_tokens: list[int] = field(default_factory=list)
    _seg_logprobs: list[float] = field(default_factory=list)
    _seg_versions: list[int] = field(default_factory=list)
    _seg_routes: list[np.ndarray] = field(default_factory=list)
    _seg_route_rows: int = 0

    # Short reprs throughout: these objects reference each other (a batch holds its tasks,
    # whose callbacks hold units, which hold the batch), and asyncio/anyio format task
    # reprs on every cancel scope; the generated dataclass reprs made each new
    # connection print a whole batch and stalled the manager's loop for seconds.
    def __repr__(self) -> str:
        return f"<SampleState {self.group.prompt.id!r}[{self.index}] {len(self.token_ids)} tokens>"

    @property
    def seed(self) -> int:
        return (self.group.seed + self.index) % 2**63  # the engine's seed range

    @property
    def remaining(self) -> int:
        return self.group.budget - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def start_segment(self, worker_id: str, worker_version: int) -> None:
        if self.placed_at is None:
            self.placed_at = time.monotonic()
        self.floor_version = worker_version if self.floor_version is None else min(self.floor_version, worker_version)
        self._seg_worker = worker_id
        self._seg_tokens, self._seg_logprobs, self._seg_versions = [], [], []
        self._seg_routes, self._seg_route_rows = [], 0

    def extend(
        self,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        finish: str | None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
        routes: np.ndarray | None = None,
        routes_start: int = 0,
    ) -> None:
        """New tokens of the running segment, and its finish reason once it has one.
        `top_logprobs` only go to `progress` (a batch's groups do not carry them).
        `routes`: the experts of positions `routes_start`..; a migrated sample's new worker
        computes the prefix again, and only positions not yet held are kept."""
        if len(self._seg_tokens) + len(tokens) > self.remaining:
            raise ValueError(
                f"worker sent {len(self._seg_tokens) + len(tokens)} tokens for a budget of {self.remaining}"
            )
        if routes is not None:
            held = self.num_route_rows + self._seg_route_rows
            if routes_start > held:
                raise ValueError(f"worker sent expert routes from position {routes_start}, {held} held")
            new = routes[held - routes_start :]
            if len(new):
                self._seg_routes.append(new)
                self._seg_route_rows += len(new)
        self._seg_tokens += tokens
        self._seg_logprobs += logprobs
        self._seg_versions += versions
        progress = self.group.batch.progress
        if progress is not None and tokens:  # what arrived is kept, even if the worker dies next
            progress.put_nowait(
                SampleDelta(
                    self.group.batch.batch_id, self.index, tokens, logprobs, versions, top_logprobs=top_logprobs or []
                )
            )
        if finish is not None and finish != "abort":  # abort: handed back, it continues elsewhere
            self.end_segment()
            self.finish_reason = finish
            self.finished_at = time.monotonic()

    def end_segment(self) -> None:
        """Commit the running segment (also when its worker failed: what arrived is kept)."""
        if self._seg_worker is None:
            return
        if self._seg_tokens:
            self.token_ids += self._seg_tokens
            self.logprobs += self._seg_logprobs
            self.weight_versions += self._seg_versions
            self.segments.append(Segment(worker=self._seg_worker, num_tokens=len(self._seg_tokens)))
        self.routes += self._seg_routes
        self.num_route_rows += self._seg_route_rows
        self._seg_routes, self._seg_route_rows = [], 0
        self._seg_worker = None
        self._seg_tokens, self._seg_logprobs, self._seg_versions = [], [], []
        if not self.done and self.remaining <= 0:  # the budget was spent without a finish
            self.finish_reason = "length"
            self.finished_at = time.monotonic()

    def result(self) -> SampleResultOut:
        assert self.finish_reason in ("stop", "length") and self.finished_at is not None
        submitted = self.group.batch.submitted_at
        return SampleResultOut(
            index=self.index,
            output_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            weight_versions=self.weight_versions,
            segments=self.segments,
            num_failures=self.num_failures,
            queue_time_s=round((self.placed_at or submitted) - submitted, 6),
            latency_s=round(self.finished_at - submitted, 6),
            routed_experts=self._routes_out(),
        )

    def _routes_out(self) -> str | None:
        """Every position's routes, or None when some are missing (a worker that reports
        none, e.g. a plain SGLang server without the flag)."""
        expected = rows_through(len(self.group.prompt.input_ids), len(self.token_ids))
        if not self.routes or self.num_route_rows < expected:
            return None
        return encode_routes(np.concatenate(self.routes)[:expected])


@dataclass(eq=False, repr=False)
class GroupState:
    batch: Batch
    prompt: BatchPrompt
    seed: int
    samples: list[SampleState] = field(default_factory=list)
    num_done: int = 0

    def __repr__(self) -> str:
        return f"<GroupState {self.prompt.id!r} of {self.batch.batch_id}>"

    @property
    def floor_version(self) -> int | None:
        """The oldest version any of the group's tokens may have (None: nothing placed yet)."""
        floors = [s.floor_version for s in self.samples if s.floor_version is not None]
        return min(floors, default=None)

    @property
    def budget(self) -> int:
        """Tokens each sample of this prompt may generate."""
        own = self.prompt.max_new_tokens
        return self.batch.request.sampling.max_new_tokens if own is None else own

    def result(self) -> GroupResult:
        return GroupResult(
            prompt_id=self.prompt.id,
            prompt_tokens=len(self.prompt.input_ids),
            samples=[s.result() for s in self.samples],
        )


@dataclass(eq=False, repr=False)
class WorkUnit:
    """Samples that go to one worker in one request: either fresh samples of one group
    with consecutive indices (one request with `n`, sharing the prompt's prefill), or one
    sample that resumes from its tokens so far."""

    group: GroupState
    samples: list[SampleState]

    def __repr__(self) -> str:
        return f"<WorkUnit {self.group.prompt.id!r} x{len(self.samples)} of {self.group.batch.batch_id}>"

    @property
    def is_fresh(self) -> bool:
        return not self.samples[0].token_ids

    def split(self, k: int) -> tuple[WorkUnit, WorkUnit | None]:
        """The first `k` samples, and the rest (None if nothing is left)."""
        if k >= len(self.samples):
            return self, None
        return WorkUnit(self.group, self.samples[:k]), WorkUnit(self.group, self.samples[k:])


@dataclass(eq=False, repr=False)
class Batch:
    batch_id: str
    request: BatchRequest
    required_version: int
    deadline: float
    """Monotonic time at which the batch fails."""
    groups: list[GroupState] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    results: asyncio.Queue[GroupResult | BatchFailed] = field(default_factory=asyncio.Queue)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    num_groups_done: int = 0
    num_migrated: int = 0
    failed: BatchFailed | None = None
    progress: asyncio.Queue[SampleDelta | BatchFailed] | None = None
    """When set (the OpenAI/vLLM endpoints' one-prompt batches): every sample's tokens as
    they arrive, its finish, and the batch's failure, for a client that streams."""

    def __repr__(self) -> str:
        return f"<Batch {self.batch_id}: {self.num_groups_done}/{len(self.groups)} groups>"

    @classmethod
    def build(
        cls, batch_id: str, request: BatchRequest, required_version: int, deadline: float, seeds: list[int]
    ) -> Batch:
        batch = cls(batch_id, request, required_version, deadline)
        for prompt, seed in zip(request.prompts, seeds, strict=True):
            group = GroupState(batch, prompt, seed)
            group.samples = [SampleState(group, i) for i in range(request.sampling.n)]
            batch.groups.append(group)
        return batch

    @property
    def finished(self) -> bool:
        return self.failed is not None or self.num_groups_done == len(self.groups)

    def fresh_units(self) -> list[WorkUnit]:
        return [WorkUnit(g, list(g.samples)) for g in self.groups]

    def sample_done(self, sample: SampleState) -> None:
        """Count a finished sample; emit its group when it was the last one."""
        group = sample.group
        group.num_done += 1
        if self.progress is not None:
            stop = sample.token_ids[-1] if sample.finish_reason == "stop" and sample.token_ids else None
            finish: Any = sample.finish_reason  # "stop" or "length": it is done
            self.progress.put_nowait(SampleDelta(self.batch_id, sample.index, finish_reason=finish, matched_stop=stop))
        if group.num_done == len(group.samples):
            result = group.result()  # before counting: it validates every sample
            self.num_groups_done += 1
            self.results.put_nowait(result)

    def fail(self, failure: BatchFailed) -> None:
        if self.failed is None:
            self.failed = failure
            self.results.put_nowait(failure)
            if self.progress is not None:
                self.progress.put_nowait(failure)

    def unfinished_samples(self) -> int:
        return sum(len(g.samples) - g.num_done for g in self.groups)
