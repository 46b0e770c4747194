"""Stopping a real run from outside: Ctrl-C typed into its terminal (once: finish the step
and save; twice: stop now) and kill -9 of the trainer. Remote mode with a launched worker
and the reward pool, as the default main job runs; the trainer is a `polyrl train`
process whose controlling terminal is a pty, so a Ctrl-C reaches its whole foreground
process group, as a keyboard's does. After each stop: a checkpoint that loads and agrees
with itself, no step trained on scores that no reward function gave, no process of the
run left; `--resume` continues, and the last one finishes."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from terminal import read_terminal
from transformers import AutoModelForCausalLM

from chaos_harness.harness import read_steps
from polyrl.config import load_config
from polyrl.lifetime import HURRY, wait_unless_hurried
from polyrl.trainer.checkpoint import MODEL_DIR, STATE_FILE, latest_checkpoint, read_trainer_state
from polyrl.trainer.loop import StopRequest, train

TOTAL_STEPS = 14
OVERRIDES = [
    "logging.console=false",
    "logging.tensorboard=false",
    "manager.port=0",
    "fleet.num_workers=1",
    f"trainer.total_steps={TOTAL_STEPS}",
    "trainer.save_every=2",
    "trainer.train_batch_size=8",
    "trainer.ppo_mini_batch_size=4",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    'reward.functions=["reward_fns:one_plus_length"]',
]
"""Small; the default reward goes through the pool too, but this one's scores are all >= 1."""


class Trainer:
    """`polyrl train` in a session of its own, with a pty as its controlling terminal (or
    none); everything it writes is kept."""

    def __init__(self, args: list[str], env: dict[str, str], terminal: bool) -> None:
        self.output = bytearray()
        self.master: int | None = None
        if terminal:
            self.master, slave = os.openpty()
            io = dict(stdin=slave, stdout=slave, stderr=slave, preexec_fn=_take_terminal)
        else:
            io = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        command = [sys.executable, "-m", "polyrl.cli", "train", *args]
        self.proc = subprocess.Popen(command, env=env, start_new_session=True, **io)
        if terminal:
            os.close(slave)
        source = self.master if terminal else self.proc.stdout.fileno()
        self._reader = threading.Thread(target=read_terminal, args=(source, self.output), daemon=True)
        self._reader.start()

    def type_ctrl_c(self) -> None:
        assert self.master is not None
        os.write(self.master, b"\x03")

    def wait(self, timeout_s: float = 90) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(5)
        if self.master is not None:
            os.close(self.master)
        return code

    def text(self) -> str:
        """What it wrote, without the terminal's colours."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.output.decode(errors="replace"))


def _take_terminal() -> None:
    """In the child, after setsid: the pty on fd 0 becomes its controlling terminal, and its
    process group the terminal's foreground group."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _rows(run_dir: Path) -> list[dict]:
    return read_steps(run_dir / "metrics.jsonl")  # whole lines only: the trainer may be writing one


def _wait_for_step(trainer: Trainer, run_dir: Path, step: int, timeout_s: float = 120) -> None:
    """Until `trainer` has logged `step` (a resumed one first drops the rows of steps past its
    checkpoint, then says so)."""
    deadline = time.monotonic() + timeout_s
    while (
        "--resume" in trainer.proc.args
        and "resumed from" not in trainer.text()
        or not any(r["step"] >= step for r in _rows(run_dir))
    ):
        assert trainer.proc.poll() is None, trainer.text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in {timeout_s:.0f}s: {trainer.text()[-3000:]}"
        time.sleep(0.05)


