"""Automatic prefix caching in the engine: a conversation's next turn reuses the KV of the
turns before it, gives the same tokens as an engine without the cache, and a new weight
version (or a sequence whose KV spans versions) leaves nothing reusable behind."""

from __future__ import annotations

import pytest
from test_engine import run, spicy_model

from polyrl.config import EngineConfig
from polyrl.engine import block_manager
from polyrl.engine.block_manager import BlockManager
from polyrl.engine.engine import Engine
from polyrl.engine.sequence import Sequence
from polyrl.engine.types import EngineRequest
from polyrl.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=7)


def cfg(caching: bool = True, **kw) -> EngineConfig:
    return EngineConfig(block_size=4, max_num_batched_tokens=32, enable_prefix_caching=caching, **kw)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return spicy_model(tiny_model_dir)


def turn(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams = GREEDY):
    """One request; returns (its result, the prompt tokens the cache supplied)."""
    hits = engine.blocks.num_hit_tokens
    result = run(engine, [EngineRequest(rid, prompt, sampling)])[(rid, 0)]
    return result, engine.blocks.num_hit_tokens - hits


def conversation(engine: Engine, turns: int = 3, sampling: SamplingParams = GREEDY):
    """Each turn's prompt is the whole history: the turns before, the engine's replies
    as it sampled them (token ids, never re-tokenized), and a new user message."""
    history, out = [1, *range(5, 27)], []
    for t in range(turns):
        result, hit = turn(engine, f"turn{t}", history, sampling)
        out.append((list(history), result, hit))
        history = history + result.token_ids + [40 + t, 41 + t, 42 + t]
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_later_turns_reuse_the_history_and_sample_the_same_tokens(model, sampling) -> None:
    cached = conversation(Engine(model, cfg()), sampling=sampling)
    plain = conversation(Engine(model, cfg(caching=False)), sampling=sampling)
    for (prompt, got, hit), (_, want, no_hit) in zip(cached, plain):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert no_hit == 0
    assert cached[0][2] == 0  # nothing to reuse on the first turn
    for (before, reply, _), (prompt, _, hit) in zip(cached, cached[1:]):
        # every full block whose KV the turn before computed: all of its tokens but the
        # last reply token, which no step fed
        computed = len(before) + len(reply.token_ids) - 1
        assert hit == computed // 4 * 4, (len(prompt), hit)


def test_a_new_weight_version_empties_the_cache(model) -> None:
    engine = Engine(model, cfg())
    first, _ = turn(engine, "a", [1, *range(5, 27)])
    again = [1, *range(5, 27), *first.token_ids, 30]
    engine.update_weights({k: p.detach().clone() for k, p in model.named_parameters()}, version=1)
    assert engine.blocks.num_cached_blocks == 0
    result, hit = turn(engine, "b", again)
    assert hit == 0 and result.weight_versions == [1] * 12
    _, hit = turn(engine, "c", again)  # cached again, under version 1
    assert hit == (len(again) - 1) // 4 * 4
    engine.update_weights(None, version=2)  # a colocated trainer's in-place update
    assert turn(engine, "d", again)[1] == 0


def test_kv_spanning_two_versions_is_not_kept(model) -> None:
    """`continue`: a sample keeps its KV across a version; none of it may be reused after."""
    engine = Engine(model, cfg())
    prompt = [1, *range(5, 27)]
    engine.add_request(EngineRequest("a", prompt, GREEDY))
    tokens: list[int] = []
    while len(tokens) < 4:
        tokens += [t for d in engine.step() for t in d.token_ids]
    tokens += [t for d in engine.update_weights(None, version=1, policy="continue") for t in d.token_ids]
    while engine.has_work:
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert engine.blocks.num_cached_blocks == 0
    assert turn(engine, "b", prompt + tokens + [31])[1] == 0


