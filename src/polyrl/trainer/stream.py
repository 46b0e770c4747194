"""Learning from a stream of finished groups.

Groups are scored as they arrive (rewards run in a process pool, off the learner's
thread), turned into advantages one group at a time, and trained on as soon as a
mini-batch's worth of prompts is scored. Nothing waits for the whole batch, so the
same code serves a local engine and workers that finish out of order. With
`rollout.deterministic`, `in_prompt_order` puts the groups back in submission order
first, so mini-batches do not depend on which worker was fast.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedTokenizerBase

from polyrl.config import AlgoConfig, OverlongBufferConfig
from polyrl.data.rewards import RewardPool
from polyrl.protocol.samples import Group, Sample
from polyrl.protocol.version import WeightVersion
from polyrl.trainer.batching import SeqItem, group_items
from polyrl.trainer.grpo import group_advantages
from polyrl.trainer.learner import Learner
from polyrl.trainer.overlong import shaped_rewards
from polyrl.trainer.step_groups import step_advantages, turn_advantages


class GroupScorer:
    """Decodes a group's completions and sends them to the reward pool; with
    `overlong.enable`, adds DAPO's overlong penalty to what comes back (trainer/overlong.py).
    Without a pool (a source whose groups arrive scored), an unscored group is an error."""

    def __init__(
        self,
        pool: RewardPool | None,
        tokenizer: PreTrainedTokenizerBase,
        overlong: OverlongBufferConfig | None = None,
        max_new_tokens: int = 0,
    ) -> None:
        """`max_new_tokens`: `rollout.max_new_tokens`, the budget the penalty ramps up to."""
        self.pool, self.tokenizer = pool, tokenizer
        self.overlong, self.max_new_tokens = overlong or OverlongBufferConfig(), max_new_tokens

    def decode(self, sample: Sample) -> str:
        """The completion as the reward sees it: the final stop token is dropped, but any
        other special token stays visible, so a policy cannot hide junk in tokens that a
        `skip_special_tokens` decode would erase (a tiny model learns that hack quickly)."""
        ids = sample.completion_ids[:-1] if sample.finish_reason == "stop" else sample.completion_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def submit(self, group: Group):
        """Rewards for the group's samples; a group that came scored (an Atropos
        environment's) keeps its own."""
        if group.rewards is not None:
            done: Future = Future()
            done.set_result(group.rewards)
            return done
        if self.pool is None:
            raise RuntimeError(
                f"the group of prompt {group.prompt.index} came without rewards, and this run scores none"
            )
        n = len(group.samples)
        completions = [self.decode(s) for s in group.samples]
        columns = {k: [v] * n for k, v in group.prompt.columns.items()}
        # TRL passes extra per-sample fields as keyword arguments; reward functions take **kwargs.
        columns["finish_reason"] = [s.finish_reason for s in group.samples]
        future = self.pool.submit([group.prompt.text] * n, completions, columns)
        return ShapedRewards(future, group, self) if self.overlong.enable else future

    def shape(self, group: Group, rewards: list[float]) -> list[float]:
        return shaped_rewards(group, rewards, self.overlong, self.max_new_tokens)


class ShapedRewards:
    """A reward future whose result has the overlong penalty added."""

    def __init__(self, future, group: Group, scorer: GroupScorer) -> None:
        self.future, self.group, self.scorer = future, group, scorer

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[float]:
        return self.scorer.shape(self.group, self.future.result())

    @property
    def num_failed(self) -> int:
        return getattr(self.future, "num_failed", 0)


def in_prompt_order(groups: Iterable[Group], prompt_indices: list[int]) -> Iterator[Group]:
    """The groups of `prompt_indices`, in that order: each one once it and every group
    before it have arrived (those that finish early wait here). The source is read to
    its end, so a rollout that records its step's stats after the last group does so."""
    source = iter(groups)
    arrived: dict[int, Group] = {}
    try:
        for index in prompt_indices:
            while index not in arrived:
                group = next(source, None)
                if group is None:
                    raise RuntimeError(f"the rollout ended without the group of prompt {index}")
                arrived[group.prompt.index] = group
            yield arrived.pop(index)
    except GeneratorExit:
        getattr(source, "close", lambda: None)()  # closed early: so is the rollout's batch
        raise
    extra = [g.prompt.index for g in source] + list(arrived)
    if extra:
        raise RuntimeError(f"the rollout returned groups of prompts it was not asked for: {extra}")


@dataclass
class StreamResult:
    groups: list[Group] = field(default_factory=list)
    train_metrics: list[dict[str, float]] = field(default_factory=list)
    reward_wait_s: float = 0.0
    update_s: float = 0.0
    num_filtered_groups: int = 0
    num_overlong_filtered: int = 0
    """Samples cut at their length budget, left out of the loss (`algo.overlong_filter`)."""
    num_failed_samples: int = 0
    """Samples scored 0.0 because a reward function raised, returned a bad value or timed out."""
    version: WeightVersion | None = None
    """The learner's weight version when the step began."""
    wait_s: float = 0.0
    """Seconds the learner waited for the next group (idle: nothing to score or train)."""


