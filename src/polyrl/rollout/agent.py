"""A rollout whose groups are agent episodes (`data.source = "agent"`).

The user's episode function (`data.agent`) plays each episode against an
`AgentClient` (`polyrl.agent.client`); every call it makes is one sample of a batch on
the manager (calls made together share a batch), so placement, token-level migration off a dead worker and the weight versions
of each token are the fleet's, as for any sample. A call names its episode
(`BatchPrompt.session`): the manager sends it to the worker that served the episode's
last call, which holds its prefix in the engine's prefix cache, when that worker has a
free slot. Weights still flow as in remote mode, so this wraps the fleet's rollout and
takes over only `generate`.

The episodes run on one event loop in an I/O thread of the trainer's process; an episode
function is meant to wait on the model and on tools, and a slow reward belongs in a
process or a thread of its own. `rollout.n` episodes of one item make a group; a group
with an episode that raised is dropped (logged, counted in `rollout/agent_failed_groups`):
its advantages would compare a broken episode with working ones.

Fully asynchronous (`rollout.fully_async`), the feed (`rollout/feed.py`) keeps items in
flight as it keeps prompts; every call of an episode asks for at least the version its
episode started at, so an item is due for the staleness bound once that version is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from polyrl.agent.client import AgentClient, EpisodeLimit
from polyrl.agent.render import Renderer
from polyrl.data.rewards import load_callable
from polyrl.manager.client import AsyncBatchClient
from polyrl.protocol.manager_api import (
    BatchError,
    BatchFailed,
    BatchPrompt,
    BatchRequest,
    FleetDecision,
    GroupResult,
)
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.remote import RECOVERABLE, to_sample
from polyrl.rollout.stats import RolloutStats

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from polyrl.config import DataConfig
    from polyrl.protocol.manager_api import WorkerInfo, WorkerList
    from polyrl.protocol.version import WeightVersion
    from polyrl.rollout.remote import RemoteRollout

log = logging.getLogger("polyrl.agent")

CALL_ATTEMPTS = 5
"""Tries of one call while the manager is away (it is restarted meanwhile)."""
MAX_CALLS = 256
"""Calls in flight at once; the rest wait here. Before calls were batched, a batch of
1024 episodes on 2 CPU cores opened a thousand streams at once and starved the manager's
loop past the client's 10 s connect timeout; the manager still opens one stream to a
worker per call, and a worker runs at most `engine.max_num_seqs` of them anyway."""


class CallBatcher:
    """The episodes' calls, gathered into batches: the calls made within `window_s` of each
    other (episodes waiting on the same engine step ask at about the same time) go to the
    manager as one batch of many prompts, each with its own seed, budget and session, and
    each call's group comes back as soon as it is done. One HTTP stream per batch instead
    of per call: on 2 CPU cores, the trainer's thread spent half its time in httpx with one
    stream per call."""

    def __init__(self, batches: AsyncBatchClient, window_s: float = 0.002) -> None:
        self.batches, self.window_s = batches, window_s
        self._waiting: dict[tuple[int, int], tuple[SamplingParams, list[tuple[BatchPrompt, asyncio.Future]]]] = {}
        """By (the sampling object's identity, the version asked for): the episodes of one
        submitted batch share both, so their calls can share a batch on the manager."""
        self._ids = itertools.count()
        self._flush_at: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task] = set()
        self.num_batches = 0
        self.num_calls = 0

    async def call(self, prompt: BatchPrompt, sampling: SamplingParams, version: int) -> GroupResult:
        """`prompt`'s one sample (`prompt.max_new_tokens` set) under `sampling`; raises
        BatchError when its batch fails."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GroupResult] = loop.create_future()
        prompt = prompt.model_copy(update={"id": f"{prompt.id}#{next(self._ids)}"})
        self._waiting.setdefault((id(sampling), version), (sampling, []))[1].append((prompt, done))
        if self._flush_at is None:
            self._flush_at = loop.call_later(self.window_s, self._flush)
        return await done

    def _flush(self) -> None:
        self._flush_at = None
        waiting, self._waiting = self._waiting, {}
        for (_, version), (sampling, calls) in waiting.items():
            budget = max(p.max_new_tokens or 1 for p, _ in calls)
            request = BatchRequest(
                prompts=[p for p, _ in calls],
                sampling=sampling.model_copy(update={"n": 1, "max_new_tokens": budget}),
                min_weight_version=version,
            )
            task = asyncio.ensure_future(self._run(request, {p.id: f for p, f in calls}))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, request: BatchRequest, futures: dict[str, asyncio.Future]) -> None:
        self.num_batches += 1
        self.num_calls += len(futures)
        try:
            async for group in self.batches.generate(request):
                future = futures.pop(group.prompt_id, None)
                if future is not None and not future.done():
                    future.set_result(group)
            failure: BaseException = BatchError(
                BatchFailed(batch_id="", kind="disconnected", message="the batch ended without every call's group")
            )
        except BatchError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 (an I/O error of the client: each waiting call gets it)
            failure = e
        for future in futures.values():
            if not future.done():
                future.set_exception(failure)