def _wait_until(trainer: Trainer, condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert trainer.proc.poll() is None, trainer.text()[-3000:]
        assert time.monotonic() < deadline, f"not {what} in {timeout_s:.0f}s: {trainer.text()[-3000:]}"
        time.sleep(0.01)


def _checkpoint_files(run_dir: Path) -> dict[str, int]:
    """Each checkpoint's trainer state file -> its modification time (ns): a save, or a save
    again of the same step, changes it."""
    return {p.parent.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").glob(f"step_*/{STATE_FILE}")}


def _run_processes(tag: str) -> dict[int, str]:
    """Every live process whose environment carries the run's tag (children inherit it, and
    an orphan keeps it): pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if tag.encode() not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found[int(entry.name)] = cmdline
    return found


def _assert_none_left(tag: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _run_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of the run outlived it: {left}"


def _check_stopped_run(run_dir: Path, output: str) -> int:
    """The newest checkpoint loads and agrees with itself; every logged step was scored by
    the function. Returns the checkpoint's step."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, output[-3000:]
    step = read_trainer_state(ckpt)["state"]["step"]
    assert ckpt.name == f"step_{step:06d}"
    AutoModelForCausalLM.from_pretrained(ckpt / MODEL_DIR)
    rows = _rows(run_dir)
    assert rows and all(r["critic/score/min"] >= 1.0 and r["reward/failed_samples"] == 0 for r in rows), rows
    assert "scoring 0.0" not in output
    assert "died (exit code" not in output  # the weight publisher's process, say
    return step


@pytest.mark.slow
def test_ctrl_c_twice_and_kill_minus_9_leave_a_resumable_run_and_no_process(tmp_path: Path) -> None:
    run_dir, tag = tmp_path / "run", f"polyrl-test-{uuid.uuid4().hex}"
    tests_dir = Path(__file__).parent
    src_dir = tests_dir.parent / "src"
    hold, held = tmp_path / "hold", tmp_path / "hold.held"
    env = os.environ | {
        "POLYRL_TEST_RUN": tag,
        "PYTHONPATH": f"{src_dir}{os.pathsep}{tests_dir}",
        "COLUMNS": "200",
        "POLYRL_TEST_CRASH_ONCE": str(tmp_path / "crashed"),
        "POLYRL_TEST_HOLD": str(hold),
    }
    try:
        # One Ctrl-C: the step in progress finishes and is saved; exit 130.
        first = Trainer(["--run-dir", str(run_dir), *OVERRIDES], env, terminal=True)
        _wait_for_step(first, run_dir, 3)
        first.type_ctrl_c()
        assert first.wait() == 130, first.text()[-3000:]
        out = first.text()
        # the pool worker died once (the function's doing), and was retried; Ctrl-C killed none
        assert (tmp_path / "crashed").exists() and out.count("its worker died") == 1 and "retry 1 of 2" in out
        step = _check_stopped_run(run_dir, out)
        assert step == _rows(run_dir)[-1]["step"] >= 3  # the interrupted step was finished and saved
        _assert_none_left(tag)

        # --resume goes on; two Ctrl-Cs: stop now, without saving the step in progress. A step
        # takes ~50 ms here, so its scoring is held (reward_fns.one_plus_length) for the second
        # Ctrl-C to find it unfinished, and the first to be handled before the second is typed.
        first_step = step
        second = Trainer(["--resume", str(run_dir)], env, terminal=True)
        _wait_for_step(second, run_dir, step + 1)
        hold.touch()
        _wait_until(second, lambda: held.exists(), "a step held in its scoring")
        saved = _checkpoint_files(run_dir)  # every earlier step's save is done: a held step comes after it
        second.type_ctrl_c()
        _wait_until(second, lambda: "Ctrl-C: finishing this step" in second.text(), "the first Ctrl-C handled")
        second.type_ctrl_c()
        assert second.wait() == 130, second.text()[-3000:]
        hold.unlink()
        assert "Ctrl-C again: stopping now without saving this step" in second.text(), second.text()[-3000:]
        assert "its worker died" not in second.text()
        step = _check_stopped_run(run_dir, second.text())
        _assert_none_left(tag)
        # the checkpoint is the last one saved before the interrupted step, written by no one since
        rows = _rows(run_dir)
        assert _checkpoint_files(run_dir) == saved, (saved, _checkpoint_files(run_dir))
        logged = [int(r["step"]) for r in rows]
        assert logged == list(range(1, logged[-1] + 1)) and logged[-1] > first_step  # the held step: logged[-1] + 1
        assert step == max([first_step] + [s for s in logged if s > first_step and s % 2 == 0])  # trainer.save_every=2
        state = read_trainer_state(latest_checkpoint(run_dir))["state"]
        assert state["cursor"] == step * 8 and state["weight_version"] == rows[step - 1]["training/weight_version"]

        # kill -9 of a training trainer: every process of the run is gone 5 s later.
        third = Trainer(["--resume", str(run_dir)], env, terminal=False)
        _wait_for_step(third, run_dir, step + 1)
        running = _run_processes(tag)
        for role in (
            "polyrl.cli manager",
            "--worker-id local",
            "--worker-id w0",
            "polyrl.transfer.serve",
            "multiprocessing.spawn",
            "multiprocessing.resource_tracker",
        ):
            assert any(role in cmd for cmd in running.values()), (role, running)
        os.kill(third.proc.pid, signal.SIGKILL)
        third.wait()
        _assert_none_left(tag, within_s=5.0)
        step = _check_stopped_run(run_dir, third.text())

        # and the run finishes: in this process and colocated, which starts no process (the
        # remote resumes above went on from their checkpoints already), to keep the test short
        state = train(load_config(run_dir / "config.toml", ["rollout.mode=local"]), run_dir, resume=True)
        assert state.step == TOTAL_STEPS and [r["step"] for r in _rows(run_dir)] == list(range(1, TOTAL_STEPS + 1))
        assert _check_stopped_run(run_dir, "") == TOTAL_STEPS
        assert (run_dir / "final_model").is_dir()
    finally:
        for pid in _run_processes(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


PIPED_JOB = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, lambda *_: None)  # the shell: outside the job's group, the Ctrl-C is not for it
tee = subprocess.Popen(["tee", sys.argv[1]], stdin=subprocess.PIPE)
trainer = subprocess.Popen(sys.argv[3:], stdout=tee.stdin, stderr=subprocess.STDOUT)
tee.stdin.close()
codes = f"{trainer.wait()} {tee.wait()}"
with open(sys.argv[2], "w") as f:
    f.write(codes)
"""
"""`polyrl train ... 2>&1 | tee LOG` as a shell runs it in a terminal: the trainer and tee
in one process group, the terminal's foreground group, so a typed Ctrl-C reaches both.
argv: LOG, where to write "<trainer's exit code> <tee's>", the trainer's command."""


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_although_tee_died_of_it(tmp_path: Path) -> None:
    """One Ctrl-C to `polyrl train ... 2>&1 | tee log`: tee dies of it, and from then on the
    trainer's stdout and stderr are a pipe nobody reads (EPIPE). The step in progress still
    finishes, is saved, and the trainer exits 130. The console is on, as by default: its
    step line is what hit the broken pipe first."""
    run_dir, tag = tmp_path / "run", f"polyrl-test-{uuid.uuid4().hex}"
    tests_dir = Path(__file__).parent
    hold, held, log_file, codes = tmp_path / "hold", tmp_path / "hold.held", tmp_path / "train.log", tmp_path / "codes"
    env = os.environ | {
        "POLYRL_TEST_RUN": tag,
        "PYTHONPATH": f"{tests_dir.parent / 'src'}{os.pathsep}{tests_dir}",
        "POLYRL_TEST_HOLD": str(hold),
    }
    overrides = [o for o in OVERRIDES if not o.startswith("logging.console")] + ["trainer.save_every=1000"]
    train = [sys.executable, "-m", "polyrl.cli", "train", "--run-dir", str(run_dir), *overrides]
    master, slave = os.openpty()
    hold.touch()  # the first step waits in its scoring: the Ctrl-C comes mid-step
    job = subprocess.Popen(
        [sys.executable, "-c", PIPED_JOB, str(log_file), str(codes), *train],
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_take_terminal,
    )
    os.close(slave)
    output = bytearray()
    reader = threading.Thread(target=read_terminal, args=(master, output), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not held.exists():
            assert job.poll() is None and time.monotonic() < deadline, output.decode(errors="replace")[-3000:]
            time.sleep(0.05)
        os.write(master, b"\x03")
        time.sleep(1.0)  # the Ctrl-C is handled, tee is gone
        hold.unlink()
        job.wait(timeout=90)
        trainer_code, tee_code = (int(c) for c in codes.read_text().split())
        assert tee_code == -signal.SIGINT  # the pipe's reader died of the Ctrl-C
        assert trainer_code == 130, log_file.read_text()[-3000:]
        assert _check_stopped_run(run_dir, log_file.read_text()) == _rows(run_dir)[-1]["step"] == 1
        assert "run directory" in log_file.read_text()  # tee kept what came before
        _assert_none_left(tag)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        reader.join(5)
        os.close(master)
        for pid in _run_processes(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


POOL_IN_A_TERMINAL = """
import signal, sys, time
from polyrl.data.rewards import RewardPool
interrupted = []
signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))  # as the trainer: Ctrl-C is its to handle
pool = RewardPool(["reward_fns:length_reward"])
assert pool.score(["p"], ["abc"]) == [3.0]
print("ready", flush=True)
while not interrupted:
    time.sleep(0.01)
print("interrupted", flush=True)
sys.stdin.readline()
assert pool.score(["p"], ["abcd"]) == [4.0]
"""


def _session_and_group(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[3]), int(fields[2])  # session, process group


def test_the_resource_tracker_shares_the_trainers_session_ignores_ctrl_c_and_leaves_with_it() -> None:
    """What README says of multiprocessing's resource tracker, the one child Python starts
    for the trainer (with the reward pool's first worker) in the trainer's session: a
    Ctrl-C typed into the terminal reaches it and changes nothing, and it is gone once
    the trainer is."""
    tag = f"polyrl-test-{uuid.uuid4().hex}"
    tests_dir = Path(__file__).parent
    env = os.environ | {"POLYRL_TEST_RUN": tag, "PYTHONPATH": f"{tests_dir.parent / 'src'}{os.pathsep}{tests_dir}"}
    master, slave = os.openpty()
    owner = subprocess.Popen(
        [sys.executable, "-c", POOL_IN_A_TERMINAL],
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_take_terminal,
    )
    os.close(slave)
    output = bytearray()
    reader = threading.Thread(target=read_terminal, args=(master, output), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in output:
            assert owner.poll() is None and time.monotonic() < deadline, output.decode(errors="replace")
            time.sleep(0.02)
        trackers = [pid for pid, cmd in _run_processes(tag).items() if "multiprocessing.resource_tracker" in cmd]
        assert len(trackers) == 1, _run_processes(tag)
        tracker = trackers[0]
        assert _session_and_group(tracker) == _session_and_group(owner.pid) == (owner.pid, owner.pid)
        os.write(master, b"\x03")
        while b"interrupted" not in output:
            assert owner.poll() is None and time.monotonic() < deadline, output.decode(errors="replace")
            time.sleep(0.02)
        time.sleep(0.5)
        assert tracker in _run_processes(tag)  # the Ctrl-C reached it too, and it lives on
        os.write(master, b"\n")  # the pool scores again, then the owner exits
        assert owner.wait(timeout=30) == 0, output.decode(errors="replace")
        _assert_none_left(tag)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        reader.join(5)
        os.close(master)


def test_ctrl_c_during_the_cleanup_hurries_it_instead_of_cutting_it_short() -> None:
    """In the loop: the first Ctrl-C asks for a stop, the second stops at once. During the
    start-up the first stops at once. In a cleanup, Ctrl-C only hurries the children's end
    (a cleanup cut short would leave them running); a child's stop then no longer waits
    for it to drain."""
    with StopRequest() as stop:
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
        assert stop.closing and not HURRY.is_set()
        stop._handle(signal.SIGINT, None)  # in the start-up's cleanup: hurry it, do not cut it
        assert HURRY.is_set()
    with StopRequest() as stop:
        stop.started = True
        stop._handle(signal.SIGINT, None)
        assert stop.requested and not HURRY.is_set()
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
        assert HURRY.is_set()
    with StopRequest() as stop:
        assert not HURRY.is_set()  # each run starts unhurried
        stop.started = stop.closing = True
        stop._handle(signal.SIGINT, None)  # no KeyboardInterrupt
        assert HURRY.is_set()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            start = time.monotonic()
            assert not wait_unless_hurried(child, 30.0)
            assert time.monotonic() - start < 1.0
        finally:
            child.kill()
            child.wait()
        with pytest.raises(KeyboardInterrupt):  # a user who insists still gets out
            stop._handle(signal.SIGINT, None)
    HURRY.clear()


def test_a_child_started_with_the_parent_death_env_dies_with_its_parent(tmp_path: Path) -> None:
    """`polyrl.lifetime.parent_death_env`: the child asks for its parent-death signal
    itself, after exec (no `preexec_fn`, which can hang a threaded parent's child between
    fork and exec). A middle process starts such a child and is killed -9: the child goes
    too. A child whose named parent is not its parent (it died before the child asked)
    leaves at once."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, time; from polyrl.lifetime import die_with_parent_from_env; die_with_parent_from_env(); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    middle = (
        "import subprocess, sys, os, time; from polyrl.lifetime import parent_death_env; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], env=os.environ | parent_death_env()); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", middle])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child_pid), "the child outlived its parent"
    finally:
        proc.kill()
    env = os.environ | {"POLYRL_DIE_WITH_PARENT": f"{os.getpid() + 10**6}:{int(signal.SIGTERM)}"}  # no such parent
    orphan = subprocess.run([sys.executable, "-c", child.replace("time.sleep(60)", "")], env=env, timeout=30)
    assert orphan.returncode == 1


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