def learn_from_stream(
    groups: Iterable[Group],
    scorer: GroupScorer,
    learner: Learner,
    algo: AlgoConfig,
    mini_batch_size: int,
    version: WeightVersion | None = None,
    before_update: Callable[[], None] | None = None,
) -> StreamResult:
    """Score and train on groups in arrival order; one optimizer step per mini-batch.
    version: the learner's weight version now; tokens of another version lag behind it.
    before_update: called right before each mini-batch's update (the rollout's local
    window closes then)."""
    out = StreamResult(version=version)
    pending: deque = deque()  # (group, reward future), in arrival order
    scored: list[Group] = []

    def collect(need: int = 0) -> None:
        """Move groups whose rewards are in to `scored`, in arrival order, waiting for
        rewards until `need` groups are scored."""
        while pending and (len(scored) < need or pending[0][1].done()):
            group, future = pending.popleft()
            t0 = time.perf_counter()
            group.rewards = future.result()
            out.reward_wait_s += time.perf_counter() - t0
            out.num_failed_samples += getattr(future, "num_failed", 0)  # a pre-scored group's Future has none
            scored.append(group)

    def train(batch: list[Group]) -> None:
        t0 = time.perf_counter()
        items = _items(batch, algo, out)
        if items:
            # Until the step's first update, the learner holds the weights that sampled the
            # step's current-version tokens: there, recomputed log-probs must equal the engine's.
            first = not out.train_metrics
            if before_update is not None:
                before_update()
            out.train_metrics.append(learner.train_mini_batch(items, weights_as_sampled=first))
        out.update_s += time.perf_counter() - t0

    for group in _timed(groups, out):
        out.groups.append(group)
        pending.append((group, scorer.submit(group)))
        # Once a mini-batch's groups are all in, wait for their rewards, not for the next
        # group: that may be a whole round of decoding away (it cost the one-worker run
        # on the 2-core box 0.47 s a step, a third of the learner's idle time).
        collect(need=mini_batch_size if len(scored) + len(pending) >= mini_batch_size else 0)
        while len(scored) >= mini_batch_size:
            train(scored[:mini_batch_size])
            del scored[:mini_batch_size]
    collect(need=len(scored) + len(pending))
    for start in range(0, len(scored), mini_batch_size):
        train(scored[start : start + mini_batch_size])
    return out


def _timed(groups: Iterable[Group], out: StreamResult) -> Iterator[Group]:
    """The groups, with the time spent waiting for each added to `out.wait_s`."""
    source = iter(groups)
    while True:
        t0 = time.perf_counter()
        group = next(source, None)
        out.wait_s += time.perf_counter() - t0
        if group is None:
            return
        yield group


def _items(batch: list[Group], algo: AlgoConfig, out: StreamResult) -> list[SeqItem]:
    items: list[SeqItem] = []
    for group in batch:
        rewards = torch.tensor([group.rewards], dtype=torch.float64)  # [1, n]
        if algo.filter_zero_variance_groups and bool((rewards == rewards[0, 0]).all()):
            out.num_filtered_groups += 1  # no learning signal: every advantage would be 0
            continue
        advantages = group_advantages(rewards, algo.norm_adv_by_std)[0].tolist()
        if group.zero_advantage is not None:
            advantages = [0.0 if zero else a for a, zero in zip(advantages, group.zero_advantage, strict=True)]
        if algo.adv_estimator == "gigpo":
            prompt_ids, w = group.prompt.prompt_ids, algo.gigpo.step_advantage_w
            per_token = step_advantages(
                prompt_ids, group.samples, group.rewards or [], advantages, w, algo.norm_adv_by_std
            )
            group = _with_token_advantages(group, per_token)
        elif algo.adv_estimator == "turn_grpo":
            per_token = turn_advantages(group.samples, group.rewards or [], algo.gamma, algo.norm_adv_by_std)
            group = _with_token_advantages(group, per_token)
        if algo.overlong_filter:
            out.num_overlong_filtered += sum(
                s.finish_reason == "length" and bool(s.completion_ids) for s in group.samples
            )
        items += group_items(group, advantages, out.version, drop_truncated=algo.overlong_filter)
    return items


def _with_token_advantages(group: Group, per_token: list[list[float] | None]) -> Group:
    """The group with per-token advantages (gigpo's, turn_grpo's) written into its samples;
    None, or a sample whose advantage is forced to 0, keeps the group advantage."""
    if group.zero_advantage is not None:
        per_token = [None if zero else a for a, zero in zip(per_token, group.zero_advantage, strict=True)]
    samples = [s if a is None else replace(s, advantages=a) for s, a in zip(group.samples, per_token, strict=True)]
    return replace(group, samples=samples)