class EpisodeRunner:
    """Plays episodes on the running event loop: each item's `sampling.n` of them, each
    call one prompt of a batch (`CallBatcher`) on the manager behind `batches`."""

    def __init__(
        self,
        play: Callable[..., Any],
        batches: AsyncBatchClient,
        tokenizer: PreTrainedTokenizerBase,
        renderer: Renderer,
        cfg: DataConfig,
        temperature: float,
        max_tokens: int,
        manager_lost: Callable[[], Any] | None = None,
    ) -> None:
        """`manager_lost`: called (in a thread) when a call is cut because the manager went
        away; it returns once the manager is back, and the call is made again."""
        if not asyncio.iscoroutinefunction(play):
            raise ValueError(f"data.agent {cfg.agent!r}: the episode function must be async (async def)")
        self.play, self.batches, self.tokenizer, self.renderer = play, batches, tokenizer, renderer
        self.calls = CallBatcher(batches)
        self.cfg, self.temperature, self.max_tokens, self.manager_lost = cfg, temperature, max_tokens, manager_lost
        self.num_failed_groups = 0
        self.num_limited = 0
        """Episodes that hit a bound and did not catch `EpisodeLimit` (reward 0)."""
        self._slots = asyncio.Semaphore(MAX_CALLS)

    async def group(self, prompt: Prompt, sampling: SamplingParams, seeds: list[int], version: int) -> Group | None:
        """The item's episodes, one per seed; None (logged) when one of them raised."""
        outcomes = await asyncio.gather(
            *(self.episode(prompt, i, sampling, seed, version) for i, seed in enumerate(seeds)),
            return_exceptions=True,
        )
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            self.num_failed_groups += 1
            log.warning(
                "dropped the episodes of item %d: %d of %d raised, first: %s: %s",
                prompt.index,
                len(failed),
                len(outcomes),
                type(failed[0]).__name__,
                failed[0],
            )
            return None
        samples = [
            replace(client.transcript.to_sample(), call_rewards=per_call)
            for client, _, per_call in outcomes  # type: ignore[misc]
        ]
        rewards = [reward for _, reward, _ in outcomes]  # type: ignore[misc]
        return Group(prompt=replace(prompt, prompt_ids=samples[0].prompt_ids or []), samples=samples, rewards=rewards)

    async def episode(
        self, prompt: Prompt, i: int, sampling: SamplingParams, seed: int, version: int
    ) -> tuple[AgentClient, float, list[float] | None]:
        """Episode `i` of `prompt`'s item: (its client, which holds the transcript; reward;
        the reward per call, when the function returned a list: one number per call it
        made, summing to the reward). `seed` fixes every call's sampling seed, so a
        replayed episode draws the same."""
        episode = f"{prompt.index}.{i}.{seed % 10**6}"
        rng = random.Random(seed)

        async def generate(ids: list[int], max_new_tokens: int) -> Sample:
            return await self.call(episode, ids, max_new_tokens, rng.getrandbits(62), sampling, version)

        client = AgentClient(
            generate,
            self.tokenizer,
            self.renderer,
            episode_id=episode,
            temperature=self.temperature,
            max_new_tokens=sampling.max_new_tokens,
            max_turns=self.cfg.agent_max_turns,
            max_tokens=self.max_tokens,
            tool_parser=self.cfg.agent_tool_parser,
        )
        try:
            reward = await self.play(client, dict(prompt.columns))
        except EpisodeLimit as e:
            self.num_limited += 1
            log.debug("%s: scored 0", e)
            reward = 0.0
        if client.transcript.num_calls == 0:
            raise ValueError("the episode made no call to the model")
        per_call = None
        if isinstance(reward, list | tuple):
            per_call = [_number(r) for r in reward]
            if len(per_call) != client.transcript.num_calls:
                raise ValueError(
                    f"data.agent returned {len(per_call)} rewards for an episode of {client.transcript.num_calls} calls "
                    "(a list holds one reward per call)"
                )
            return client, sum(per_call), per_call
        return client, _number(reward), None

    async def call(
        self, episode: str, ids: list[int], max_new_tokens: int, seed: int, sampling: SamplingParams, version: int
    ) -> Sample:
        """One engine call of `episode` (one sample: `n` = 1), placed by the manager (on the
        episode's last worker when it can) and moved to another worker if its own dies
        mid-reply."""
        prompt = BatchPrompt(id=episode, input_ids=ids, seed=seed, max_new_tokens=max_new_tokens, session=episode)
        for attempt in range(CALL_ATTEMPTS):
            try:
                async with self._slots:
                    result = await self.calls.call(prompt, sampling, version)
                break
            except BatchError as e:
                if e.kind not in RECOVERABLE or self.manager_lost is None or attempt == CALL_ATTEMPTS - 1:
                    raise
                log.warning("episode %s: call cut (%s); asking again once the manager is back", episode, e)
                await asyncio.to_thread(self.manager_lost)
        return to_sample(result.samples[0], result.prompt_tokens)


