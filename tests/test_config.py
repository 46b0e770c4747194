"""Config: TOML + dotted overrides, and one-line errors naming the key (exit code 2 via CLI)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

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


def _taken_port() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


HEAVY = ("torch", "transformers", "datasets")
"""Config errors come before these imports (seconds of them): the time budget is 2 s."""


# Each case: the command after `polyrl`, and the text the one error line must hold.
# {tmp} is the test's directory, {port} a port held open by the test.
CLI_ERRORS = {
    "unknown key": (["train", "trainer.lrr=1"], "trainer.lrr: unknown key; did you mean trainer.lr?"),
    "unknown section": (["train", "traner.lr=1"], "traner: unknown key; did you mean trainer?"),
    "bad value": (["train", "trainer.lr=abc"], "trainer.lr"),
    "config file": (["train", "--config", "/nonexistent.toml"], "not found"),
    "unknown task": (["train", "data.task=nosuchtask"], "data.task: unknown task 'nosuchtask'"),
    "missing data file": (["train", "data.task=dataset", "data.path={tmp}/none.jsonl"], "data.path: file not found"),
    "wrong columns": (["train", "data.task=dataset", "data.path={tmp}/qa.jsonl"], "needs column 'prompt'"),
    "malformed jsonl": (
        ["train", "data.task=dataset", "data.path={tmp}/bad.jsonl"],
        "config error: data.path: {tmp}/bad.jsonl line 1 is not JSON: Expecting value (column 1)",
    ),
    "malformed jsonl, later line": (
        ["train", "data.task=dataset", "data.path={tmp}/bad3.jsonl"],
        "data.path: {tmp}/bad3.jsonl line 3 is not JSON: Expecting ',' delimiter",
    ),
    "wrong columns, parquet": (
        ["train", "data.task=dataset", "data.path={tmp}/qa.parquet", "data.format=openr1"],
        "needs column 'problem'",
    ),
    "reward module": (["train", "reward.functions=['no_such_module:score']"], "cannot import module 'no_such_module'"),
    "reward attribute": (["train", "reward.functions=['polyrl.data.tasks:no_such_fn']"], "has no 'no_such_fn'"),
    "reward functions for scored groups": (
        ["train", "data.source=agent", "data.agent=a:b", "data.path={tmp}/qa.jsonl", "reward.functions=['a.b:c']"],
        "reward.functions: data.source = 'agent' brings its groups scored",
    ),
    "taken port": (["train", "manager.port={port}"], "manager.port: 127.0.0.1:{port} is in use"),
    "model path": (["train", "model.path=/no/such/dir"], "model.path: /no/such/dir does not exist"),
    "model file": (["train", "model.path={tmp}/qa.jsonl"], "is not a directory"),
    "manager port": (["manager", "--port", "{port}"], "manager.port: 127.0.0.1:{port} is in use"),
    "worker port": (
        ["worker", "--model", "{tmp}/model", "--port", "{port}"],
        "worker.port: 127.0.0.1:{port} is in use",
    ),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_config_errors_are_one_fast_line_before_anything_is_written(case, tmp_path):
    """Exit 2, one line naming the problem, before torch & co. are imported and before the
    run directory exists (so the corrected command may use the same --run-dir)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "qa.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('not json\n{"prompt": "1+1=", "answer": "2"}\n')  # issue 38's file
    (tmp_path / "bad3.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"\n')
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "qa.parquet")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    command, needle = CLI_ERRORS[case]
    with _taken_port() as taken:
        fill = {"tmp": tmp_path, "port": taken.getsockname()[1]}
        argv = [a.format(**fill) for a in command]
        if command[0] == "train":
            argv[1:1] = ["--run-dir", str(run_dir)]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "polyrl.cli", *argv], capture_output=True, text=True, timeout=60
        )
        elapsed_s = time.perf_counter() - t0
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("config error: "), lines
    assert needle.format(**fill) in lines[0]
    assert not [m for m in imported if m.split(".")[0] in HEAVY], "heavy imports before the error"
    assert not run_dir.exists()
    # 2 s is the budget (0.15-0.5 s measured on 2 idle cores); the margin is for loaded CI boxes,
    # and the import check above is what keeps it fast.
    assert elapsed_s < 4, elapsed_s


def test_a_roles_start_up_imports_run_without_collections_and_stay_frozen():
    """`polyrl train`, `worker` and `tiny-model` import torch and transformers inside
    `gc_heap.start_up_imports`: no automatic collection while they load (it walked the
    growing heap again and again), and what they leave is frozen (or the deferred
    collections would come due right after). In a fresh interpreter: the freeze is for
    the process's life."""
    code = """
import gc
from polyrl.gc_heap import start_up_imports
before = gc.get_freeze_count()
with start_up_imports():
    paused = not gc.isenabled()
    kept = [[i] for i in range(1000)]  # what an import leaves
print(paused, gc.isenabled(), gc.get_freeze_count() - before >= len(kept))
gc.disable()
with start_up_imports():
    pass
print(gc.isenabled())  # the caller's setting is kept
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "True", "False"], out.stdout + out.stderr


def test_learner_switches_are_auto_or_bool():
    assert load_config(None).trainer.working_copy == "auto"
    cfg = load_config(None, ["trainer.working_copy=false", "trainer.compile_layers=true"])
    assert cfg.trainer.working_copy is False and cfg.trainer.compile_layers is True
    assert load_config(None, ["trainer.compile_layers=auto"]).trainer.compile_layers == "auto"
    with pytest.raises(ConfigError, match="trainer.compile_layers"):
        load_config(None, ["trainer.compile_layers='sometimes'"])


def test_the_ray_launcher_needs_ray_and_its_keys_need_the_launcher(monkeypatch):
    from polyrl import preflight

    with pytest.raises(ConfigError, match="fleet.ray_num_gpus need fleet.launcher=ray"):
        load_config(None, ["fleet.ray_num_gpus=1"])
    cfg = load_config(None, ["fleet.launcher=ray", "fleet.ray_num_gpus=1", "manager.port=0"])
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    with pytest.raises(ConfigError, match=r"fleet.launcher: ray needs Ray: pip install 'polyrl\[ray\]'"):
        preflight.preflight(cfg)
