"""The long-tail workload of `benchmarks/spot_gpu.py`, checked on the CPU before any GPU
time is spent on it: its length distribution, and that `polyrl`'s own data path turns the
file into prompts with those budgets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from spot_gpu import longtail_budgets, write_workload  # noqa: E402

from polyrl.config import DataConfig  # noqa: E402
from polyrl.data.source import PromptSource  # noqa: E402
from polyrl.data.tasks import char_match_reward  # noqa: E402
from polyrl.preflight import _check_data  # noqa: E402


def test_longtail_budgets_have_the_asked_median_and_tail() -> None:
    budgets = np.array(longtail_budgets(20000, median=300, p99=3000, cap=100000, seed=1))
    assert abs(np.median(budgets) / 300 - 1) < 0.05
    assert abs(np.percentile(budgets, 99) / 3000 - 1) < 0.12
    top = np.sort(budgets)[-len(budgets) // 20 :]  # the longest 5% hold a large share of the tokens
    assert 0.25 < top.sum() / budgets.sum() < 0.5
    capped = longtail_budgets(2000, median=300, p99=3000, cap=1024, seed=1)
    assert max(capped) == 1024 and min(capped) >= 1
    assert capped == longtail_budgets(2000, median=300, p99=3000, cap=1024, seed=1)
    with pytest.raises(ValueError, match="need 0 < median < p99"):
        longtail_budgets(1, median=300, p99=300, cap=10)


def test_the_workload_file_becomes_prompts_with_those_budgets(tmp_path: Path, tiny_model_dir: Path) -> None:
    budgets = longtail_budgets(24, median=30, p99=300, cap=256)
    path = write_workload(tmp_path / "w.jsonl", 24, budgets)
    cfg = DataConfig(task="dataset", path=str(path), format="plain", max_new_tokens_key="max_new_tokens")
    _check_data(cfg)
    prompts = PromptSource(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), seed=0).take(24)
    assert sorted(p.max_new_tokens for p in prompts) == sorted(budgets)  # one epoch, shuffled
    # the reward the benchmark names takes the remaining columns: the answer itself scores
    # 1, its first half scores half the answer's length over the answer's length
    answers = [p.columns["answer"] for p in prompts]
    assert all(answers) and len(set(answers)) > 1
    assert char_match_reward([p.text for p in prompts], answers, answer=answers) == [1.0] * 24
    halves = [a[: len(a) // 2] for a in answers]
    expected = [(len(a) // 2) / len(a) for a in answers]
    assert char_match_reward([p.text for p in prompts], halves, answer=answers) == pytest.approx(expected)
    equal = write_workload(tmp_path / "e.jsonl", 4, None)
    assert "max_new_tokens" not in equal.read_text()