def _number(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(
            f"data.agent returned {type(reward).__name__}, not a number (the episode's reward) or a list of "
            "numbers (one per call)"
        )
    return float(reward)


class AgentRollout:
    """`generate` through the episode function; publishing, workers and the learner's
    start go to the fleet's rollout (`inner`)."""

    shares_weights = False

    def __init__(
        self,
        inner: RemoteRollout,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: tuple[int, ...],
        temperature: float,
        context: int,
    ) -> None:
        """`context`: the most tokens an episode may hold (the workers' context, or
        `data.agent_max_tokens` when lower)."""
        self.inner = inner
        play = load_callable(cfg.agent or "", "data.agent")
        renderer = Renderer(tokenizer, stop_token_ids)
        self.stats = RolloutStats()
        self._lock = threading.Lock()
        self._started: dict[str, WeightVersion] = {}
        """Items in flight (by prompt id): the version their episodes started at."""
        self._futures: set[Future] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="polyrl-agents", daemon=True)
        self._thread.start()
        link = inner.link
        batches = self._on_loop(_batch_client(link.url, link.token, link.ca_file)).result()
        self.runner = EpisodeRunner(
            play,
            batches,
            tokenizer,
            renderer,
            cfg,
            temperature,
            min(context, cfg.agent_max_tokens or context),
            manager_lost=inner.fleet,  # a control call: it brings the manager back
        )

    def _on_loop(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def weight_version(self) -> WeightVersion:
        return self.inner.weight_version

    @property
    def num_instances(self) -> int:
        return self.inner.num_instances

    def publish(self, weights: Mapping[str, torch.Tensor] | None, version: WeightVersion) -> None:
        self.inner.publish(weights, version)

    def learner_started(self) -> None:
        self.inner.learner_started()

    def fleet_decision(self, decision: FleetDecision) -> None:
        self.inner.fleet_decision(decision)

    def workers(self) -> list[WorkerInfo]:
        return self.inner.workers()

    def fleet(self) -> WorkerList:
        return self.inner.fleet()

    def note_fleet(self, stats: RolloutStats) -> WorkerList:
        return self.inner.note_fleet(stats)

    def learner_waiting(self, due: set[str]) -> None:
        """The idle window opens (hybrid mode). `due` names items, and the manager knows only
        their calls, so nothing is moved: a due episode's next call finds the trainer's
        engine free anyway."""
        self.inner.learner_waiting(set())

    def due_groups(self, max_floor_version: int) -> set[str]:
        """Items in flight whose episodes may hold a token of that version or older: those
        started at it or before (every call of an episode asks for at least the version its
        episode started at, so none of its tokens is older)."""
        with self._lock:
            return {pid for pid, v in self._started.items() if v <= max_floor_version}

    def generate(
        self, prompts: list[Prompt], sampling: SamplingParams, stats: RolloutStats | None = None
    ) -> Iterator[Group]:
        """Starts every item's `sampling.n` episodes now; each group as its last episode
        ends. An item whose episode raised gives no group (logged, and counted in `stats`).
        `stats`: where the groups are booked (default: a new `self.stats`, the step's)."""
        done: queue.SimpleQueue[Group | None] = queue.SimpleQueue()
        version = self.inner.weight_version
        futures = []
        for p in prompts:
            seeds = [random.getrandbits(62) for _ in range(sampling.n)]  # the run's seeded RNG, in its thread
            with self._lock:
                self._started[str(p.index)] = version
            future = self._on_loop(self.runner.group(p, sampling, seeds, version))
            with self._lock:
                self._futures.add(future)
            future.add_done_callback(lambda f, pid=str(p.index): self._ended(f, pid, done))
            futures.append(future)
        is_step = stats is None
        if stats is None:
            stats = self.stats = RolloutStats(num_requested=len(prompts) * sampling.n)
        stats.num_failed_groups = stats.num_failed_groups or 0
        return self._groups(done, futures, stats, sampling.n, is_step)

    def _ended(self, future: Future, pid: str, done: queue.SimpleQueue) -> None:
        with self._lock:
            self._started.pop(pid, None)
            self._futures.discard(future)
        done.put(None if future.cancelled() or future.exception() else future.result())

    def _groups(
        self, done: queue.SimpleQueue, futures: list[Future], stats: RolloutStats, n: int, is_step: bool
    ) -> Iterator[Group]:
        t0 = time.perf_counter()
        try:
            for _ in futures:
                group = done.get()
                if group is None:  # an episode raised (logged): not the fleet's loss
                    stats.num_requested -= n
                    stats.num_failed_groups = (stats.num_failed_groups or 0) + 1
                    continue
                stats.count(group)
                stats.gen_s = time.perf_counter() - t0
                stats.first_group_s = stats.first_group_s or stats.gen_s
                yield group
        finally:
            for f in futures:
                f.cancel()
        if is_step:
            self.inner.note_fleet(stats)

    def close(self) -> None:
        """The loop and its client; the fleet's rollout is closed by whoever started it.
        Episodes still running are cancelled, so that their readers end."""
        with self._lock:
            running = list(self._futures)
        for f in running:
            f.cancel()
        if self._loop.is_running():
            try:
                self._on_loop(self.runner.batches.close()).result(timeout=5)
            except Exception:  # noqa: BLE001 (closing: nothing to do about it)
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


async def _batch_client(url: str, token: str, ca_file: str | None) -> AsyncBatchClient:
    """Made on the loop that uses it."""
    return AsyncBatchClient(url, token, connect_retries=2, ca_file=ca_file)
