"""Config: TOML + dotted overrides, and one-line errors naming the key (exit code 2 via CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polyrl.config import ConfigError, load_config, save_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[trainer]\nlr = 1e-4\n[rollout]\nn = 4\n[data]\ntask = "copy"\n')
    cfg = load_config(path, ["trainer.lr=1e-6", "rollout.n=8", "reward.functions=['a.b:c']"])
    assert cfg.trainer.lr == 1e-6
    assert cfg.rollout.n == 8
    assert cfg.data.task == "copy"  # from the file, untouched by overrides
    assert cfg.reward.functions == ["a.b:c"]


def test_bare_string_override_and_roundtrip(tmp_path):
    cfg = load_config(None, ["data.task=reverse", "algo.tis_cap=0", "model.path=/some/dir"])
    assert cfg.data.task == "reverse" and cfg.model.path == "/some/dir"
    save_config(cfg, tmp_path / "saved.toml")
    assert load_config(tmp_path / "saved.toml") == cfg


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lrr=1", "trainer.lrr"),
        ("nosuch.section=1", "nosuch"),
        ("rollout.n=eight", "rollout.n"),
        ("rollout.n=0", "rollout.n"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("algo.loss_agg_mode='sum'", "algo.loss_agg_mode"),
        ("trainer.ppo_mini_batch_size=5", "trainer.train_batch_size"),
        ("reward.weights=[1.0]", "reward.weights"),
        ("rollout.mode='colocated'", "rollout.mode"),
        ("fleet.num_workers=-1", "fleet.num_workers"),
        ("fleet.churn_min_workers=3", "fleet.churn_min_workers"),
        ("manager.transfer.group_hosts=['10.0.0.1','10.0.0.2']", "group_hosts"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config error:")
    assert key in msg


def test_staleness_needs_a_rollout_that_can_run_ahead():
    assert load_config(None, ["rollout.max_staleness=1"]).rollout.max_staleness == 1  # remote, the default
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(None, ["rollout.mode=local", "rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.deterministic needs rollout.max_staleness = 0"):
        load_config(None, ["rollout.deterministic=true", "rollout.max_staleness=1"])


def test_min_workers_needs_workers():
    with pytest.raises(ConfigError, match="fleet.min_workers"):
        load_config(None, ["rollout.mode=local", "fleet.min_workers=1"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.lr"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["trainer.lr=abc"], "trainer.lr"),
        (["trainer.bogus=1"], "trainer.bogus: unknown key"),
        (["--config", "/nonexistent.toml"], "not found"),
        (["data.task=nosuchtask", "trainer.total_steps=1"], "data.task"),
    ],
)
def test_cli_config_error_exit_code(args, needle, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_learner_switches_are_auto_or_bool():
    assert load_config(None).trainer.working_copy == "auto"
    cfg = load_config(None, ["trainer.working_copy=false", "trainer.compile_layers=true"])
    assert cfg.trainer.working_copy is False and cfg.trainer.compile_layers is True
    assert load_config(None, ["trainer.compile_layers=auto"]).trainer.compile_layers == "auto"
    with pytest.raises(ConfigError, match="trainer.compile_layers"):
        load_config(None, ["trainer.compile_layers='sometimes'"])
