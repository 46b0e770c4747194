"""The worker's edge of its HTTP API: requests (`polyrl.protocol.worker_api`) into the
engine's types, and engine results into response JSON. The server only glues these to
HTTP, so they are tested without one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from polyrl.engine.types import EngineRequest, SampleDelta, SampleResult
from polyrl.httpapi import checksum
from polyrl.protocol.routes import encode_routes, rows_through
from polyrl.protocol.worker_api import FinishReasonInfo, GenerateRequest, GenerateResponse, MetaInfo

SSE_DONE = b"data: [DONE]\n\n"


class WireSamples:
    """The samples of one `/generate` request, numbered as on the wire: prompt after
    prompt, each prompt's samples in order (`GenerateBatchRequest`); a single prompt's are
    numbered 0..n-1. Only admitted prompts get results; a refused one keeps its numbers."""

    def __init__(self, requests: list[EngineRequest], admitted: set[str]) -> None:
        self.offsets: dict[str, int] = {}
        self.results: dict[int, SampleResult] = {}
        """By wire index, the admitted prompts' samples."""
        offset = 0
        for r in requests:
            self.offsets[r.rid] = offset
            if r.rid in admitted:
                for i in range(r.sampling.n):
                    self.results[offset + i] = SampleResult(r.rid, i, len(r.input_ids))
            offset += r.sampling.n

    def apply(self, deltas: list[SampleDelta]) -> set[int]:
        """Accumulate deltas into their samples; the wire indices that changed."""
        touched = set()
        for d in deltas:
            index = self.offsets[d.rid] + d.index
            self.results[index].add(d)
            touched.add(index)
        return touched


def engine_request(body: GenerateRequest, input_ids: list[int]) -> EngineRequest:
    """A `/generate` request for the engine; its rid defaults to a fresh uuid4 hex. Top
    log-probs are SGLang's request-level `top_logprobs_num`, wanted with `return_logprob`."""
    rid = body.rid if body.rid is not None else uuid.uuid4().hex
    top = body.top_logprobs_num if body.return_logprob else 0
    update = {"top_logprobs": top, "return_routed_experts": body.return_routed_experts}
    sampling = body.sampling_params.model_copy(update=update)
    return EngineRequest(rid=rid, input_ids=input_ids, sampling=sampling)


def text_token_ids(result: SampleResult) -> list[int]:
    """The tokens that make up the text: the stop token that ended the sample is trimmed."""
    if result.finish_reason == "stop" and result.matched_stop is not None and result.token_ids:
        return result.token_ids[:-1]
    return result.token_ids


def sample_response(
    result: SampleResult,
    text: str,
    *,
    return_logprob: bool,
    current_version: int,
    with_index: bool,
    start: int = 0,
    index: int | None = None,
) -> dict[str, Any]:
    """One sample as SGLang's /generate reports it: cumulative (also one stream chunk),
    or from token `start` on (an incremental stream chunk; `text` is then the caller's).
    `index`: its number on the wire, when not its index in its request (a batched
    request numbers samples across its prompts)."""
    finish = None
    if result.finish_reason is not None:
        finish = FinishReasonInfo(type=result.finish_reason, matched=result.matched_stop)
    token_ids, versions = result.token_ids[start:], result.weight_versions[start:]
    logprobs = top = None
    if return_logprob:
        logprobs = [(lp, tok, None) for lp, tok in zip(result.logprobs[start:], token_ids, strict=True)]
        if result.top_logprobs:
            top = [[(lp, tok, None) for tok, lp in position] for position in result.top_logprobs[start:]]
    routes = None
    if result.routed_experts:  # rows from the one after the previous chunk's last
        first = 0 if start == 0 else rows_through(result.prompt_tokens, start)
        rows = result.routes_between(first, rows_through(result.prompt_tokens, len(result.token_ids)))
        routes = encode_routes(rows.numpy())
    meta = MetaInfo(
        id=result.rid,
        finish_reason=finish,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(result.token_ids),
        weight_version=result.weight_versions[-1] if result.weight_versions else current_version,
        output_token_weight_versions=versions,
        output_token_logprobs=logprobs,
        output_top_logprobs=top,
        routed_experts=routes,
    )
    index = (result.index if index is None else index) if with_index else None
    response = GenerateResponse(text=text, output_ids=token_ids, meta_info=meta, index=index)
    exclude: dict[str, Any] = {}
    if not with_index:
        exclude["index"] = True
    meta_out = set() if routes is not None else {"routed_experts"}
    if not return_logprob:
        meta_out |= {"output_token_logprobs", "output_top_logprobs"}
    elif top is None:
        meta_out.add("output_top_logprobs")
    if meta_out:
        exclude["meta_info"] = meta_out
    return response.model_dump(mode="json", exclude=exclude)


def sse_event(payload: Any, with_checksum: bool = False) -> bytes:
    """One server-sent event, as SGLang streams them: `data: <json>` and a blank line.
    `with_checksum` (polyrl's incremental streams) puts the JSON's xxh3-64 in an SSE
    comment line first (`: xxh3 <hex>`), which other SSE clients skip."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    head = b": xxh3 " + checksum(data).encode() + b"\n" if with_checksum else b""
    return head + b"data: " + data + b"\n\n"
