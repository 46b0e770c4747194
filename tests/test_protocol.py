"""The manager->worker wire: one set of models (`polyrl.protocol.worker_api`) on both
sides, and no request body the manager builds by hand."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from polyrl.engine.types import SampleResult
from polyrl.manager import backends, weight_sync
from polyrl.manager.backends import Delta, GenerationCall, WorkerFailed, generate_body, parse_chunk
from polyrl.protocol import worker_api
from polyrl.protocol.sampling import SamplingParams
from polyrl.worker import server
from polyrl.worker.protocol import sample_response

MANAGER = Path(__file__).resolve().parents[1] / "src" / "polyrl" / "manager"


def test_both_sides_of_the_worker_api_use_the_same_classes() -> None:
    assert server.GenerateRequest is backends.GenerateRequest is worker_api.GenerateRequest
    assert server.GenerateBatchRequest is backends.GenerateBatchRequest is worker_api.GenerateBatchRequest
    for name in ("UpdateWeightsFromPublisherRequest", "UpdateWeightsFromDiskRequest", "UpdateWeightsResponse"):
        assert getattr(server, name) is getattr(weight_sync, name) is getattr(worker_api, name), name


def test_no_manager_request_body_is_a_dict_literal() -> None:
    """A body passed to an HTTP call (`json=`, `content=`, `data=`), held in a variable
    called `body` or built by a `*_body` function under manager/ is never a dict literal."""
    found = []
    for path in sorted(MANAGER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                found += [
                    f"{path.name}:{node.lineno}"
                    for kw in node.keywords
                    if kw.arg in ("json", "content", "data") and isinstance(kw.value, ast.Dict)
                ]
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{path.name}:{node.lineno}" for t in targets if isinstance(t, ast.Name) and t.id == "body"]
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_body"):
                found += [
                    f"{path.name}:{n.lineno}"
                    for n in ast.walk(node)
                    if isinstance(n, ast.Assign | ast.AnnAssign | ast.Return) and isinstance(n.value, ast.Dict)
                ]
    assert not found, found


def test_a_batched_request_parses_back_into_each_calls_own_request() -> None:
    calls = [
        GenerationCall("a", [1, 2], SamplingParams(max_new_tokens=4, n=2, seed=5)),
        GenerationCall("b", [3], SamplingParams(max_new_tokens=9, n=1, seed=8, temperature=0.5)),
    ]
    sent = worker_api.GenerateBatchRequest.model_validate_json(backends.generate_batch_body(calls, 0.05))
    assert sent.stream and sent.incremental_stream and sent.return_logprob and sent.stream_interval_s == 0.05
    for call, prompt in zip(calls, sent.prompts(), strict=True):
        assert (prompt.rid, prompt.input_ids) == (call.rid, call.input_ids)
        assert prompt.sampling_params == call.sampling and prompt.incremental_stream


def test_calls_are_cut_into_requests_by_count_and_by_prompt_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "MAX_CALLS_PER_REQUEST", 3)
    monkeypatch.setattr(backends, "MAX_TOKENS_PER_REQUEST", 10)
    calls = [GenerationCall(str(k), [1] * size, SamplingParams()) for k, size in enumerate([2, 2, 2, 2, 9, 4, 30, 1])]
    assert backends._requests_of(list(range(8)), calls) == [[0, 1, 2], [3], [4], [5], [6], [7]]


@pytest.mark.parametrize(
    ("code", "error"),
    [("429", backends.WorkerBusy), ("400", backends.RequestRefused), ("500", backends.WorkerFailed)],
)
def test_a_batched_streams_refusal_of_one_call_is_that_calls_error(code: str, error: type) -> None:
    event = json.dumps({"error": {"message": "no", "type": "x", "code": code}, "rid": "c7"})
    rid, raised = backends._call_refusal(event)  # type: ignore[misc]
    assert rid == "c7" and type(raised) is error and "no" in str(raised)
    assert backends._call_refusal(json.dumps({"error": {"message": "engine died"}})) is None  # the whole stream's


def test_a_generate_request_carries_only_what_the_manager_set() -> None:
    """Fields left at their defaults stay off the wire (a plain SGLang server refuses
    polyrl's extensions), and what is sent parses back into the same request."""
    call = GenerationCall("r1", [1, 2, 3], SamplingParams(max_new_tokens=9, top_k=5, top_logprobs=2, n=3, seed=11))
    raw = generate_body(call, incremental=False)
    sent = json.loads(raw)
    assert "incremental_stream" not in sent and "stream_interval_s" not in sent and "text" not in sent
    assert sent["top_logprobs_num"] == 2 and sent["sampling_params"]["top_k"] == 5
    assert sent["sampling_params"]["max_new_tokens"] == 9 and sent["sampling_params"]["sampling_seed"] == 11
    assert "top_logprobs" not in sent["sampling_params"] and "seed" not in sent["sampling_params"]  # SGLang's names
    again = worker_api.GenerateRequest.model_validate_json(raw)
    assert again.sampling_params == call.sampling.model_copy(update={"top_logprobs": 0})
    assert again.input_ids == [1, 2, 3] and again.top_logprobs_num == 2


def test_what_the_worker_streams_the_manager_reads_back() -> None:
    """The worker's chunk builder and the manager's parser agree: tokens, log-probs, each
    token's version, top log-probs, the finish; an incremental chunk continues the count."""
    result = SampleResult(
        "r",
        1,
        4,
        token_ids=[5, 6, 7],
        logprobs=[-0.1, -0.2, -0.3],
        weight_versions=[2, 2, 3],
        finish_reason="stop",
        matched_stop=7,
        top_logprobs=[[(5, -0.1)], [(6, -0.2)], [(7, -0.3)]],
    )
    seen: dict[int, int] = {}
    first = sample_response(result, "", return_logprob=True, current_version=3, with_index=True, start=0)
    first["output_ids"], first["meta_info"]["finish_reason"] = first["output_ids"][:2], None
    for key in ("output_token_weight_versions", "output_token_logprobs", "output_top_logprobs"):
        first["meta_info"][key] = first["meta_info"][key][:2]
    first["meta_info"]["completion_tokens"] = 2
    delta = parse_chunk(json.dumps(first), seen, incremental=True)
    assert delta == Delta(1, [5, 6], [-0.1, -0.2], [2, 2], None, [[(5, -0.1)], [(6, -0.2)]]) and seen == {1: 2}
    rest = sample_response(result, "", return_logprob=True, current_version=3, with_index=True, start=2)
    delta = parse_chunk(json.dumps(rest).encode(), seen, incremental=True)
    assert delta == Delta(1, [7], [-0.3], [3], "stop", [[(7, -0.3)]]) and seen == {1: 3}


def test_the_manager_reads_a_plain_sglang_chunk_and_names_what_is_wrong() -> None:
    plain = {
        "text": "ab",
        "output_ids": [4, 9],
        "meta_info": {
            "id": "x",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": 5,
            "finish_reason": {"type": "length", "length": 2},
            "e2e_latency": 0.1,
            "output_token_logprobs": [[-1.0, 4, None], [-2.0, 9, None]],
        },
    }
    assert parse_chunk(json.dumps(plain), {}, incremental=False) == Delta(0, [4, 9], [-1.0, -2.0], [5, 5], "length", [])
    with pytest.raises(WorkerFailed, match="worker reported: engine died"):
        parse_chunk(json.dumps({"error": {"message": "engine died", "type": "internal"}}), {}, incremental=True)
    with pytest.raises(WorkerFailed, match="unreadable stream chunk"):
        parse_chunk(b'{"text": "a", "output_ids": [1', {}, incremental=True)
    plain["meta_info"]["finish_reason"] = {"type": "exploded"}
    with pytest.raises(WorkerFailed, match="unreadable stream chunk"):
        parse_chunk(json.dumps(plain), {}, incremental=False)
    plain["meta_info"]["finish_reason"] = None
    plain["meta_info"]["output_token_logprobs"] = [[-1.0, 4, None]]
    with pytest.raises(WorkerFailed, match="2 tokens, 1 log-probs"):
        parse_chunk(json.dumps(plain), {}, incremental=False)


def test_a_weight_version_is_a_non_negative_int64_and_keeps_its_wire_name() -> None:
    from pydantic import ValidationError

    from polyrl.protocol.manager_api import DueGroupsRequest, Heartbeat, PublishVersion

    assert PublishVersion(version=2**63 - 1).model_dump() == {"version": 2**63 - 1, "on_device": False}
    beat = {"state": "active", "num_running": 0, "num_waiting": 0, "gen_throughput": 0.0}
    assert Heartbeat(weight_version=3, **beat).model_dump()["weight_version"] == 3
    for bad in (-1, 2**63):
        with pytest.raises(ValidationError):
            PublishVersion(version=bad)
        with pytest.raises(ValidationError):
            Heartbeat(weight_version=bad, **beat)
        with pytest.raises(ValidationError):
            worker_api.UpdateWeightsFromDiskRequest(model_path="m", weight_version=bad)
    assert DueGroupsRequest(max_floor_version=-2).max_floor_version == -2  # v0 less a staleness of 2


def test_one_sampling_class_reads_sglang_spellings_and_refuses_the_rest() -> None:
    """SGLang's -1 for top_k off and `sampling_seed` read as the one convention (0, `seed`);
    its detokenisation-only fields are dropped; a conflict, an unknown field or a value
    beyond the wire's int64 is refused as the body is parsed."""
    from pydantic import ValidationError

    sglang = {"top_k": -1, "sampling_seed": 4, "skip_special_tokens": True, "max_new_tokens": 7}
    assert SamplingParams.model_validate(sglang) == SamplingParams(seed=4, max_new_tokens=7)
    assert SamplingParams.model_validate({"seed": 4, "sampling_seed": 4}).seed == 4
    for bad in ({"seed": 4, "sampling_seed": 5}, {"top_k_typo": 3}, {"stop_token_ids": [2**63]}, {"top_k": -2}):
        with pytest.raises(ValidationError):
            SamplingParams.model_validate(bad)
    params = SamplingParams(top_k=0, seed=9, top_logprobs=3, min_p=0.0)
    assert params.sglang() == {
        **params.model_dump(exclude={"seed", "top_logprobs", "min_p", "return_routed_experts"}),
        "top_k": -1,
        "stop_token_ids": [],
        "sampling_seed": 9,
    }
    assert SamplingParams.model_validate(params.sglang()) == params.model_copy(update={"top_logprobs": 0})
