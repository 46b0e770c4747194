"""Shared fixtures: one tiny model directory per session, built offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors (tests/test_triton_ops.py);
# the switch is read when a kernel is defined, so it is set before anything imports polyrl.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # reward functions for the spawn pool live here

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from polyrl.config import TinyModelConfig
    from polyrl.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(hidden_size=64, intermediate_size=128))
