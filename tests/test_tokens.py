"""Where a token comes from: a token file (`--token-file`, the `*.token_file` keys, a run's
manager.json) or the environment (POLYRL_TOKEN, POLYRL_TOKEN_FILE), in every command that
takes one, so that none has to be on a command line, where `ps` shows it to every user of
the machine; and what `polyrl status` says when it was given none (issue 38, 6 and 15b)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from chaos_harness.harness import chaos_manager_config, wait_for
from polyrl.launch.start import write_owner_only
from polyrl.manager.main import ManagerThread

ENV = {k: v for k, v in os.environ.items() if k not in ("POLYRL_TOKEN", "POLYRL_TOKEN_FILE")} | {"COLUMNS": "250"}
"""No token from the environment unless a test puts one there; wide enough for one line."""


def polyrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "polyrl.cli", *args]
    return subprocess.run(
        command, env=env or ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_status_without_a_token_says_none_was_given_and_where_to_find_one() -> None:
    with ManagerThread(chaos_manager_config()) as mt:  # a manager with a token, as polyrl train starts it
        out = polyrl("status", mt.url)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 1, text
    assert len(text.splitlines()) == 1, text
    assert "no token given" in text and "manager.json" in text and "refused" not in text, text


@pytest.fixture
def token_files(tmp_path: Path) -> tuple[str, Path, Path]:
    """A token, a file holding it (with a line end, as `echo` writes it), and a run's
    manager.json holding it."""
    token = secrets.token_hex(16)
    plain, run_info = tmp_path / "token", tmp_path / "manager.json"
    plain.write_text(f"{token}\n")
    run_info.write_text(json.dumps({"url": "http://127.0.0.1:5000", "token": token}))
    return token, plain, run_info


def test_manager_and_status_take_the_token_from_a_file_or_the_environment(
    token_files: tuple[str, Path, Path], tmp_path: Path
) -> None:
    token, plain, run_info = token_files
    ready = tmp_path / "url"
    manager = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyrl.cli",
            "manager",
            "--port",
            "0",
            "--token-file",
            str(plain),
            "--ready-file",
            str(ready),
        ],
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: ready.exists() or manager.poll() is not None, 60, "the manager to serve")
        url = ready.read_text()
        assert token not in cmdline(manager.pid)
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/v1/workers", headers=headers).status_code == 200  # the file's token is the manager's
        assert httpx.get(f"{url}/v1/workers", headers={"Authorization": "Bearer x"}).status_code == 401

        assert polyrl("status", url, "--token-file", str(run_info)).returncode == 0  # a run's manager.json
        assert polyrl("status", url, env=ENV | {"POLYRL_TOKEN_FILE": str(plain)}).returncode == 0
        assert polyrl("status", url, env=ENV | {"POLYRL_TOKEN": token}).returncode == 0
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token")
        assert polyrl("status", url, "--token-file", str(wrong)).returncode == 1

        empty = tmp_path / "empty"
        empty.write_text("\n")
        for args in (["--token-file", str(empty)], ["--token-file", str(tmp_path / "missing")]):
            out = polyrl("status", url, *args)
            assert out.returncode == 2 and "--token-file" in out.stderr and len(out.stderr.splitlines()) == 1, (
                out.stderr
            )
    finally:
        manager.terminate()
        manager.wait(timeout=30)


def test_a_bad_token_file_stops_train_and_manager_before_they_start(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("two words")  # not a token, and not to be echoed
    run_dir = tmp_path / "run"
    out = polyrl("train", "--run-dir", str(run_dir), f"manager.token_file={secret}")
    assert out.returncode == 2 and out.stderr.startswith("config error: manager.token_file:"), out.stderr
    assert "holds no token" in out.stderr and "words" not in out.stderr and not run_dir.exists()
    out = polyrl("manager", "--port", "0", "--token-file", str(tmp_path / "missing"))
    assert out.returncode == 2 and "config error: manager.token_file: cannot read" in out.stderr, out.stderr
    out = polyrl("manager", "--port", "0", f"manager.read_token_file={secret}")
    assert out.returncode == 2 and "config error: manager.read_token_file:" in out.stderr, out.stderr


@pytest.mark.slow
def test_train_and_a_worker_that_joins_it_take_the_token_from_files(
    token_files: tuple[str, Path, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The main job's way of adding a worker: `polyrl worker ... --token-file RUN_DIR/manager.json`,
    to a `polyrl train` whose token came from `manager.token_file`; neither command line
    holds the token."""
    token, plain, _ = token_files
    run_dir = tmp_path / "run"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyrl.cli",
            "train",
            "--run-dir",
            str(run_dir),
            "manager.port=0",
            "fleet.num_workers=0",
            "fleet.min_workers=1",
            "fleet.ready_timeout_s=60",
            "trainer.total_steps=2",
            "trainer.save_every=0",
            "logging.console=false",
            "logging.tensorboard=false",
            f"manager.token_file={plain}",
        ],
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    worker = None
    try:
        info = run_dir / "manager.json"
        wait_for(lambda: info.exists() or trainer.poll() is not None, 120, "the run's manager.json")
        assert json.loads(info.read_text())["token"] == token
        assert info.stat().st_mode & 0o777 == 0o600
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polyrl.cli",
                "worker",
                "--model",
                str(run_dir / "init_model"),
                "--port",
                "0",
                "--manager",
                json.loads(info.read_text())["url"],
                "--token-file",
                str(info),
                "--worker-id",
                "joined",
            ],
            env=ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        assert token not in cmdline(worker.pid) and token not in cmdline(trainer.pid)
        output, _ = trainer.communicate(timeout=240)  # it waits for a worker (fleet.min_workers=1): this one
        assert trainer.returncode == 0, output[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and rows[-1]["training/num_workers"] >= 1, rows
        assert token not in output
    finally:
        for proc in (trainer, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_runs_token_file_is_written_whole_and_owner_only(tmp_path: Path) -> None:
    """A reader polling for manager.json sees it whole or not at all (the file appears by a
    rename), and it is never readable by others, even replacing a readable one."""
    info = tmp_path / "manager.json"
    info.write_text("old")
    os.chmod(info, 0o644)
    (tmp_path / "manager.json.tmp").write_text("a leftover")  # from a run killed mid-write
    write_owner_only(info, '{"token": "t"}')
    assert json.loads(info.read_text()) == {"token": "t"}
    assert info.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manager.json"]
