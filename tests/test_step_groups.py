"""GiGPO's step-level advantages (`algo.adv_estimator = "gigpo"`) and turn-level GRPO's
(`"turn_grpo"`) against hand-computed numbers, on episodes shaped like the tool
example's: call, tool answer, reply."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from polyrl.config import AlgoConfig, load_config
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.trainer.step_groups import call_spans, step_advantages, turn_advantages, turn_returns
from polyrl.trainer.stream import StreamResult, _items

approx = functools.partial(pytest.approx, rel=1e-5)  # the std carries an epsilon
PROMPT = [1, 2, 3]
CALL, TOOL, STOP = 7, 8, 2


def _episode(*parts: tuple[list[int], bool]) -> Sample:
    """A completion from (tokens, sampled) runs."""
    ids = [t for tokens, _ in parts for t in tokens]
    mask = [sampled for tokens, sampled in parts for _ in tokens]
    return Sample(ids, [-1.0] * len(ids), "stop", [0] * len(ids), loss_mask=None if all(mask) else mask)


def _tool_group() -> Group:
    """Four episodes: two call the tool and get the same answer (so their second calls share
    a context), one calls and gets another answer, one answers straight away."""
    samples = [
        _episode(([CALL, STOP], True), ([TOOL, 20], False), ([20, STOP], True)),  # right answer
        _episode(([CALL, STOP], True), ([TOOL, 20], False), ([21, STOP], True)),  # wrong answer
        _episode(([CALL, STOP], True), ([TOOL, 30], False), ([30, STOP], True)),  # another context
        _episode(([22, STOP], True)),  # no call
    ]
    return Group(Prompt(index=0, text="p", prompt_ids=PROMPT), samples, rewards=[1.0, 0.4, 1.0, 0.0])


def test_calls_are_the_runs_of_sampled_tokens() -> None:
    group = _tool_group()
    assert call_spans(group.samples[0]) == [(0, 2), (4, 6)]
    assert call_spans(group.samples[3]) == [(0, 2)]
    assert call_spans(Sample([], [], "stop", [])) == []


@pytest.mark.parametrize("norm", [False, True])
def test_second_calls_are_compared_only_with_calls_that_saw_the_same_context(norm: bool) -> None:
    group = _tool_group()
    episode = [0.4, -0.2, 0.4, -0.6]  # any episode advantages: they are added as given
    out = step_advantages(PROMPT, group.samples, group.rewards or [], episode, 0.5, norm)
    # first calls: all four share the prompt, so the step group is the whole group
    mean = (1.0 + 0.4 + 1.0 + 0.0) / 4
    std = (sum((r - mean) ** 2 for r in (1.0, 0.4, 1.0, 0.0)) / 3) ** 0.5 if norm else 1.0
    # second calls after tool answer 20: episodes 0 and 1 only (mean 0.7; unbiased std 0.4243)
    std2 = ((0.3**2 + 0.3**2) / 1) ** 0.5 if norm else 1.0
    assert out[0] == approx([0.4 + 0.5 * (1.0 - mean) / std] * 2 + [0.4] * 2 + [0.4 + 0.5 * 0.3 / std2] * 2)
    assert out[1][4:] == approx([-0.2 - 0.5 * 0.3 / std2] * 2)
    # the episode that got answer 30 shares its second context with no one: step part 0
    assert out[2][4:] == approx([0.4, 0.4])
    assert out[3] == approx([-0.6 + 0.5 * (0.0 - mean) / std] * 2)


def test_the_stream_trains_each_call_on_its_own_advantage() -> None:
    """Through `_items`, as the trainer builds a mini-batch: per-token advantages with
    gigpo, one per sequence (GRPO's) without."""
    plain = _items([_tool_group()], AlgoConfig(), StreamResult())
    gigpo = _items([_tool_group()], AlgoConfig(adv_estimator="gigpo"), StreamResult())
    assert all(item.token_advantages is None for item in plain)
    first, wrong = gigpo[0].token_advantages, gigpo[1].token_advantages
    assert first is not None and wrong is not None
    # the right and the wrong answer after the same tool answer are pulled further apart
    # than GRPO's whole-group comparison pulls them
    assert plain[1].advantage < 0 < plain[0].advantage
    assert first[4] > plain[0].advantage and wrong[4] < plain[1].advantage
    assert first[4] - wrong[4] > plain[0].advantage - plain[1].advantage


def test_the_estimator_is_checked() -> None:
    assert (
        load_config(None, ["algo.adv_estimator=gigpo", "algo.gigpo.step_advantage_w=2"]).algo.gigpo.step_advantage_w
        == 2
    )
    with pytest.raises(Exception, match="adv_estimator"):
        load_config(None, ["algo.adv_estimator=gae"])


def test_a_calls_return_is_its_reward_and_the_discounted_returns_after_it() -> None:
    three_calls = _episode(([4], True), ([8], False), ([5], True), ([8], False), ([6], True))
    with_rewards = replace(three_calls, call_rewards=[1.0, 0.0, 2.0])
    assert turn_returns(with_rewards, 3, 3.0, gamma=0.5) == [1.5, 1.0, 2.0]
    assert turn_returns(with_rewards, 3, 3.0, gamma=0.0) == [1.0, 0.0, 2.0]
    # one reward for the episode: its last call's
    assert turn_returns(three_calls, 3, 0.7, gamma=1.0) == [0.7, 0.7, 0.7]
    assert turn_returns(three_calls, 3, 0.7, gamma=0.0) == [0.0, 0.0, 0.7]
    with pytest.raises(ValueError, match="2 call rewards"):
        turn_returns(replace(three_calls, call_rewards=[1.0, 2.0]), 3, 3.0, gamma=1.0)


@pytest.mark.parametrize("norm", [False, True])
def test_each_turn_is_compared_with_the_same_turn_of_the_other_episodes(norm: bool) -> None:
    """Three episodes rewarded per call, gamma 0: each call's advantage comes from its own
    reward against the group's calls of the same turn; the one-call episode takes part in
    the first turn only."""
    group = _tool_group()
    samples = [
        replace(group.samples[0], call_rewards=[0.3, 0.7]),
        replace(group.samples[1], call_rewards=[0.3, 0.1]),
        replace(group.samples[2], call_rewards=[0.3, 0.7]),
        replace(group.samples[3], call_rewards=[0.0]),
    ]
    out = turn_advantages(samples, [1.0, 0.4, 1.0, 0.0], gamma=0.0, norm_by_std=norm)

    def grpo(values: list[float]) -> list[float]:
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if norm else 1.0
        return [(v - mean) / std for v in values]

    first, second = grpo([0.3, 0.3, 0.3, 0.0]), grpo([0.7, 0.1, 0.7])
    for i in range(3):
        assert out[i] == approx([first[i]] * 2 + [0.0] * 2 + [second[i]] * 2)  # the tool's tokens: 0
    assert out[3] == approx([first[3]] * 2)


def test_the_stream_trains_each_turn_on_its_own_advantage() -> None:
    group = _tool_group()
    group.samples = [
        replace(s, call_rewards=r) for s, r in zip(group.samples, [[0.3, 0.7], [0.3, 0.1], [0.3, 0.7], [0.0]])
    ]
    items = _items([group], AlgoConfig(adv_estimator="turn_grpo", gamma=0.0), StreamResult())
    right, wrong = items[0].token_advantages, items[1].token_advantages
    assert right is not None and wrong is not None
    assert right[0] == wrong[0] and right[4] > 0 > wrong[4]  # the same call; then the answers differ
