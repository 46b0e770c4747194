"""Atropos groups as polyrl training samples (no server): masks, scores, advantages,
overrides, inference log-probs, and what the learner makes of them."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from polyrl.config import AlgoConfig, ConfigError, load_config
from polyrl.data.atropos import ScoredGroup, check_group, to_group
from polyrl.trainer.batching import collate, group_items
from polyrl.trainer.grpo import LossInputs, group_advantages, policy_loss
from polyrl.trainer.stream import _items

X = -100  # a context position


def scored(**kw) -> ScoredGroup:
    base = {
        "tokens": [[5, 6, 7, 8, 9], [5, 6, 7, 10]],
        "masks": [[X, X, 7, 8, 9], [X, X, 7, 10]],
        "scores": [1.0, 0.0],
    }
    return ScoredGroup.model_validate(base | kw)


def test_prompt_is_the_leading_context_and_scores_are_rewards():
    g = to_group(scored(), index=3, version=2)
    assert g.prompt.prompt_ids == [5, 6] and g.prompt.index == 3
    assert [s.completion_ids for s in g.samples] == [[7, 8, 9], [7, 10]]
    assert g.rewards == [1.0, 0.0]
    assert all(s.prompt_ids is None and s.loss_mask is None and s.advantages is None for s in g.samples)
    assert g.samples[0].weight_versions == [2, 2, 2]
    assert g.zero_advantage is None


def test_inference_logprobs_are_aligned_with_tokens():
    lp = [[1.0, 1.0, -0.1, -0.2, -0.3], [1.0, 1.0, -0.5, -0.6]]  # Atropos puts 1.0 on context positions
    g = to_group(scored(inference_logprobs=lp), 0, 0)
    assert [s.logprobs for s in g.samples] == [[-0.1, -0.2, -0.3], [-0.5, -0.6]]
    assert all(s.has_logprobs for s in g.samples)
    items = group_items(g, [0.5, -0.5])
    mb = collate(items, pad_id=0)
    # target column t predicts token t+1: the first completion token (position 2) is column 1
    assert mb.behav_logp[0, 1:4].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert mb.target_ids[0, 1:4].tolist() == [7, 8, 9]
    assert mb.mask[0].tolist() == [0, 1, 1, 1] and mb.mask[1].tolist() == [0, 1, 1, 0]
    assert mb.behav_known is None


def test_without_inference_logprobs_the_learner_supplies_its_own():
    g = to_group(scored(), 0, 0)
    assert not any(s.has_logprobs for s in g.samples)
    items = group_items(g, [1.0, -1.0], version=0)
    assert all(not it.behav_known and it.num_current_tokens == 0 for it in items)
    mb = collate(items, pad_id=0)
    assert mb.behav_known is not None and mb.behav_known.sum() == 0


def test_context_inside_the_completion_is_kept_out_of_the_loss():
    # a tool's output (two context tokens) between two generated turns
    g = to_group(scored(tokens=[[5, 6, 7, 30, 31, 8], [5, 6, 7, 8]], masks=[[X, X, 7, X, X, 8], [X, X, 7, 8]]), 0, 0)
    s = g.samples[0]
    assert s.completion_ids == [7, 30, 31, 8] and s.loss_mask == [True, False, False, True]
    items = group_items(g, [1.0, -1.0])
    assert items[0].num_loss_tokens == 2 and items[0].num_completion_tokens == 4
    mb = collate(items, pad_id=0)
    assert mb.mask[0].tolist() == [0, 1, 0, 0, 1]


def test_a_sequence_with_another_context_keeps_it():
    g = to_group(scored(tokens=[[5, 6, 7], [11, 12, 13, 14]], masks=[[X, X, 7], [X, X, X, 14]]), 0, 0)
    assert g.prompt.prompt_ids == [5, 6]
    assert g.samples[0].prompt_ids is None and g.samples[1].prompt_ids == [11, 12, 13]
    items = group_items(g, [1.0, -1.0])
    assert items[1].token_ids == [11, 12, 13, 14] and items[1].prompt_len == 3


def test_group_advantages_from_scores_and_set_advantage_to_zero():
    algo = AlgoConfig()
    g = to_group(
        scored(
            tokens=[[5, 6, 7]] * 3,
            masks=[[X, 6, 7]] * 3,
            scores=[1.0, 0.0, 0.5],
            overrides=[{}, {"set_advantage_to_zero": True}, None],
        ),
        0,
        0,
    )
    assert g.zero_advantage == [False, True, False]
    from polyrl.trainer.stream import StreamResult

    items = _items([g], algo, StreamResult())
    expected = group_advantages(torch.tensor([[1.0, 0.0, 0.5]]), algo.norm_adv_by_std)[0].tolist()
    assert [it.advantage for it in items] == pytest.approx([expected[0], 0.0, expected[2]])
    assert expected[1] != 0.0  # the override, not the scores, made it 0


def test_the_groups_own_per_token_advantages_are_used():
    adv = [[0.0, 0.0, 0.3, 0.2, 0.1], [0.0, 0.0, -1.0, -2.0]]
    g = to_group(scored(advantages=adv, overrides=[{}, {"set_advantage_to_zero": True}]), 0, 0)
    assert g.samples[0].advantages == [0.3, 0.2, 0.1] and g.samples[1].advantages == [0.0, 0.0]
    mb = collate(group_items(g, [9.0, 9.0]), pad_id=0)  # per-token values win over the group's
    assert mb.advantages.shape == (2, 4)
    assert mb.advantages[0, 1:4].tolist() == pytest.approx([0.3, 0.2, 0.1])
    assert mb.advantages[1].tolist() == [0.0] * 4
    # the loss takes [B, T] advantages: with ratio 1 and no clipping, pg = -adv per token
    z = torch.zeros(2, 4)
    inputs = LossInputs(logp=z, old_logp=z, behav_logp=z, advantages=mb.advantages, mask=mb.mask)
    loss, _ = policy_loss(inputs, AlgoConfig(entropy_coef=0.0), num_tokens=int(mb.mask.sum()), num_seqs=2)
    assert loss.item() == pytest.approx(-(0.3 + 0.2 + 0.1) / 5)


def test_malformed_groups_are_refused():
    with pytest.raises(ValidationError, match="masks are not aligned"):
        scored(masks=[[X, 6], [X, X, 7, 10]])
    with pytest.raises(ValidationError, match="inference_logprobs are not aligned"):
        scored(inference_logprobs=[[1.0], [1.0]])
    with pytest.raises(ValidationError, match="2 token lists, 2 masks, 1 scores"):
        scored(scores=[1.0])
    assert "outside the model's vocabulary" in check_group(scored(), vocab_size=8, max_token_len=64)
    assert "longer than max_token_len=4" in check_group(scored(), vocab_size=64, max_token_len=4)
    assert check_group(scored(), vocab_size=64, max_token_len=64) is None


def test_config_checks():
    with pytest.raises(ConfigError, match="data.atropos.url: required"):
        load_config(None, ["data.source=atropos"])
    with pytest.raises(ConfigError, match="rollout.mode: local has no manager"):
        load_config(None, ["data.source=atropos", "data.atropos.url=http://127.0.0.1:8000", "rollout.mode=local"])
    with pytest.raises(ConfigError, match="data.atropos.url"):
        load_config(None, ["data.source=atropos", "data.atropos.url=127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="data.source"):
        load_config(None, ["data.source=elsewhere"])
    cfg = load_config(None, ["data.source=atropos", "data.atropos.url=http://127.0.0.1:8000"])
    assert cfg.data.atropos.url == "http://127.0.0.1:8000"


def test_base_envs_empty_lists_mean_none_and_bad_groups_are_dropped_not_fatal():
    from types import SimpleNamespace

    from polyrl.rollout.atropos import AtroposRollout

    good = {
        "tokens": [[5, 6, 7]],
        "masks": [[X, X, 7]],
        "scores": [1.0],
        "advantages": [],
        "overrides": [],
        "inference_logprobs": [],
        "ref_logprobs": [],
        "messages": [],
        "group_overrides": {},
    }
    misaligned = good | {"masks": [[X, 7]]}
    too_long = good | {"tokens": [[5] * 70], "masks": [[X] * 69 + [5]]}
    client = SimpleNamespace(registration=SimpleNamespace(max_token_len=64))
    inner = SimpleNamespace(weight_version=4, completion_versions=lambda keys: [None] * len(keys))
    rollout = AtroposRollout(inner, client, vocab_size=64, temperature=1.0, steps_done=0)
    groups = rollout._convert([misaligned, good, too_long])
    assert len(groups) == 1 and rollout.num_dropped == 2
    assert groups[0].samples[0].completion_ids == [7] and groups[0].samples[0].weight_versions == [4]


@pytest.mark.parametrize("impl", ["padded", "packed"])
def test_learner_uses_its_own_logprobs_where_none_came(tiny_model_dir, impl):
    """Without inference_logprobs the importance weight is exactly 1 (the learner's own
    log-probs stand in); with them it compares against the given ones."""
    from transformers import AutoModelForCausalLM

    from polyrl.config import TrainerConfig
    from polyrl.trainer.learner import Learner, build_optimizer

    def learner() -> Learner:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        cfg = TrainerConfig(train_batch_size=2, ppo_mini_batch_size=2, warmup_steps=0, learner_impl=impl)
        opt, sched = build_optimizer(model, cfg, total_updates=4)
        return Learner(
            model=model,
            ref_model=None,
            optimizer=opt,
            scheduler=sched,
            algo=AlgoConfig(tis_cap=2.0),
            cfg=cfg,
            temperature=1.0,
            pad_id=0,
        )

    without = group_items(to_group(scored(), 0, 0), [1.0, -1.0], version=0)
    metrics = learner().train_mini_batch(without, weights_as_sampled=True)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert "rollout/logprob_diff" not in metrics  # nothing to compare the learner with
    lp = [[1.0, 1.0, -9.0, -9.0, -9.0], [1.0, 1.0, -9.0, -9.0]]  # far less likely than the model says
    given = group_items(to_group(scored(inference_logprobs=lp), 0, 0), [1.0, -1.0], version=0)
    metrics = learner().train_mini_batch(given, weights_as_sampled=True)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(2.0)  # exp(old - (-9)) capped at tis_cap
    assert metrics["rollout/logprob_diff"] > 4


@pytest.mark.slow
def test_polyrl_train_stops_with_one_line_when_the_api_is_unreachable(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "data.source=atropos",
        f"data.atropos.url={url}",
        "data.atropos.unreachable_timeout_s=1",
        "manager.port=0",
        "fleet.num_workers=0",
        "logging.console=false",
        "logging.tensorboard=false",
    ]
    env = os.environ | {"POLYRL_TOKEN": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [
        line for line in (proc.stdout + proc.stderr).splitlines() if f"Atropos API at {url} unreachable for 1s" in line
    ]
    assert len(lines) == 1 and "--resume" in lines[0], proc.stderr[-3000:]
    # Logs to a pipe or file are plain lines, not rich's 80 columns padded with spaces.
    manager_log = (tmp_path / "run" / "manager.log").read_text().splitlines()
    for text in (proc.stdout.splitlines(), manager_log):
        assert text and not [line for line in text if line != line.rstrip()], text
    [add_worker] = [line for line in proc.stdout.splitlines() if "add a worker: polyrl worker" in line]
    assert add_worker.endswith(f"--token-file {tmp_path / 'run' / 'manager.json'}"), add_worker
    assert " INFO polyrl.launch.start: rollout manager on " in add_worker
