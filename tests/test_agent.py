"""Agent episodes (`data.source = "agent"`): the chat template applied turn by turn, tool
calls read from replies, the client's bounds and checks, and, through a real manager and
real workers, the token-exact record of multi-turn episodes with tool messages, session
affinity, and a worker killed -9 in the middle of turn 2."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from chaos_harness.harness import ChaosFleet, chaos_manager_config, kill_while_holding, wait_for
from polyrl.agent.client import AgentClient, EpisodeLimit
from polyrl.agent.render import Renderer, TemplateError
from polyrl.agent.tool_calls import parse_tool_calls
from polyrl.agent.transcript import Transcript
from polyrl.config import DataConfig, TinyModelConfig
from polyrl.manager.client import AsyncBatchClient
from polyrl.models.tiny import CHAT_TEMPLATE, build_tokenizer, save_tiny_model
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.agent import EpisodeRunner
from polyrl.trainer.batching import group_items

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "a word", "parameters": {}}}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_an_agent_run_starts_no_reward_functions(tokenizer, agent_model: Path, tmp_path: Path) -> None:
    """Episodes come scored: the run starts no reward pool (its process imported the math
    reward's libraries for nothing), and a group that came unscored all the same fails
    with its prompt named instead of being scored by a function the run never chose."""
    from transformers import AutoModelForCausalLM

    from polyrl.config import load_config
    from polyrl.trainer.stream import GroupScorer
    from polyrl.trainer.task import prompts_and_rewards

    items = tmp_path / "items.jsonl"
    items.write_text('{"key": "a"}\n')
    cfg = load_config(None, ["data.source=agent", "data.agent=m:play", f"data.path={items}"])
    source, pool = prompts_and_rewards(cfg, tokenizer, AutoModelForCausalLM.from_pretrained(agent_model))
    assert pool is None and source.default_reward is None
    sample = Sample(completion_ids=[2], logprobs=[-1.0], finish_reason="stop", weight_versions=[0])
    unscored = Group(prompt=Prompt(index=3, text="a", prompt_ids=[1]), samples=[sample])
    with pytest.raises(RuntimeError, match="prompt 3 came without rewards"):
        GroupScorer(pool, tokenizer).submit(unscored)


def chatml(tokenizer):
    """The tiny alphabet with Qwen's turn markers as special tokens, and a ChatML-shaped
    template (a space where Qwen writes a newline, which the alphabet lacks)."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    return tok


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


# ----------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("template", ["tiny", "chatml"])
def test_turns_append_to_the_sampled_tokens_as_the_template_renders_them(tokenizer, template: str) -> None:
    """Prompt + sampled reply + the next turn's tokens are the template's rendering of the
    whole conversation, token for token, except that the reply is the sampled tokens (with
    the stop token the engine sampled where the template closes the turn)."""
    tok = tokenizer if template == "tiny" else chatml(tokenizer)
    stop = tok.eos_token_id if template == "tiny" else tok.convert_tokens_to_ids("<|im_end|>")
    renderer = Renderer(tok, (stop,))
    first = [{"role": "user", "content": "word?"}]
    prompt = renderer.first(first, TOOLS)
    whole = tok.apply_chat_template(first, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt == encode(tok, whole)
    reply = [*encode(tok, "get"), stop]
    new = [{"role": "tool", "tool_call_id": "c0", "content": "abc"}, {"role": "user", "content": "go"}]
    after = renderer.after_reply(reply, new, TOOLS)
    conversation = [*first, {"role": "assistant", "content": "get"}, *new]
    full = encode(tok, tok.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False))
    ours = prompt + reply + after
    if template == "tiny":  # the template writes no end-of-sequence token: ours holds the sampled one
        assert ours[: len(prompt) + 3] + ours[len(prompt) + 4 :] == full
    else:  # <|im_end|> was sampled, and the template's own is not written again
        assert ours == full
    # a reply cut at its budget (no stop token) is closed by the template's own marker
    cut = renderer.after_reply(encode(tok, "get"), new, TOOLS)
    assert prompt + encode(tok, "get") + cut == (full if template == "chatml" else full)


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    with pytest.raises(TemplateError, match="chat template"):
        Renderer(build_tokenizer(), (2,))


def test_hermes_tool_calls_are_read_and_malformed_ones_stay_text() -> None:
    text = 'let me look <tool_call>\n{"name": "lookup", "arguments": {"q": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "let me look" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"q": 1}')]
    two = '<tool_call>{"name": "a", "arguments": "{}"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(two, "hermes")[1]] == [("a", "{}"), ("b", "{}")]
    broken = '<tool_call>{"name": "lookup", </tool_call>'
    assert parse_tool_calls(broken, "hermes") == (broken, [])
    assert parse_tool_calls(text, "none") == (text, [])