def test_evicted_blocks_are_recomputed_and_the_tokens_do_not_change(model) -> None:
    """A KV cache of 20 blocks: other requests take the freed blocks over, the history's
    keys go with them, and the next turn recomputes what it lost."""
    engine = Engine(model, cfg(num_kv_blocks=20))
    prompt = [1, *range(5, 27)]
    first, _ = turn(engine, "a", prompt)
    for i in range(3):  # 3 x (23 + 12 tokens) = 27 blocks: every free block is reused
        turn(engine, f"other{i}", [2, *range(10 + i, 32 + i)])
    history = prompt + first.token_ids + [32]
    result, hit = turn(engine, "b", history)
    want, _ = turn(Engine(model, cfg(caching=False)), "b", history)
    assert hit < (len(history) - 1) // 4 * 4
    assert result.token_ids == want.token_ids


def test_samples_of_one_prompt_and_a_preempted_sequence_reuse_blocks(model) -> None:
    """n samples fork from one prefill; their blocks are cached when they finish, and a
    request for a longer prompt over the same prefix starts from them."""
    engine = Engine(model, cfg())
    prompt = [1, *range(5, 27)]
    results = run(engine, [EngineRequest("n", prompt, SamplingParams(max_new_tokens=6, n=3, seed=1))])
    assert len(results) == 3 and engine.blocks.num_cached_blocks >= 5
    _, hit = turn(engine, "b", [*prompt, *results[("n", 1)].token_ids, 9])
    assert hit == 28  # 23 prompt + 6 sampled tokens, 28 of them computed: 7 full blocks


def test_a_block_is_matched_only_with_its_own_tokens(monkeypatch) -> None:
    """Even if two prefixes' keys collided, a block is reused only where its tokens are the
    sequence's own."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda prev, tokens: 0)
    blocks = BlockManager(8, 4, prefix_caching=True)

    def seq(tokens: list[int]) -> Sequence:
        return Sequence(0, "r", 0, tokens, len(tokens), GREEDY, 0, frozenset())

    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks.allocate(a, 9)
    a.num_computed_tokens = 9
    blocks.free(a)
    assert blocks.num_cached_blocks == 1  # one key: the colliding second block kept none
    assert blocks.match_prefix(seq([9, 9, 9, 9, 5, 6, 7, 8, 1])) == 0
    assert blocks.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 1])) == 4
    assert blocks.num_free == 7


def test_the_cache_can_be_turned_off(model) -> None:
    engine = Engine(model, cfg(caching=False))
    conversation(engine, turns=2)
    assert engine.blocks.num_hit_tokens == 0 and engine.blocks.num_cached_blocks == 0
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0


def test_stats_count_queries_and_hits(model) -> None:
    engine = Engine(model, cfg())
    turns = conversation(engine, turns=2)
    stats = engine.stats()
    assert stats.prefix_cache_hits == turns[1][2] > 0
    assert stats.prefix_cache_queries == sum(len(prompt) for prompt, _, _ in turns)


def test_episodes_that_arrive_together_compute_their_shared_opening_once(model) -> None:
    """A GRPO group's episodes arrive at once with the same opening: one computes it and
    the others read its blocks while it is still running (keyed as its prefill computes
    them), with the tokens of an engine without the cache."""
    opening = [1, *range(5, 27)]  # 23 tokens: 5 full blocks of 4
    requests = [EngineRequest(f"e{i}", [*opening, 30 + i], SAMPLED) for i in range(4)]
    engine = Engine(model, cfg())
    got = run(engine, requests)
    want = run(Engine(model, cfg(caching=False)), requests)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    # the opening's 5 full blocks were computed once: each later episode read them
    assert engine.blocks.num_hit_tokens == 3 * 20


def test_requests_with_one_prompt_are_admitted_together_after_the_first(model) -> None:
    """Separate requests with the same prompt (an OpenAI client's group, n=1 each): the
    first computes it, and the next step admits all the others, which read its blocks
    and compute only the block with their last token. With a prompt a whole number of
    blocks long they were admitted one a step, each waiting for a block it computes
    itself anyway."""
    for length in (24, 23):  # 6 full blocks of 4; 5 full blocks and 3 tokens
        engine = Engine(model, cfg())
        for i in range(4):
            engine.add_request(EngineRequest(f"r{i}", [1, *range(5, 4 + length)], GREEDY))
        engine.step()
        assert engine.stats().num_running == 1
        engine.step()
        assert engine.stats().num_running == 4, length
        assert engine.blocks.num_hit_tokens == 3 * ((length - 1) // 4 * 4)
        engine.abort_all()
