"""The fleet model behind `polyrl plan`: its schedule's arithmetic on cases worked by hand,
and the properties a planner must keep (the tail bounds a synchronous step, the staleness
bound holds, shared cores are shared, a preemption loses no sample)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.plan.calibration import Calibration, DecodePoint
from polyrl.plan.fleet_model import Fleet, FleetModel, Workload, predict


def cal(**kw) -> Calibration:
    base = dict(
        device="test",
        model="test",
        decode=[DecodePoint(batch=1, step_s=0.01)],
        prefill_tokens_per_s=1e9,
        learner_tokens_per_s=10_000,
        version_bytes=0,
    )
    return Calibration(**(base | kw))


def test_a_synchronous_step_is_generation_then_training_then_the_pull() -> None:
    # 4 groups x 2 samples of 100 tokens on one worker: 100 decode steps of 10 ms, then
    # 4 x 2 x (5 + 100) tokens at 10k tokens/s, then a 1 MB pull at 1 Gbit/s
    c = cal(version_bytes=1_000_000, pull_gbps=1.0)
    p = predict(c, Workload.fixed(4, 2, 5, 100), Fleet(1, "remote"), steps=3)
    assert p.step_s == pytest.approx(100 * 0.01 + 840 / 10_000 + 0.008, rel=1e-6)
    assert p.tokens_per_step == 840
    assert p.learner_idle_s == pytest.approx(1.0, rel=1e-6)


def test_groups_that_finish_together_still_train_as_every_mini_batch() -> None:
    # the same step in 2 mini-batches: every group ends at once, so both train after it.
    # (Groups alike in every field once compared equal, and the second mini-batch was
    # empty: a 4-worker main job was predicted at 1.55 s a step, measured 2.12.)
    p = predict(cal(), Workload.fixed(4, 2, 5, 100, mini_batches=2), Fleet(1, "remote"), steps=3)
    assert p.step_s == pytest.approx(100 * 0.01 + 840 / 10_000, rel=1e-6)


def test_the_decode_step_interpolates_between_measured_batches() -> None:
    c = cal(decode=[DecodePoint(batch=64, step_s=0.02), DecodePoint(batch=1, step_s=0.01)])
    assert c.decode[0].batch == 1
    assert c.decode_step_s(1) == 0.01
    assert c.decode_step_s(32) == pytest.approx(0.01 + 0.01 * 31 / 63)
    assert c.decode_step_s(127) == pytest.approx(0.03)  # beyond: the last slope
    with pytest.raises(ValueError, match="one point per batch"):
        cal(decode=[DecodePoint(batch=1, step_s=0.01), DecodePoint(batch=1, step_s=0.02)])


def test_more_workers_cannot_shorten_a_synchronous_step_below_its_tail() -> None:
    work = Workload.long_tail(32, 8, 5, 300, 3000, 1024)
    longest = max(work.budgets[:32])
    one = predict(cal(), work, Fleet(1, "remote"), steps=1, warmup=0)
    many = predict(cal(), work, Fleet(8, "remote"), steps=1, warmup=0)
    assert many.step_s >= longest * 0.01
    assert many.step_s == pytest.approx(one.step_s, rel=0.05)  # a flat decode step: batching was free
    assert many.fleet_idle_ratio > one.fleet_idle_ratio


def test_fully_async_never_waits_for_the_tail_and_keeps_the_bound() -> None:
    work = Workload.long_tail(32, 8, 5, 300, 3000, 1024, mini_batches=2)
    sync = predict(cal(), work, Fleet(2, "remote"), steps=10)
    for k in (1, 2):
        p = predict(cal(), work, Fleet(2, "fully_async", staleness=k), steps=10)
        assert p.step_s < 0.8 * sync.step_s
        assert p.lag_max <= k
        assert p.tokens_per_step > 0


def test_processes_on_a_shared_host_share_its_cores() -> None:
    work = Workload.fixed(16, 4, 5, 50)
    compute = [DecodePoint(batch=1, step_s=0.001), DecodePoint(batch=64, step_s=0.064)]  # no batching gain
    host = dict(decode=compute, host_cores=1.0, engine_cores=1.0, learner_cores=1.0)
    own = predict(cal(decode=compute), work, Fleet(2, "remote"), steps=2)
    shared = predict(cal(**host), work, Fleet(2, "remote"), steps=2)
    one = predict(cal(**host), work, Fleet(1, "remote"), steps=2)
    assert shared.step_s > own.step_s
    assert shared.step_s == pytest.approx(one.step_s, rel=0.05)  # the second worker's core is not there


def test_the_learner_runs_on_the_threads_the_governor_leaves_it() -> None:
    # 2 cores, one worker (1 core), the learner on 2 threads at 1000 tokens/s or 1 at 500.
    # Group A (10 tokens) is ready at 0.1 s; its 205 tokens train in micro-batches of 41
    # beside the worker: 3 cores wanted of 2, so each runs at 2/3 and the learner's
    # threads wait a third of the time; the check after the 4th micro-batch (0.246 s in,
    # past CHECK_S) drops a thread, and the 5th takes 41/500 s. The worker lost a third of
    # 0.246 s, so group B (1000 tokens) is ready at 10.082 s. Its 1195 tokens then train
    # on one thread: 30 micro-batches of 80 ms, each window closing at 0.24 s, short of the
    # 0.3 s of idle cores a thread needs to come back (as `cpu_threads` does).
    c = cal(host_cores=2.0, engine_cores=1.0, learner_cores=2.0, learner_tokens_per_s=1000)
    work = Workload(2, 1, 195, (10, 1000), mini_batches=2, micro_batch_tokens=41)
    governed = FleetModel(c.model_copy(update={"learner_one_thread_tokens_per_s": 500}), work, Fleet(1, "remote"))
    p = governed.run(1, warmup=0)
    assert p.step_s == pytest.approx(0.1 + 0.246 + 41 / 500 + 10.082 - 0.428 + 1195 / 500, rel=1e-3)
    assert governed.governor.threads == 1
    # a learner as fast on one thread as on two loses only the worker's contention
    same = predict(c.model_copy(update={"learner_one_thread_tokens_per_s": 1000}), work, Fleet(1, "remote"), 1, 0)
    assert same.step_s == pytest.approx(10.0 + 0.246 / 3 + 1195 / 1000, rel=1e-3)
    assert c.learner_speed(1) == 0.5 and c.learner_speed(2) == 1.0  # no one-thread rate: in proportion


def test_the_trainer_reads_each_finished_group_before_the_learner_has_it() -> None:
    # a shared host: two groups of one 100-token sample end together at 1.0 s; the manager
    # sends each whole, and the trainer's one reader takes 105 x 0.1 ms per group, so the
    # learner has both at 1.021 s and trains their 210 tokens in 21 ms. Colocated, the
    # engine runs in the trainer's process: nothing to read
    c = cal(host_cores=2.0, engine_cores=1.0, learner_cores=1.0, stream_cpu_s_per_token=1e-4)
    work = Workload.fixed(2, 1, 5, 100)
    remote = predict(c, work, Fleet(1, "remote"), steps=1, warmup=0)
    assert remote.step_s == pytest.approx(1.0 + 2 * 0.0105 + 0.021, rel=1e-6)
    colocated = predict(c, work, Fleet(0, "colocated"), steps=1, warmup=0)
    assert colocated.step_s == pytest.approx(1.0 + 0.021, rel=1e-6)


def test_a_preempted_worker_loses_no_sample() -> None:
    work = Workload.fixed(16, 4, 5, 200)
    calm = predict(cal(), work, Fleet(3, "remote"), steps=6)
    stormy = predict(cal(), work, Fleet(3, "remote", preempt_per_hour=3600, restart_s=0.5), steps=6, seed=1)
    assert stormy.tokens_per_step == calm.tokens_per_step
    assert stormy.step_s > calm.step_s


def test_the_command_predicts_from_a_calibration_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cal.json"
    cal(host_cores=2.0, learner_cores=2.0).save(path)
    out = tmp_path / "plan.json"
    args = ["plan", "fleet", "--calibration", str(path), "--workers", "1", "2", "--json", str(out), "--steps", "2"]
    assert main([*args, "trainer.total_steps=3"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["fleet"] for r in rows] == ["1 worker", "2 workers"]
    assert all(r["step_s"] > 0 for r in rows)
    assert "| 2 workers |" in capsys.readouterr().out
    path.write_text("{}")
    assert main(args) == 2
    assert "calibration file" in capsys.readouterr().out


def test_the_seeds_table_has_a_row_per_fleet_beside_the_seeds_numbers(capsys) -> None:
    assert main(["plan", "seeds"]) == 0
    out = capsys.readouterr().out
    for seeds in ("~10,000", "~12,000", "~18,000"):
        assert seeds in out
    assert "not measured" in out


def test_calibrate_measures_this_machines_engine_and_learner() -> None:
    from polyrl.config import load_config
    from polyrl.plan.calibrate import calibrate

    c = calibrate(load_config(None, ["rollout.max_new_tokens=8"]), batches=(1, 4), new_tokens=4, repeats=1, context=32)
    assert [p.batch for p in c.decode] == [1, 4]
    assert c.decode_context == 8 + 4 / 2 and c.decode_kv_s_per_token >= 0  # timed with 32 more tokens of prompt
    assert all(p.step_s > 0 for p in c.decode)
    assert c.learner_tokens_per_s > 0 and c.prefill_tokens_per_s > 0
    assert c.version_bytes > 0
    assert c.host_cores is not None  # a CPU: every process shares the host
    if c.learner_cores > 1:  # where the thread governor puts the learner beside a busy worker
        assert c.learner_one_thread_tokens_per_s is not None and c.learner_one_thread_tokens_per_s > 0


def test_calibrate_served_times_several_worker_processes(caplog) -> None:
    # a worker process's decode step varies from one start to the next (10.1-12.1 ms at
    # batch 256 on the 2-core box): --served times several, one after another
    from polyrl.config import load_config
    from polyrl.plan.calibrate import calibrate

    cfg = load_config(None, ["rollout.max_new_tokens=4"])
    with caplog.at_level(logging.INFO, logger="polyrl.plan"):
        c = calibrate(cfg, batches=(1, 4), new_tokens=3, repeats=1, served=True, served_workers=2, context=16)
    assert [p.batch for p in c.decode] == [1, 4] and all(p.step_s > 0 for p in c.decode)
    assert c.decode_kv_s_per_token >= 0 and c.prefill_tokens_per_s > 0  # the last worker's context timings
    assert c.prefill_step_s == 0  # a CPU engine runs every step alike
    assert c.engine_cores > 0 and c.stream_cpu_s_per_token > 0 and c.worker_start_s > 0
    assert c.publish_s > 0  # a real publisher took the weights each time
    assert "over 2 worker processes" in caplog.text
    with pytest.raises(ValueError, match="at least 1"):
        calibrate(cfg, batches=(1,), new_tokens=3, repeats=1, served=True, served_workers=0)


def test_calibrate_times_the_steps_that_arrivals_make_eager(tiny_model_dir: Path) -> None:
    # a served worker decoding a call while small groups arrive one after another: its own
    # counters say how many steps also prefilled, and the cost of each is what the call lost
    from polyrl.config import load_config
    from polyrl.plan.calibrate import _prefill_step_s, _ServedWorker

    cfg = load_config(None, ["rollout.n=2", "engine.admit_batch=2"])
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    worker = _ServedWorker(cfg, tiny_model_dir, 8, vocab)
    try:
        cost, added = _prefill_step_s(worker, 4, 8, 48, repeats=2)
    finally:
        worker.close()
    assert cost >= 0 and len(added) == 2
    assert max(added) >= 1  # the arrivals were admitted mid-call, each in a step of its own


def test_the_trainers_engine_hands_its_samples_to_the_workers_when_the_learner_starts() -> None:
    # two groups of one sample, 50 and 100 tokens, one slot on each engine: the worker
    # takes the first (the manager fills workers first), the trainer's engine the long
    # one; the learner starts at 0.5 s on the short one, and with `learner` the long one's
    # last 50 tokens are decoded by the worker, nothing lost
    work = Workload(prompts=2, n=1, prompt_tokens=5, budgets=(50, 100), mini_batches=2)
    engines = {}
    for until in ("always", "learner"):
        fleet = Fleet(1, "remote", trainer_engine=True, trainer_until=until, max_num_seqs=1, trainer_max_num_seqs=1)
        model = FleetModel(cal(), work, fleet)
        step = model.run(1, warmup=0)
        engines[until] = {e.name: e.ticks for e in model.engines}
        assert step.tokens_per_step == 105 + 55
        # `always`: the learner's first 5.5 ms share the trainer's device with its engine
        shared = 55 / 10_000 if until == "always" else 0.0
        assert step.step_s == pytest.approx(1.0 + shared + 105 / 10_000, rel=1e-6)
    assert engines["always"] == {"trainer0": 100, "w0": 50}
    assert engines["learner"] == {"trainer0": 50, "w0": 100}


def test_the_trainers_own_engine_decodes_at_its_own_rate() -> None:
    # the workers' step is 10 ms, the trainer's in-process engine's 5 ms: colocated, 100 steps
    c = cal(trainer_decode=[DecodePoint(batch=1, step_s=0.005)])
    assert c.decode_step_s(8) == 0.01 and c.decode_step_s(8, trainer=True) == 0.005
    p = predict(c, Workload.fixed(4, 2, 5, 100), Fleet(0, "colocated"), steps=2)
    assert p.step_s == pytest.approx(100 * 0.005 + 840 / 10_000, rel=1e-6)


def test_beside_a_fleet_the_trainers_engine_decodes_at_a_workers_rate() -> None:
    # hybrid and fully asynchronous runs serve the trainer's engine from a worker process
    # (`launch/local_worker.py`): its 10 ms step, not the in-process engine's 5 ms
    c = cal(trainer_decode=[DecodePoint(batch=1, step_s=0.005)])
    for mode in ("remote", "fully_async"):
        model = FleetModel(c, Workload.fixed(4, 2, 5, 100), Fleet(0, mode, trainer_engine=True))
        model.run(1, warmup=0)
        assert model.engines[0].name == "trainer0" and model.engines[0].ticks == 100
        assert model.now == pytest.approx(100 * 0.01 + 840 / 10_000, rel=1e-6)


def test_a_decode_step_reads_the_context_its_batch_holds() -> None:
    # one sample of 10 tokens after a 105-token prompt: step i holds 105 + i tokens, 100 more
    # than the calibration's own context, at 1 us a token
    c = cal(decode_context=5, decode_kv_s_per_token=1e-6)
    p = predict(c, Workload.fixed(1, 1, 105, 10), Fleet(1, "remote"), steps=1, warmup=0)
    assert p.step_s == pytest.approx(10 * 0.01 + 1e-6 * (10 * 100 + 45) + 115 / 10_000, rel=1e-6)
    assert c.decode_step_s(1, context=0) == pytest.approx(0.01 - 5e-6)


def test_a_full_kv_cache_sends_sequences_back_and_loses_none() -> None:
    work = Workload.fixed(8, 4, 5, 100)
    roomy = FleetModel(cal(), work, Fleet(1, "remote"))
    tight = FleetModel(cal(), work, Fleet(1, "remote", kv_tokens=1000))
    a, b = roomy.run(2, warmup=0), tight.run(2, warmup=0)
    assert roomy.kv_preemptions == 0 and tight.kv_preemptions > 0
    assert b.tokens_per_step == a.tokens_per_step  # every sample finished
    assert b.step_s > a.step_s  # fewer sequences at once, and the moved ones computed again


def test_a_worker_killed_in_a_step_makes_that_step_longer_and_loses_nothing() -> None:
    work = Workload.fixed(8, 4, 5, 100)
    calm = FleetModel(cal(), work, Fleet(2, "remote")).run(4, warmup=0)
    model = FleetModel(cal(), work, Fleet(2, "remote", kill_in_step=3, restart_s=0.5))
    killed = model.run(4, warmup=0)
    assert killed.steps[2] > calm.steps[2] and killed.steps[:2] == calm.steps[:2]
    assert killed.tokens_per_step == calm.tokens_per_step
    assert model.engines[0].up  # back after restart_s


def test_moved_samples_re_prefill_in_chunks_of_the_step_budget() -> None:
    # a killed worker's 2 samples move to the other with their tokens, about 1,000 to
    # prefill: with a budget of 2048 tokens a step, in one step; with 68 (the 2 running
    # samples' decodes first, then 66 prefill tokens), in 16 steps, and the moved samples
    # start decoding 8 and 16 steps later (the prefill's own cost is the same)
    work = Workload.fixed(2, 2, 0, 1000)
    slow = cal(prefill_tokens_per_s=10_000)
    steps = {}
    for budget in (None, 2048, 68):
        fleet = Fleet(2, "remote", kill_in_step=2, restart_s=100.0, batched_tokens=budget)
        steps[budget] = predict(slow, work, fleet, steps=2, warmup=0).steps[1]
    assert steps[None] == pytest.approx(steps[2048])  # the budget never binds: as before
    assert steps[68] > steps[2048] + 0.1  # 15 more decode steps of 10 ms


def test_a_run_with_workers_waits_for_each_publish_a_colocated_one_does_not() -> None:
    work = Workload.fixed(4, 2, 5, 100)
    for mode, workers in (("remote", 1), ("colocated", 0)):
        bare = predict(cal(), work, Fleet(workers, mode), steps=3)
        published = predict(cal(publish_s=0.25), work, Fleet(workers, mode), steps=3)
        assert published.step_s == pytest.approx(bare.step_s + (0.25 if workers else 0.0), rel=1e-6)


def test_clients_of_one_gpu_cost_each_other_what_was_measured() -> None:
    # 2 mini-batches: the learner trains the short groups' while the worker decodes the long
    work = Workload(4, 2, 5, (10, 10, 100, 100), mini_batches=2)
    apart = predict(cal(learner_tokens_per_s=1_000), work, Fleet(1, "remote"), steps=2)
    free = predict(cal(learner_tokens_per_s=1_000, shared_gpu=True), work, Fleet(1, "remote"), steps=2)
    slowed = cal(learner_tokens_per_s=1_000, shared_gpu=True, engine_slowdown_beside_learner=1.0)
    both = predict(slowed, work, Fleet(1, "remote"), steps=2)
    assert free.step_s == pytest.approx(apart.step_s)  # nothing measured between them: side by side
    assert both.step_s > apart.step_s
    # colocated, the trainer's engine and its learner take turns: nothing to share
    alone = predict(cal(learner_tokens_per_s=1_000), work, Fleet(0, "colocated"), steps=2)
    assert predict(slowed, work, Fleet(0, "colocated"), steps=2).step_s == pytest.approx(alone.step_s)


def test_every_client_among_more_than_the_gpu_holds_gets_its_part_of_the_sms() -> None:
    # one slot on each engine: group A (10 tokens) on the worker, B (100) on the trainer's
    # engine, C (100) on the worker after A. A's 15 tokens train at 0.1 s beside both
    # engines: 3 busy clients on 2 shares, each at 2/3, so the learner takes 2.25 ms and
    # each engine loses 0.75 ms; B and C then train alone (10.5 ms each) as they end
    work = Workload(3, 1, 5, (10, 100, 100), mini_batches=3)
    fleet = Fleet(1, "remote", trainer_engine=True, max_num_seqs=1, trainer_max_num_seqs=1)
    crowded = predict(cal(shared_gpu=True, gpu_clients=2.0), work, fleet, steps=1, warmup=0)
    assert crowded.step_s == pytest.approx(1.1 + 0.00075 + 0.0105, rel=1e-6)
    roomy = predict(cal(shared_gpu=True, gpu_clients=3.0), work, fleet, steps=1, warmup=0)
    assert roomy.step_s == pytest.approx(1.1 + 0.0105, rel=1e-6)


def test_workers_on_the_trainers_gpu_take_a_version_in_place_and_come_first() -> None:
    # a fully asynchronous run, one worker and the trainer's engine on one GPU: with a
    # 1 GB version over 1 Gbit/s the worker on a link of its own is 8 s behind each
    # publish, so each step's new prompts go to the trainer's engine; on one GPU it reads
    # the published copy in place, and the manager gives the work to it first
    work = Workload.fixed(4, 2, 5, 100)
    fleet = Fleet(1, "fully_async", trainer_engine=True)
    slow_link = dict(version_bytes=1_000_000_000, pull_gbps=1.0)
    shares = {}
    for gpu in (False, True):
        model = FleetModel(cal(shared_gpu=gpu, **slow_link), work, fleet)
        model.run(4)
        shares[gpu] = {e.name: e.ticks for e in model.engines}
    assert shares[True]["w0"] > shares[True]["trainer0"]
    assert shares[False]["w0"] < shares[False]["trainer0"]


def test_a_learner_among_more_gpu_clients_than_the_gpu_holds_gets_its_part_of_the_sms() -> None:
    # the learner trains the short groups' mini-batch while the trainer's engine and a
    # worker decode the long ones: 3 clients where the GPU holds 2 shares of its SMs (the
    # worker's 4 slots take a long group and a short one, the trainer's engine the others)
    work = Workload(4, 2, 5, (200, 10, 10, 200), mini_batches=2)
    fleet = Fleet(1, "remote", trainer_engine=True, max_num_seqs=4)
    roomy = predict(cal(shared_gpu=True, learner_tokens_per_s=20), work, fleet, steps=2)
    crowded = predict(cal(shared_gpu=True, learner_tokens_per_s=20, gpu_clients=2.0), work, fleet, steps=2)
    assert crowded.step_s > roomy.step_s


def test_each_admission_into_an_overlapped_batch_costs_a_prefill_step_and_arrivals_are_gathered() -> None:
    # groups of one sample, of 20 lengths, on one worker of 8 slots in a fully asynchronous
    # run: they finish and are replaced one at a time; with CUDA's overlapped decode each
    # admission costs an eager step (`prefill_step_s`), unless the busy batch gathers
    # arrivals first (here up to 4, or 16 steps)
    work = Workload(prompts=16, n=1, prompt_tokens=4, budgets=tuple(range(40, 240, 10)))

    def run(prefill_step_s: float, wait_steps: int) -> tuple[float, float]:
        fleet = Fleet(1, "fully_async", staleness=2, max_num_seqs=8, admit_wait_steps=wait_steps, admit_batch=4)
        model = FleetModel(cal(prefill_step_s=prefill_step_s), work, fleet)
        step_s = model.run(4, warmup=1).step_s
        return step_s, model.engines[0].prefill_steps / model.engines[0].steps

    assert run(0.02, 0)[0] > run(0.0, 0)[0] * 1.05  # about one admission a sample, each 20 ms more
    assert run(0.02, 16)[1] < run(0.02, 0)[1] * 0.75  # arrivals share fewer admission steps
