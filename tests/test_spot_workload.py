"""The long-tail workload of `benchmarks/spot_gpu.py`, checked on the CPU before any GPU
time is spent on it: its length distribution, that `polyrl`'s own data path turns the
file into prompts with those budgets, how a row's throughput is summed up, and the
stand-in row's capacity probe."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from spot_gpu import (  # noqa: E402
    decode_capacity,
    longtail_budgets,
    parse_shape,
    replay,
    summarise,
    time_to,
    write_workload,
)

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


def _row(step: int, seconds: float, tokens: float, fleet: float | None, ready: float | None) -> dict[str, float]:
    row = {
        "step": step,
        "perf/time_per_step": seconds,
        "perf/total_num_tokens": tokens,
        "response_length/mean": tokens / 8,
        "rollout/samples_received": 8.0,
        "cost/usd_per_hour": 13.0,
        "rollout/samples_lost": 0.0,
        "rollout/migrated_samples": 0.0,
        "rollout/local_samples": 0.0,
    }
    if ready is not None:
        row["async/ready_groups"] = ready
    if fleet is not None:
        row["bench/fleet_tokens"], row["bench/fleet_tokens_local"] = fleet, fleet / 4
    return row


def test_a_fully_async_row_counts_what_the_fleet_produced_not_only_what_was_trained() -> None:
    """A learner eating a warm-up backlog trains faster than the fleet produces: the row's
    steady rate is the fleet's (the slower); a learner that is slower keeps its own."""
    backlog = [
        _row(1, 9.0, 800, 5000, 0),
        _row(2, 2.0, 1600, 800, 12),
        _row(3, 2.0, 1600, 800, 10),
        _row(4, 2.0, 1600, 800, 8),
    ]
    res = summarise("fully_async_k4", backlog, warmup=1, wall=0.0, notes=[], last=3)
    assert res.tokens_per_s == 800 and res.produced_tokens_per_s == 400 and res.steady_tokens_per_s == 400
    assert res.backlog_used == 4 and res.local_made == 0.25
    assert res.tokens_per_usd == 400 * 3600 / 13.0
    slow_learner = [_row(s, 2.0, 800, 1200, 20) for s in (1, 2, 3, 4)]
    assert summarise("fully_async_k4", slow_learner, 1, 0.0, [], 3).steady_tokens_per_s == 400
    colocated = [_row(s, 2.0, 800, None, None) for s in (1, 2, 3)]
    res = summarise("colocated", colocated, 1, 0.0, [], 3)
    assert res.steady_tokens_per_s == res.tokens_per_s == 400 and res.produced_tokens_per_s is None


def test_the_capacity_probe_keeps_its_batch_full(tiny_model_dir: Path) -> None:
    out = decode_capacity(tiny_model_dir, 256, [2, 8], [5, 40, 12], warm_s=0.3, measure_s=0.8)
    assert set(out) == {2, 8}
    assert 1.5 < out[2]["mean_running"] <= 2 and 6 < out[8]["mean_running"] <= 8  # refilled as they finish
    assert all(v["tok_s"] > 0 and v["preemptions"] == 0 for v in out.values())


def test_the_learning_rows_model_shape_is_parsed_and_bad_sizes_are_refused() -> None:
    assert parse_shape("hidden_size=512, num_layers=28,") == {"hidden_size": 512, "num_layers": 28}
    assert parse_shape("") == {}
    for bad in ("hidden=512", "hidden_size", "hidden_size=big", "num_layers=-1", "num_heads=5"):
        with pytest.raises(SystemExit, match="--learn-shape"):
            parse_shape(bad)


def test_time_to_a_reward_counts_the_steps_until_five_in_a_row_average_it() -> None:
    rows = [{"perf/time_per_step": 2.0, "critic/score/mean": s} for s in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)]
    assert time_to(rows, 0.2) == (10.0, 5)  # the mean of steps 1-5 is 0.2
    assert time_to(rows, 0.4) == (14.0, 7)
    assert time_to(rows, 0.41) is None


KEPT = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_a_kept_gpu_run_replays_through_the_fleet_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`--replay`: the rows one H200 ran (BENCHMARKS.md, "The MPS kill row with the
    due-first queue"), predicted again from their own configs and calibration, no GPU."""
    replay(KEPT / "spot_gpu_mps_kill_2026-12-02a.json")
    out = capsys.readouterr().out
    table = {
        line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ") and "s/step" not in line
    }
    assert set(table) == {"fully_async_k4", "best_kill"}
    for row, line in table.items():
        measured, predicted = (float(x) for x in line.split(" | ")[1:3])
        assert measured == {"fully_async_k4": 3.54, "best_kill": 4.85}[row]  # the file's own measurements
        assert 1.0 < predicted < 10.0
    steps = [line for line in out.splitlines() if line.startswith("  ") and "(" in line]
    assert len(steps) == 2 and all(len(line.split(")")) == 8 for line in steps)  # 7 measured steps a row


def test_a_replay_refuses_a_run_written_without_the_plan(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text('{"args": {}, "results": []}')
    with pytest.raises(SystemExit, match="no plan_rows, budgets, calibrations"):
        replay(path)
