"""Atropos groups get the weight versions of their tokens (issue 41): the OpenAI/vLLM
routes book every completion they serve with its tokens' versions, and the trainer looks
each generated span of a scored group up in the manager's book by its token ids. No
model and no worker: a scripted backend, and a manager with no fleet."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_manager import fast_cfg
from test_worker import InProcessWorker, _tiny

from polyrl.data.atropos import ScoredGroup, generated_spans, token_versions
from polyrl.engine.types import SampleDelta
from polyrl.inference.routes import InferenceRoutes, Served
from polyrl.inference.versions import VersionBook
from polyrl.manager.main import ManagerThread
from polyrl.metrics.step_stats import version_lag_metrics
from polyrl.protocol.completions import from_runs, sequence_key, to_runs
from polyrl.protocol.manager_api import RegisterRequest
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.atropos import AtroposRollout
from polyrl.rollout.manager_link import ManagerLink
from polyrl.trainer.batching import group_items

TOKEN = "versions-test-token"
X = -100  # a context position
EOS = 2


def test_runs_and_spans():
    assert to_runs([1, 1, 2, 2, 2]) == [(1, 2), (2, 3)] and from_runs([(1, 2), (2, 3)]) == [1, 1, 2, 2, 2]
    assert generated_spans([X, X, 7, 8, X, X, 13]) == [(2, 4), (6, 7)]
    assert generated_spans([X, X, X]) == []


def test_the_book_keeps_exact_and_trimmed_keys_and_forgets_the_oldest():
    book = VersionBook(max_keys=4)
    book.record([5, 6], [7, 8, EOS], [1, 1, 2])
    exact, trimmed = sequence_key([5, 6, 7, 8, EOS]), sequence_key([5, 6, 7, 8])
    assert book.lookup([exact, trimmed, sequence_key([5, 6, 7])]) == [[(1, 2), (2, 1)], [(1, 2)], None]
    book.record([5, 6, 7], [8], [3])  # its exact key is the first one's trimmed key: it wins
    book.record([5, 6], [7, 8, 9], [4, 4, 4])  # a trimmed key never replaces an exact one
    assert book.lookup([trimmed]) == [[(3, 1)]]
    book.record([1], [1, 1], [5, 5])
    assert len(book) == 4 and book.lookup([exact]) == [None]  # the oldest went first
    book.record([1], [9], [0, 0])  # not one version per token: not booked
    assert book.lookup([sequence_key([1, 9])]) == [None]


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class SwappingBackend:
    """Every sample generates "ab!c" one token per delta; the weights swap from version
    1 to 2 after its second token (an in-flight swap)."""

    async def served(self) -> Served:
        return Served(["m"], CharTokenizer(), 64, 4, 0)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[list[SampleDelta]]:
        for pos, (char, version) in enumerate(zip("ab!c", [1, 1, 2, 2], strict=True)):
            finish = "length" if pos == 3 else None
            yield [SampleDelta("r", i, [ord(char)], [-0.5], [version], finish) for i in range(sampling.n)]


@pytest.fixture
def served_app() -> Iterator[tuple[TestClient, VersionBook]]:
    book = VersionBook()
    routes = InferenceRoutes(SwappingBackend(), book)
    app = FastAPI()
    app.post("/generate")(routes.vllm_generate)
    app.post("/v1/completions")(routes.completions)
    with TestClient(app) as client:
        yield client, book


def test_the_routes_book_each_completion_with_its_tokens_versions(served_app):
    client, book = served_app
    prompt = [40, 41]
    reply = client.post("/generate", json={"prompt": {"prompt_token_ids": prompt}, "n": 2, "logprobs": 0})
    assert reply.status_code == 200 and reply.json()["token_ids"] == [[97, 98, 33, 99]] * 2
    assert book.lookup([sequence_key(prompt + [97, 98, 33, 99])]) == [[(1, 2), (2, 2)]]
    # a stop string cuts the sample: what is booked is what the client got
    reply = client.post("/v1/completions", json={"model": "m", "prompt": [50], "max_tokens": 4, "stop": ["!"]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ab"
    assert book.lookup([sequence_key([50, 97, 98, 33]), sequence_key([50, 97, 98])]) == [[(1, 2), (2, 1)], [(1, 2)]]


def group(tokens: list[list[int]], masks: list[list[int]]) -> dict:
    return {"tokens": tokens, "masks": masks, "scores": [float(i % 2) for i in range(len(tokens))]}


def test_a_group_with_an_unknown_span_is_unversioned_as_a_whole():
    g = ScoredGroup.model_validate(group([[5, 6, 7, 8, 11, 13]], [[X, X, 7, 8, X, 13]]))
    assert token_versions(g, [[[(1, 2)], [(2, 1)]]]) == [[1, 1, 1, 2]]  # context: the version before it
    assert token_versions(g, [[[(1, 2)], None]]) is None
    assert token_versions(g, [[[(1, 1)], [(2, 1)]]]) is None  # booked shorter than the span: not this one


@pytest.fixture
def manager() -> Iterator[ManagerThread]:
    with ManagerThread(fast_cfg(token=TOKEN, heartbeat_timeout_s=60.0)) as mt:
        yield mt


def atropos_rollout(manager: ManagerThread, batch: list[dict], version: int) -> tuple[AtroposRollout, ManagerLink]:
    """The trainer's Atropos rollout at learner version `version`, asking `manager`;
    `batch` is what the Atropos API hands out."""
    link = ManagerLink(manager.url, TOKEN, timeout_s=10, retry_s=1)
    inner = SimpleNamespace(
        weight_version=version,
        completion_versions=link.completion_versions,
        note_fleet=lambda stats: SimpleNamespace(num_migrations=0),
    )
    client = SimpleNamespace(registration=SimpleNamespace(max_token_len=64), next_batch=lambda steps_done: batch)
    return AtroposRollout(inner, client, vocab_size=64, temperature=1.0, steps_done=0), link  # type: ignore[arg-type]


def test_an_environment_generating_ahead_of_the_trainer_shows_version_lag(manager):
    """The environment's completions were served at versions 1 and 2 and scored while
    the learner moved on to 3: the groups carry their versions through the manager's
    HTTP API, `rollout/version_lag` is real, and the lagging tokens are kept out of
    `rollout/logprob_diff`. A group the manager never served is booked as before and
    counted."""

    def book(book: VersionBook) -> None:
        book.record([5, 6], [7, 8, 9], [1, 1, 1])  # vLLM /generate: the env keeps every token
        book.record([5, 6], [7, 10, EOS], [1, 1, 1])  # text re-tokenized: the stop token is gone
        book.record([5, 6], [7, 8], [2, 2])  # a two-turn episode: the first turn
        book.record([5, 6, 7, 8, 11, 12], [13, EOS], [2, 3])  # its second turn, across a swap

    manager.call(book, manager.manager.completions)
    batch = [
        group([[5, 6, 7, 8, 9], [5, 6, 7, 10]], [[X, X, 7, 8, 9], [X, X, 7, 10]]),
        group([[5, 6, 7, 8, 11, 12, 13, EOS]], [[X, X, 7, 8, X, X, 13, EOS]]),
        group([[5, 6, 20, 21]], [[X, X, 20, 21]]),  # served elsewhere
    ]
    rollout, link = atropos_rollout(manager, batch, version=3)
    try:
        groups = list(rollout.generate([], SamplingParams(max_new_tokens=4)))
    finally:
        link.close()
    versions = [[s.weight_versions for s in g.samples] for g in groups]
    assert versions == [[[1, 1, 1], [1, 1]], [[2, 2, 2, 2, 2, 3]], [[3, 3]]]
    lag = version_lag_metrics(groups, 3)
    assert lag["rollout/version_lag/max"] == 2 and lag["rollout/version_lag/mean"] > 1
    assert rollout.stats.metrics()["rollout/unversioned_groups"] == 1
    items = group_items(groups[0], [1.0, -1.0], version=3)
    assert sum(it.num_current_tokens for it in items) == 0  # none measures the engine/trainer mismatch


def test_a_worker_called_directly_books_what_it_serves_and_the_manager_asks_it(manager, tmp_path):
    """atroposlib's vLLM class on a worker's /generate (a real engine at version 0); the
    trainer, two versions on, asks the manager, which asks its workers."""
    with InProcessWorker(_tiny(tmp_path / "model")) as worker:
        register = RegisterRequest(
            worker_id="w1", url=worker.http.url, model_path="m", weight_version=0, max_num_seqs=8, max_model_len=2048
        )
        manager.call(manager.manager.register, register)
        prompt = [1, 5, 6, 7]
        body = {"prompt": {"prompt_token_ids": prompt}, "n": 2, "max_tokens": 6, "logprobs": 0, "ignore_eos": True}
        served = worker.client.post("/generate", json=body).json()["token_ids"]
        tokens = [prompt + ids for ids in served]
        masks = [[X] * len(prompt) + ids for ids in served]
        rollout, link = atropos_rollout(manager, [group(tokens, masks)], version=2)
        try:
            groups = list(rollout.generate([], SamplingParams(max_new_tokens=6)))
        finally:
            link.close()
    assert [s.weight_versions for s in groups[0].samples] == [[0] * 6, [0] * 6]
    assert version_lag_metrics(groups, 2)["rollout/version_lag/mean"] == 2
    assert rollout.stats.metrics()["rollout/unversioned_groups"] == 0
