"""The packed learner (one padding-free row per micro-batch, log-probs from the hidden
states) against the padded one: same log-probs, same loss, same gradients in float32."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.trainer import lm_head
from polyrl.trainer.batching import SeqItem, collate
from polyrl.trainer.learner import Learner, build_optimizer, is_fast_path_default
from polyrl.trainer.lm_head import head_logprobs
from polyrl.trainer.packing import collate_packed, pack_by_tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", ["eager", "compiled", "triton"])
def test_head_logprobs_match_full_logits(monkeypatch, temperature, path):
    """Values and gradients (of a random mix of logp and entropy) against autograd through
    the full logits, with the chunk forced to 5 tokens, on each path of the per-chunk math:
    eager; `compiled`, torch.compile's (aot_eager here: inductor's C++ build is too slow for
    CI), as on a GPU without Triton; `triton`, the kernels (in Triton's interpreter on CPU).
    Each fused path counts its calls, so a test that ran another path fails."""
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMS", 5 * 50)
    calls = {"compiled": 0, "triton": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    compiled = functools.cache(lambda fn: counted("compiled", torch.compile(fn, dynamic=True, backend="aot_eager")))
    monkeypatch.setattr(lm_head, "_fused", compiled)
    for name in ("chunk_forward", "chunk_backward"):
        monkeypatch.setattr(lm_head.head_kernels, name, counted("triton", getattr(lm_head.head_kernels, name)))
    if path == "compiled":
        monkeypatch.setattr(lm_head, "USE_TRITON", False)
    elif path == "triton" and not lm_head.head_kernels.usable(torch.empty(1, 1)):
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)  # [N, H]
    weight = torch.randn(50, 16, generator=g, requires_grad=True)  # [V, H]
    targets = torch.randint(0, 50, (23,), generator=g)
    a, b = torch.randn(23, generator=g), torch.randn(23, generator=g)

    logp, ent = head_logprobs(hidden, weight, targets, temperature, fused=path != "eager")
    (logp * a + ent * b).sum().backward()
    got = [logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()]
    expected_calls = {
        "eager": {"compiled": 0, "triton": 0},
        "compiled": {"compiled": 2, "triton": 0},
        "triton": {"compiled": 0, "triton": 2},
    }[path]
    assert {k: min(v, 2) for k, v in calls.items()} == expected_calls, calls  # (forward and backward, per chunk)

    hidden.grad = weight.grad = None
    log_q = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)  # [N, V]
    ref_logp = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_q.exp() * log_q).sum(-1)
    (ref_logp * a + ref_ent * b).sum().backward()
    for x, y in zip(got, [ref_logp, ref_ent, hidden.grad, weight.grad]):
        assert _rel_err(x, y.detach()) < 1e-5


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative error of a whole tensor (element-wise it would flag entries that cancel)."""
    return ((x - y).norm() / y.norm().clamp(min=1e-12)).item()


def test_pack_by_tokens_respects_budget():
    """Greedy in arrival order: a micro-batch takes sequences while their tokens fit the
    budget; a longer one gets its own. Checked micro-batch by micro-batch, so a packer
    that never packs (or one that overfills) fails."""
    items = [SeqItem([1] * n, 1, [0.0] * (n - 1), 0.0) for n in (3, 5, 2, 9, 4, 4, 12)]
    batches = pack_by_tokens(items, max_tokens=10)
    assert [x for b in batches for x in b] == items
    assert [[len(x.token_ids) for x in b] for b in batches] == [[3, 5, 2], [9], [4, 4], [12]]


def _model(tiny_model_dir, arch_tied: tuple[str, bool]) -> torch.nn.Module:
    arch, tied = arch_tied
    config = AutoConfig.from_pretrained(tiny_model_dir)
    if arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(**{k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")})
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _items(seed: int) -> list[SeqItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(7):
        n, p = int(torch.randint(4, 30, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.randint(3, 40, (n,), generator=g).tolist()
        items.append(SeqItem(ids, p, (-torch.rand(n - p, generator=g) * 3).tolist(), float(i % 3) - 1.0))
    return items


def _learner(model, impl, algo, ref=None, **kw):
    cfg = TrainerConfig(train_batch_size=4, ppo_mini_batch_size=4, warmup_steps=0, learner_impl=impl, **kw)
    opt, sched = build_optimizer(model, cfg, total_updates=10)
    return Learner(
        model=model, ref_model=ref, optimizer=opt, scheduler=sched, algo=algo, cfg=cfg, temperature=0.7, pad_id=0
    )


@pytest.mark.parametrize("arch_tied", [("qwen3", True), ("qwen3", False), ("llama", True)])
def test_packed_logprobs_equal_padded(tiny_model_dir, arch_tied):
    model = _model(tiny_model_dir, arch_tied)
    items = _items(0)
    padded = _learner(copy.deepcopy(model), "padded", AlgoConfig())
    packed = _learner(copy.deepcopy(model), "packed", AlgoConfig())
    with torch.no_grad():
        mb = collate(items, 0)
        ref_logp, ref_ent = padded.logprobs(padded.model, mb, True)
        logp, ent = packed.logprobs(packed.model, collate_packed(items, 0), True)
    m = mb.mask > 0
    assert _rel_err(logp[m], ref_logp[m]) < 1e-6
    assert _rel_err(ent[m], ref_ent[m]) < 1e-6


def test_packed_forward_never_infers_packing(tiny_model_dir, monkeypatch):
    """transformers infers packing from the position ids when it builds a mask, with an
    `.all()` that makes the host wait for the device at every forward. The packed learner
    knows its documents' bounds, so that inference must not run at all."""
    from transformers import masking_utils

    def refuse(position_ids):
        raise AssertionError("find_packed_sequence_indices ran: the learner's forward waits for the device")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", refuse)
    items = _items(2)
    learner = _learner(_model(tiny_model_dir, ("qwen3", True)), "packed", AlgoConfig(), micro_batch_max_tokens=48)
    metrics = learner.train_mini_batch(items, weights_as_sampled=True)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "arch_tied, epochs, mode, with_ref, max_tokens",
    [
        (("qwen3", True), 1, "token-mean", False, 64),
        (("qwen3", False), 2, "seq-mean-token-mean", True, 40),
        (("llama", True), 2, "seq-mean-token-sum", False, 4096),
    ],
)
def test_packed_training_equals_padded(tiny_model_dir, arch_tied, epochs, mode, with_ref, max_tokens):
    """Same metrics and same accumulated gradients, several micro-batches, 1 and 2 epochs."""
    model = _model(tiny_model_dir, arch_tied)
    algo = AlgoConfig(ppo_epochs=epochs, loss_agg_mode=mode, entropy_coef=0.01, kl_coef=0.1 if with_ref else 0.0)
    items = _items(1)
    out = {}
    for impl in ("padded", "packed"):
        ref = copy.deepcopy(model).requires_grad_(False) if with_ref else None
        learner = _learner(copy.deepcopy(model), impl, algo, ref, micro_batch_max_tokens=max_tokens)
        out[impl] = (learner.train_mini_batch(items, weights_as_sampled=True), learner.model)
    (m_pad, pad), (m_pack, pack) = out["padded"], out["packed"]
    assert m_pad.keys() == m_pack.keys()
    for key in m_pad:
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-5, abs=1e-7), key
    for (name, p), q in zip(pad.named_parameters(), pack.parameters()):
        assert _rel_err(q.grad, p.grad) < 1e-5, name


def test_bf16_working_copy_tracks_fp32_masters(tiny_model_dir):
    """The bf16 copy trains, its gradients land on the float32 masters, and after the step
    it holds the masters' new values; the result is close to autocast's."""
    model = _model(tiny_model_dir, ("qwen3", True))
    items = _items(2)
    results = {}
    for working_copy in (False, True):
        cfg = TrainerConfig(train_batch_size=4, ppo_mini_batch_size=4, warmup_steps=0, working_copy=working_copy)
        m = copy.deepcopy(model)
        opt, sched = build_optimizer(m, cfg, total_updates=10)
        learner = Learner(
            model=m,
            ref_model=None,
            optimizer=opt,
            scheduler=sched,
            algo=AlgoConfig(),
            cfg=cfg,
            temperature=0.7,
            pad_id=0,
            compute_dtype=torch.bfloat16,
        )
        results[working_copy] = learner.train_mini_batch(items, weights_as_sampled=True)
        assert (learner.work is not m) == working_copy
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())
        for p, w in zip(m.parameters(), learner.work.parameters()):
            assert torch.equal(w, p.to(w.dtype))
    assert results[True]["actor/grad_norm"] == pytest.approx(results[False]["actor/grad_norm"], rel=0.05)
    assert results[True]["actor/entropy"] == pytest.approx(results[False]["actor/entropy"], rel=0.01)


def test_auto_keeps_cpu_exact(tiny_model_dir):
    """On CPU "auto" means no working copy and no compile, even with bf16 compute; explicit
    true still gives the copy."""
    model = _model(tiny_model_dir, ("qwen3", True))
    assert TrainerConfig().working_copy == "auto" and TrainerConfig().compile_layers == "auto"
    for working_copy, has_copy in (("auto", False), (True, True)):
        cfg = TrainerConfig(train_batch_size=4, ppo_mini_batch_size=4, working_copy=working_copy)
        m = copy.deepcopy(model)
        opt, sched = build_optimizer(m, cfg, total_updates=10)
        learner = Learner(
            model=m,
            ref_model=None,
            optimizer=opt,
            scheduler=sched,
            algo=AlgoConfig(),
            cfg=cfg,
            temperature=0.7,
            pad_id=0,
            compute_dtype=torch.bfloat16,
        )
        assert (learner.work is not m) == has_copy and not learner.is_compiled
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert is_fast_path_default(cuda, torch.bfloat16, is_packed=True, world_size=1)
    assert not is_fast_path_default(cpu, torch.bfloat16, is_packed=True, world_size=1)
    assert not is_fast_path_default(cuda, torch.float32, is_packed=True, world_size=1)
    assert not is_fast_path_default(cuda, torch.bfloat16, is_packed=False, world_size=1)
    assert not is_fast_path_default(cuda, torch.bfloat16, is_packed=True, world_size=2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_keeps_attention_per_document(tiny_model_dir, monkeypatch):
    """The flex document mask (the GPU's alternative), run by eager flex_attention on CPU,
    gives the exact per-document SDPA's log-probs."""
    from torch.nn.attention.flex_attention import flex_attention

    from polyrl.trainer import packing

    monkeypatch.setattr(packing, "_compiled_flex", lambda: flex_attention)
    model = _model(tiny_model_dir, ("qwen3", True))
    items = _items(3)
    out = []
    for backend in ("sdpa", "flex"):
        learner = _learner(copy.deepcopy(model), "packed", AlgoConfig(), packed_attention=backend)
        with torch.no_grad():
            out.append(learner.logprobs(learner.model, collate_packed(items, 0), True))
    m = collate(items, 0).mask > 0
    assert _rel_err(out[1][0][m], out[0][0][m]) < 1e-5
    assert _rel_err(out[1][1][m], out[0][1][m]) < 1e-5


@pytest.mark.parametrize(
    "loss, correction",
    [
        ("gspo", {"rollout_is": "sequence", "rollout_is_threshold": 1.5}),
        ("cispo", {"rollout_rs": "geometric", "rollout_rs_threshold": 0.5, "rollout_rs_threshold_lower": 0.05}),
    ],
)
def test_sequence_level_modes_packed_equal_padded(tiny_model_dir, loss, correction):
    """Sequence-level ratios, weights and rejection read each sequence's own tokens in the
    packed learner as in the padded one (its loss inputs sit on the padded grid): same
    metrics, same gradients, two epochs so that the ratios differ from 1."""
    from polyrl.config import RolloutCorrectionConfig

    model = _model(tiny_model_dir, ("qwen3", True))
    rc = RolloutCorrectionConfig(**correction)
    algo = AlgoConfig(policy_loss=loss, loss_agg_mode="seq-mean-token-mean", ppo_epochs=2, rollout_correction=rc)
    items = _items(3)
    out = {}
    for impl in ("padded", "packed"):
        learner = _learner(copy.deepcopy(model), impl, algo, micro_batch_max_tokens=48)
        out[impl] = (learner.train_mini_batch(items, weights_as_sampled=True), learner.model)
    (m_pad, pad), (m_pack, pack) = out["padded"], out["packed"]
    assert 0 < m_pad["mismatch/masked_seq_frac"] < 1 or rc.rollout_rs is None, m_pad
    for key in m_pad:
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-5, abs=1e-7), key
    for (name, p), q in zip(pad.named_parameters(), pack.parameters()):
        assert _rel_err(q.grad, p.grad) < 1e-5, name
