"""The embedded engine against HF transformers: greedy tokens, log-probs, abort/resume,
shared prefill, preemption, weight hot-swap, and the asyncio driver."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading

import pytest
import torch
from test_worker import engine_waits_once_running
from transformers import AutoModelForCausalLM

from polyrl.config import EngineConfig, RolloutConfig, TinyModelConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.block_manager import padded_tables
from polyrl.engine.engine import Engine
from polyrl.engine.sampler import SamplingBatch, gumbel_noise, mix32, sample
from polyrl.engine.types import EngineFullError, EngineRequest, RequestError, SampleResult
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.sampling import SamplingParams
from polyrl.trainer.grpo import token_logprobs
from polyrl.transfer.manifest import flatten, unflatten

PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12], [1, *range(3, 30)], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
# Small blocks and a small token budget: prompts are prefilled in chunks next to decodes.
SMALL = EngineConfig(block_size=4, max_num_batched_tokens=16)


@pytest.fixture(autouse=True, params=["as-configured", "overlap"])
def overlap_decode(request, monkeypatch):
    """Every test here runs twice: with the engine as configured (on CPU: each step read
    back at once) and with the overlapped decode that CUDA uses, whose bookkeeping (chained
    steps fed on the device, rows of stopped or aborted samples dropped) is the same on CPU."""
    if request.param == "overlap":
        init = Engine.__init__
        monkeypatch.setattr(
            Engine,
            "__init__",
            lambda self, model, cfg, *a, **k: init(
                self, model, cfg.model_copy(update={"overlap_decode": "on"}), *a, **k
            ),
        )
    return request.param == "overlap"


def spicy_model(path, seed: int = 0):
    """The tiny model with large random weights, so greedy outputs vary from token to token
    (a freshly initialised model mostly repeats its input, which would test little)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0, generator=g)
    return model


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp(request.param),
        TinyModelConfig(arch=request.param, hidden_size=64, intermediate_size=128),
    )
    return spicy_model(path)


def run(engine: Engine, requests: list[EngineRequest], max_steps: int = 10_000) -> dict[tuple[str, int], SampleResult]:
    results: dict[tuple[str, int], SampleResult] = {}
    for r in requests:
        engine.add_request(r)
        for i in range(r.sampling.n):
            results[(r.rid, i)] = SampleResult(r.rid, i, len(r.input_ids))
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for d in engine.step():
            results[(d.rid, d.index)].add(d)
    return results


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_hf_generate(model):
    results = run(Engine(model, SMALL), [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        r = results[(str(i), 0)]
        assert r.token_ids == hf_greedy(model, p, 12)
        assert r.finish_reason == "length" and r.weight_versions == [0] * 12
    assert len({tuple(r.token_ids) for r in results.values()}) == len(PROMPTS)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_rollout_ignore_eos_generates_every_sample_to_its_budget(model, ignore_eos):
    """`rollout.ignore_eos`: the run's sampling carries none of its stop tokens. Here every
    token id is one, so without it each sample ends at its first token."""
    sampling = RolloutConfig(max_new_tokens=9, n=3, ignore_eos=ignore_eos).sampling(range(model.config.vocab_size))
    results = run(Engine(model, SMALL), [EngineRequest(str(i), p, sampling) for i, p in enumerate(PROMPTS)])
    assert len(results) == 3 * len(PROMPTS)
    for r in results.values():
        assert (len(r.token_ids), r.finish_reason) == ((9, "length") if ignore_eos else (1, "stop"))


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20), (0.0, 1.0, 0)])
def test_logprobs_equal_the_trainers_full_forward(model, temperature, top_p, top_k):
    s = SamplingParams(
        max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, n=3, seed=7, ignore_eos=True
    )
    results = run(Engine(model, SMALL), [EngineRequest(str(i), p, s) for i, p in enumerate(PROMPTS)])
    for (rid, _), r in results.items():
        prompt = PROMPTS[int(rid)]
        ids = torch.tensor([prompt + r.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[:, len(prompt) - 1 : -1]
        # The learner's own function, at the temperature the trainer uses (1 for greedy).
        ref, _ = token_logprobs(logits, torch.tensor([r.token_ids]), temperature or 1.0)
        assert torch.allclose(ref[0], torch.tensor(r.logprobs), atol=1e-4), (
            (ref[0] - torch.tensor(r.logprobs)).abs().max()
        )


def test_top_logprobs_equal_a_full_forwards_and_only_where_asked(model):
    """Top log-probs are the k best of log softmax(logits / T) at each position (the
    sampled token's definition), for the request that asks; its neighbour in the same
    batch gets none, and its tokens are as if nobody had asked."""
    asked = SamplingParams(max_new_tokens=6, temperature=0.7, n=2, seed=3, ignore_eos=True, top_logprobs=4)
    plain = asked.model_copy(update={"top_logprobs": 0})
    results = run(Engine(model, SMALL), [EngineRequest("a", PROMPTS[0], asked), EngineRequest("b", PROMPTS[1], plain)])
    alone = run(Engine(model, SMALL), [EngineRequest("b", PROMPTS[1], plain)])
    for i in range(2):
        assert results[("b", i)].top_logprobs == [] and results[("b", i)].token_ids == alone[("b", i)].token_ids
        r = results[("a", i)]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPTS[0] + r.token_ids])).logits[0, len(PROMPTS[0]) - 1 : -1]
        ref_values, ref_ids = (logits / 0.7).log_softmax(-1).topk(4)
        assert len(r.top_logprobs) == 6
        assert [[t for t, _ in pos] for pos in r.top_logprobs] == ref_ids.tolist()
        assert torch.allclose(torch.tensor([[lp for _, lp in pos] for pos in r.top_logprobs]), ref_values, atol=1e-4)


