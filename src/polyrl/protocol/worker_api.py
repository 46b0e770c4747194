"""Wire models of the worker's HTTP API, for both of its sides: the worker parses its
requests and builds its replies with them, and the manager builds its requests and
parses the replies with the same classes. The API is a subset of SGLang's native one, so a
client written for SGLang's `/generate` works against a polyrl worker and a real SGLang
server can stand in for one.

Requests forbid unknown fields (422 naming the field): a misspelt sampling parameter
silently ignored would change what the trainer learns from. The SGLang fields that only
shape detokenisation (`skip_special_tokens`, ...) are accepted and ignored. Replies
ignore unknown fields. A client sends only the fields it set (`model_dump(
exclude_unset=True)`): polyrl's extensions stay off the wire unless asked for, and a
plain SGLang server refuses fields it does not know.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from polyrl.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams
from polyrl.protocol.version import WeightVersion
from polyrl.transfer.identity import DeviceIdentity, WeightPath

BATCHED_INPUT_MESSAGE = "batched input is token ids only: send input_ids as a list of lists, or one request per text"
MAX_BATCH_PROMPTS = 4096
"""The most prompts in one batched `/generate` (far more than an engine runs at once)."""
FinishReason = Literal["stop", "length", "abort"]


class _Wire(BaseModel):
    """A request: unknown fields are refused (422 naming the field)."""

    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    """A reply: unknown fields are ignored, so a client reads a newer worker's replies
    (or a real SGLang server's, which carry more)."""

    model_config = ConfigDict(extra="ignore")


def _refuse_batched(value: Any) -> Any:
    """SGLang accepts lists of prompts; we refuse them with a message saying what to do
    instead of pydantic's 'Input should be a valid integer' on the inner list."""
    if isinstance(value, list) and any(isinstance(item, list | str) for item in value):
        raise ValueError(BATCHED_INPUT_MESSAGE)
    return value


# ---------------------------------------------------------------------------------- requests


class GenerateRequest(_Wire):
    input_ids: list[int] | None = None
    text: str | None = None
    rid: str | None = None
    """Default: a fresh uuid4 hex. `/abort_request` takes this id."""
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """With `return_logprob`: also the this-many most likely tokens per position
    (`meta_info.output_top_logprobs`, as SGLang's)."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: also each position's experts (`meta_info.routed_experts`,
    as SGLang's)."""
    stream: bool = False
    incremental_stream: bool = False
    """polyrl extension: each stream chunk carries only what is new since the sample's
    previous chunk (tokens, log-probs, versions, text); `completion_tokens` stays the
    running total. Cumulative snapshots cost O(length^2) bytes over a sample's life."""
    stream_interval_s: float = Field(0.0, ge=0, le=5)
    """polyrl extension: at most one chunk per this many seconds (the worker's own
    `worker.stream_interval_s` if longer); a finished sample is sent at once. The reader
    (the manager, in the trainer's process) then parses fewer, bigger chunks."""

    _no_batched_ids = field_validator("input_ids", mode="before")(_refuse_batched)

    @field_serializer("sampling_params")
    def _sglang_sampling(self, params: SamplingParams) -> dict[str, Any]:
        return params.sglang()

    @field_validator("text", "rid", mode="before")
    @classmethod
    def _no_batched_text(cls, value: Any) -> Any:
        if isinstance(value, list):
            raise ValueError(BATCHED_INPUT_MESSAGE)
        return value

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("send exactly one of input_ids and text")
        return self


class GenerateBatchRequest(_Wire):
    """SGLang's batched `/generate`, for token ids: `input_ids` is a list of prompts, each
    with its own `rid` and sampling parameters (one object for all, or a list). Each
    prompt runs as its own request, so `/abort_request` stops one by its rid.

    Samples are numbered across the request in order, prompt after prompt: sample j of
    prompt k has `index` n_0 + ... + n_(k-1) + j in the stream and in the reply, and its
    `meta_info.id` is prompt k's rid. A prompt the engine refuses (invalid, or no room)
    does not stop the others: a stream then carries an error event naming its rid
    (`{"error": {...}, "rid": ...}`), and the request fails only when every prompt is
    refused. The manager sends one of these for the calls it places on a worker at
    once: one HTTP exchange instead of one per call, which on a 2-core box was about
    1.3 cores of an agent run's work."""

    input_ids: list[list[int]] = Field(min_length=1, max_length=MAX_BATCH_PROMPTS)
    rid: list[str] | None = None
    """Default: a fresh uuid4 hex per prompt."""
    sampling_params: SamplingParams | list[SamplingParams] = SamplingParams()
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_routed_experts: bool = False
    stream: bool = False
    incremental_stream: bool = False
    stream_interval_s: float = Field(0.0, ge=0, le=5)

    @field_serializer("sampling_params")
    def _sglang_sampling(self, params: SamplingParams | list[SamplingParams]) -> Any:
        return [p.sglang() for p in params] if isinstance(params, list) else params.sglang()

    @model_validator(mode="after")
    def _one_per_prompt(self) -> GenerateBatchRequest:
        count = len(self.input_ids)
        if self.rid is not None and (len(self.rid) != count or len(set(self.rid)) != count):
            raise ValueError(f"rid must hold {count} distinct ids, one per prompt")
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != count:
            raise ValueError(f"sampling_params must be one object or a list of {count}, one per prompt")
        return self

    def prompts(self) -> list[GenerateRequest]:
        """One single-prompt request per prompt (not validated again)."""
        rids = self.rid or [uuid.uuid4().hex for _ in self.input_ids]
        params = self.sampling_params
        shared = self.model_dump(exclude={"input_ids", "rid", "sampling_params"})
        return [
            GenerateRequest.model_construct(
                input_ids=ids,
                rid=rid,
                sampling_params=params[k] if isinstance(params, list) else params,
                **shared,
            )
            for k, (ids, rid) in enumerate(zip(self.input_ids, rids, strict=True))
        ]


class AbortRequest(_Wire):
    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if bool(self.rid) == self.abort_all:
            raise ValueError('send either {"rid": ...} or {"abort_all": true}')
        return self


class UpdateWeightsFromDiskRequest(_Wire):
    model_path: str
    weight_version: WeightVersion | None = None
    """Default: the current version + 1."""
    load_format: str | None = None
    """Ignored: the directory's `*.safetensors` files are read."""
    abort_all_requests: bool = False
    """Abort in-flight requests (they return partial tokens) before the swap."""


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` and SGLang's `POST /load_lora_adapter`: a PEFT
    adapter directory on the worker's disk, served merged into the base as the next
    weight version (one adapter at a time). Unknown fields (vLLM's `load_inplace`) are
    ignored: a new adapter always replaces the served one."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    weight_version: WeightVersion | None = None
    """polyrl extension; default: the current version + 1."""


class RelaySource(_Wire):
    """Another worker's relay, and the token it checks for this pull."""

    host: str
    port: int = Field(ge=1, le=65535)
    token: str
    tls: bool = False
    """The relay speaks TLS (its worker serves HTTPS): verified against `worker.tls.ca_file`."""


class RelayGrant(_Wire):
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex: the key the relay checks its receivers' tokens with (`transfer.wire.relay_key`)."""
    max_send_gbps: float | None = Field(None, gt=0)
    """The relay's send cap (`manager.transfer.max_send_gbps`); None: none."""


class UpdateWeightsFromPublisherRequest(_Wire):
    """polyrl extension: pull `weight_version` from the trainer's weight publisher
    (`polyrl.transfer`), as a delta against the current version when it can."""

    host: str
    port: int = Field(ge=1, le=65535)
    weight_version: WeightVersion
    token: str
    """The per-transfer secret the manager got from the publisher for this worker."""
    worker_id: str
    """The id the token was granted to."""
    num_streams: int = Field(4, ge=1, le=64)
    timeout_s: float = Field(60.0, gt=0)
    codec: Literal["auto", "raw", "delta", "zstd", "int8"] = "auto"
    """auto: encoded pulls (a delta against the current version, else zstd) only when raw
    pulls have been slow (below ~2 Gbit/s); on a fast link a raw pull is quicker than
    encoding. int8 is LOSSY (opt-in; the worker logs it)."""
    path: WeightPath = "tcp"
    """tcp: pull over the network (with `codec`). On the trainer's host: nccl (its GPU
    broadcasts to ours) or cuda_ipc (our engine is on its GPU); either falls back to tcp
    if it fails. The reply says which path was taken."""
    tls: bool = False
    """The publisher speaks TLS: verify it against `worker.tls.ca_file` (tcp path only)."""
    swap_policy: Literal["recompute", "continue", "abort"] | None = None
    """What the swap does to running requests (`engine.swap_policy`); None: the worker's
    own setting. `continue` is vLLM's `pause_generation(mode="keep")` in one call."""
    relays: list[RelaySource] = []
    """Workers to pull from before the publisher (`host`, `port`), in order: the first,
    then the next when one fails mid-pull, keeping the chunks already checked."""
    relay_grant: RelayGrant | None = None
    """Serve this version on from the worker's own relay, under this grant."""


# --------------------------------------------------------------------------------- responses


class FinishReasonInfo(_Reply):
    type: FinishReason
    matched: int | None = None
    """The stop token id that ended the sample (type "stop"), else null."""


class MetaInfo(_Reply):
    id: str
    finish_reason: FinishReasonInfo | None = None
    """null while a streamed sample is still running."""
    prompt_tokens: int
    completion_tokens: int
    """Every token of the sample so far (an incremental chunk carries only the new ones)."""
    weight_version: WeightVersion = 0
    """Version of the weights that produced the last token (the current one if none)."""
    output_token_weight_versions: list[int] | None = None
    """The version of each output token (polyrl's; always sent by a polyrl worker). A plain
    SGLang server leaves it out: its `weight_version` then stands for the whole response."""
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    """[logprob, token_id, null] per output token; only with `return_logprob`."""
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None
    """Per output token, the `top_logprobs_num` most likely [logprob, token_id, null]."""
    routed_experts: str | None = None
    """With `return_routed_experts`: the experts of prompt + output positions but the last
    (`polyrl.protocol.routes`: base64 int32, row after row, as SGLang's); an incremental
    chunk carries the rows new since the sample's previous chunk."""


class GenerateResponse(_Reply):
    text: str
    """The decoded completion without its final stop token; other special tokens stay."""
    output_ids: list[int]
    """Every generated token, the stop token included (aligned with the log-probs)."""
    meta_info: MetaInfo
    index: int | None = None
    """Sample index, present when n > 1 and in every stream chunk."""


class AbortResponse(_Reply):
    num_aborted: int


class UpdateWeightsResponse(_Reply):
    success: bool
    message: str
    weight_version: WeightVersion | None = None
    path: WeightPath | None = None
    """How a publisher pull came (tcp after a failed GPU path, too); None: nothing pulled."""
    device: DeviceIdentity | None = None
    """Where this worker's engine is: the manager offers the GPU paths on its next sync
    when this is the trainer's host."""


class ServerInfo(_Reply):
    worker_id: str
    state: Literal["active", "draining"]
    model_path: str
    weight_version: WeightVersion
    num_running_reqs: int
    num_queued_reqs: int
    gen_throughput: float
    num_generated_tokens: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the engine's prefix cache since start."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose KV the cache held."""
    num_steps: int = 0
    """The engine's forward steps since start."""
    num_prefill_steps: int = 0
    """Of those, the steps that computed prompt tokens; on CUDA they run eagerly, outside
    the captured decode graphs, and cost a batch more than a decode step does."""
    num_prompt_tokens: int = 0
    """Prompt tokens the engine computed since start (prefix-cache hits excluded; a moved
    sample's re-prefill included)."""
    max_total_num_tokens: int
    kv_cache_usage: float = 0.0
    """The share of the KV cache's blocks in use now, 0-1 (vLLM's `kv_cache_usage_perc`
    metric): with `num_running_reqs`, the context the batch holds, which sets a decode
    step's cost at RL lengths."""
    max_model_len: int
    max_num_seqs: int


class ModelInfo(_Reply):
    model_path: str
    is_generation: bool = True
