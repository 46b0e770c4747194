"""Mixture-of-experts models (Qwen3-MoE): the tiny model the CLI builds, the engine's
tokens and log-probs against transformers', LoRA on it, and the main job learning on it."""

from __future__ import annotations

import copy
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_e2e import QUICK
from test_engine import PROMPTS, SMALL, hf_greedy, run, spicy_model
from test_lora import _generate, _perturb
from test_manager import Consumer, _start_worker, _streamed_from, batch, fast_cfg, wait_active
from test_rollout_learner import _learner
from test_train import _metrics
from test_worker import WorkerProcess, _wait_until
from transformers import AutoModelForCausalLM

from polyrl.config import AlgoConfig, ConfigError, LoraConfig, TinyModelConfig, load_config
from polyrl.engine import fused_moe, triton_ops
from polyrl.engine.engine import Engine
from polyrl.engine.lora import expected_spec
from polyrl.engine.types import EngineRequest, SampleDelta, SampleResult
from polyrl.manager.main import ManagerThread
from polyrl.models.moe import has_moe
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.routes import decode_routes
from polyrl.protocol.sampling import SamplingParams
from polyrl.trainer.batching import SeqItem, collate
from polyrl.trainer.grpo import token_logprobs
from polyrl.trainer.loop import train
from polyrl.trainer.lora import adapter_spec, adapter_version, apply_lora

MOE = TinyModelConfig(arch="qwen3_moe", hidden_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("moe"), MOE)


@pytest.fixture(scope="module")
def moe_model(moe_dir: Path) -> torch.nn.Module:
    """Large random weights: greedy tokens and routes vary from token to token."""
    return spicy_model(moe_dir)


