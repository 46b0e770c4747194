from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so `reward_fns` imports under any import mode

from polyrl.data.rewards import RewardPool, RewardPoolError, load_callable  # noqa: E402

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


def _num_failed(pool: RewardPool, mode: str) -> int:
    future = pool.submit(PROMPTS, COMPLETIONS, {"mode": [mode] * len(PROMPTS)})
    future.result()
    return future.num_failed


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
    assert _num_failed(pool, mode) == 3 and _num_failed(pool, "ok") == 0  # reward/failed_samples


def test_timeout_scores_zero_then_pool_recovers(pool, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _score(pool, "sleep") == [2.0, 4.0, 8.0]
    assert time.monotonic() - start < 10
    assert any("timed out" in r.getMessage() for r in caplog.records)
    assert _score(pool, "ok") == [2.5, 4.5, 8.5]


def test_a_signalled_worker_scores_and_a_killed_one_is_retried(tmp_path, caplog):
    """SIGINT (a terminal's Ctrl-C reaches its whole process group) does not touch a pool
    worker, which has a session of its own; a worker killed mid-call is infrastructure: the
    call runs again on a fresh worker, and the scores are the function's, not 0.0."""
    import os
    import signal

    hang = tmp_path / "hang"
    columns = {"hang": [str(hang)] * len(PROMPTS)}
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        RewardPool(["reward_fns:hang_when_told"], timeout_s=30) as pool,
    ):
        for sig in (signal.SIGINT, signal.SIGKILL):
            hang.touch()
            future = pool.submit(PROMPTS, COMPLETIONS, columns)
            pid = _wait_for_pid(hang.with_suffix(".pid"))
            assert os.getsid(pid) != os.getsid(0)
            if sig == signal.SIGKILL:
                hang.unlink()  # the retry scores at once
            os.kill(pid, sig)
            assert future.result() == [1.0, 2.0, 4.0] and future.num_failed == 0
            lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            assert lines == ([] if sig == signal.SIGINT else [lines[0]]), lines
        assert "died" in lines[0] and "retry 1 of 2" in lines[0]


def test_workers_restarted_from_a_thread_outlive_it(caplog):
    """A timeout restarts the pool from whichever thread waited; the new workers' parent-death
    signal must not fire when that thread ends (it fires on the end of the *thread* that
    started a process), or the next call would find them killed."""
    import threading

    with RewardPool(["reward_fns:flaky"], timeout_s=0.5) as pool:

        def time_out_then_score() -> None:
            pool.score(PROMPTS, COMPLETIONS, {"mode": ["sleep"] * 3})
            _score(pool, "ok")  # the new workers are up (and have asked for their signal) while it lives

        waiter = threading.Thread(target=time_out_then_score)
        waiter.start()
        waiter.join()
        time.sleep(0.5)  # time for a parent-death signal to land
        caplog.clear()  # the timeout's own line
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert _score(pool, "ok") == [1.0, 1.0, 1.0]
        assert not [r for r in caplog.records if r.name == LOGGER]


def test_a_function_that_keeps_killing_its_worker_stops_scoring():
    """Bounded retries, then an error: never a 0.0 that no function produced."""
    with RewardPool(["reward_fns:kill_own_worker"], timeout_s=30) as pool:
        with pytest.raises(RewardPoolError, match="died 3 times"):
            pool.score(PROMPTS, COMPLETIONS)


def _wait_for_pid(path: Path) -> int:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, "the reward function never started"
        time.sleep(0.02)
    pid = int(path.read_text())
    path.unlink()
    return pid


def test_bad_path_fails_at_construction():
    with pytest.raises(ValueError, match="reward_fns:nope"):
        RewardPool(["reward_fns:length_reward", "reward_fns:nope"])


def test_weights_length_mismatch():
    with pytest.raises(ValueError, match="weights"):
        RewardPool(["reward_fns:length_reward"], weights=[1.0, 2.0])


def test_pool_workers_die_with_a_trainer_killed_with_sigkill(tmp_path):
    """kill -9 of the process that owns the pool leaves no worker (nor multiprocessing's
    resource tracker, which the worker kept alive) behind."""
    import os
    import signal
    import subprocess

    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from polyrl.data.rewards import RewardPool\n"
        "pool = RewardPool(['reward_fns:length_reward'], num_workers=1)\n"
        "pool.score(['p'], ['c'], {})\n"
        "print('ready', flush=True); time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True
    )
    children: list[int] = []
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        children = _children(owner.pid)
        assert children, "the pool started no worker process"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if _alive(pid)], "pool processes outlived their owner"
    finally:
        for pid in [owner.pid, *children]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