# ----------------------------------------------------------------------------- the client


def scripted(replies: list[list[int]], seen: list[tuple[list[int], int]]):
    """An engine stand-in for the client's own tests: each call returns the next reply."""
    turn = iter(replies)

    async def generate(ids: list[int], max_new_tokens: int) -> Sample:
        seen.append((list(ids), max_new_tokens))
        out = next(turn)[:max_new_tokens]
        finish = "stop" if out and out[-1] == 2 else "length"
        return Sample(out, [-0.5] * len(out), finish, [7] * len(out), workers=["w"])

    return generate


def client_for(tokenizer, replies, seen, **kw: Any) -> AgentClient:
    args = dict(episode_id="e", temperature=1.0, max_new_tokens=8, max_turns=4, max_tokens=200)
    return AgentClient(scripted(replies, seen), tokenizer, Renderer(tokenizer, (2,)), **(args | kw))


def test_the_client_records_turns_and_returns_openai_objects(tokenizer) -> None:
    seen: list = []
    get, abc = encode(tokenizer, "get") + [2], encode(tokenizer, "abc") + [2]
    client = client_for(tokenizer, [get, abc], seen)

    async def episode() -> None:
        messages: list[Any] = [{"role": "user", "content": "word?"}]
        first = await client.chat.completions.create(messages=messages, model="anything", tools=TOOLS)
        assert first.choices[0].message.content == "get" and first.choices[0].finish_reason == "stop"
        assert first.usage.completion_tokens == 4
        messages += [first.choices[0].message, {"role": "tool", "content": "abc"}]
        second = await client.chat.completions.create(messages=messages, temperature=1.0)
        assert second.choices[0].message.content == "abc"

    asyncio.run(episode())
    t = client.transcript
    assert seen[0][0] == t.prompt_ids and seen[1][0] == t.prompt_ids + t.ids[: len(seen[1][0]) - len(t.prompt_ids)]
    sample = t.to_sample()
    glue = len(seen[1][0]) - len(seen[0][0]) - len(get)  # "|tool: abc|assistant: "
    assert sample.completion_ids == get + seen[1][0][len(seen[0][0]) + len(get) :] + abc
    assert sample.loss_mask == [True] * len(get) + [False] * glue + [True] * len(abc)
    assert sample.logprobs == [-0.5] * len(get) + [0.0] * glue + [-0.5] * len(abc)
    assert sample.weight_versions == [7] * len(sample.completion_ids)


