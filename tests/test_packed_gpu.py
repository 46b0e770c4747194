"""The packed learner on a GPU in bf16 against the padded one (skipped without CUDA).

The float32 equality lives in test_packed_learner.py; here the CUDA-only attention
backends (torch's varlen flash attention, compiled flex attention), the bf16 working copy
and compiled layers must stay within bf16's precision of today's path over a few steps."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from polyrl.config import AlgoConfig, TrainerConfig
from polyrl.trainer.batching import SeqItem, collate
from polyrl.trainer.learner import Learner, build_optimizer
from polyrl.trainer.packing import collate_packed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "vocab_size": 8192,
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPE, tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _items(vocab: int) -> list[SeqItem]:
    rng = random.Random(0)
    items = []
    for _ in range(16):
        n = rng.randint(80, 900)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        items.append(SeqItem(ids, 32, [-9.0 + rng.uniform(-0.5, 0.5) for _ in range(n - 32)], rng.uniform(0.5, 1.5)))
    return items


def _learner(model, **kw) -> Learner:
    """Plain unless `kw` asks otherwise: "auto" would turn on the copy and compile here."""
    kw = {"working_copy": False, "compile_layers": False, **kw}
    cfg = TrainerConfig(
        lr=1e-5, warmup_steps=0, train_batch_size=16, ppo_mini_batch_size=16, micro_batch_max_tokens=4096, **kw
    )
    opt, sched = build_optimizer(model, cfg, total_updates=10)
    return Learner(
        model=model,
        ref_model=None,
        optimizer=opt,
        scheduler=sched,
        algo=AlgoConfig(),
        cfg=cfg,
        temperature=1.0,
        pad_id=0,
        compute_dtype=torch.bfloat16,
    )


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).float().norm() / y.float().norm()).item()


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "flex"])
def test_packed_logprobs_match_padded_in_bf16(model, backend):
    """A document mask that leaked across sequences would change log-probs by far more."""
    items = _items(SHAPE["vocab_size"])
    padded = _learner(copy.deepcopy(model), learner_impl="padded")
    packed = _learner(copy.deepcopy(model), packed_attention=backend)
    with torch.no_grad():
        mb = collate(items, 0).to(torch.device("cuda"))
        ref_logp, ref_ent = padded.logprobs(padded.model, mb, True)
        logp, ent = packed.logprobs(packed.model, collate_packed(items, 0).to(torch.device("cuda")), True)
    m = mb.mask > 0
    assert _rel_err(logp[m], ref_logp[m]) < 1e-2
    assert _rel_err(ent[m], ref_ent[m]) < 1e-2


@pytest.mark.parametrize(
    "kw",
    [{}, {"packed_attention": "flex"}, {"working_copy": True}, {"working_copy": True, "compile_layers": True}],
    ids=["varlen", "flex", "copy", "copy+compile"],
)
def test_packed_training_matches_padded_in_bf16(model, kw):
    items = _items(SHAPE["vocab_size"])
    curves = []
    for learner in (_learner(copy.deepcopy(model), learner_impl="padded"), _learner(copy.deepcopy(model), **kw)):
        curves.append([learner.train_mini_batch(items, weights_as_sampled=True) for _ in range(3)])
    for m_pad, m_pack in zip(*curves, strict=True):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert m_pack[key] == pytest.approx(m_pad[key], rel=3e-2, abs=1e-3), key


def test_auto_turns_on_copy_and_compile_for_packed_bf16(model):
    """The measured fastest setting is the default on one GPU; padded stays today's path."""
    auto = {"working_copy": "auto", "compile_layers": "auto"}
    packed = _learner(copy.deepcopy(model), **auto)
    padded = _learner(copy.deepcopy(model), learner_impl="padded", **auto)
    assert packed.work is not packed.model and packed.is_compiled
    assert padded.work is padded.model and not padded.is_compiled