def test_sampling_respects_top_k_and_top_p(model):
    s = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, n=4, seed=3, ignore_eos=True)
    results = run(Engine(model, SMALL), [EngineRequest("k", PROMPTS[0], s)])
    assert all(r.token_ids == hf_greedy(model, PROMPTS[0], 8) for r in results.values())  # top-1 == greedy
    s = s.model_copy(update={"top_k": 0, "top_p": 1e-6})
    results = run(Engine(model, SMALL), [EngineRequest("p", PROMPTS[0], s)])
    assert all(r.token_ids == hf_greedy(model, PROMPTS[0], 8) for r in results.values())


def test_shared_prefill_equals_separate_seeded_requests(model):
    s = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=123, ignore_eos=True)
    prompt = [1, *range(3, 32)]  # 30 tokens: 7 full blocks of 4 and a partial one
    engine = Engine(model, SMALL)
    engine.add_request(EngineRequest("shared", prompt, s))
    engine.step()  # the first 16-token chunk of the prompt
    assert len(engine._requests["shared"]) == 1
    engine.step()  # the rest, then the fork
    # The 4 samples share the 7 full blocks; each fork got a copy of the partial one.
    assert len(engine._requests["shared"]) == 4
    assert engine.blocks.num_blocks - engine.blocks.num_free == 8 + 3
    while engine.has_work:
        engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks  # shared blocks freed exactly once
    engine = Engine(model, SMALL)
    separate = run(
        engine, [EngineRequest(f"s{j}", prompt, s.model_copy(update={"n": 1, "seed": 123 + j})) for j in range(4)]
    )
    assert len({tuple(r.token_ids) for r in separate.values()}) > 1  # the seeds do differ
    engine = Engine(model, SMALL)
    again = run(engine, [EngineRequest("shared", prompt, s)])
    for j in range(4):
        assert again[("shared", j)].token_ids == separate[(f"s{j}", 0)].token_ids
        assert again[("shared", j)].logprobs == pytest.approx(separate[(f"s{j}", 0)].logprobs, abs=1e-4)


