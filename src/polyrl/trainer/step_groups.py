"""Step-level advantages for agent episodes: GiGPO's group in the group.

An agent episode is trained as one sequence with one reward, so GRPO gives every call in
it the same advantage: the episode's reward against its group's mean. That mixes up what
each call did. In a tool task, the episodes that called the tool are ahead of those that
did not, so every token of their *answer* gets a positive advantage whatever the answer
was; the answers are sharpened towards whatever they happened to be before the model has
learned which answer is right.

GiGPO (Feng et al. 2025, verl-agent's `adv_estimator=gigpo`) adds a second, finer
comparison. Calls that start from the same state form a step group, and each call is
also scored against its step group. Here the state is the call's whole context, token for
token: the calls that follow the same tool answer are compared with each other and not
with episodes that never got there. The episode's reward is every call's return (the
reward comes at the end, so a discount would only rescale it). Each sampled token of
call k of episode i gets

    A_episode[i] + step_advantage_w * A_step[i, k]

where A_step is (R_i - mean of its step group), divided by the step group's std when
`algo.norm_adv_by_std`, and 0 when no other episode shares the context. The first call
of every episode shares the group's prompt, so its step group is the whole group, as in
GiGPO.

`turn_advantages` (`algo.adv_estimator = "turn_grpo"`) groups calls by their turn instead,
over a return per call, for episodes that reward each call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np
import torch
import xxhash

from polyrl.protocol.samples import Sample
from polyrl.trainer.grpo import group_advantages


def call_spans(sample: Sample) -> list[tuple[int, int]]:
    """[start, end) of each call's reply in the completion: each run of trained tokens
    (a sample without a loss mask is a single call)."""
    if sample.loss_mask is None:
        return [(0, len(sample.completion_ids))] if sample.completion_ids else []
    spans, start = [], None
    for i, trained in enumerate([*sample.loss_mask, False]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _context_keys(prompt_ids: list[int], sample: Sample, spans: list[tuple[int, int]]) -> list[int]:
    """One hash per call of everything before it (the prompt and the completion so far)."""
    h = xxhash.xxh3_128(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    done, keys = 0, []
    completion = np.asarray(sample.completion_ids, dtype=np.int64)
    for start, _ in spans:
        h.update(completion[done:start].tobytes())
        done = start
        keys.append(h.intdigest())
    return keys


def step_advantages(
    prompt_ids: list[int],
    samples: list[Sample],
    rewards: list[float],
    episode_advantages: list[float],
    weight: float,
    norm_by_std: bool,
) -> list[list[float] | None]:
    """Per sample, its per-token advantages (`Sample.advantages` layout), or None where
    the sample keeps one advantage for all its tokens (it brings its own, or is empty).
    A step group's advantages are GRPO's own rule (`group_advantages`) over its returns."""
    spans = _trained_spans(samples)
    keys = [
        _context_keys(s.prompt_ids if s.prompt_ids is not None else prompt_ids, s, sp) if sp else []
        for s, sp in zip(samples, spans, strict=True)
    ]
    members: dict[int, list[tuple[int, int]]] = defaultdict(list)  # context -> (sample, call)
    for i, sample_keys in enumerate(keys):
        for k, key in enumerate(sample_keys):
            members[key].append((i, k))
    # a group of one has no baseline: group_advantages gives it 0
    step = _grouped_advantages(members.values(), lambda i, k: rewards[i], norm_by_std)
    return _spread(samples, spans, episode_advantages, lambda i, k: episode_advantages[i] + weight * step[i, k])


def turn_returns(sample: Sample, num_calls: int, reward: float, gamma: float) -> list[float]:
    """Each call's return: its reward plus `gamma` times the next call's return. The
    rewards are the episode's per call (`Sample.call_rewards`), or its one `reward` given
    to its last call."""
    rewards = sample.call_rewards
    if rewards is None:
        rewards = [0.0] * (num_calls - 1) + [reward] if num_calls else []
    if len(rewards) != num_calls:
        raise ValueError(f"an episode of {num_calls} calls was given {len(rewards)} call rewards")
    returns, ahead = [0.0] * num_calls, 0.0
    for k in reversed(range(num_calls)):
        ahead = rewards[k] + gamma * ahead
        returns[k] = ahead
    return returns


def turn_advantages(
    samples: list[Sample], rewards: list[float], gamma: float, norm_by_std: bool
) -> list[list[float] | None]:
    """Turn-level GRPO: per sample, its per-token advantages (`Sample.advantages` layout),
    where call k's tokens get GRPO's rule (`group_advantages`) applied to its return among
    the group's k-th calls. An episode's calls are compared with the same turn of the
    other episodes of its item, so a move's own success is not averaged with the other
    moves' (which, under one episode advantage, every token of it would carry as noise).
    None where a sample brings its own advantages or has no call."""
    spans = _trained_spans(samples)
    returns = [turn_returns(s, len(sp), r, gamma) for s, sp, r in zip(samples, spans, rewards, strict=True)]
    by_turn: dict[int, list[tuple[int, int]]] = defaultdict(list)  # turn -> (sample, call)
    for i, sp in enumerate(spans):
        for k in range(len(sp)):
            by_turn[k].append((i, k))
    advantage = _grouped_advantages(by_turn.values(), lambda i, k: returns[i][k], norm_by_std)
    # untrained tokens (the environment's) keep 0
    return _spread(samples, spans, [0.0] * len(samples), lambda i, k: advantage[i, k])


def _trained_spans(samples: list[Sample]) -> list[list[tuple[int, int]]]:
    """Each sample's calls (`call_spans`); none for a sample that brings its own advantages."""
    return [call_spans(s) if s.advantages is None else [] for s in samples]


def _grouped_advantages(
    groups: Iterable[list[tuple[int, int]]], value: Callable[[int, int], float], norm_by_std: bool
) -> dict[tuple[int, int], float]:
    """GRPO's rule (`group_advantages`) within each group of (sample, call) pairs, over
    `value(sample, call)`."""
    out: dict[tuple[int, int], float] = {}
    for group in groups:
        values = torch.tensor([[value(i, k) for i, k in group]], dtype=torch.float64)
        out.update(zip(group, group_advantages(values, norm_by_std)[0].tolist(), strict=True))
    return out


def _spread(
    samples: list[Sample],
    spans: list[list[tuple[int, int]]],
    fill: list[float],
    per_call: Callable[[int, int], float],
) -> list[list[float] | None]:
    """Per sample, `fill[i]` on every completion token and `per_call(i, k)` on call k's;
    None for a sample without calls."""
    out: list[list[float] | None] = []
    for i, s in enumerate(samples):
        if not spans[i]:
            out.append(None)
            continue
        per_token = [fill[i]] * len(s.completion_ids)
        for k, (start, end) in enumerate(spans[i]):
            per_token[start:end] = [per_call(i, k)] * (end - start)
        out.append(per_token)
    return out
