"""Shared fixtures: one tiny model directory per session, built offline."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

# Collection imports torch, transformers and every test module: with the garbage collector
# paused meanwhile and what it loaded frozen once it is done, 3-4 s less CPU on 2 cores (the
# collector walked the growing heap again and again). As `polyrl.gc_heap.start_up_imports`.
gc.disable()

# OpenMP threads that find no work sleep at once instead of spinning for it first. The tests
# run two pytest workers on 2 cores, and an end-to-end test starts a trainer, a manager and
# workers of its own: a thread spinning for the next op held a core that another process was
# waiting for. The two agent examples side by side on this box took 155 and 182 s, and 59
# and 95 s with this (alone, one of them was 5-9% slower with it). Read by libgomp when torch
# loads it, so set before torch is imported; every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in its interpreter on CPU tensors (tests/test_triton_ops.py);
# the switch is read when a kernel is defined, so it is set before anything imports polyrl.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # reward functions for the spawn pool live here

torch.set_num_threads(2)


def pytest_collection_finish(session: pytest.Session) -> None:
    from polyrl.gc_heap import freeze_gc_heap

    gc.enable()
    freeze_gc_heap()


@pytest.fixture
def fixed_threads(monkeypatch: pytest.MonkeyPatch):
    """For runs compared bit for bit: torch's intra-op thread count held where it is. The
    process's governor (`polyrl.cpu_threads`) moves it with the machine's load, and a
    matmul split over another number of threads rounds differently (a resumed LoRA run's
    loss differed from the straight run's in the ninth digit after an engine test had
    left the governor at work)."""
    from polyrl import cpu_threads

    before = torch.get_num_threads()
    governor = cpu_threads.CpuThreads()
    governor.fix(before)
    monkeypatch.setattr(cpu_threads, "_process", governor)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from polyrl.config import TinyModelConfig
    from polyrl.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(hidden_size=64, intermediate_size=128))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA and a server certificate it signed for localhost and 127.0.0.1;
    paths by name: ca, cert, key (the venv has no `cryptography`: openssl's command line)."""
    import shutil

    from polyrl.tls import self_signed

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def copy_run(tmp_path_factory) -> Path:
    """The default job, colocated: the copy task from a from-scratch tiny model, 40 steps.
    Trained once per session: tests/test_train.py checks that it learns, and
    tests/test_lora.py trains LoRA on `reverse` from its final model."""
    from polyrl.config import load_config
    from polyrl.trainer.loop import train

    run_dir = tmp_path_factory.mktemp("copy") / "run"
    overrides = ["trainer.total_steps=40", "logging.console=false", "logging.tensorboard=false", "rollout.mode=local"]
    train(load_config(None, overrides), run_dir)
    return run_dir
