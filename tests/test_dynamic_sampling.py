"""DAPO's dynamic sampling (`algo.filter_groups`) and overlong handling
(`reward.overlong_buffer`, `algo.overlong_filter`): the formulas against a reference, the
step's rounds with a cap, a colocated run that resumes exactly, and a worker killed
during an extra round in the remote mode (in-process manager, fake workers)."""

from __future__ import annotations

import logging
import random
import shutil
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from test_manager import TOKEN, FakeWorker, expected_sample, fast_cfg, wait_active
from test_rollout_learner import _Scorer
from test_train import _metrics
from test_worker import _wait_until
from transformers import AutoModelForCausalLM

from polyrl.config import AlgoConfig, ConfigError, FilterGroupsConfig, OverlongBufferConfig, load_config
from polyrl.manager.main import ManagerThread
from polyrl.metrics.step_stats import rollout_metrics
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.manager_link import ManagerLink
from polyrl.rollout.remote import RemoteRollout
from polyrl.rollout.stats import RolloutStats
from polyrl.trainer.dynamic_sampling import DynamicSampler
from polyrl.trainer.loop import train
from polyrl.trainer.overlong import overlong_penalty, shaped_rewards
from polyrl.trainer.stream import StreamResult, _items, in_prompt_order

# ------------------------------------------------------------------------------ overlong


def _reference_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's eq. 13, written out case by case."""
    if length <= max_len - buffer_len:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer_len) - length) / buffer_len * factor
    return -factor


@pytest.mark.parametrize("buffer_len,factor", [(4, 1.0), (1, 0.5), (10, 2.0)])
def test_overlong_penalty_follows_the_formula(buffer_len: int, factor: float) -> None:
    for length in range(0, 11):
        got = overlong_penalty(length, 10, buffer_len, factor)
        assert got == pytest.approx(_reference_penalty(length, 10, buffer_len, factor)), length
    assert overlong_penalty(10, 10, buffer_len, factor) == pytest.approx(-factor)


def _sample(length: int, finish: str = "stop") -> Sample:
    return Sample(list(range(3, 3 + length)), [-1.0] * length, finish, [0] * length)  # type: ignore[arg-type]


def _group(index: int, lengths: list[int], budget: int | None = None, finish: str = "stop") -> Group:
    prompt = Prompt(index=index, text="p", prompt_ids=[1, 2], max_new_tokens=budget)
    return Group(prompt=prompt, samples=[_sample(n, "length" if n == 8 else finish) for n in lengths])


def test_shaped_rewards_use_each_prompts_own_budget() -> None:
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    assert shaped_rewards(_group(0, [2, 5, 8]), [1.0, 1.0, 1.0], cfg, 8) == pytest.approx([1.0, 0.75, 0.0])
    assert shaped_rewards(_group(0, [2, 5, 6]), [0.0] * 3, cfg, 8) == pytest.approx([0.0, -0.25, -0.5])
    assert shaped_rewards(_group(0, [2, 5, 6], budget=6), [0.0] * 3, cfg, 8) == pytest.approx([0.0, -0.75, -1.0])
    assert shaped_rewards(_group(0, [8]), [1.0], OverlongBufferConfig(), 8) == [1.0]  # off