def test_abort_then_resume_equals_uninterrupted(model):
    for sampling in (GREEDY, SamplingParams(max_new_tokens=12, temperature=1.0, seed=99, ignore_eos=True)):
        full = run(Engine(model, SMALL), [EngineRequest("r", PROMPTS[0], sampling)])[("r", 0)]
        engine = Engine(model, SMALL)
        part = SampleResult("r", 0, len(PROMPTS[0]))
        engine.add_request(EngineRequest("r", PROMPTS[0], sampling))
        while len(part.token_ids) < 5:
            for d in engine.step():
                part.add(d)
        for d in engine.abort("r"):
            part.add(d)
        assert part.finish_reason == "abort" and len(part.token_ids) == 5 and not engine.has_work
        # Resume on a fresh engine (another worker): prompt + partial tokens, fewer new tokens.
        resumed_req = EngineRequest(
            "r2", PROMPTS[0] + part.token_ids, sampling.model_copy(update={"max_new_tokens": 7})
        )
        rest = run(Engine(model, SMALL), [resumed_req])[("r2", 0)]
        assert part.token_ids + rest.token_ids == full.token_ids
        assert part.logprobs + rest.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_preemption_under_a_small_kv_cache_changes_nothing(model, caplog):
    s = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=5, ignore_eos=True)
    requests = [EngineRequest(str(i), p, s) for i, p in enumerate(PROMPTS)]
    roomy = run(Engine(model, SMALL), requests)
    tight_engine = Engine(model, SMALL.model_copy(update={"num_kv_blocks": 14}))
    with caplog.at_level("WARNING", logger="polyrl.engine.scheduler"):
        tight = run(tight_engine, requests)
    assert tight_engine.stats().num_preemptions == tight_engine.scheduler.num_preemptions > 0
    assert "KV cache full" in caplog.text  # the operator is told, once per order of magnitude
    assert len(caplog.records) <= len(str(tight_engine.scheduler.num_preemptions))
    assert {k: r.token_ids for k, r in tight.items()} == {k: r.token_ids for k, r in roomy.items()}
    assert tight_engine.blocks.num_free == 14


