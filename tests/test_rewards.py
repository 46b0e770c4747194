from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so `reward_fns` imports under any import mode

from polyrl.data.rewards import RewardPool, load_callable  # noqa: E402

LOGGER = "polyrl.data.rewards"
PROMPTS = ["p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "cccc"]


@pytest.fixture(scope="module")
def pool():
    """One pool for the module: spawn start-up is the slow part."""
    with RewardPool(
        ["reward_fns:length_reward", "reward_fns:flaky"],
        weights=[2.0, 0.5],
        num_workers=2,
        timeout_s=3.0,
    ) as p:
        yield p


def _score(pool: RewardPool, mode: str) -> list[float]:
    return pool.score(PROMPTS, COMPLETIONS, {"mode": [mode] * len(PROMPTS)})


def test_load_callable_resolves_and_rejects():
    assert load_callable("reward_fns:length_reward")([], ["xy"]) == [2.0]
    for bad, words in [
        ("reward_fns.length_reward", "form"),
        ("no_such_module_xyz:f", "cannot import"),
        ("reward_fns:missing", "has no"),
        ("reward_fns:time", "not callable"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            load_callable(bad)
        assert bad in str(err.value)


def test_weighted_sum(pool):
    assert _score(pool, "ok") == [2.0 * 1 + 0.5, 2.0 * 2 + 0.5, 2.0 * 4 + 0.5]


def test_submit_is_non_blocking(pool):
    futures = [pool.submit(PROMPTS, COMPLETIONS, {"mode": ["ok"] * 3}) for _ in range(4)]
    assert all(f.result() == [2.5, 4.5, 8.5] for f in futures)


@pytest.mark.parametrize("mode", ["raise", "short", "nan", "text"])
def test_bad_function_scores_zero_and_logs_once(pool, caplog, mode):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _score(pool, mode) == [2.0, 4.0, 8.0]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "reward_fns:flaky" in lines[0]
    if mode == "raise":
        assert "boom" in lines[0]
    assert _score(pool, "ok") == [2.5, 4.5, 8.5]  # the pool keeps working


def test_timeout_scores_zero_then_pool_recovers(pool, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _score(pool, "sleep") == [2.0, 4.0, 8.0]
    assert time.monotonic() - start < 10
    assert any("timed out" in r.getMessage() for r in caplog.records)
    assert _score(pool, "ok") == [2.5, 4.5, 8.5]


def test_bad_path_fails_at_construction():
    with pytest.raises(ValueError, match="reward_fns:nope"):
        RewardPool(["reward_fns:length_reward", "reward_fns:nope"])


def test_weights_length_mismatch():
    with pytest.raises(ValueError, match="weights"):
        RewardPool(["reward_fns:length_reward"], weights=[1.0, 2.0])