def test_overlong_filter_masks_truncated_samples_out_of_the_loss() -> None:
    """The truncated sample leaves the loss; the group's advantages still count it."""
    group = _group(0, [2, 8, 3])
    group.rewards = [1.0, 0.0, 0.0]
    out = StreamResult()
    kept, everything = _items([group], AlgoConfig(overlong_filter=True), out), _items([group], AlgoConfig(), out)
    assert [len(i.token_ids) - i.prompt_len for i in kept] == [2, 3] and len(everything) == 3
    assert out.num_overlong_filtered == 1
    assert [i.advantage for i in kept] == [everything[0].advantage, everything[2].advantage]


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["rollout.fully_async=true", "rollout.max_staleness=1"], "fully_async"),
        (["rollout.max_staleness=1"], "rollout.max_staleness = 0"),
        (["rollout.max_new_tokens=4", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=5"], "len"),
        (["algo.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches"),
        (["algo.filter_groups.metric=acc"], "metric"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["algo.filter_groups.enable=true", *overrides])


# ------------------------------------------------------------------------------ rounds


class _Rounds:
    """Rounds of `size` groups from a list; records how each was left."""

    def __init__(self, rounds: list[list[list[int]]]) -> None:
        self.rounds, self.closed_at = iter(rounds), []
        self.stats = RolloutStats()

    def __call__(self):
        round_ = next(self.rounds)
        self.stats = RolloutStats(num_requested=len(round_) * 3)
        for i, lengths in enumerate(round_):
            try:
                group = _group(i, lengths)
                self.stats.count(group)
                yield group
            except GeneratorExit:
                self.closed_at.append(i)
                raise


def test_rounds_until_enough_groups_then_the_rest_is_cancelled() -> None:
    rounds = _Rounds([[[1, 1, 1], [1, 2, 3]], [[2, 2, 2], [1, 2, 2]], [[3, 2, 1], [5, 5, 5]]])
    cfg = FilterGroupsConfig(enable=True, max_num_gen_batches=5)
    sampler = DynamicSampler(rounds, _Scorer(), cfg, 3, rounds)  # the fake is its own rollout
    kept = list(sampler)
    assert [g.rewards for g in kept] == [[1.0, 2.0, 3.0], [1.0, 2.0, 2.0], [3.0, 2.0, 1.0]]
    assert rounds.closed_at == [0]  # the third round stopped once it gave the third group
    assert sampler.stats.metrics() == {
        "batch/num_gen_batches": 3.0,
        "batch/kept_groups": 3.0,
        "batch/kept_group_ratio": 3 / 5,
        "batch/gen_tokens_per_train_token": 26 / 17,  # tokens of the 5 groups scored / of the 3 kept
        "batch/capped": 0.0,
    }
    stats = rounds.stats  # the step's: the three rounds' sum
    assert (stats.num_requested, stats.num_received, stats.num_cancelled) == (18, 15, 3)
    assert stats.metrics()["rollout/samples_lost"] == 0


def test_the_cap_trains_on_what_it_has_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    rounds = _Rounds([[[1, 1], [1, 2]]] * 3)
    sampler = DynamicSampler(rounds, _Scorer(), FilterGroupsConfig(enable=True, max_num_gen_batches=2), 4, rounds)
    with caplog.at_level(logging.WARNING):
        assert len(list(sampler)) == 2
    assert sampler.stats.is_capped and sampler.stats.num_gen_batches == 2
    assert "max_num_gen_batches" in caplog.text and "2 of 4 groups" in caplog.text
    nothing = _Rounds([[[1, 1]]])
    assert list(DynamicSampler(nothing, _Scorer(), FilterGroupsConfig(max_num_gen_batches=1), 4, nothing)) == []
    assert rollout_metrics([], 8) == {}  # a step without a group still logs its other metrics


# ------------------------------------------------------------------------------ a run


RUN = [
    "trainer.total_steps=2",
    "trainer.train_batch_size=8",
    "trainer.ppo_mini_batch_size=4",
    "trainer.save_every=1",
    "rollout.n=2",  # pairs: many groups score alike, so steps take several rounds
    "rollout.max_new_tokens=4",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "logging.console=false",
    "logging.tensorboard=false",
    "rollout.mode=local",
    "algo.filter_groups.enable=true",
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.len=2",
    "algo.overlong_filter=true",
]


def test_every_step_trains_a_full_batch_of_informative_groups_and_resumes_exactly(
    tmp_path: Path, fixed_threads: None
) -> None:
    """Colocated, the default task: each step trains exactly train_batch_size groups with a
    reward spread; the cursor counts every prompt of every round; a run resumed from step 1's
    checkpoint gives step 2 and the final weights bit for bit."""
    straight = tmp_path / "straight"
    state = train(load_config(None, RUN), straight)
    rows = _metrics(straight)
    for r in rows:
        assert r["batch/kept_groups"] == 8 and r["batch/capped"] == 0
        assert r["training/mixed_reward_group_ratio"] == 1.0 and r["rollout/samples_lost"] == 0
        assert r["batch/gen_tokens_per_train_token"] >= 1 and 0 < r["batch/kept_group_ratio"] <= 1
    assert any(r["batch/num_gen_batches"] > 1 for r in rows)
    assert state.cursor == 8 * sum(r["batch/num_gen_batches"] for r in rows)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000002", "final_model"))
    train(load_config(resumed / "config.toml"), resumed, resume=True)
    again = _metrics(resumed)
    assert [r["step"] for r in again] == [1, 2]
    for key in ("batch/num_gen_batches", "actor/pg_loss", "critic/score/mean", "rollout/samples_cancelled"):
        assert again[1][key] == rows[1][key], key
    a = AutoModelForCausalLM.from_pretrained(straight / "final_model")
    b = AutoModelForCausalLM.from_pretrained(resumed / "final_model")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ------------------------------------------------------------------------------ remote, a kill


class _NoProcesses:
    def revive_manager(self, why: str) -> bool:
        return False

    def revive_local_worker(self) -> None:
        pass


class _Model(torch.nn.Linear):
    device = torch.device("cpu")


def test_a_worker_killed_during_an_extra_round_loses_nothing() -> None:
    """Remote mode through the trainer's own rollout client: one kept group per round of
    4, so the step takes 4 rounds; a worker that dies mid-stream joins for round 2. Every
    kept group is whole and token-exact, every sample requested is received or cancelled,
    and the manager holds no batch afterwards."""
    random.seed(0)
    n, budget, size = 2, 12, 4
    with ExitStack() as stack:
        mt = stack.enter_context(ManagerThread(fast_cfg()))
        stack.enter_context(FakeWorker(mt.url, "healthy", token_delay_s=0.005))
        wait_active(mt, "healthy")
        link = ManagerLink(mt.url, TOKEN)
        stack.callback(link.close)
        rollout = RemoteRollout(
            model=_Model(1, 1),
            mode="remote",
            compute_dtype=torch.float32,
            link=link,
            publisher=None,  # type: ignore[arg-type]  # nothing is published here
            endpoint=None,  # type: ignore[arg-type]
            processes=_NoProcesses(),
        )
        requests, cursor = [], iter(range(1000))
        sampling = SamplingParams(n=n, max_new_tokens=budget)

        def new_round():
            if len(requests) == 1:  # the extra rounds start: a worker that will die joins
                stack.enter_context(FakeWorker(mt.url, "dying", mode="die", fault_after=3, token_delay_s=0.005))
                wait_active(mt, "dying")
            prompts = [
                Prompt(index=i, text="", prompt_ids=[5 + i % 7, 6, 7]) for i in (next(cursor) for _ in range(size))
            ]
            open_batch = link.open_batch
            link.open_batch = lambda request: requests.append(request) or open_batch(request)  # type: ignore[method-assign]
            try:
                return rollout.generate(prompts, sampling)
            finally:
                link.open_batch = open_batch  # type: ignore[method-assign]

        class OnePerRound(_Scorer):  # the round's first prompt has a reward spread
            def submit(self, group):
                spread = group.prompt.index % size == 0
                return self._Future([float(spread and i) for i in range(len(group.samples))], True)

        sampler = DynamicSampler(
            new_round, OnePerRound(), FilterGroupsConfig(enable=True, max_num_gen_batches=0), 4, rollout
        )
        kept = list(sampler)
        assert [g.prompt.index for g in kept] == [0, 4, 8, 12] and sampler.stats.num_gen_batches == 4
        seeds = {int(p.id): p for r in requests for p in r.prompts}
        for g in kept:
            for i, s in enumerate(g.samples):
                assert s.completion_ids == expected_sample(seeds[g.prompt.index], i, budget)
        stats = rollout.stats
        assert stats.num_requested == 4 * size * n
        assert (
            stats.num_received + stats.num_cancelled == stats.num_requested
            and stats.metrics()["rollout/samples_lost"] == 0
        )
        assert stats.num_migrated > 0  # the kill hit samples in flight, which went on elsewhere
        _wait_until(lambda: not mt.manager.batches and not mt.manager.pending, 10, "no batch left in the manager")


def test_closing_groups_in_prompt_order_closes_the_rollouts_batch() -> None:
    """`rollout.deterministic` wraps a round in `in_prompt_order`: closing the wrapper must
    reach the rollout's iterator, which is what cancels the batch."""
    rounds = _Rounds([[[1, 2], [1, 2], [1, 2]]])
    ordered = in_prompt_order(rounds(), [0, 1, 2])
    assert next(ordered).prompt.index == 0
    ordered.close()
    assert rounds.closed_at == [0]


def test_a_step_at_the_cap_without_any_group_is_logged_and_the_run_goes_on(tmp_path: Path) -> None:
    overrides = [*RUN, "trainer.total_steps=1", "algo.filter_groups.max_num_gen_batches=2"]
    overrides.append("reward.overlong_buffer.enable=false")  # (its penalty would give the groups a spread)
    state = train(load_config(None, [*overrides, 'reward.functions=["reward_fns:constant"]']), tmp_path / "run")
    (row,) = _metrics(tmp_path / "run")
    assert (row["batch/capped"], row["batch/kept_groups"], row["batch/num_gen_batches"]) == (1, 0, 2)
    assert state.step == 1 and state.cursor == 2 * 8