def test_stats_count_steps_prefill_steps_and_prompt_tokens(model):
    engine = Engine(model, SMALL)  # a 16-token budget: the 47 prompt tokens take several steps
    run(engine, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
    stats = engine.stats()
    assert stats.num_prompt_tokens == sum(map(len, PROMPTS)) - stats.prefix_cache_hits
    assert 3 <= stats.num_prefill_steps < stats.num_steps
    assert stats.num_steps >= GREEDY.max_new_tokens + stats.num_prefill_steps - 1


def test_stop_tokens_and_eos(model):
    ref = hf_greedy(model, PROMPTS[1], 12)
    stop = ref[3]
    engine = Engine(model, SMALL)
    results = run(
        engine,
        [
            EngineRequest("s", PROMPTS[1], GREEDY.model_copy(update={"stop_token_ids": (stop,)})),
            EngineRequest("other", PROMPTS[0], GREEDY),
        ],
    )  # decodes on past the stop
    r = results[("s", 0)]
    assert r.finish_reason == "stop" and r.matched_stop == stop
    assert r.token_ids == ref[: ref.index(stop) + 1]
    assert results[("other", 0)].token_ids == hf_greedy(model, PROMPTS[0], 12)
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize(
    "policy,per_update", [("recompute", False), ("continue", False), ("abort", False), ("continue", True)]
)
def test_weight_hot_swap_mid_run(model, tmp_path, policy, per_update, overlap_decode):
    """`per_update`: the policy comes with the update (as the manager sends it for fully
    asynchronous training) and overrides the engine's own "recompute"."""
    new_model = spicy_model(
        save_tiny_model(
            tmp_path / "m2", TinyModelConfig(arch=model.config.model_type, hidden_size=64, intermediate_size=128)
        ),
        seed=1,
    )
    engine = Engine(
        spicy_model(model.name_or_path), SMALL.model_copy(update={"swap_policy": "recompute" if per_update else policy})
    )
    part = SampleResult("r", 0, len(PROMPTS[0]))
    engine.add_request(EngineRequest("r", PROMPTS[0], GREEDY))
    while len(part.token_ids) < 4:
        for d in engine.step():
            part.add(d)
    # The new version arrives as a flat buffer + manifest, the transfer layer's format.
    buffer, manifest = flatten(new_model.state_dict(), version=1)
    for d in engine.update_weights(unflatten(buffer, manifest), version=1, policy=policy if per_update else None):
        part.add(d)
    while engine.has_work:
        for d in engine.step():
            part.add(d)
    # The update's own deltas carry the token of an overlapped step still in flight: the
    # old version made it.
    old = part.weight_versions.count(0)
    assert old == (5 if overlap_decode else 4)
    assert part.token_ids[:old] == hf_greedy(model, PROMPTS[0], old)
    if policy == "abort":
        assert part.finish_reason == "abort" and part.weight_versions == [0] * old
        return
    assert part.weight_versions == [0] * old + [1] * (12 - old)
    after = hf_greedy(new_model, PROMPTS[0] + part.token_ids[:old], 12 - old)
    if policy == "recompute":
        assert part.token_ids[old:] == after  # exactly the new model's continuation
    else:
        assert part.token_ids[old:] != hf_greedy(model, PROMPTS[0], 12)[old:]  # changed, on stale KV
    fresh = run(engine, [EngineRequest("fresh", PROMPTS[1], GREEDY)])[("fresh", 0)]
    assert fresh.token_ids == hf_greedy(new_model, PROMPTS[1], 12) and fresh.weight_versions == [1] * 12


def test_bad_weights_are_refused_and_leave_the_model_alone(model):
    engine = Engine(spicy_model(model.name_or_path), SMALL)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sd = dict(engine.model.state_dict())
    with pytest.raises(RequestError, match="unknown"):
        engine.update_weights({**sd, "nope.weight": torch.zeros(1)}, 1)
    name = next(iter(sd))
    with pytest.raises(RequestError, match="shape"):
        engine.update_weights({**sd, name: torch.zeros(3)}, 1)
    with pytest.raises(RequestError, match="missing"):
        engine.update_weights({name: sd[name]}, 1)
    assert engine.weight_version == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


@pytest.mark.parametrize(
    "ids,sampling,match",
    [
        ([], GREEDY, "empty"),
        ([1, 999], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([1, 2], GREEDY.model_copy(update={"max_new_tokens": 0}), "max_new_tokens"),
        ([1, 2], GREEDY.model_copy(update={"max_new_tokens": 255}), "context length"),
        ([1, 2], GREEDY.model_copy(update={"top_p": 0.0}), "top_p"),
        ([1, 2], GREEDY.model_copy(update={"n": 0}), "n must be"),
        ([1, 2], GREEDY.model_copy(update={"stop_token_ids": (500,)}), "outside"),
    ],
)
def test_invalid_requests_are_refused(model, ids, sampling, match):
    engine = Engine(model, SMALL)
    with pytest.raises(RequestError, match=match):
        engine.add_request(EngineRequest("bad", ids, sampling))
    assert not engine.has_work


def test_sampler_noise_is_uniform_enough_and_keyed():
    seeds = torch.tensor([1, 1, 2], dtype=torch.long)
    positions = torch.tensor([5, 6, 5], dtype=torch.long)
    g = gumbel_noise(seeds, positions, 50_000)
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.equal(g[0], gumbel_noise(seeds[:1], positions[:1], 50_000)[0])  # batch-independent
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.std().item() - 1.2825) < 0.03  # Gumbel(0,1)
    x = torch.arange(1 << 16, dtype=torch.long)
    assert mix32(x).unique().numel() == 1 << 16 and int(mix32(x).max()) < 2**32


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], sampling: SamplingParams) -> SampleResult:
    """One streamed request, accumulated."""
    r = SampleResult(rid, 0, len(prompt))
    async for deltas in engine.generate(EngineRequest(rid, prompt, sampling)):
        for d in deltas:
            r.add(d)
    return r


def test_async_engine_streams_aborts_and_refuses_when_full(model, monkeypatch):
    async def main(engine: AsyncEngine, go_on: threading.Event) -> None:
        collect = functools.partial(_collect, engine)
        long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        first = asyncio.create_task(collect("a", [1, 5], long))
        second = asyncio.create_task(collect("b", PROMPTS[0], GREEDY))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineFullError):
            await collect("c", PROMPTS[0], GREEDY)
        while engine.stats().num_generated_tokens < 3:
            await asyncio.sleep(0.01)
        assert engine.abort("a") and not engine.abort("unknown")
        go_on.set()
        a, b = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert a.finish_reason == "abort" and 0 < len(a.token_ids) < 200
        assert b.token_ids == hf_greedy(model, PROMPTS[0], 12)
        assert await engine.wait_idle(1.0)
        await engine.update_weights(None, 5)
        c = await collect("c", PROMPTS[0], GREEDY)
        assert c.weight_versions == [5] * 12

    inner = Engine(model, SMALL.model_copy(update={"max_num_seqs": 1, "max_queued_requests": 1}))
    engine = AsyncEngine(inner)
    # "a" stops at 3 tokens until aborted: a test starved for its 200 tokens' time would
    # find it done, the queue free for "c", and nothing to abort
    with engine_waits_once_running(inner, monkeypatch, "a", at=3) as go_on:
        engine.start()
        try:
            asyncio.run(main(engine, go_on))
        finally:
            engine.shutdown()


