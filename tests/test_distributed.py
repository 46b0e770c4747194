"""Training on several ranks (FSDP2 over gloo on CPU): the same mini-batches give the same
losses, gradients and parameters as one process; `polyrl train` under torchrun end to end,
with checkpoints that resume on another number of ranks; activation checkpointing."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_train import SMALL
from transformers import AutoModelForCausalLM, AutoTokenizer

from chaos_harness.harness import free_port
from polyrl.config import ConfigError, load_config
from polyrl.trainer.batching import SeqItem
from polyrl.trainer.checkpoint import TrainState, latest_checkpoint, read_trainer_state, save_checkpoint
from polyrl.trainer.distributed import DataParallel, data_parallel, gather_state, gather_weights, split_items
from polyrl.trainer.learner import enable_gradient_checkpointing
from polyrl.trainer.loop import run_commands, train
from polyrl.trainer.policy import build_learner, load_learner, load_model
from polyrl.trainer.run import Run

LEARNER = [
    "trainer.micro_batch_max_tokens=40",  # several micro-batches per rank, and idle ones
    "trainer.warmup_steps=0",
    "trainer.grad_clip=0.5",  # clipping is active: it needs the global norm
    "algo.kl_coef=0.05",  # the reference model is sharded too
    "algo.entropy_coef=0.01",
    "rollout.temperature=0.8",
]


def _mini_batches(seed: int, sizes: list[int], vocab: int) -> list[list[SeqItem]]:
    """Synthetic scored samples of varied lengths with fixed advantages."""
    rng = random.Random(seed)
    batches = []
    for size in sizes:
        items = []
        for _ in range(size):
            prompt_len, completion_len = rng.randint(2, 8), rng.randint(1, 9)
            ids = [rng.randrange(3, vocab) for _ in range(prompt_len + completion_len)]
            behav = [-rng.uniform(0.5, 4.0) for _ in range(completion_len)]
            items.append(SeqItem(ids, prompt_len, behav, rng.uniform(-1.5, 1.5)))
        batches.append(items)
    return batches


AS_SAMPLED = [True, True, False]
"""weights_as_sampled per mini-batch (it only adds the rollout/logprob_diff metric)."""


def _train(
    rank: int,
    world_size: int,
    port: int,
    init_dir: Path,
    ckpt: Path | None,
    out: Path,
    batches: list,
    overrides: list[str],
    device: str,
) -> None:
    """One rank: the real learner (sharded when world_size > 1, from `ckpt` when given) through
    the real commands; rank 0 saves the metrics, the whole weights and optimizer state. One
    process also checkpoints after the first mini-batch (into out's directory)."""
    if world_size > 1:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        os.environ.update(env, WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)  # two ranks on two cores
    with data_parallel() as dp:
        cfg = load_config(None, [*overrides, f"trainer.device={device}"])
        learner = load_learner(dp, cfg, init_dir, 0, ckpt)
        if not dp.is_main:
            run_commands(learner, dp)
            return
        flags = AS_SAMPLED[len(AS_SAMPLED) - len(batches) :]
        metrics = []
        for i, (items, as_sampled) in enumerate(zip(batches, flags, strict=True)):
            metrics.append(learner.train_mini_batch(items, as_sampled))
            if i == 0 and world_size == 1:
                _, optimizer = gather_state(learner.model, learner.optimizer, dp)
                tokenizer = AutoTokenizer.from_pretrained(init_dir)
                save_checkpoint(out.parent, TrainState(step=1), learner.model, tokenizer, optimizer, learner.scheduler)
        weights = gather_weights(learner.model, dp) or dict(learner.model.named_parameters())
        _, optimizer = gather_state(learner.model, learner.optimizer, dp)
        cpu = {k: t.detach().cpu() for k, t in weights.items()}
        torch.save({"metrics": metrics, "weights": cpu, "optimizer": optimizer}, out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_resume_and_take_the_single_process_steps(tmp_path, tiny_model_dir, monkeypatch, mode):
    """One process trains on three mini-batches, checkpointing after the first; two ranks
    resume from that checkpoint and train on the other two. Same metrics, same Adam moments
    (so the same gradients), same weights."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = [*LEARNER, f"algo.loss_agg_mode={mode}", "algo.ppo_epochs=2"]
    # 1 item: rank 1 has nothing to train on but still joins every collective.
    batches = _mini_batches(1, [6, 1, 5], vocab=40)
    _train(0, 1, 0, tiny_model_dir, None, tmp_path / "one.pt", batches, overrides, "cpu")
    ckpt = latest_checkpoint(tmp_path)
    args = (2, free_port(), tiny_model_dir, ckpt, tmp_path / "two.pt", batches[1:], overrides, "cpu")
    mp.spawn(_train, args=args, nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["metrics"][1]["rollout/logprob_diff"] > 0.1  # the random behaviour log-probs
    for m1, m2 in zip(one["metrics"][1:], two["metrics"], strict=True):
        assert m1.keys() == m2.keys()
        for key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # The whole optimizer state has one process's layout, and Adam's moments (linear and
    # quadratic in the gradients) agree element by element.
    s1, s2 = one["optimizer"], two["optimizer"]
    assert json.dumps(s1["param_groups"]) == json.dumps(s2["param_groups"])  # (betas may come back a list)
    assert s1["state"].keys() == s2["state"].keys()
    for i, state in s1["state"].items():
        torch.testing.assert_close(s2["state"][i]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(s2["state"][i]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-4, atol=1e-11)
    # Adam divides by the gradient's own scale: float noise in a near-zero gradient can move a
    # weight by up to ~lr/100 (the weights move by ~lr per update).
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)


def test_split_items_balances_tokens():
    items = [SeqItem([1] * n, 1, [0.0] * (n - 1), 0.0) for n in (9, 2, 7, 3, 3, 5, 1)]
    shares = split_items(items, 3)
    assert sorted(id(x) for s in shares for x in s) == sorted(id(x) for x in items)
    loads = [sum(len(x.token_ids) for x in s) for s in shares]
    assert max(loads) - min(loads) <= 1, loads
    assert split_items(items[:1], 2)[1] == []


def test_local_rollout_is_refused_on_several_ranks(tmp_path):
    cfg = load_config(None, [*SMALL, "rollout.mode=local"])
    with pytest.raises(ConfigError, match="rollout.mode"):
        Run.create(cfg, tmp_path / "run", False, DataParallel(0, 2))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ end to end

E2E = [
    "trainer.total_steps=2",
    "trainer.train_batch_size=4",
    "trainer.ppo_mini_batch_size=2",
    "trainer.num_threads=1",
    "trainer.save_every=0",
    "rollout.n=4",
    "rollout.max_new_tokens=4",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "algo.kl_coef=0.01",
    "rollout.mode=remote",
    "fleet.num_workers=0",  # rank 0's own engine serves every sample
    "manager.port=0",
    "logging.console=false",
    "logging.tensorboard=false",
]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "polyrl.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env, check=False)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_polyrl_train_under_torchrun_then_resume_on_one_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = _torchrun("train", "--run-dir", str(run_dir), *E2E)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(run_dir) == [1, 2]  # rank 0 alone logs
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer_price = load_config(None, []).cost.trainer_usd_per_hour
    assert rows[0]["cost/usd_per_hour"] == pytest.approx(2 * trainer_price)  # two trainer GPUs, no workers
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.name == "step_000002"
    saved = read_trainer_state(ckpt)["optimizer"]
    assert sorted(saved["state"]) == list(range(len(saved["state"])))  # one process's layout
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    init = AutoModelForCausalLM.from_pretrained(run_dir / "init_model")
    assert final.config.architectures == ["Qwen3ForCausalLM"]
    assert not torch.equal(final.model.embed_tokens.weight, init.model.embed_tokens.weight)
    state = train(load_config(run_dir / "config.toml", ["trainer.total_steps=3"]), run_dir, resume=True)
    assert state.step == 3 and _steps(run_dir) == [1, 2, 3]


def test_a_config_error_on_rank_0_stops_every_rank(tmp_path):
    proc = _torchrun("train", "--run-dir", str(tmp_path / "run"), *E2E, "rollout.mode=local")
    assert proc.returncode != 0 and "rollout.mode: local" in proc.stderr


# ----------------------------------------------------------------------- activation checkpointing


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir):
    cfg = load_config(None, LEARNER)
    batch = _mini_batches(2, [5], vocab=40)[0]
    grads, metrics, calls = [], [], []
    for checkpointing in (False, True):
        model = load_model(tiny_model_dir, torch.device("cpu"))
        if checkpointing:
            enable_gradient_checkpointing(model)
        calls.append(0)
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        learner = build_learner(cfg, model, init_path=tiny_model_dir, pad_id=0, blob=None, dp=DataParallel())
        metrics.append(learner.train_mini_batch(batch, weights_as_sampled=True))
        grads.append([p.grad for p in model.parameters()])
        assert not model.training  # the engine's forward passes never recompute
    assert calls[1] > calls[0]  # the backward pass really recomputed the layers
    assert metrics[0] == pytest.approx(metrics[1], rel=1e-6, abs=1e-9)
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)


def test_gradient_checkpointing_runs_with_the_colocated_engine(tmp_path):
    """Local mode: the engine generates with the very modules that checkpoint in training."""
    state = train(load_config(None, [*SMALL, "trainer.total_steps=2", "trainer.gradient_checkpointing=true"]), tmp_path)
    assert state.step == 2


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_match_one_in_bf16(tmp_path, tiny_model_dir, monkeypatch):
    """bf16 compute: one GPU autocasts, two gather bf16 parameters (FSDP's policy); the
    losses of a few steps agree within bf16's precision."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # one GPU as two run: autocast, not "auto"'s working copy and compiled layers
    overrides = [*LEARNER, "model.dtype=bfloat16", "trainer.working_copy=false", "trainer.compile_layers=false"]
    batches = _mini_batches(3, [8, 3, 8], vocab=40)
    _train(0, 1, 0, tiny_model_dir, None, tmp_path / "one.pt", batches, overrides, "cuda")
    mp.spawn(
        _train, args=(2, free_port(), tiny_model_dir, None, tmp_path / "two.pt", batches, overrides, "cuda"), nprocs=2
    )
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=3e-2, abs=1e-3), key
