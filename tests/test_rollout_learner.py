"""Local rollout and the learner: log-prob agreement, exact micro-batching, streaming."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polyrl.config import AlgoConfig, EngineConfig, TrainerConfig
from polyrl.engine.engine import Engine
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.local import LocalRollout
from polyrl.trainer.batching import SeqItem, collate, group_items, pack_micro_batches
from polyrl.trainer.learner import Learner, build_optimizer, lr_lambda
from polyrl.trainer.stream import in_prompt_order, learn_from_stream


@pytest.fixture()
def model_tok(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tok, texts):
    return [Prompt(index=i, text=t, prompt_ids=tok(t).input_ids, columns={"answer": "x"}) for i, t in enumerate(texts)]


def _learner(model, algo=AlgoConfig(), **trainer_kw):
    cfg = TrainerConfig(**{"train_batch_size": 4, "ppo_mini_batch_size": 4, "warmup_steps": 0, **trainer_kw})
    opt, sched = build_optimizer(model, cfg, total_updates=10)
    return Learner(
        model=model, ref_model=None, optimizer=opt, scheduler=sched, algo=algo, cfg=cfg, temperature=0.7, pad_id=0
    )


def test_rollout_groups_and_logprobs_match_a_forward_pass(model_tok):
    model, tok = model_tok
    torch.manual_seed(0)
    # 5 running sequences at most: the groups of different prompts interleave.
    rollout = LocalRollout(Engine(model, EngineConfig(block_size=4, max_num_seqs=5)))
    params = SamplingParams(n=3, max_new_tokens=6, temperature=0.7, stop_token_ids=[tok.eos_token_id], ignore_eos=True)
    prompts = _prompts(tok, ["1+2=", "13+4=", "ab>", "abcd|"])
    groups = list(rollout.generate(prompts, params))
    assert sorted(g.prompt.text for g in groups) == sorted(p.text for p in prompts)
    assert all(len(g.samples) == 3 for g in groups)
    samples = [s for g in groups for s in g.samples]
    for s in samples:
        assert 1 <= len(s.completion_ids) <= 6
        stops = [i for i, t in enumerate(s.completion_ids) if t == tok.eos_token_id]
        assert stops == ([len(s.completion_ids) - 1] if s.finish_reason == "stop" else [])
    # The learner's recomputation (right padding, explicit positions) must reproduce the
    # engine's behaviour log-probs (left padding, KV cache): the on-policy guarantee.
    learner = _learner(model)
    items = [
        SeqItem(g.prompt.prompt_ids + s.completion_ids, len(g.prompt.prompt_ids), s.logprobs, 0.0)
        for g in groups
        for s in g.samples
    ]
    mb = collate(items, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, _ = learner.logprobs(model, mb, with_entropy=False)
    diff = ((logp - mb.behav_logp).abs() * mb.mask).max().item()
    assert diff < 1e-4, diff
    assert mb.mask.sum().item() == sum(len(s.completion_ids) for s in samples)


def test_local_rollout_gives_each_prompt_its_own_budget(model_tok):
    model, tok = model_tok
    rollout = LocalRollout(Engine(model, EngineConfig(block_size=4, max_num_seqs=8)))
    prompts = _prompts(tok, ["1+2=", "13+4=", "ab>"])
    for p, budget in zip(prompts, [2, None, 50], strict=True):
        p.max_new_tokens = budget
    groups = list(rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=5, ignore_eos=True)))
    lengths = {g.prompt.text: [len(s.completion_ids) for s in g.samples] for g in groups}
    assert lengths == {"1+2=": [2, 2], "13+4=": [5, 5], "ab>": [5, 5]}  # 50 is capped by the run's 5


def test_pack_micro_batches_respects_budget():
    items = [SeqItem([1] * n, 1, [0.0] * (n - 1), 0.0) for n in (3, 5, 2, 9, 4, 4)]
    batches = pack_micro_batches(items, max_tokens=10)
    assert [x for b in batches for x in b] == items  # order kept, nothing lost
    for b in batches:
        assert len(b) == 1 or max(len(x.token_ids) for x in b) * len(b) <= 10


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batching_is_exact(model_tok, mode):
    """One mini-batch split into many micro-batches takes the same optimizer step."""
    model, tok = model_tok
    torch.manual_seed(1)
    items = [
        SeqItem(tok("12+3=").input_ids + [5, 6, 2], 6, [-1.0, -2.0, -0.5], 1.0),
        SeqItem(tok("ab>").input_ids + [7], 4, [-3.0], -0.5),
        SeqItem(tok("abcd|").input_ids + [8, 9, 10, 2], 6, [-1.0, -1.5, -2.0, -0.1], 0.3),
        SeqItem(tok("9+9=").input_ids + [11, 12], 5, [-2.0, -2.0], -0.8),
    ]
    algo = AlgoConfig(loss_agg_mode=mode, entropy_coef=0.01)
    whole, split = copy.deepcopy(model), copy.deepcopy(model)
    m_whole = _learner(whole, algo, micro_batch_max_tokens=4096).train_mini_batch(items, weights_as_sampled=True)
    m_split = _learner(split, algo, micro_batch_max_tokens=16).train_mini_batch(items, weights_as_sampled=True)
    assert m_whole["actor/pg_loss"] == pytest.approx(m_split["actor/pg_loss"], abs=1e-6)
    assert m_whole["actor/grad_norm"] == pytest.approx(m_split["actor/grad_norm"], rel=1e-5)
    # Compare the accumulated gradients (still in .grad after the step); Adam's first update is
    # ~lr * sign(g), which would magnify float noise in near-zero entries.
    for p, q in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7)
    assert any(not torch.equal(p, p0) for p, p0 in zip(whole.parameters(), model.parameters()))


class _Scorer:
    """Reward = number of completion tokens (so groups differ). `ready`: every reward is
    done when asked; else none is until waited for (a reward model or a verifier still
    working when the next group is polled)."""

    class _Future:
        def __init__(self, r, ready):
            self.r, self.ready = r, ready

        def done(self):
            return self.ready

        def result(self):
            return self.r

    def __init__(self, ready: bool = True):
        self.ready = ready

    def submit(self, group):
        return self._Future([float(len(s.completion_ids)) for s in group.samples], self.ready)


def _group(tok, i, lengths):
    p = _prompts(tok, [f"{i}+1="])[0]
    samples = [Sample(list(range(5, 5 + n)), [-1.0] * n, "length", [0] * n) for n in lengths]
    return Group(prompt=p, samples=samples)


def test_stream_trains_per_mini_batch_and_filters(model_tok):
    model, tok = model_tok
    learner = _learner(model, AlgoConfig(filter_zero_variance_groups=True))
    groups = [_group(tok, i, [1, 2, 3]) for i in range(5)] + [_group(tok, 9, [2, 2, 2])]
    result = learn_from_stream(iter(groups), _Scorer(), learner, learner.algo, mini_batch_size=2)
    assert len(result.groups) == 6 and all(g.rewards for g in result.groups)
    assert len(result.train_metrics) == 3  # 6 groups / mini-batches of 2
    assert result.num_filtered_groups == 1
    assert learner.scheduler.last_epoch == 3


def test_a_full_mini_batch_trains_before_the_next_group_is_awaited(model_tok):
    """Once a mini-batch's groups are all in, the learner waits for their rewards, not for
    the next group (a whole round of decoding away on a busy fleet: 0.47 s of the
    one-worker main job's step on the 2-core box)."""
    model, tok = model_tok
    learner = _learner(model)
    events: list[str] = []
    train = learner.train_mini_batch

    def recorded(items, weights_as_sampled):
        events.append("train")
        return train(items, weights_as_sampled)

    learner.train_mini_batch = recorded

    def arriving():
        for i in range(5):
            events.append(f"g{i}")
            yield _group(tok, i, [1, 2, 3])

    result = learn_from_stream(arriving(), _Scorer(ready=False), learner, learner.algo, mini_batch_size=2)
    assert events == ["g0", "g1", "train", "g2", "g3", "train", "g4", "train"]
    assert all(g.rewards for g in result.groups)


def test_the_learner_checks_the_thread_governor_after_each_micro_batch(model_tok, monkeypatch):
    """The CPU thread governor hears from every micro-batch (`checked_each`): read once
    per mini-batch it was one mini-batch behind a worker starting or stopping beside the
    learner (the one-worker main job's step: 3.2 s, then 2.75 s)."""
    from polyrl.cpu_threads import CpuThreads

    model, tok = model_tok
    learner = _learner(model, micro_batch_max_tokens=16)
    checked = []
    monkeypatch.setattr(CpuThreads, "checkpoint", lambda self: checked.append(1))
    items = [SeqItem(list(range(5, 15)), 4, [-1.0] * 6, 0.5) for _ in range(4)]
    learner.train_mini_batch(items, weights_as_sampled=True)
    assert len(checked) >= 4  # one after each of the (at least 4) micro-batches


def test_lr_schedule():
    cfg = TrainerConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1)
    f = lr_lambda(cfg, total_updates=14)
    assert [round(f(i), 3) for i in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0) and f(14) == pytest.approx(0.1) and f(9) == pytest.approx(0.55)
    lin = lr_lambda(TrainerConfig(warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.0), total_updates=10)
    assert lin(5) == pytest.approx(0.5)


