"""What polyrl prints for people, as they meet it (issue 38): `polyrl status` through a pipe,
as a script or a cron job runs it; the trainer's log on a 120-column terminal (a pty) and
in a file. No line is broken for a width: a table is as wide as its rows, and a command
in a log line can be copied whole."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from terminal import read_terminal
from test_operator_view import register_fake

from chaos_harness.harness import TOKEN, chaos_manager_config
from polyrl.manager.main import ManagerThread
from polyrl.status import COLUMNS

WORKER_IDS = ("spot-worker-in-europe-west4-a", "spot-worker-in-us-central1-b")
"""Long ids: at rich's 80 columns off a terminal, the table was squeezed and every header cut."""

TRAIN = [
    "trainer.total_steps=1",
    "fleet.num_workers=0",
    "manager.port=0",
    "logging.tensorboard=false",
    "trainer.train_batch_size=8",
    "trainer.ppo_mini_batch_size=4",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]
"""One small step of the main job (remote mode: the manager and the trainer's own worker)."""


def _polyrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "polyrl.cli", *args]


def _env() -> dict[str, str]:
    """This environment without a width (rich reads COLUMNS before asking the terminal)."""
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "POLYRL_TOKEN")}


def _plain(output: bytes) -> str:
    """What a terminal shows, without colours and cursor moves."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode(errors="replace"))


# ------------------------------------------------------------------------------ polyrl status


def test_status_through_a_pipe_is_neither_squeezed_nor_wrapped() -> None:
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        for worker_id in WORKER_IDS:
            register_fake(mt, worker_id, usd_per_hour=0.42)
        shown = subprocess.run(
            _polyrl("status", mt.url, "--token", TOKEN), capture_output=True, text=True, env=_env(), timeout=60
        )
        refused = subprocess.run(
            _polyrl("status", mt.url, "--token", "wrong"), capture_output=True, text=True, env=_env(), timeout=60
        )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    [summary] = [line for line in lines if "step/version" in line]
    assert summary.startswith(mt.url) and summary.endswith("lost 0"), summary
    [header] = [line for line in lines if " worker " in line]
    assert all(f" {name} " in header for name in COLUMNS), header
    for worker_id in WORKER_IDS:
        [row] = [line for line in lines if worker_id in line]
        assert re.search(r" active .* v0 .* 0\.42 ", row), row
    assert "…" not in shown.stdout
    assert refused.returncode == 1 and refused.stdout == "", refused.stdout
    [error] = refused.stderr.splitlines()  # one line, on stderr
    assert mt.url in error and "token" in error, error


def test_status_watch_through_a_pipe_prints_every_refresh() -> None:
    """`polyrl status --watch >> log`: one table per refresh, until Ctrl-C (rich's live
    display showed nothing off a terminal, then the last table at the end)."""
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, WORKER_IDS[0])
        command = _polyrl("status", mt.url, "--token", TOKEN, "--watch", "--interval", "0.1")
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            preexec_fn=_ctrl_c_as_from_a_shell,
        )
        try:
            lines = _lines_of(proc.stdout)
            deadline = time.monotonic() + 30
            while lines.count("1 worker") < 3 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            num_tables = lines.count("1 worker")
            signals = _signal_state(proc.pid)
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"Ctrl-C did not stop it ({num_tables} tables; {signals})")
            assert code == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert num_tables >= 3, lines


def _ctrl_c_as_from_a_shell() -> None:
    """In the child before it runs: SIGINT at its default and not blocked, as an
    interactive shell starts a command, whatever this test process inherited or set
    (a child inherits an ignored or blocked SIGINT, and then Ctrl-C never reaches it)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    """The process's blocked and ignored signal masks (for a failure's message)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "no /proc status"
    return ", ".join(line for line in status if line.startswith(("SigBlk", "SigIgn")))


def _lines_of(stream: IO[str] | None) -> list[str]:
    """The stream's lines (stripped) as they come, read by a thread."""
    assert stream is not None
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.strip() for line in stream), daemon=True).start()
    return lines


# --------------------------------------------------------------------------- the trainer's log


@pytest.mark.slow
def test_the_add_a_worker_command_is_one_line_on_a_120_column_terminal(tmp_path: Path) -> None:
    """The trainer logs the command that adds a worker; on a 120-column terminal rich's log
    handler broke it over three lines, which a copy and paste keeps."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # rows, columns
    output = bytearray()
    try:
        proc = _train(tmp_path / "run", stdout=slave)
    finally:
        os.close(slave)
    reader = threading.Thread(target=read_terminal, args=(master, output), daemon=True)
    reader.start()
    code = _wait(proc)
    reader.join(10)
    os.close(master)
    text = _plain(bytes(output))
    assert code == 0, text[-3000:]
    match = re.search(r"add a worker: (polyrl worker --model .*?manager\.json)", text, re.S)
    assert match is not None, text[-3000:]
    assert "\n" not in match.group(1), match.group(1)


@pytest.mark.slow
def test_a_log_file_gets_no_progress_bar(tmp_path: Path) -> None:
    """`polyrl train > train.log`: log lines and step lines, and no progress bar (rich
    printed the bar's last state when it stopped)."""
    log = tmp_path / "train.log"
    with log.open("wb") as out:
        code = _wait(_train(tmp_path / "run", stdout=out))
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "training done: 1 steps" in text
    assert not [line for line in text.splitlines() if "━" in line or line.startswith("train ")], text[-3000:]


def _train(run_dir: Path, stdout: int | IO[bytes]) -> subprocess.Popen[bytes]:
    command = _polyrl("train", "--run-dir", str(run_dir), *TRAIN)
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
    )


def _wait(proc: subprocess.Popen[bytes], timeout_s: float = 240) -> int:
    """Its exit code; killed (its children die with it, `polyrl.lifetime`) if it hangs."""
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