def test_the_cli_builds_a_tiny_qwen3_moe(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    cmd = [sys.executable, "-m", "polyrl.cli", "tiny-model", "--out", str(out), "arch=qwen3_moe", "num_experts=6"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 6
    assert model.config.num_experts_per_tok == 2 and model.config.norm_topk_prob
    assert has_moe(model) and model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(None, ["model.tiny.arch=qwen3_moe", "model.tiny.num_experts=2", "model.tiny.num_experts_per_tok=3"])


def test_greedy_tokens_equal_transformers(moe_model: torch.nn.Module) -> None:
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    results = run(Engine(moe_model, SMALL), [EngineRequest(str(i), p, greedy) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert results[(str(i), 0)].token_ids == hf_greedy(moe_model, p, 12)
    assert len({tuple(r.token_ids) for r in results.values()}) == len(PROMPTS)


def test_the_fused_layers_run_the_experts_as_transformers_does(
    moe_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's fused decoder (Triton kernels, in the interpreter here) runs the MoE
    blocks as the engine's Triton experts: the same greedy tokens as transformers. With
    them, any experts implementation qualifies for CUDA graphs; with the model's own
    blocks (`moe_runner_backend = "model"`) only transformers' `grouped_mm` (no host
    sync) does, not the `eager` loop."""
    if not triton_ops.available("cpu"):
        pytest.skip("Triton is not installed")
    engine = Engine(moe_model, SMALL)
    assert engine.runner.fused_moe and engine.runner.supports_fused_decode(moe_model, 256)
    engine.runner.decode_graphs = SimpleNamespace(max_batch=0)  # the fused layers, no graph replays
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    results = run(engine, [EngineRequest(str(i), p, greedy) for i, p in enumerate(PROMPTS[:2])])
    for i, p in enumerate(PROMPTS[:2]):
        assert results[(str(i), 0)].token_ids == hf_greedy(moe_model, p, 8)
    # The routes a sample asks for are the Triton experts' own, and transformers' ones.
    asked = greedy.model_copy(update={"max_new_tokens": 4, "return_routed_experts": True})
    ((completion, routes),) = _engine_routes(engine, [EngineRequest("r", PROMPTS[2], asked)]).values()
    ids = PROMPTS[2] + completion
    assert torch.equal(routes.long(), _hf_routes(moe_model, ids)[: len(ids) - 1].long())
    model_blocks = Engine(moe_model, SMALL.model_copy(update={"moe_runner_backend": "model"}))
    assert not model_blocks.runner.fused_moe
    assert moe_model.config._experts_implementation == "grouped_mm"
    assert model_blocks.runner.supports_fused_decode(moe_model, 256)
    monkeypatch.setattr(moe_model.config, "_experts_implementation_internal", "eager")
    assert moe_model.config._experts_implementation == "eager"
    assert not model_blocks.runner.supports_fused_decode(moe_model, 256)
    assert engine.runner.supports_fused_decode(moe_model, 256)
    # Beyond the pairs the Triton experts take, a captured step would run the model's blocks.
    assert not engine.runner.supports_fused_decode(moe_model, fused_moe.FUSED_MAX_PAIRS)


def test_logprobs_equal_a_full_forward_to_1e5(moe_dir: Path) -> None:
    """Sampled tokens, scored again by transformers' whole-sequence forward with the
    learner's own function. The model as initialised: the large weights above make
    logits in the hundreds, where float32's rounding alone (a different summation order
    in paged attention) moves a log-prob by 1e-5."""
    moe_model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True)
    results = run(Engine(moe_model, SMALL), [EngineRequest(str(i), p, sampling) for i, p in enumerate(PROMPTS)])
    worst = 0.0
    for (rid, _), r in results.items():
        prompt = PROMPTS[int(rid)]
        with torch.no_grad():
            logits = moe_model(torch.tensor([prompt + r.token_ids])).logits[:, len(prompt) - 1 : -1]
        ref, _ = token_logprobs(logits, torch.tensor([r.token_ids]), 1.0)
        worst = max(worst, (ref[0] - torch.tensor(r.logprobs)).abs().max().item())
    assert worst < 1e-5, worst


def test_lora_on_a_moe_adapts_attention_and_the_engine_matches_it_after_every_sync(moe_dir: Path) -> None:
    """all-linear means the attention projections on a mixture of experts (PEFT would also
    reach the experts' 3-D weights and the router, which engines cannot merge yet; naming
    them is refused). The engine merges each adapter version and samples with the
    learner's log-probs."""
    trained = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    peft = apply_lora(trained, LoraConfig(rank=4, alpha=8))
    adapted = {
        re.sub(r".*\.layers\.\d+\.(.*)\.lora_A\..*", r"\1", n) for n, _ in peft.named_parameters() if "lora_A" in n
    }
    assert adapted == {f"self_attn.{x}_proj" for x in "qkvo"}, adapted
    worker_spec = expected_spec(AutoModelForCausalLM.from_pretrained(moe_dir), 4, 8, "all-linear")
    assert worker_spec == adapter_spec(peft)  # a worker configured with all-linear accepts these adapters
    with pytest.raises(ValueError, match="experts' or the router's weights"):
        apply_lora(AutoModelForCausalLM.from_pretrained(moe_dir), LoraConfig(target_modules=["q_proj", "down_proj"]))
    engine = Engine(AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval(), SMALL)
    prompt = PROMPTS[2]
    for version in (1, 2):
        _perturb(trained, version)
        engine.update_weights(adapter_version(peft), version)
        completion, engine_logp = _generate(engine, prompt, version)
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = trained(ids).logits[:, len(prompt) - 1 : -1]
        learner_logp, _ = token_logprobs(logits, ids[:, len(prompt) :], 1.0)
        assert (learner_logp[0] - torch.tensor(engine_logp)).abs().max().item() < 1e-5, version


def test_the_load_balancing_loss_is_transformers_and_moves_the_router(moe_dir: Path) -> None:
    """`algo.router_aux_loss_coef`: the learner's `actor/router_aux_loss` is transformers'
    own aux loss of the same batch (padding left out), and with a large weight the
    router's update differs from the update without it (off by default: no metric)."""
    items = [
        SeqItem([1, 5, 6, 7, 8, 9], 3, [-1.0, -2.0, -0.5], 1.0),
        SeqItem([1, 11, 12, 13], 2, [-3.0, -1.0], -1.0),
    ]
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = collate(items, 0)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    routers = {}
    for coef in (0.0, 10.0):
        m = copy.deepcopy(model)
        learner = _learner(m, AlgoConfig(router_aux_loss_coef=coef))
        metrics = learner.train_mini_batch(items, weights_as_sampled=True)
        routers[coef] = m.model.layers[0].mlp.gate.weight.detach().clone()
        if coef:
            assert metrics["actor/router_aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
        else:
            assert "actor/router_aux_loss" not in metrics
    assert not torch.allclose(routers[0.0], routers[10.0])


@pytest.mark.parametrize("mode", ["disabled", "R2"])
def test_r2_replays_the_proximal_forwards_experts_in_every_epoch(moe_dir: Path, mode: str) -> None:
    """Two PPO epochs with a large learning rate: the first update moves the router, so in
    the second epoch some tokens' own top-k experts differ from the proximal forward's.
    With R2 the second epoch's forward goes through the proximal forward's experts (and
    says how many it overrode); without, through its own."""
    items = [SeqItem([1, *range(5, 5 + n)], 2, [-1.0] * (n - 1), adv) for n, adv in ((12, 1.0), (9, -1.0), (14, 0.5))]
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    algo = AlgoConfig(router_replay=mode, ppo_epochs=2, clip_ratio_low=10.0, clip_ratio_high=10.0, entropy_coef=0.0)
    learner = _learner(model, algo, lr=0.05)
    router = model.model.layers[0].mlp.gate
    seen: list[torch.Tensor] = []  # every forward's layer-0 experts, as the experts received them
    model.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    weights_before = router.weight.detach().clone()
    metrics = learner.train_mini_batch(items, weights_as_sampled=True)
    assert not torch.equal(router.weight, weights_before)  # the router did learn
    proximal, epoch1, epoch2 = seen  # the old log-prob forward, then one training forward per epoch
    assert torch.equal(proximal, epoch1)  # the same weights so far
    if mode == "R2":
        assert torch.equal(epoch2, proximal)
        assert 0 < metrics["actor/router_replay_changed_frac"] <= 1
    else:
        assert not torch.equal(epoch2, proximal)
        assert "actor/router_replay_changed_frac" not in metrics


def test_r2_is_refused_on_a_dense_model(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _learner(model, AlgoConfig(router_replay="R2"))


@pytest.mark.slow
def test_the_default_main_job_learns_on_a_tiny_moe_with_r3(tmp_path: Path) -> None:
    """`polyrl train model.path=DIR` after `polyrl tiny-model --out DIR arch=qwen3_moe`,
    shortened as `test_default_run_learns_through_two_workers`, to the same bar: the
    learner (transformers' MoE forward and backward) and two launched workers (the
    engine's), with R3: every sample's routes come back through the manager and the
    learner replays them."""
    model_dir = save_tiny_model(tmp_path / "moe", TinyModelConfig(arch="qwen3_moe"))
    overrides = [*QUICK, f"model.path={model_dir}", "trainer.total_steps=30", "algo.router_replay=R3"]
    train(load_config(None, overrides), tmp_path / "run")
    rows = _metrics(tmp_path / "run")
    assert all(r["rollout/samples_lost"] == 0 for r in rows)
    assert all(abs(r["rollout/logprob_diff"]) < 1e-3 for r in rows if "rollout/logprob_diff" in r)
    assert all(0 <= r["actor/router_replay_changed_frac"] <= 1 for r in rows)  # replayed in every step
    rewards = [r["critic/score/mean"] for r in rows]
    assert sum(rewards[-5:]) / 5 > rewards[0] + 0.15, rewards


def _engine_routes(
    engine: Engine, requests: list[EngineRequest]
) -> dict[tuple[str, int], tuple[list[int], torch.Tensor | None]]:
    """Every sample's tokens and its deltas' routes, concatenated (None: it had none)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    routes: dict[tuple[str, int], list[torch.Tensor]] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for d in engine.step():
            tokens.setdefault((d.rid, d.index), []).extend(d.token_ids)
            if d.routed_experts is not None:
                routes.setdefault((d.rid, d.index), []).append(d.routed_experts)
    return {key: (tokens[key], torch.cat(routes[key]) if key in routes else None) for key in tokens}


def _hf_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' experts for every position of `ids` ([positions, moe_layers, k])."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2])) for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_engine_reports_the_experts_of_every_position_as_transformers_routes_them(
    moe_model: torch.nn.Module, overlap: str
) -> None:
    """`return_routed_experts`: prompts prefilled in chunks, n = 3 samples forked from one
    prefill, decodes chained on the device (overlap) or not: each sample's routes, over all
    its deltas, are transformers' for prompt + completion but the last token; a request
    that does not ask gets none."""
    cfg = SMALL.model_copy(update={"overlap_decode": overlap})
    asked = SamplingParams(max_new_tokens=9, temperature=1.0, n=3, seed=5, ignore_eos=True, return_routed_experts=True)
    plain = asked.model_copy(update={"return_routed_experts": False})
    requests = [EngineRequest(str(i), p, asked) for i, p in enumerate(PROMPTS)]
    got = _engine_routes(Engine(moe_model, cfg), [*requests, EngineRequest("plain", PROMPTS[0], plain)])
    assert len(got) == 3 * len(PROMPTS) + 3
    for (rid, index), (completion, routes) in got.items():
        if rid == "plain":
            assert routes is None
            continue
        ids = PROMPTS[int(rid)] + completion
        expected = _hf_routes(moe_model, ids)[: len(ids) - 1]
        assert routes is not None and routes.shape == expected.shape == (len(ids) - 1, 2, 2)
        assert torch.equal(routes.long(), expected.long()), (rid, index)


@pytest.fixture(scope="module")
def spicy_moe_dir(moe_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The large-weights MoE saved, for worker processes (its routes have clear winners)."""
    out = tmp_path_factory.mktemp("spicy_moe")
    moe_model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(moe_model.name_or_path) / f, out / f)
    return out


@pytest.mark.slow
def test_routes_reach_the_batch_through_workers_and_a_kill(spicy_moe_dir: Path, moe_model: torch.nn.Module) -> None:
    """Two real workers; w1 is killed -9 mid-sample and its samples continue on w2, which
    joins after and computes their prefix again: every sample's routes in its group result are still
    transformers' for prompt + output, the migrated ones' prefix as w1 streamed it."""
    request = batch(4, 2, 120)
    request.sampling = request.sampling.model_copy(update={"ignore_eos": True, "return_routed_experts": True})
    procs: list[WorkerProcess] = []
    with ManagerThread(fast_cfg(heartbeat_timeout_s=3.0, stall_timeout_s=20, stream_interval_s=0.0)) as mt:
        try:
            # w1 stops generating at 40 of the 120 tokens: however late the kill, it lands
            # mid-sample (a sample finished before it would not move)
            procs.append(_start_worker(spicy_moe_dir, mt.url, "w1", hold_at=40))
            procs[0].wait_ready()
            wait_active(mt, "w1")
            consumer = Consumer(mt, request)
            _wait_until(lambda: _streamed_from(mt, "w1"), 60, "w1 streams tokens")
            procs[0].proc.send_signal(signal.SIGKILL)  # mid-sample: what it streamed waits for w2
            procs.append(_start_worker(spicy_moe_dir, mt.url, "w2"))
            groups = consumer.join_ok(120)
        finally:
            for p in procs:
                p.kill()
    prompts = {p.id: p.input_ids for p in request.prompts}
    moved = 0
    for g in groups:
        for s in g.samples:
            ids = prompts[g.prompt_id] + s.output_ids
            assert s.routed_experts is not None
            routes = decode_routes(s.routed_experts, len(ids) - 1).reshape(len(ids) - 1, 2, 2)
            assert np.array_equal(routes, _hf_routes(moe_model, ids)[: len(ids) - 1].numpy()), (g.prompt_id, s.index)
            moved += [seg.worker for seg in s.segments] == ["w1", "w2"]
    assert moved


@pytest.mark.parametrize("mode,impl", [("disabled", "padded"), ("R3", "padded"), ("R3", "packed")])
def test_r3_trains_through_the_experts_the_engine_sampled_with(moe_dir: Path, mode: str, impl: str) -> None:
    """The engine samples with one router; an update (here: new random router weights)
    moves the learner's. With R3 the learner's forward sends every position the engine
    reported through the engine's experts, padded or packed; without, some through others."""
    rollout_model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    sampling = SamplingParams(
        max_new_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True, return_routed_experts=True
    )
    got = _engine_routes(
        Engine(rollout_model, SMALL), [EngineRequest(str(i), p, sampling) for i, p in enumerate(PROMPTS[:3])]
    )
    items = [
        SeqItem(
            PROMPTS[int(rid)] + completion,
            len(PROMPTS[int(rid)]),
            [-1.0] * len(completion),
            1.0 - index,
            routes=routes.flatten(1).numpy().astype(np.int32),
        )
        for (rid, index), (completion, routes) in sorted(got.items())
    ]
    trained = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in trained.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0, generator=gen)
    seen: list[torch.Tensor] = []
    trained.model.layers[1].mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    learner = _learner(trained, AlgoConfig(router_replay=mode), learner_impl=impl)
    metrics = learner.train_mini_batch(items, weights_as_sampled=True)
    (used,) = seen  # one forward: with one epoch the training pass is the proximal one
    lengths = [len(it.token_ids) for it in items]
    width = max(lengths)
    starts = np.cumsum([0, *lengths[:-1]]) if impl == "packed" else [i * width for i in range(len(items))]
    same = different = 0
    for start, it in zip(starts, items, strict=True):
        rows = used[start : start + len(it.token_ids) - 1]
        engine = torch.from_numpy(it.routes).view(-1, 2, 2)[:, 1]  # layer 1's
        agree = (rows.sort(-1).values == engine.long().sort(-1).values).all(-1)
        same, different = same + int(agree.sum()), different + int((~agree).sum())
    if mode == "R3":
        assert different == 0 and same > 0
        assert 0 < metrics["actor/router_replay_changed_frac"] <= 1
    else:
        assert different > 0


def test_a_results_routes_between_two_positions_join_only_the_deltas_they_span() -> None:
    result = SampleResult("r", 0, 3)
    chunks = [torch.arange(n * 4, dtype=torch.int16).view(n, 2, 2) + 100 * i for i, n in enumerate((3, 1, 1, 2))]
    for chunk in chunks:
        result.add(SampleDelta("r", 0, [1], [0.0], [0], routed_experts=chunk))
    whole = torch.cat(chunks)
    for first, end in ((0, 7), (0, 3), (2, 5), (3, 4), (5, 7), (4, 4)):
        assert torch.equal(result.routes_between(first, end), whole[first:end]), (first, end)


def test_an_update_of_a_moe_travels_as_a_delta_bit_exact(moe_dir: Path) -> None:
    """A real optimizer step on the tiny MoE (AdamW, lr 1e-5), published as bf16 like a
    trainer's version: the worker's delta pull rebuilds it bit for bit, experts' 3-D
    weights and router included, in fewer bytes than the raw version."""
    from test_transfer import assert_same, source

    from polyrl.transfer.manifest import unflatten
    from polyrl.transfer.publisher import WeightPublisher
    from polyrl.transfer.receiver import pull

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    bf16 = lambda: {k: p.detach().to(torch.bfloat16).clone() for k, p in model.named_parameters()}  # noqa: E731
    v1 = bf16()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    v2 = bf16()
    changed = {k for k in v1 if not torch.equal(v1[k], v2[k])}
    assert any(".experts." in k for k in changed) and any(".mlp.gate." in k for k in changed)
    with WeightPublisher(chunk_bytes=4096, keep_versions=2) as publisher:
        publisher.publish(v1, 1)
        publisher.publish(v2, 2)
        held = pull(source(publisher, 1), 1)
        got = pull(source(publisher, 2), 2, base=(1, held.buffer))
    assert got.codec == "delta" and got.wire_bytes < 0.3 * got.manifest.total_bytes  # 16% when written
    assert_same(unflatten(got.buffer, got.manifest), v2)