def test_the_client_refuses_what_it_cannot_honour_and_stops_at_the_bounds(tokenizer) -> None:
    seen: list = []
    reply = encode(tokenizer, "ab") + [2]
    client = client_for(tokenizer, [reply] * 8, seen, max_turns=2)
    first = [{"role": "user", "content": "hi"}]

    async def run() -> None:
        for bad, match in [({"temperature": 0.5}, "rollout.temperature"), ({"n": 2}, "n:"), ({"top_p": 0.9}, "top_p")]:
            with pytest.raises(ValueError, match=match):
                await client.chat.completions.create(messages=first, **bad)
        r = await client.chat.completions.create(messages=first)
        with pytest.raises(ValueError, match="extend the last call"):
            await client.chat.completions.create(messages=[{"role": "user", "content": "other"}, r.choices[0].message])
        with pytest.raises(ValueError, match="no new message"):
            await client.chat.completions.create(messages=[*first, r.choices[0].message])
        more = [*first, r.choices[0].message, {"role": "user", "content": "more"}]
        r2 = await client.chat.completions.create(messages=more)
        with pytest.raises(EpisodeLimit, match="agent_max_turns = 2"):
            await client.chat.completions.create(
                messages=[*more, r2.choices[0].message, {"role": "user", "content": "x"}]
            )

    asyncio.run(run())
    assert len(seen) == 2
    # the token bound: a reply is cut to the room left, and no room left is the episode's end
    seen2: list = []
    tight = client_for(tokenizer, [encode(tokenizer, "abcdefgh")] * 4, seen2, max_tokens=30)

    async def run_tight() -> None:
        r = await tight.chat.completions.create(messages=first)
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(EpisodeLimit, match="agent_max_tokens = 30"):
            await tight.chat.completions.create(
                messages=[*first, r.choices[0].message, {"role": "user", "content": "go on"}]
            )

    asyncio.run(run_tight())
    assert seen2[0][1] == 8 and len(tight.transcript) <= 30


def test_environment_tokens_take_the_version_of_the_reply_they_lead_to() -> None:
    t = Transcript()
    t.add_context([1, 2])
    t.add_reply(Sample([3, 4], [-1.0, -1.0], "stop", [5, 5], ["a"], [2]))
    t.add_context([9])
    t.add_reply(Sample([6], [-2.0], "length", [6], ["a", "b"], [0, 1]))
    t.add_context([8, 8])  # after the last reply: never seen by the model, not trained on
    s = t.to_sample()
    assert s.prompt_ids == [1, 2] and s.completion_ids == [3, 4, 9, 6]
    assert s.weight_versions == [5, 5, 6, 6] and s.loss_mask == [True, True, False, True]
    assert s.finish_reason == "length" and s.workers == ["a", "b"] and s.worker_tokens == [2, 1]


# ----------------------------------------------------------------------------- the fleet


async def tool_episode(client: Any, item: dict[str, Any]) -> float:
    """Three calls with a tool message and a user message between them."""
    messages: list[Any] = [{"role": "user", "content": f"find {item['word']}"}]
    for turn in range(3):
        reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
        if turn < 2:
            messages += [
                reply.choices[0].message,
                {"role": "tool", "tool_call_id": f"c{turn}", "content": item["word"]},
            ]
    return float(len(messages))


def rewarded_per_call(rewards: list[float]):
    """An episode of two calls that rewards each (`algo.adv_estimator = "turn_grpo"`)."""

    async def play(client: Any, item: dict[str, Any]) -> list[float]:
        messages: list[Any] = [{"role": "user", "content": item["word"]}]
        reply = await client.chat.completions.create(messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "again"}]
        await client.chat.completions.create(messages=messages)
        return rewards

    return play


class Recorded(AsyncBatchClient):
    """The manager's client, keeping every call's request and what the engine sampled."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[Any, Any]] = []

    async def generate(self, request):  # type: ignore[no-untyped-def]
        """(the call's prompt, its group) for every call of every batch."""
        by_id = {p.id: p for p in request.prompts}
        async for group in super().generate(request):
            self.calls.append((by_id[group.prompt_id], group))
            yield group


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("agent_model"), TinyModelConfig(max_position_embeddings=512, chat_template=True)
    )


