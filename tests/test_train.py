"""End to end on CPU: a short run leaves a complete run directory; resume is bit-exact."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyrl.config import load_config
from polyrl.trainer.checkpoint import latest_checkpoint
from polyrl.trainer.loop import train

SMALL = [
    "trainer.total_steps=4",
    "trainer.train_batch_size=8",
    "trainer.ppo_mini_batch_size=4",
    "trainer.save_every=2",
    "rollout.n=4",
    "rollout.max_new_tokens=4",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "algo.kl_coef=0.01",  # exercises the reference model path too
    "data.task=copy",  # partial credit: rewards differ within a group from the first step
    "logging.console=false",
    "rollout.mode=local",  # the learner and resume semantics; the remote path is tests/test_e2e.py
]

VERL_KEYS = [
    "perf/throughput",
    "perf/throughput_all_gpus",
    "perf/time_per_step",
    "perf/total_num_tokens",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/clipfrac",
    "critic/score/mean",
    "response_length/mean",
    "training/num_rollout_instances",
    "rollout/logprob_diff",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_is_complete(tmp_path):
    run_dir = tmp_path / "run"
    state = train(load_config(None, SMALL), run_dir)
    assert state.step == 4 and state.cursor == 4 * 8 and state.weight_version == 4
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in VERL_KEYS:
        assert key in rows[-1], key
    assert rows[-1]["actor/kl_loss"] >= 0 and rows[-1]["rollout/logprob_diff"] < 1e-4
    assert load_config(run_dir / "config.toml") == load_config(None, SMALL)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert latest_checkpoint(run_dir).name == "step_000004"
    assert (run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors").exists()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    init = AutoModelForCausalLM.from_pretrained(run_dir / "init_model")
    assert not torch.equal(final.model.embed_tokens.weight, init.model.embed_tokens.weight)


class Crash(Exception):
    pass


def crash_after(last_step: int) -> Callable[[int, dict[str, float]], None]:
    """`on_step_end` of a trainer that dies after `last_step` (logged; checkpointed only
    when it is a save step)."""

    def on_step_end(step: int, metrics: dict[str, float]) -> None:
        if step == last_step:
            raise Crash

    return on_step_end


def test_resume_reproduces_the_uninterrupted_run(tmp_path, fixed_threads):
    cfg = load_config(None, SMALL)
    train(cfg, tmp_path / "straight")

    with pytest.raises(Crash):  # step 3 is logged but not checkpointed: resume must redo it
        train(cfg, tmp_path / "resumed", on_step_end=crash_after(3))
    assert latest_checkpoint(tmp_path / "resumed").name == "step_000002"
    train(load_config(tmp_path / "resumed" / "config.toml"), tmp_path / "resumed", resume=True)

    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the crashed step 3 appears once
    assert [r["training/weight_version"] for r in resumed] == [1, 2, 3, 4]  # the checkpoint's, counted on
    for a, b in zip(straight, resumed):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert a[key] == b[key], (a["step"], key)
    fa = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final_model")
    fb = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final_model")
    for p, q in zip(fa.parameters(), fb.parameters()):
        assert torch.equal(p, q)


def test_ctrl_c_saves_a_consistent_checkpoint_and_resume_continues(tmp_path):
    """SIGINT mid-run: the step in progress finishes, is saved, exit code 130; resume goes on."""
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *SMALL]
    args = [a for a in args if not a.startswith("trainer.total_steps")] + ["trainer.total_steps=500"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    last_logged = _metrics(run_dir)[-1]["step"]
    assert latest_checkpoint(run_dir).name == f"step_{last_logged:06d}"
    cfg = load_config(run_dir / "config.toml", ["trainer.total_steps=" + str(last_logged + 1)])
    state = train(cfg, run_dir, resume=True)
    assert state.step == last_logged + 1
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, last_logged + 2))


def test_cli_refuses_to_overwrite_a_run(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--resume" in proc.stderr


def test_a_config_error_found_while_loading_leaves_no_run_behind(tmp_path):
    """Most config errors come before anything is written (tests/test_config.py); one that
    only the loaded tokenizer can reveal removes what the start wrote (config.toml,
    init_model/), so the corrected command may use the same --run-dir."""
    from polyrl.cli import _train_main
    from polyrl.config import ConfigError
    from polyrl.trainer.distributed import DataParallel

    run_dir = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "data.apply_chat_template=true"])  # the tiny tokenizer has none
    with pytest.raises(ConfigError, match="data.apply_chat_template"):
        _train_main(cfg, run_dir, resume=False, dp=DataParallel())
    assert not run_dir.exists()


@pytest.mark.slow
def test_grpo_learns_the_copy_task(copy_run):
    """A sign or masking error in the learner shows up here: 40 steps must raise the reward.
    (The run is conftest.py's `copy_run`, which tests/test_lora.py starts from too.)"""
    rewards = [r["critic/score/mean"] for r in _metrics(copy_run)]
    assert sum(rewards[-5:]) / 5 > rewards[0] + 0.15, rewards


def test_dataset_task_with_math_reward(tmp_path):
    """GSM8K-format jsonl through `datasets`, scored by math-verify in the reward pool."""
    rows = [{"question": f"{a}+{a}=", "answer": f"steps\n#### {2 * a}"} for a in range(10)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None, [*SMALL, "trainer.total_steps=2", "data.task=dataset", f"data.path={data}", "data.format=gsm8k"]
    )
    state = train(cfg, tmp_path / "run")
    assert state.step == 2
    rows = _metrics(tmp_path / "run")
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)


def test_a_length_schedule_sets_each_steps_budget(tmp_path):
    """rollout.max_new_tokens_schedule: [[1, 8], [3, 2]] gives steps 1-2 eight tokens and
    steps 3-4 two (ignore_eos: every sample takes its whole budget); a bad schedule is
    refused with the key's name."""
    overrides = [*SMALL, "rollout.max_new_tokens=8", "rollout.ignore_eos=true", "trainer.save_every=0"]
    cfg = load_config(None, [*overrides, "rollout.max_new_tokens_schedule=[[1, 8], [3, 2]]"])
    assert [cfg.rollout.budget_at(s) for s in (1, 2, 3, 4)] == [8, 8, 2, 2]
    train(cfg, tmp_path / "run")
    rows = _metrics(tmp_path / "run")
    assert [(r["response_length/max"], r["response_length/min"]) for r in rows] == [(8, 8), (8, 8), (2, 2), (2, 2)]
    assert all(r["response_length/clip_ratio"] == 1.0 for r in rows)  # against each step's own budget
    for bad, says in (("[[3, 2], [1, 8]]", "steps must rise"), ("[[1, 9]]", "budgets must lie")):
        with pytest.raises(ValueError, match=says):
            load_config(None, [*overrides, f"rollout.max_new_tokens_schedule={bad}"])
