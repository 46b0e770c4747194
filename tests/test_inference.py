"""The OpenAI- and vLLM-compatible endpoints, on a worker and on the manager.

Driven by the official `openai` client and by atroposlib's own server classes, against
real servers on free 127.0.0.1 ports with the tiny offline model."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_manager import fast_cfg, wait_active, workers_of
from test_worker import CONTEXT, InProcessWorker, WorkerProcess, _tiny, _wait_until

from polyrl.engine.types import SampleDelta
from polyrl.inference.render import Choice, chat_response, completion_response, vllm_response
from polyrl.manager.main import ManagerThread
from polyrl.models.tiny import add_chat_template

TOKEN = "inference-test-token"
AUTH_T = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "1+2=3, 4+5="
MESSAGES = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_chat_template(_tiny(tmp_path_factory.mktemp("inference_model")))


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[InProcessWorker]:
    with InProcessWorker(model_dir) as w:
        w.state.token = TOKEN
        yield w


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def oai(worker: InProcessWorker) -> Iterator[openai.OpenAI]:
    with client_for(worker.http.url) as client:
        yield client


def model_name(worker: InProcessWorker) -> str:
    return str(worker.state.model_path)


# ------------------------------------------------------------------ builders, no server


class CharTokenizer:
    """One character per token id (id = ord), enough for the builders."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def _delta(index: int, text: str, finish: str | None = None, matched: int | None = None) -> SampleDelta:
    ids = [ord(ch) for ch in text]
    return SampleDelta("r", index, ids, [-0.5] * len(ids), [0] * len(ids), finish, matched)


def test_stop_string_cuts_text_and_tokens() -> None:
    tok = CharTokenizer()
    c = Choice(0, ["END", "xy"])
    c.add(_delta(0, "abcE"), tok)
    assert not c.done
    assert c.release(tok) == ("a", range(0, 1))  # 3 characters held back (the longest stop)
    c.add(_delta(0, "NDzzz"), tok)
    assert c.done and c.finish_reason == "stop" and c.text == "abc"
    assert c.token_ids == [ord(ch) for ch in "abcEND"]  # the shortest prefix holding the stop
    assert c.release(tok) == ("bc", range(1, 6))


