"""The manager->worker wire: one set of models (`polyrl.protocol.worker_api`) on both
sides, and no request body the manager builds by hand."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from polyrl.manager import backends, weight_sync
from polyrl.manager.backends import GenerationCall, generate_body
from polyrl.manager.protocol import BatchSampling
from polyrl.protocol import worker_api
from polyrl.worker import server

MANAGER = Path(__file__).resolve().parents[1] / "src" / "polyrl" / "manager"


def test_both_sides_of_the_worker_api_use_the_same_classes() -> None:
    assert server.GenerateRequest is backends.GenerateRequest is worker_api.GenerateRequest
    for name in ("UpdateWeightsFromPublisherRequest", "UpdateWeightsFromDiskRequest", "UpdateWeightsResponse"):
        assert getattr(server, name) is getattr(weight_sync, name) is getattr(worker_api, name), name


def test_no_manager_request_body_is_a_dict_literal() -> None:
    """A body passed to an HTTP call (`json=`, `content=`, `data=`), held in a variable
    called `body` or built by a `*_body` function under manager/ is never a dict literal."""
    found = []
    for path in sorted(MANAGER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                found += [f"{path.name}:{node.lineno}" for kw in node.keywords
                          if kw.arg in ("json", "content", "data") and isinstance(kw.value, ast.Dict)]  # fmt: skip
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{path.name}:{node.lineno}" for t in targets if isinstance(t, ast.Name) and t.id == "body"]
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_body"):
                found += [f"{path.name}:{n.lineno}" for n in ast.walk(node)
                          if isinstance(n, ast.Assign | ast.AnnAssign | ast.Return) and isinstance(n.value, ast.Dict)]  # fmt: skip
    assert not found, found


def test_a_generate_request_carries_only_what_the_manager_set() -> None:
    """Fields left at their defaults stay off the wire (a plain SGLang server refuses
    polyrl's extensions), and what is sent parses back into the same request."""
    call = GenerationCall("r1", [1, 2, 3], num_samples=3, seed=11, remaining_tokens=9,
                          sampling=BatchSampling(max_new_tokens=20, top_k=5, top_logprobs=2))  # fmt: skip
    raw = generate_body(call, incremental=False)
    sent = json.loads(raw)
    assert "incremental_stream" not in sent and "stream_interval_s" not in sent and "text" not in sent
    assert sent["top_logprobs_num"] == 2 and sent["sampling_params"]["top_k"] == 5
    assert sent["sampling_params"]["max_new_tokens"] == 9  # the call's remaining budget, not the batch's
    again = worker_api.GenerateRequest.model_validate_json(raw)
    assert again.sampling_params.sampling_seed == 11 and again.sampling_params.n == 3 and again.input_ids == [1, 2, 3]