def test_rollout_ignores_the_models_generation_config(model_tok):
    """A checkpoint's own sampling tweaks (n-gram bans, penalties) must not leak into rollout:
    they would change what is sampled without changing the log-probs we report."""
    model, tok = model_tok
    model.generation_config.no_repeat_ngram_size = 1  # would forbid any repeated token
    model.generation_config.repetition_penalty = 5.0
    torch.manual_seed(0)
    rollout = LocalRollout(Engine(model, EngineConfig()))
    params = SamplingParams(n=16, max_new_tokens=8, temperature=1.0, ignore_eos=True)
    groups = list(rollout.generate(_prompts(tok, ["ab>", "1+1="]), params))
    samples = [s for g in groups for s in g.samples]
    assert any(len(set(s.completion_ids)) < len(s.completion_ids) for s in samples)


def test_bf16_compute_keeps_fp32_master_weights(model_tok):
    model, tok = model_tok
    learner = _learner(model)
    learner.compute_dtype = torch.bfloat16
    items = [
        SeqItem(tok("ab>").input_ids + [7, 8], 4, [-3.0, -3.0], 1.0),
        SeqItem(tok("ab>").input_ids + [9], 4, [-3.0], -1.0),
    ]
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.train_mini_batch(items, weights_as_sampled=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _exact_logprobs(model, tok) -> tuple[Prompt, list[int], SeqItem, list[float]]:
    """A 4-token completion of "1+2=", its learner item, and the model's own log-probs of
    those tokens (what an engine with the same weights would report)."""
    prompt = _prompts(tok, ["1+2="])[0]
    completion = [5, 6, 7, 8]
    item = SeqItem(prompt.prompt_ids + completion, len(prompt.prompt_ids), [0.0] * 4, 1.0)
    with torch.no_grad():
        mb = collate([item], pad_id=tok.pad_token_id)
        true = _learner(model).logprobs(model, mb, with_entropy=False)[0][0][mb.mask[0].bool()].tolist()
    return prompt, completion, item, true


def test_logprob_diff_counts_only_tokens_of_the_current_version(model_tok):
    """Tokens sampled ahead by older weights (max_staleness) differ from the learner by the
    update, not by a mismatch: the metric must leave them out, and only them."""
    model, tok = model_tok
    prompt, completion, item, true = _exact_logprobs(model, tok)
    behav = true[:2] + [t - 3.0 for t in true[2:]]  # tokens 3-4: an older version's log-probs
    versions = [4, 4, 3, 3]
    sample = Sample(completion, behav, "length", versions)
    [mixed] = group_items(Group(prompt, [sample]), [1.0], version=4)
    assert mixed.current == [True, True, False, False] and mixed.num_current_tokens == 2
    [unmarked] = group_items(Group(prompt, [sample]), [1.0])
    assert unmarked.current is None
    diff_mixed = _learner(copy.deepcopy(model)).train_mini_batch([mixed], weights_as_sampled=True)[
        "rollout/logprob_diff"
    ]
    diff_all = _learner(copy.deepcopy(model)).train_mini_batch([unmarked], weights_as_sampled=True)[
        "rollout/logprob_diff"
    ]
    assert diff_mixed < 1e-4, diff_mixed
    assert diff_all == pytest.approx(1.5, abs=1e-3)  # 2 of 4 tokens off by 3
    [stale] = group_items(Group(prompt, [Sample(completion, behav, "length", [3] * 4)]), [1.0], version=4)
    assert "rollout/logprob_diff" not in _learner(copy.deepcopy(model)).train_mini_batch(
        [stale], weights_as_sampled=True
    )


def test_mismatch_per_version_lag(model_tok):
    """Each token carries its lag from the sample's versions to the learner's batch; the KL
    between engine and trainer is also reported per lag > 0, over that lag's tokens only."""
    model, tok = model_tok
    prompt, completion, item, true = _exact_logprobs(model, tok)
    behav = [true[0], true[1], true[2] - 3.0, true[3] - 1.0]  # log rho = old - behav: 0, 0, 3, 1
    [lagged] = group_items(Group(prompt, [Sample(completion, behav, "length", [4, 4, 3, 2])]), [1.0], version=4)
    assert lagged.lags == [0, 0, 1, 2]
    exact = SeqItem(item.token_ids, item.prompt_len, true, 1.0)  # lag 0, no mismatch
    assert collate([lagged, exact], 0).lag[:, len(prompt.prompt_ids) - 1 :].tolist() == [[0, 0, 1, 2], [0] * 4]
    metrics = _learner(copy.deepcopy(model)).train_mini_batch([lagged, exact], weights_as_sampled=True)
    k3 = {1: math.exp(3) - 1 - 3, 2: math.exp(1) - 1 - 1}
    for lag, log_rho in ((1, 3.0), (2, 1.0)):
        assert metrics[f"mismatch/lag_{lag}/k1_kl"] == pytest.approx(-log_rho, abs=1e-3)
        assert metrics[f"mismatch/lag_{lag}/k3_kl"] == pytest.approx(k3[lag], rel=1e-3)
    assert "mismatch/lag_0/k3_kl" not in metrics
    assert metrics["mismatch/k3_kl"] == pytest.approx((k3[1] + k3[2]) / 8, rel=1e-3)  # 8 counted tokens


def test_groups_in_prompt_order_wait_for_the_earlier_ones():
    """rollout.deterministic: groups come out in submission order whatever order they
    finish in; each as soon as the groups before it are there; a missing or extra group
    is an error, not a silently different batch."""

    def group(index):
        return Group(prompt=Prompt(index=index, text="", prompt_ids=[1]), samples=[])

    seen = []

    def finishing(order):
        for i in order:
            seen.append(i)
            yield group(i)

    ordered = in_prompt_order(finishing([12, 10, 13, 11]), [10, 11, 12, 13])
    assert next(ordered).prompt.index == 10 and seen == [12, 10]  # 10 is out before 13 arrives
    assert [g.prompt.index for g in ordered] == [11, 12, 13] and seen == [12, 10, 13, 11]
    with pytest.raises(RuntimeError, match="without the group of prompt 11"):
        list(in_prompt_order(finishing([10]), [10, 11]))
    with pytest.raises(RuntimeError, match="not asked for"):
        list(in_prompt_order(finishing([11, 10, 14]), [10, 11]))