def test_finish_by_stop_token_keeps_it_out_of_the_text() -> None:
    tok = CharTokenizer()
    c = Choice(0, [])
    c.add(_delta(0, "hi!", finish="stop", matched=ord("!")), tok)
    body = completion_response("id", "m", tok, 3, [c], logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == "hi" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["h", "i"] and choice["logprobs"]["text_offset"] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_and_vllm_shapes() -> None:
    tok = CharTokenizer()
    a, b = Choice(0, []), Choice(1, [])
    a.add(_delta(0, "ok", finish="length"), tok)
    b.add(_delta(1, "no!", finish="stop", matched=ord("!")), tok)
    chat = chat_response("id", "m", tok, 5, [a, b], logprobs=True)
    assert [c["message"]["content"] for c in chat["choices"]] == ["ok", "no"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "o", "logprob": -0.5, "bytes": [ord("o")], "top_logprobs": []}
    a2, b2 = Choice(0, []), Choice(1, [])
    a2.add(_delta(0, "ok", finish="length"), tok)
    b2.add(_delta(1, "no!", finish="stop", matched=ord("!")), tok)
    vllm = vllm_response(tok, [1, 2], [a2, b2], with_logprobs=True)
    assert vllm["finish_reasons"] == ["length", "stop"]
    assert vllm["logprobs"][1] == [[{str(ord("n")): -0.5}], [{str(ord("o")): -0.5}], [{str(ord("!")): -0.5}]]
    assert vllm["text"] == ["ok", "no"] and vllm["token_ids"][1] == [ord(ch) for ch in "no!"]


# --------------------------------------------------------------------- a worker, openai client


def test_models_lists_the_served_model_and_needs_the_token(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [model_name(worker)]
    with client_for(worker.http.url) as other:
        other.api_key = "wrong"
        with pytest.raises(openai.AuthenticationError):
            other.models.list()


def test_completion_n_logprobs_usage(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    tok = worker.tokenizer
    out = oai.completions.create(
        model=model_name(worker),
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 3 and sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.prompt_tokens == len(tok(PROMPT)["input_ids"])
    assert out.usage.completion_tokens == 18
    for c in out.choices:
        assert c.finish_reason == "length"
        lps = c.logprobs.token_logprobs
        assert len(lps) == 6 and all(math.isfinite(lp) and lp <= 0 for lp in lps)
        assert "".join(c.logprobs.tokens) == c.text
        assert len(tok(c.text, add_special_tokens=False)["input_ids"]) == 6
    again = oai.completions.create(
        model=model_name(worker),
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible


def test_chat_stream_equals_non_stream_with_usage(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name(worker),
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    whole = oai.chat.completions.create(**kwargs)
    text, lps, finish, usage = "", [], None, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            lps += [entry.logprob for entry in (c.logprobs.content if c.logprobs else [])]
            finish = c.finish_reason or finish
    choice = whole.choices[0]
    assert text == choice.message.content and finish == choice.finish_reason == "length"
    assert lps == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)
    assert all(math.isfinite(lp) and lp <= 0 for lp in lps) and len(lps) == 8
    prompt = worker.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens == len(worker.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert usage.completion_tokens == 8


def test_completion_stream_n_and_stop(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    base = oai.completions.create(
        model=model_name(worker), prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = base.choices[0].text
    assert len(full) == 12
    stop = full[5:7]
    cut = full[: full.find(stop)]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    stream = oai.completions.create(
        model=model_name(worker),
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        n=2,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: cut, 1: cut} and finishes == {0: "stop", 1: "stop"}


def test_bad_requests_get_clear_4xx_and_the_worker_keeps_serving(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    name = model_name(worker)
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="at most"):
        oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, n=100_000)
    with pytest.raises(openai.BadRequestError, match="context"):
        oai.completions.create(model=name, prompt=PROMPT, max_tokens=CONTEXT)
    with pytest.raises(openai.UnprocessableEntityError, match="role"):
        oai.chat.completions.create(model=name, messages=[{"content": "hi"}], max_tokens=2)  # type: ignore[list-item]
    with pytest.raises(openai.UnprocessableEntityError, match="empty"):
        oai.completions.create(model=name, prompt="", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, presence_penalty=1.0)
    raw = httpx.post(f"{worker.http.url}/v1/completions", json={"model": name, "prompt": PROMPT}, timeout=30)
    assert raw.status_code == 401 and raw.json()["error"]["type"] == "unauthorized"
    assert oai.completions.create(model=name, prompt=PROMPT, max_tokens=2).choices[0].finish_reason


# ------------------------------------------------------------------------ vLLM's /generate


def test_vllm_generate_and_sglang_generate_share_the_path(worker: InProcessWorker) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    ids = list(worker.tokenizer(PROMPT)["input_ids"])
    body = {
        "prompt": {"prompt_token_ids": ids},
        "logprobs": 0,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    vllm = httpx.post(f"{worker.http.url}/generate", json=body, headers=headers, timeout=60).json()
    assert vllm["finish_reasons"] == ["length", "length"]
    tokens = [[int(next(iter(item[0]))) for item in sample] for sample in vllm["logprobs"]]
    assert tokens == vllm["token_ids"] and len(tokens[0]) == 5
    sglang = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
    }
    sg = httpx.post(f"{worker.http.url}/generate", json=sglang, headers=headers, timeout=60).json()
    assert sg["output_ids"] == tokens[0]
    assert [lp for lp, _, _ in sg["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [next(iter(item[0].values())) for item in vllm["logprobs"][0]], abs=1e-5
    )
    neither = httpx.post(f"{worker.http.url}/generate", json={"max_tokens": 3}, headers=headers, timeout=30)
    assert neither.status_code == 422 and "vLLM" in neither.json()["error"]["message"]


def test_atroposlib_vllm_server_class_against_a_worker(worker: InProcessWorker, model_dir: Path) -> None:
    _check_atropos_call(model_dir, *asyncio.run(_atropos_vllm_call(worker.http.url, str(model_dir))))


def _check_atropos_call(
    model_dir: Path, prompt: list[int], tokens: list[list[int]], logprobs: list[list[float]], finishes: list[Any]
) -> None:
    """What atroposlib read back is what the model gives: each sample's log-probs are those
    of its own tokens after the prompt, recomputed here by the model itself (float32 on
    CPU: equal to 1e-4), so a route that returned another token's or another position's
    log-prob fails, not only one that returned a positive number."""
    from transformers import AutoModelForCausalLM

    assert len(tokens) == 2 and all(len(t) == 4 for t in tokens) and finishes == ["length", "length"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for sample, lps in zip(tokens, logprobs, strict=True):
        ids = torch.tensor([prompt + sample])
        with torch.no_grad():
            log_q = torch.log_softmax(
                model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1
            )  # [4, V] (temperature 1)
        expected = log_q.gather(-1, torch.tensor(sample).unsqueeze(-1)).squeeze(-1).tolist()
        assert lps == pytest.approx(expected, abs=1e-4)


async def _atropos_vllm_call(
    url: str, model_dir: str
) -> tuple[list[int], list[list[int]], list[list[float]], list[Any]]:
    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.openai_server import OpenAIServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    config = APIServerConfig(
        server_type="vllm",
        base_url=f"{url}/v1",
        api_key=TOKEN,
        model_name=model_dir,
        tokenizer_name=model_dir,
        timeout=60,
    )
    server = VLLMServer(config)
    managed = ManagedServer(server, tokenizer=server.tokenizer)
    try:
        await managed.chat_completion(messages=MESSAGES, n=2, max_tokens=4, temperature=1.0, ignore_eos=True)
        nodes = managed.get_state()["nodes"]
    finally:
        if server.check_task is not None:
            server.check_task.cancel()
    assert len(nodes) == 2
    prompt_tokens, out_tokens, out_logprobs, finishes = await server.tokens_and_logprobs_completion(
        prompt=PROMPT, n=2, max_tokens=4, temperature=1.0, ignore_eos=True
    )
    if server.check_task is not None:
        server.check_task.cancel()
    openai_server = OpenAIServer(config.model_copy(update={"server_type": "openai"}))
    try:  # its health check is a 1-token chat call, made by the first request
        chat = await openai_server.chat_completion(messages=MESSAGES, n=2, max_tokens=3)
        completion = await openai_server.completion(prompt=PROMPT, n=2, max_tokens=3)
    finally:
        if openai_server.check_task is not None:
            openai_server.check_task.cancel()
    assert len(chat.choices) == 2 and len(completion.choices) == 2
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices + completion.choices)
    return list(prompt_tokens), out_tokens, out_logprobs, finishes


# ------------------------------------------------------------------------ the manager


@pytest.fixture(scope="module")
def fleet(model_dir: Path) -> Iterator[ManagerThread]:
    """A manager with one real worker process."""
    with ManagerThread(fast_cfg(token=TOKEN, heartbeat_timeout_s=3.0, inference_wait_s=5.0)) as mt:
        proc = _start_worker(model_dir, mt.url, "w1")
        try:
            proc.wait_ready()
            wait_active(mt, "w1")
            yield mt
        finally:
            proc.kill()


def _start_worker(model_dir: Path, manager_url: str, worker_id: str) -> WorkerProcess:
    return WorkerProcess(model_dir, "--manager", manager_url, "--token", TOKEN, "--worker-id", worker_id)


def test_manager_serves_completions_and_chat_through_the_fleet(fleet: ManagerThread, model_dir: Path) -> None:
    name = str(model_dir)
    with client_for(fleet.url) as oai:
        assert [m.id for m in oai.models.list().data] == [name]
        out = oai.completions.create(
            model=name, prompt=PROMPT, n=6, max_tokens=5, logprobs=0, seed=3, extra_body={"ignore_eos": True}
        )
        assert sorted(c.index for c in out.choices) == list(range(6))  # n=6 over a worker of 4 slots
        assert out.usage.completion_tokens == 30
        assert all(len(c.logprobs.token_logprobs) == 5 and max(c.logprobs.token_logprobs) <= 0 for c in out.choices)
        text, usage = "", None
        stream = oai.chat.completions.create(
            model=Path(name).name,
            messages=MESSAGES,
            max_tokens=7,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.delta.content or "" for c in chunk.choices)
        whole = oai.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=7, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert text == whole.choices[0].message.content and usage is not None and usage.completion_tokens == 7
        stop = text[2:4]
        cut = oai.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=7, temperature=0.0, stop=stop, extra_body={"ignore_eos": True}
        )
        assert cut.choices[0].message.content == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="at most 128"):
            oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, n=129)
        assert oai.completions.create(model=name, prompt=PROMPT, max_tokens=2).choices[0].text is not None
    sglang = httpx.post(f"{fleet.url}/generate", json={"input_ids": [1, 2]}, headers=AUTH_T, timeout=30)
    assert sglang.status_code == 422 and "vLLM" in sglang.json()["error"]["message"]


def test_atroposlib_vllm_server_class_against_the_manager(fleet: ManagerThread, model_dir: Path) -> None:
    _check_atropos_call(model_dir, *asyncio.run(_atropos_vllm_call(fleet.url, str(model_dir))))


def test_manager_without_workers_answers_503_in_bounded_time() -> None:
    with ManagerThread(fast_cfg(token=TOKEN, inference_wait_s=0.5)) as mt, client_for(mt.url) as oai:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="no rollout worker"):
            oai.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_worker_killed_mid_request_the_client_sees_a_complete_answer(model_dir: Path) -> None:
    """Two workers; the one serving an OpenAI request is killed with SIGKILL mid-way: the
    client still gets every token, the same ones an uninterrupted run gives."""
    budget = CONTEXT - 64
    kwargs: dict[str, Any] = dict(
        prompt=PROMPT, n=2, max_tokens=budget, temperature=1.0, seed=11, logprobs=0, extra_body={"ignore_eos": True}
    )
    procs: list[WorkerProcess] = []
    with ManagerThread(fast_cfg(token=TOKEN, heartbeat_timeout_s=3.0, stall_timeout_s=20)) as mt:
        try:
            procs = [_start_worker(model_dir, mt.url, f"w{i}") for i in (1, 2)]
            for p in procs:
                p.wait_ready()
            wait_active(mt, "w1", "w2")
            with client_for(mt.url) as oai, ThreadPoolExecutor(1) as pool:
                future = pool.submit(oai.completions.create, model=str(model_dir), **kwargs)

                def busy() -> str | None:
                    return next((w for w, info in workers_of(mt).items() if info["num_inflight"] > 0), None)

                _wait_until(lambda: busy() is not None, 30, "a worker busy")
                victim = busy()
                time.sleep(0.3)  # some tokens reach the manager first
                assert not future.done(), "the request ended before the kill: raise the budget"
                procs[int(victim[1]) - 1].proc.send_signal(signal.SIGKILL)
                out = future.result(timeout=180)
                migrated = mt.call(lambda: mt.manager.metrics.migrations.labels("failure")._value.get())
                assert migrated >= 1 and victim not in workers_of(mt)
                reference = oai.completions.create(model=str(model_dir), **kwargs)  # the survivor alone
        finally:
            for p in procs:
                p.kill()
    assert out.usage.completion_tokens == 2 * budget
    for got, want in zip(sorted(out.choices, key=lambda c: c.index), sorted(reference.choices, key=lambda c: c.index)):
        assert got.finish_reason == "length" and len(got.logprobs.token_logprobs) == budget
        assert got.text == want.text
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)


def test_top_logprobs_on_a_worker(worker: InProcessWorker, oai: openai.OpenAI) -> None:
    name = model_name(worker)
    chat = oai.chat.completions.create(
        model=name,
        messages=MESSAGES,
        max_tokens=5,
        temperature=1.0,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    for entry in chat.choices[0].logprobs.content:
        alts = [a.logprob for a in entry.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True) and all(lp <= 0 for lp in alts)
        assert entry.logprob <= alts[0] + 1e-6  # nothing beats the most likely token
    greedy = oai.completions.create(
        model=name, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = greedy.choices[0].logprobs
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(token_lp) and top[token] == token_lp
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": {"prompt_token_ids": [1, 5, 6]}, "logprobs": 2, "max_tokens": 3, "temperature": 0.0}
    vllm = httpx.post(f"{worker.http.url}/generate", json=body, headers=headers, timeout=60).json()
    assert all(len(item[0]) in (2, 3) for item in vllm["logprobs"][0])
    assert [int(next(iter(item[0]))) for item in vllm["logprobs"][0]] == vllm["token_ids"][0]


def test_top_logprobs_through_the_manager_equal_the_workers(fleet: ManagerThread, model_dir: Path) -> None:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    with client_for(fleet.url) as oai:
        content = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
        streamed = [
            e
            for chunk in oai.chat.completions.create(**kwargs, stream=True)
            for c in chunk.choices
            if c.logprobs
            for e in c.logprobs.content
        ]
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    for entry in content:  # greedy: the sampled token is the most likely one
        best = entry.top_logprobs[0]
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_no_op_values_of_unsupported_fields_pass_and_others_are_refused(worker: InProcessWorker) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": {"prompt_token_ids": [1, 5, 6]}, "max_tokens": 2, "repetition_penalty": 1.0, "min_tokens": 0}
    assert httpx.post(f"{worker.http.url}/generate", json=body, headers=headers, timeout=60).status_code == 200
    refused = httpx.post(
        f"{worker.http.url}/generate", json=body | {"repetition_penalty": 1.1}, headers=headers, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repetition_penalty"
    chat = {"model": model_name(worker), "messages": MESSAGES, "max_tokens": 2, "frequency_penalty": 0.5}
    refused = httpx.post(f"{worker.http.url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frequency_penalty"


def test_min_p_is_honoured_by_both_dialects(worker: InProcessWorker) -> None:
    """vLLM's min_p, on its `/generate` and on the OpenAI endpoints: 1 keeps only the most
    likely token, so temperature-1 samples are the greedy ones."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    vllm = {"prompt": {"prompt_token_ids": [1, 5, 6]}, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    url = f"{worker.http.url}/generate"
    greedy = httpx.post(url, json=vllm | {"temperature": 0}, headers=headers, timeout=60).json()
    cut = httpx.post(url, json=vllm | {"min_p": 1.0, "n": 3, "seed": 5}, headers=headers, timeout=60).json()
    assert cut["token_ids"] == greedy["token_ids"] * 3
    free = httpx.post(url, json=vllm | {"n": 3, "seed": 5}, headers=headers, timeout=60).json()
    assert free["token_ids"] != cut["token_ids"]
    chat = {"model": model_name(worker), "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "seed": 3}
    url = f"{worker.http.url}/v1/chat/completions"
    greedy = httpx.post(url, json=chat | {"temperature": 0}, headers=headers, timeout=60).json()
    cut = httpx.post(url, json=chat | {"min_p": 1.0, "n": 2}, headers=headers, timeout=60).json()
    assert [c["message"]["content"] for c in cut["choices"]] == [greedy["choices"][0]["message"]["content"]] * 2


def test_client_hanging_up_aborts_its_generation(worker: InProcessWorker) -> None:
    """Streamed or not, a client that goes away stops its samples (on the manager the same
    path closes the batch)."""
    worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)
    before = worker.info()["num_generated_tokens"]
    body = {"model": model_name(worker), "prompt": PROMPT, "max_tokens": CONTEXT - 64, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream(
        "POST", f"{worker.http.url}/v1/completions", json=body | {"stream": True}, headers=headers, timeout=30
    ) as response:
        next(response.iter_lines())  # running; now hang up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{worker.http.url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(5.0, read=1.0)
        )
    info = worker.wait_for(lambda i: i["num_running_reqs"] == 0 and i["num_queued_reqs"] == 0)
    assert info["num_generated_tokens"] - before < CONTEXT - 64  # both stopped early
    assert worker.state.num_open_generates == 0
