"""The fleet's autoscaler: its step model (Amdahl's law over the fleet's busy time), its
decisions from a run's step metrics, and a real run whose fleet it shrinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e import QUICK, _check_every_step

from polyrl.config import AutoscaleConfig, load_config
from polyrl.launch.autoscale import Autoscaler, StepCost, predicted_step_s
from polyrl.trainer.loop import train


def step(step_s: float, idle_ratio: float, workers: int, tokens: float = 1e5) -> dict[str, float]:
    return {
        "perf/time_per_step": step_s,
        "rollout/fleet_idle_s": idle_ratio * step_s * workers,
        "perf/total_num_tokens": tokens,
        "training/num_workers": float(workers),
    }


def test_the_step_model_is_amdahls_law_over_the_fleets_busy_time() -> None:
    busy = StepCost(step_s=10.0, idle_s=0.0, tokens=1.0, workers=2)  # every worker busy all step
    assert predicted_step_s(busy, 4) == pytest.approx(5.0) and predicted_step_s(busy, 1) == pytest.approx(20.0)
    half = StepCost(step_s=10.0, idle_s=10.0, tokens=1.0, workers=2)  # busy 10 of 20 worker-seconds
    assert predicted_step_s(half, 2) == pytest.approx(10.0)
    assert predicted_step_s(half, 4) == pytest.approx(5.0 + 2.5)  # 5 s nobody shortens
    idle = StepCost(step_s=10.0, idle_s=20.0, tokens=1.0, workers=2)  # the learner's step: workers wait
    assert predicted_step_s(idle, 1) == predicted_step_s(idle, 8) == pytest.approx(10.0)


def scaler(**cfg: object) -> Autoscaler:
    return Autoscaler(AutoscaleConfig(enabled=True, **cfg), trainer_usd_per_hour=10.0, worker_usd_per_hour=2.5)


def test_busy_workers_and_a_dear_trainer_grow_the_fleet_one_at_a_time() -> None:
    s = scaler(min_workers=1, max_workers=4, interval_steps=3)
    assert [s.observe(step(10.0, 0.05, 2)) for _ in range(2)] == [None, None]  # too few steps yet
    decision = s.observe(step(10.0, 0.05, 2))
    assert decision is not None and decision.target == 3 and "2 -> 3 workers" in decision.reason
    assert s.observe(step(10.0, 0.05, 2)) is None  # asked for 3: nothing more until it is there
    assert s.observe(step(9.0, 0.05, 3)) is None  # the first step at 3 pays its start: left out
    assert [s.observe(step(7.0, 0.05, 3)) for _ in range(2)] == [None, None]
    assert s.observe(step(7.0, 0.05, 3)).target == 4  # type: ignore[union-attr]


def test_idle_workers_shrink_the_fleet_and_the_bounds_hold() -> None:
    s = scaler(min_workers=1, max_workers=4, interval_steps=2)
    s.observe(step(10.0, 0.8, 3))
    assert s.observe(step(10.0, 0.8, 3)).target == 2  # type: ignore[union-attr]
    low = scaler(min_workers=2, max_workers=4, interval_steps=1)
    assert low.observe(step(10.0, 0.8, 2)) is None  # at the floor
    out = scaler(min_workers=1, max_workers=2, interval_steps=1)
    assert out.observe(step(10.0, 0.0, 5)).target == 2  # type: ignore[union-attr]  # over the ceiling: to it


def test_a_small_gain_is_not_worth_a_change() -> None:
    # 10% of the step is the fleet's: one worker more saves ~3% of the time for 20% more cost
    s = scaler(min_workers=1, max_workers=8, interval_steps=1)
    assert s.observe(step(10.0, 0.9, 2)) is not None  # (it shrinks instead)
    s = scaler(min_workers=1, max_workers=8, interval_steps=1, min_gain=0.5)
    assert s.observe(step(10.0, 0.05, 2)) is None  # a gain, but under 50%


def test_a_change_that_measures_worse_is_undone_and_that_size_held_off() -> None:
    """Workers that share cores: the model sees busy workers and predicts a gain from a
    third; the third makes nothing faster, so its measured tokens per dollar fall, and
    the scaler goes back to two and leaves three alone for `hold_steps`."""
    s = scaler(min_workers=1, max_workers=4, interval_steps=1, hold_steps=5, probe_loss=0.0)
    assert s.observe(step(10.0, 0.05, 2)).target == 3  # type: ignore[union-attr]
    s.observe(step(10.0, 0.05, 3))  # the first step at 3: left out
    back = s.observe(step(10.0, 0.05, 3))  # as slow as with 2, for more money
    assert back is not None and back.target == 2 and "not tried again" in back.reason
    s.observe(step(10.0, 0.05, 2))  # the first step back at 2: left out
    assert [s.observe(step(10.0, 0.05, 2)) for _ in range(3)] == [None] * 3  # 3 is held (5 steps)
    assert s.observe(step(10.0, 0.05, 2)).target == 3  # type: ignore[union-attr]  # the hold is over


def test_one_fewer_is_tried_when_predicted_to_cost_little_and_kept_when_it_pays() -> None:
    """Half the step is the fleet's, half nobody shortens: one worker fewer is predicted to
    lose under `probe_loss`, so it is tried; it measures better, and it stays."""
    s = scaler(min_workers=1, max_workers=4, interval_steps=1, probe_loss=0.2)
    probe = s.observe(step(1.0, 0.5, 3))
    assert probe is not None and probe.target == 2 and "trying it" in probe.reason
    s.observe(step(1.0, 0.5, 2))
    nxt = s.observe(step(1.0, 0.6, 2))  # as fast with 2, for less: no undo; 1 is tried next
    assert nxt is not None and nxt.target == 1


def test_a_target_step_time_takes_the_fewest_workers_that_meet_it() -> None:
    s = scaler(min_workers=1, max_workers=8, interval_steps=1, target_step_s=6.0)
    assert s.observe(step(10.0, 0.0, 2)).target == 3  # type: ignore[union-attr]  # 4 meet 5 s: one step toward it
    s = scaler(min_workers=1, max_workers=8, interval_steps=1, target_step_s=30.0)
    assert s.observe(step(10.0, 0.0, 2)).target == 1  # type: ignore[union-attr]  # 1 worker meets it (20 s)


def test_steps_without_workers_or_idle_time_decide_nothing() -> None:
    s = scaler(interval_steps=1)
    assert s.observe({"perf/time_per_step": 1.0, "training/num_workers": 0.0}) is None
    assert s.observe({"perf/time_per_step": 1.0, "training/num_workers": 2.0, "perf/total_num_tokens": 1.0}) is None


@pytest.mark.slow
def test_a_run_with_more_workers_than_its_target_needs_retires_the_oldest(tmp_path: Path) -> None:
    """Two launched workers, a step-time target any one worker meets: after two steps at
    two, the oldest is retired (it drains and hands back), and no sample is lost."""
    overrides = [
        *QUICK,
        "trainer.total_steps=9",
        "fleet.num_workers=2",
        "fleet.drain_timeout_s=0.5",
        "fleet.autoscale.enabled=true",
        "fleet.autoscale.min_workers=1",
        "fleet.autoscale.max_workers=2",
        "fleet.autoscale.interval_steps=2",
        "fleet.autoscale.target_step_s=1000",
    ]
    train(load_config(None, overrides), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    _check_every_step(rows)
    assert rows[-1]["fleet/retired"] == 1 and rows[-1]["fleet/launched"] == 2, rows[-1]
    assert rows[-1]["fleet/autoscale_target"] == 1
    assert rows[-1]["training/num_workers"] == 1 and max(r["training/num_workers"] for r in rows) == 2
