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


def planned(decode: list[tuple[int, float]], **cfg: object) -> Autoscaler:
    """A scaler on the fleet model: a run of 16 prompts x 4 samples, one mini-batch."""
    from test_plan import cal

    from polyrl.launch.autoscale import FleetPlanner
    from polyrl.plan.calibration import DecodePoint

    run = load_config(None, ["trainer.train_batch_size=16", "trainer.ppo_mini_batch_size=16", "rollout.n=4"])
    rates = cal(decode=[DecodePoint(batch=b, step_s=s) for b, s in decode], learner_tokens_per_s=1e5)
    return Autoscaler(AutoscaleConfig(enabled=True, **cfg), 10.0, 2.5, planner=FleetPlanner(run, rates))


def lengths(metrics: dict[str, float], response: float) -> dict[str, float]:
    return metrics | {"prompt_length/mean": 5.0, "response_length/mean": response, "response_length/max": response}


def test_the_fleet_model_sees_that_one_worker_holds_a_batch_at_no_extra_cost() -> None:
    """A decode step as long at batch 64 as at 1 (a GPU well under its memory roofline):
    one worker decodes the whole step's 64 samples as fast as four would, so the model
    keeps one. Amdahl's law sees a busy worker and adds another."""
    metrics = lengths(step(1.2, 0.05, 1), 100)
    amdahl = scaler(min_workers=1, max_workers=4, interval_steps=1)
    assert amdahl.observe(metrics).target == 2  # type: ignore[union-attr]
    model = planned([(1, 0.01), (64, 0.01)], min_workers=1, max_workers=4, interval_steps=1)
    assert model.observe(metrics) is None
    assert model.step_s(StepCost(1.2, 0.06, 1e5, 1, 5, 100, 100), [1, 4]) == pytest.approx({1: 1.2, 4: 1.2})


def test_the_fleet_model_grows_toward_its_best_size_one_worker_at_a_time() -> None:
    """A decode step that grows with its batch (compute-bound, as on a CPU): four workers
    split the batch and cut generation to a quarter, worth their price here."""
    s = planned([(1, 0.001), (64, 0.064)], min_workers=1, max_workers=4, interval_steps=1)
    # measured: the model's step (6.4 s of decoding, 0.07 s of learning) and 0.5 s it leaves out
    first = s.observe(lengths(step(6.97, 0.0, 1, tokens=6720), 100))
    assert first is not None and first.target == 2 and "fleet model for 4" in first.reason
    steps = s.step_s(StepCost(6.97, 0.0, 6720, 1, 5, 100, 100), [1, 2, 4])
    assert steps[1] == 6.97  # measured
    assert steps[2] == pytest.approx(3.2 + 0.07 + 0.5, rel=0.02)  # the model's, plus what it leaves out
    assert steps[4] == pytest.approx(1.6 + 0.07 + 0.5, rel=0.02)


def test_a_target_no_size_meets_heads_for_the_fastest_size_not_the_most_workers() -> None:
    """One shared core and a decode step as long at batch 64 as at 1: a second worker halves
    each one's speed, so with a target no size can meet the scaler heads for one worker."""
    from test_plan import cal

    from polyrl.launch.autoscale import FleetPlanner
    from polyrl.plan.calibration import DecodePoint

    run = load_config(None, ["trainer.train_batch_size=16", "trainer.ppo_mini_batch_size=16", "rollout.n=4"])
    flat = [DecodePoint(batch=1, step_s=0.01), DecodePoint(batch=64, step_s=0.01)]
    rates = cal(decode=flat, learner_tokens_per_s=1e5, host_cores=1.0, engine_cores=1.0, learner_cores=1.0)
    cfg = AutoscaleConfig(enabled=True, min_workers=1, max_workers=4, interval_steps=1, target_step_s=0.5)
    s = Autoscaler(cfg, 10.0, 2.5, planner=FleetPlanner(run, rates))
    seen = StepCost(2.0, 0.0, 6720, 2, 5, 100, 100)
    steps = s.step_s(seen, [1, 2, 3, 4])
    assert steps[1] < steps[2] < steps[3] < steps[4] and steps[1] > 0.5
    decision = s.observe(lengths(step(2.0, 0.0, 2, tokens=6720), 100))
    assert decision is not None and decision.target == 1


def test_the_run_reads_its_calibration_file_and_names_a_bad_one(tmp_path: Path) -> None:
    from test_plan import cal

    from polyrl.launch.autoscale import autoscaler_for

    good = tmp_path / "cal.json"
    cal().save(good)
    on = ["fleet.autoscale.enabled=true", f"fleet.autoscale.calibration={good}"]
    assert autoscaler_for(load_config(None, on), world_size=1).planner is not None  # type: ignore[union-attr]
    assert autoscaler_for(load_config(None, on[:1]), world_size=1).planner is None  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="calibration file .*missing.json"):
        autoscaler_for(load_config(None, [on[0], f"fleet.autoscale.calibration={tmp_path / 'missing.json'}"]), 1)


def test_the_fleet_model_never_picks_a_fleet_of_none_in_remote_mode() -> None:
    s = planned([(1, 0.001), (64, 0.064)], min_workers=0, max_workers=2, interval_steps=1)
    steps = s.step_s(StepCost(6.97, 0.0, 6720, 1, 5, 100, 100), [0, 1, 2])
    assert steps[0] == float("inf") and steps[2] < steps[1]
    decision = s.observe(lengths(step(6.97, 0.0, 1, tokens=6720), 100))
    assert decision is not None and decision.target == 2
