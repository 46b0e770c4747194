"""DAPO's two answers to truncated samples (arXiv 2503.14476, section 3.4).

Soft overlong punishment (`reward.overlong_buffer`): within the last `len` tokens of a
sample's budget the reward loses a linear share of `penalty_factor`, so the policy learns
that running long costs before it learns to be cut. Overlong filtering
(`algo.overlong_filter`): a sample cut at its budget leaves the loss, since its reward
judges an answer it was not allowed to finish.
"""

from __future__ import annotations

from polyrl.config import OverlongBufferConfig
from polyrl.protocol.samples import Group


def overlong_penalty(num_tokens: int, budget: int, buffer_len: int, penalty_factor: float) -> float:
    """The reward added to a sample of `num_tokens` under a budget of `budget` tokens: 0 up to
    budget - buffer_len tokens, then falling linearly to -penalty_factor at the budget."""
    exceed = num_tokens - (budget - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def shaped_rewards(group: Group, rewards: list[float], cfg: OverlongBufferConfig, max_new_tokens: int) -> list[float]:
    """`rewards` of the group's samples with the overlong penalty added (cfg.enable)."""
    if not cfg.enable:
        return rewards
    budget = group.prompt.budget(max_new_tokens)
    return [
        r + overlong_penalty(len(s.completion_ids), budget, cfg.len, cfg.penalty_factor)
        for r, s in zip(rewards, group.samples, strict=True)
    ]
