"""DAPO's dynamic sampling (`algo.filter_groups`, named as verl names it).

A group whose rewards are all equal gives every sample a zero advantage: it costs a
forward and backward and teaches nothing, and as accuracy rises more groups are like it,
so a fixed batch shrinks in effect. The step here asks for more prompts instead, a round
of `train_batch_size` at a time, until it holds `train_batch_size` groups with a reward
spread (or `max_num_gen_batches` rounds were taken: then it trains on fewer, and says so).

Groups are scored as they arrive, so the learner still streams: it trains on the first
kept groups while later rounds generate. Once the step has its groups, the round in
progress is closed, which cancels its unfinished prompts (the manager aborts their
samples; the colocated engine drops them). Cancelled prompts are used up: the data
cursor has moved past every prompt of every round, so a resumed run takes fresh ones and
none twice. Every round takes its seeds from the run's RNG, saved at the step's end, so a
resume repeats the same rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from polyrl.config import FilterGroupsConfig
from polyrl.protocol.samples import Group
from polyrl.rollout.source import Rollout
from polyrl.rollout.stats import RolloutStats
from polyrl.trainer.stream import GroupScorer

log = logging.getLogger(__name__)


@dataclass
class SamplingStats:
    """One step's rounds, for `batch/*` metrics."""

    num_gen_batches: int = 0
    num_groups_scored: int = 0
    num_groups_kept: int = 0
    num_generated_tokens: int = 0
    """Completion tokens of every group received, kept or not."""
    num_kept_tokens: int = 0
    num_failed_samples: int = 0
    is_capped: bool = False
    """The step ran out of rounds (`max_num_gen_batches`) before it had its groups."""

    def metrics(self) -> dict[str, float]:
        return {
            "batch/num_gen_batches": float(self.num_gen_batches),
            "batch/kept_groups": float(self.num_groups_kept),
            "batch/kept_group_ratio": self.num_groups_kept / max(self.num_groups_scored, 1),
            "batch/gen_tokens_per_train_token": self.num_generated_tokens / max(self.num_kept_tokens, 1),
            "batch/capped": float(self.is_capped),
        }


def has_reward_spread(rewards: list[float]) -> bool:
    return any(r != rewards[0] for r in rewards)


class DynamicSampler:
    """Iterates over one step's kept groups, taking rounds from `new_round` as needed."""

    def __init__(
        self,
        new_round: Callable[[], Iterator[Group]],
        scorer: GroupScorer,
        cfg: FilterGroupsConfig,
        num_groups: int,
        rollout: Rollout,
    ) -> None:
        """`new_round`: submits `num_groups` more prompts and returns their groups;
        `rollout`: whose `stats` each round sets (the step's are their sum)."""
        self.new_round, self.scorer, self.cfg = new_round, scorer, cfg
        self.num_groups, self.rollout = num_groups, rollout
        self.stats = SamplingStats()

    def __iter__(self) -> Iterator[Group]:
        step_stats = RolloutStats()
        while self.stats.num_groups_kept < self.num_groups:
            cap = self.cfg.max_num_gen_batches
            if cap and self.stats.num_gen_batches >= cap:
                self.stats.is_capped = True
                log.warning(
                    "dynamic sampling: %d of %d groups with a reward spread after %d rounds "
                    "(algo.filter_groups.max_num_gen_batches); training on those",
                    self.stats.num_groups_kept,
                    self.num_groups,
                    self.stats.num_gen_batches,
                )
                break
            self.stats.num_gen_batches += 1
            groups = self.new_round()
            is_whole = False
            try:
                is_whole = yield from self._kept(groups)
            finally:
                groups.close()  # type: ignore[attr-defined]  # cancels what is left of the round
                step_stats.add(self.rollout.stats, cut=not is_whole)
        self.rollout.stats = step_stats

    def _kept(self, groups: Iterator[Group]) -> Generator[Group, None, bool]:
        """The round's groups with a reward spread (scored here, so the learner finds them
        scored), until the step has its `num_groups`; returns whether the round was read to
        its end."""
        for group in groups:
            future = self.scorer.submit(group)
            group.rewards = future.result()
            self.stats.num_failed_samples += getattr(future, "num_failed", 0)
            self.stats.num_groups_scored += 1
            num_tokens = sum(len(s.completion_ids) for s in group.samples)
            self.stats.num_generated_tokens += num_tokens
            if not has_reward_spread(group.rewards):
                continue
            self.stats.num_groups_kept += 1
            self.stats.num_kept_tokens += num_tokens
            yield group
            if self.stats.num_groups_kept == self.num_groups:
                return False
        return True
