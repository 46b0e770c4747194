"""The two agent examples, run as a user runs them (`python examples/agent_*.py --run-dir
DIR`): `polyrl train` with its workers and the manager on the tiny model, on CPU.

Each learns to the main job's bar, with no episode failed and no sample lost; the game
runs its three-move episodes fully asynchronously with LoRA; and a crashed agent run
resumes to the same steps as an uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(example: str, run_dir: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, str(EXAMPLES / f"{example}.py"), "--run-dir", str(run_dir), "logging.console=false"]
    done = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/agent_failed_groups"] == 0 and r["rollout/samples_lost"] == 0 for r in rows)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize(("example", "steps"), [("agent_tool", 120), ("agent_game", 80)])
def test_the_example_learns_to_the_main_jobs_bar(example: str, steps: int, tmp_path: Path) -> None:
    """The issue's bar, as the main job's: the last 20% of the steps average at least 0.8
    and at least 0.4 above step 1. The runs are deterministic (one sampling seed per call),
    so the bar is checked against known runs on the 2-core box: the tool example's 120
    steps (its default) go from 0.006 to 0.92, the game's 80 from 0.02 to 0.93 (0.99
    with 120)."""
    # One worker instead of the examples' two: under `rollout.deterministic` each call's
    # sampling seed is its own, so the samples, and the rewards, do not depend on the fleet
    # (the first 40 steps of the tool and 30 of the game were the same to the last digit
    # with one and with two). Alone on 2 cores, one worker fewer took the tool's 40 steps
    # from 38 to 32 s (57.8 to 45.7 s of CPU) and the game's 30 from 56 to 60 s (86.5 to
    # 83.2 s of CPU); beside the other pytest worker's tests, the CPU is what counts.
    rows = run_example(
        example, tmp_path / "run", "rollout.deterministic=true", f"trainer.total_steps={steps}", "fleet.num_workers=1"
    )
    rewards = [r["critic/score/mean"] for r in rows]
    tail = rewards[int(len(rewards) * 0.8) :]
    last = sum(tail) / len(tail)
    assert last >= 0.8 and last >= rewards[0] + 0.4, rewards[::5]


@pytest.mark.slow
def test_the_game_example_plays_three_moves_fully_async(tmp_path: Path) -> None:
    """The game's 3-move episodes under `rollout.fully_async` with k = 1: every step trains
    a whole batch of them, episodes span versions (each token keeps its own: the workers
    take a new version between two calls of an episode, or in the middle of one), and no
    token is more than one version older than the policy it trains."""
    rows = run_example(
        "agent_game",
        tmp_path / "run",
        "trainer.total_steps=4",
        "rollout.fully_async=true",
        "rollout.max_staleness=1",
        "engine.max_num_seqs=4",  # the fleet is the bottleneck: publishes find episodes running
        "fleet.num_workers=1",  # (with two, the fleet could finish a step's episodes before the publish)
        # the main job's model and longer replies, so that episodes last long enough to span
        # versions (with the example's wider model and 4-token replies none did in one run)
        "model.tiny.hidden_size=96",
        "model.tiny.intermediate_size=192",
        "rollout.max_new_tokens=6",
        "model.lora.enabled=true",
    )
    assert len(rows) == 4
    # 8 items x 16 episodes a step, each three replies and two answers of the environment
    assert all(r["rollout/samples_received"] == 8 * 16 for r in rows)
    assert all(r["rollout/version_lag/max"] <= 1 for r in rows)
    assert max(r["rollout/multi_version_ratio"] for r in rows) > 0, [r["rollout/multi_version_ratio"] for r in rows]


@pytest.mark.slow
def test_a_resumed_agent_run_replays_the_episodes_it_had_in_flight(tmp_path: Path) -> None:
    """Agent episodes through the remote fleet, crashed after step 3 (checkpoint at step 2)
    and resumed: step 3's items are played again from the checkpoint's data cursor with the
    same seeds, and the resumed run's steps equal an uninterrupted one's."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from agent_tool import write_items
        from test_train import Crash, crash_after

        from polyrl.config import load_config
        from polyrl.trainer.checkpoint import latest_checkpoint
        from polyrl.trainer.loop import train

        items = tmp_path / "items.jsonl"
        write_items(items, count=64)
        overrides = [
            "data.source=agent",
            "data.agent=agent_tool:play",
            f"data.path={items}",
            "model.tiny.chat_template=true",
            "manager.port=0",
            "rollout.deterministic=true",
            "trainer.total_steps=4",
            "trainer.train_batch_size=4",
            "trainer.ppo_mini_batch_size=4",
            "trainer.save_every=2",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
            "logging.console=false",
            "logging.tensorboard=false",
        ]
        cfg = load_config(None, overrides)
        train(cfg, tmp_path / "straight")
        with pytest.raises(Crash):
            train(cfg, tmp_path / "resumed", on_step_end=crash_after(3))
        assert latest_checkpoint(tmp_path / "resumed").name == "step_000002"
        train(load_config(tmp_path / "resumed" / "config.toml"), tmp_path / "resumed", resume=True)
    finally:
        sys.path.remove(str(EXAMPLES))

    def metrics(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss"):
            assert a[key] == b[key], (a["step"], key)