def run_episodes(fleet: ChaosFleet, play, items: list[dict], n: int, sampling: SamplingParams):
    """Every item's `n` episodes through `fleet`'s manager, on a loop of their own; returns
    (groups, recorded calls, runner)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fleet.model_dir))
    cfg = DataConfig(source="agent", agent="x:y", path="unused.jsonl", agent_max_turns=4)

    async def main():
        batches = Recorded(fleet.mt.url, "chaos-token", connect_retries=1)
        runner = EpisodeRunner(play, batches, tok, Renderer(tok, (tok.eos_token_id,)), cfg, 1.0, 512)
        prompts = [Prompt(index=i, text="", prompt_ids=[], columns=item) for i, item in enumerate(items)]
        try:
            groups = await asyncio.gather(
                *(runner.group(p, sampling, [1000 * p.index + k for k in range(n)], 0) for p in prompts)
            )
        finally:
            await batches.close()
        return groups, batches.calls, runner

    return asyncio.run(main())


def test_what_each_call_sampled_is_what_the_learner_trains_on(agent_model: Path, tmp_path: Path) -> None:
    """Multi-turn episodes with tool messages through a real manager and worker: every
    call's prompt is the trained sequence so far, every reply's tokens and log-probs sit
    in the trained sequence where the loss mask is on, and nothing else is trained on."""
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,), ignore_eos=True)
    with ChaosFleet(agent_model, tmp_path, chaos_manager_config()) as fleet:
        fleet.add_worker()
        groups, calls, runner = run_episodes(fleet, tool_episode, [{"word": "abc"}, {"word": "fed"}], 2, sampling)
        per_call, _, _ = run_episodes(fleet, rewarded_per_call([0.25, 0.5]), [{"word": "ab"}], 2, sampling)
        miscounted, _, refused = run_episodes(fleet, rewarded_per_call([1.0]), [{"word": "ab"}], 2, sampling)
    # a list is a reward per call, summed for the episode; one of the wrong length drops its group
    assert [s.call_rewards for s in per_call[0].samples] == [[0.25, 0.5]] * 2 and per_call[0].rewards == [0.75] * 2
    assert miscounted == [None] and refused.num_failed_groups == 1
    assert runner.num_failed_groups == 0 and all(g is not None for g in groups)
    assert len(calls) == 2 * 2 * 3
    by_episode: dict[str, list] = {}
    for request, result in calls:
        by_episode.setdefault(request.session, []).append((request, result))
    checked = 0
    for group in groups:
        assert group.rewards == [5.0, 5.0]  # the function's return: user, 2 x (reply, tool) messages
        items = group_items(group, [1.0] * len(group.samples))
        for i, item in enumerate(items):
            episode = f"{group.prompt.index}.{i}.{1000 * group.prompt.index + i}"  # (the runner's name for it)
            trained = item.token_ids
            mask = [False] * item.prompt_len + item.loss_mask
            behav = [None] * item.prompt_len + item.behav_logp
            sampled_at: set[int] = set()
            for request, result in by_episode[episode]:
                prompt = request.input_ids
                out = result.samples[0]
                assert trained[: len(prompt)] == prompt  # the engine saw exactly the trained prefix
                span = range(len(prompt), len(prompt) + len(out.output_ids))
                assert [trained[i] for i in span] == out.output_ids
                assert [behav[i] for i in span] == out.logprobs
                assert all(mask[i] for i in span)
                sampled_at |= set(span)
            assert {i for i, m in enumerate(mask) if m} == sampled_at  # the tool's and template's tokens are not
            assert max(sampled_at) == len(trained) - 1
            checked += 1
    assert checked == 4


@pytest.mark.slow
def test_an_episodes_calls_go_back_to_its_worker_and_hit_the_prefix_cache(agent_model: Path, tmp_path: Path) -> None:
    """Two workers, episodes of three calls: each call after the first goes to the worker
    that served the episode's last one (it has free slots), whose prefix cache serves the
    conversation so far."""
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, stop_token_ids=(2,), ignore_eos=True)
    with ChaosFleet(agent_model, tmp_path, chaos_manager_config()) as fleet:
        handles = [fleet.add_worker(), fleet.add_worker()]
        groups, calls, _ = run_episodes(fleet, tool_episode, [{"word": w} for w in ["ab", "cd", "ef"]], 4, sampling)
        placement = fleet.mt.manager.placement
        hits, misses = placement.num_session_hits, placement.num_session_misses
        cache = [httpx.get(f"http://127.0.0.1:{h.port}/get_server_info").json() for h in handles]
    assert all(g is not None for g in groups)
    workers = {}
    for request, result in calls:
        workers.setdefault(request.session, set()).update(s.worker for s in result.samples[0].segments)
    assert len(workers) == 12 and all(len(w) == 1 for w in workers.values())
    assert {next(iter(w)) for w in workers.values()} == {"w0", "w1"}  # episodes spread, each one stays
    assert hits == 24 and misses == 0
    assert sum(c["prefix_cache_hits"] for c in cache) >= 24 * 16  # at least one full block per later call


@pytest.mark.slow  # two fleets, 16 s
def test_a_worker_killed_in_turn_2_loses_no_episode_and_no_token(agent_model: Path, tmp_path: Path) -> None:
    """Two workers; once a second call of the episodes runs on w0, w0 is killed -9. Every
    episode ends, every reply has its whole budget, and each trained sequence equals, in
    token ids, the one the same seeds give on a fleet nobody kills."""
    sampling = SamplingParams(max_new_tokens=120, temperature=1.0, stop_token_ids=(), ignore_eos=True)
    items = [{"word": w} for w in ["ab", "cd", "ef", "fa", "bc", "de"]]

    def killed_run() -> tuple[list, list]:
        with ChaosFleet(agent_model, tmp_path / "kill", chaos_manager_config()) as fleet:
            victim = fleet.add_worker()
            fleet.add_worker()
            stop = threading.Event()

            def killer() -> None:
                def on_victim() -> bool:  # on the manager's loop: a later call streaming from w0
                    manager = fleet.mt.manager
                    record = manager.registry.get("w0")
                    units = [manager.state.units.get(t) for t in (record.tasks if record is not None else ())]
                    return any(
                        u is not None and len(u.group.prompt.input_ids) > 100 and u.samples[0]._seg_tokens
                        for u in units
                    )

                def second_turn_on_victim() -> bool:
                    return stop.is_set() or fleet.mt.call(on_victim)

                # mid-reply: it has streamed tokens, and has more to make. A reply seen on w0 can
                # end before the signal lands (a slow machine makes that likely): w0 is frozen
                # first and killed only if such a reply is still unfinished, else it goes on.
                while not stop.is_set():
                    wait_for(second_turn_on_victim, 120, "a second call generating on w0")
                    if not stop.is_set() and kill_while_holding([victim.proc.pid], lambda: fleet.mt.call(on_victim)):
                        return

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            try:
                groups, calls, runner = run_episodes(fleet, tool_episode, items, 2, sampling)
            finally:
                stop.set()
                thread.join(timeout=10)
            assert victim.proc.poll() is not None, "w0 was never killed"
            lost = fleet.mt.worker_list()
        assert runner.num_failed_groups == 0 and lost.num_lost_workers == 1
        return groups, calls

    groups, calls = killed_run()
    moved = [r for _, r in calls if len(r.samples[0].segments) > 1]
    assert moved, "no reply was interrupted"
    assert [len(r.samples[0].output_ids) for _, r in calls] == [120] * len(calls)  # 0 tokens lost
    with ChaosFleet(agent_model, tmp_path / "calm", chaos_manager_config()) as fleet:
        fleet.add_worker()
        fleet.add_worker()
        reference, _, _ = run_episodes(fleet, tool_episode, items, 2, sampling)
    assert len([g for g in groups if g is not None]) == len(items)  # 0 episodes lost
    for g, ref in zip(groups, reference, strict=True):
        for s, r in zip(g.samples, ref.samples, strict=True):
            assert s.prompt_ids == r.prompt_ids and s.completion_ids == r.completion_ids
            assert s.loss_mask == r.loss_mask