def test_async_engine_survives_callers_that_stop_waiting(model):
    """A request cancelled while its add is still queued (as the manager does to the local
    engine's requests when it closes the local window), and an update whose caller gave up:
    the engine thread runs both commands, and the abort after the add, and lives on."""

    async def main():
        engine = AsyncEngine(Engine(model, SMALL))
        collect = functools.partial(_collect, engine)
        long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        cancelled = [
            asyncio.create_task(collect("a", [1, 5], long)),
            asyncio.create_task(engine.update_weights(None, 7)),
        ]
        await asyncio.sleep(0.05)  # both wait on their commands: the engine thread has not started
        for task in cancelled:
            task.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        engine.start()
        try:
            b = await asyncio.wait_for(collect("b", PROMPTS[0], GREEDY), 30)
            assert b.token_ids == hf_greedy(model, PROMPTS[0], 12)
            assert b.weight_versions == [7] * 12  # the update ran, though nobody waited for it
            assert engine.error is None and engine._thread.is_alive()
            assert await engine.wait_idle(1.0) and not engine.engine.has_work  # "a" was added, then aborted
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_matches_hf_and_runs_bf16(tmp_path):
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(hidden_size=64, intermediate_size=128))
    model = spicy_model(path).cuda()
    results = run(Engine(model, SMALL), [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        hf = model.generate(
            torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert results[(str(i), 0)].token_ids == hf[0, len(p) :].tolist()
    # bf16 weights: runs, and sampling with a seed is reproducible across batch compositions.
    engine = Engine(spicy_model(path).to("cuda", torch.bfloat16), SMALL)
    s = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=11, ignore_eos=True)
    a = run(engine, [EngineRequest("a", PROMPTS[0], s)])
    b = run(engine, [EngineRequest("a", PROMPTS[0], s), EngineRequest("b", PROMPTS[1], s)])
    assert all(len(r.token_ids) == 12 and all(lp <= 0 for lp in r.logprobs) for r in a.values())
    assert sum(a[k].token_ids == b[k].token_ids for k in a) >= 3  # bf16 batch noise may flip a rare draw


@pytest.mark.parametrize(
    "temperature,top_p,top_k,min_p",
    [
        (1.0, 1.0, 0, 0.0),
        (0.7, 1.0, 0, 0.0),
        (1.0, 0.8, 0, 0.0),
        (1.0, 1.0, 3, 0.0),
        (0.7, 1.0, 0, 0.05),
        (1.0, 0.95, 4, 0.2),
    ],
)
def test_sampled_frequencies_match_the_truncated_softmax(temperature, top_p, top_k, min_p):
    """Gumbel-max over hashed noise is an exact draw: 40k seeds reproduce the distribution,
    restricted to the tokens that pass every cut (each measured on the tempered softmax)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    num = 40_000
    batch = SamplingBatch(
        temperature=torch.full((num,), temperature),
        top_p=torch.full((num,), top_p),
        top_k=torch.full((num,), top_k, dtype=torch.long),
        min_p=torch.full((num,), min_p),
        seeds=torch.arange(num, dtype=torch.long) * 7919,
        positions=torch.full((num,), 5, dtype=torch.long),
        needs_truncation=SamplingParams(top_p=top_p, top_k=top_k, min_p=min_p).truncates,
        all_greedy=False,
    )
    token_ids, logprobs = sample(logits.expand(num, 8), batch)
    freq = torch.bincount(token_ids, minlength=8).float() / num
    probs = (logits[0] / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs < top_p) & ((top_k <= 0) | (torch.arange(8) < top_k))
    keep &= sorted_probs >= min_p * sorted_probs[0]
    assert 1 < keep.sum() < 8 or (top_p, top_k, min_p) == (1, 0, 0)  # each case cuts, and leaves a choice
    target = torch.zeros(8).index_put((order[keep],), sorted_probs[keep])
    target /= target.sum()
    assert (freq - target).abs().max() < 0.012  # ~5 standard errors at 40k draws
    assert torch.allclose(logprobs, probs.log()[token_ids])  # reported: untruncated, tempered


def test_float32_weights_generate_under_bf16_autocast(model):
    """The colocated trainer's case: float32 master weights, bf16 compute and KV cache."""
    engine = Engine(model, SMALL, compute_dtype=torch.bfloat16)
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    s = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=1, ignore_eos=True)
    results = run(engine, [EngineRequest(str(i), p, s) for i, p in enumerate(PROMPTS)])
    assert all(len(r.token_ids) == 8 and all(-30 < lp <= 0 for lp in r.logprobs) for r in results.values())
    assert next(model.parameters()).dtype == torch.float32


def test_float64_logprobs_do_not_depend_on_the_batch(model):
    """A float64 engine (rollout.deterministic on CPU) gives each sample the same tokens
    and bit-identical log-probs alone, in a batch with chunked prefills, in another batch
    order, and resumed from its first 3 tokens (a migration: the prefix is prefilled, not
    decoded); its log-probs are the float32 engine's within 1e-4 (the on-policy bound)."""
    model64 = copy.deepcopy(model).double()
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, n=3)
    requests = [EngineRequest(str(i), p, sampling.model_copy(update={"seed": 17 * i})) for i, p in enumerate(PROMPTS)]
    alone = {k: r for req in requests for k, r in run(Engine(model64, SMALL), [req]).items()}
    together = run(Engine(model64, SMALL), requests)
    reordered = run(Engine(model64, SMALL.model_copy(update={"max_num_seqs": 5})), requests[::-1])
    float32 = run(Engine(model, SMALL), requests)
    head = alone[("2", 1)]  # sample 1 of request 2 uses seed 17 * 2 + 1
    resumed = EngineRequest(
        "r", PROMPTS[2] + head.token_ids[:3], sampling.model_copy(update={"n": 1, "seed": 35, "max_new_tokens": 5})
    )
    rest = run(Engine(model64, SMALL), [resumed])[("r", 0)]
    assert (rest.token_ids, rest.logprobs) == (head.token_ids[3:], head.logprobs[3:])
    for key, a in alone.items():
        for other in (together[key], reordered[key]):
            assert (other.token_ids, other.logprobs) == (a.token_ids, a.logprobs), key
        assert float32[key].token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(float32[key].logprobs, a.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("wait_steps", [0, 5])
def test_a_busy_overlapped_batch_gathers_arrivals_before_it_admits_them(model, wait_steps):
    """A request that arrives while 8 samples decode waits up to `admit_wait_steps`
    overlapped steps (a chain of captured decodes is not broken for each arrival), is
    admitted at once past `admit_batch` waiting samples, and its tokens are the same."""
    engine = Engine(model, EngineConfig(overlap_decode="on", admit_wait_steps=wait_steps, admit_batch=8))
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("busy", PROMPTS[0], long.model_copy(update={"n": 8})))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 8 and engine._in_flight is not None  # chaining
    late: list[int] = []

    def step() -> None:
        late.extend(t for d in engine.step() if d.rid == "late" for t in d.token_ids)

    engine.add_request(EngineRequest("late", PROMPTS[1], GREEDY))
    steps = 0
    while engine.scheduler.waiting:
        step()
        steps += 1
    # the step that settles the one in flight admits; the wait is counted in chained steps
    assert steps == (1 if wait_steps == 0 else wait_steps + 1)
    engine.add_request(EngineRequest("group", PROMPTS[2], GREEDY.model_copy(update={"n": 8})))
    step()
    assert not engine.scheduler.waiting  # 8 samples waiting: admitted without a wait
    while engine.has_work:
        step()
    assert late == hf_greedy(model, PROMPTS[1], 12)


@pytest.mark.parametrize("width", [0, 1, 3, 7])
def test_padded_tables_cut_or_pad_each_block_table_to_the_width(width):
    """The engine's block tables as one int32 tensor: row i holds table i's first `width`
    blocks, then zeros; empty tables and a table longer than the width included."""
    tables = [[5, 9, 2], [], [7], [1, 2, 3, 4, 5, 6, 7, 8], [3, 3]]
    got = padded_tables(tables, width)
    want = [[*t[:width], *[0] * (width - len(t[:width]))] for t in tables]
    assert got.dtype == torch.int32 and got.shape == (len(tables), width)
    assert got.tolist() == want
