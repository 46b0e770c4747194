"""The rollout manager's API, for both of its sides: the messages between a rollout worker
and the manager (protocol version 1), and the trainer-facing batch API below.

Worker endpoints, all `POST` with `Authorization: Bearer <token>`:

* `{manager}/v1/workers/register`              RegisterRequest -> RegisterResponse
* `{manager}/v1/workers/{worker_id}/heartbeat` Heartbeat (404: the manager forgot the worker,
  which registers again)
* `{manager}/v1/workers/{worker_id}/leave`     LeaveRequest

Every model forbids unknown fields, so a worker and a manager of different versions fail
on the first message with a 422 naming the field instead of misreading each other.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.version import WeightVersion

PROTOCOL_VERSION = 1

WorkerLifecycleState = Literal["active", "draining"]
"""What a worker says about itself in a heartbeat."""

Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
"""Integers on the wire fit an int64. Python's `int` has no bound: a 400-digit version
or count passed it, then broke where it met a float (a worker's load when work is
placed, the metrics) long after the request was answered."""
Count = Annotated[int, Field(ge=0, lt=2**63)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
"""JSON parsers here accept Infinity and NaN; no field means them."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Message):
    protocol_version: Literal[1] = PROTOCOL_VERSION
    worker_id: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@-]+$")
    url: str = Field(max_length=2048)
    """Where the manager reaches the worker's HTTP API: http(s)://host:port."""
    model_path: str
    weight_version: WeightVersion
    max_num_seqs: int = Field(ge=1, lt=2**63)
    max_model_len: int = Field(ge=1, lt=2**63)
    capabilities: list[str] = []
    """Extensions beyond SGLang's API the worker speaks: "incremental_stream" (chunks carry
    only what is new), "batched_generate" (many calls in one `/generate`, each with its
    own rid, errors and abort: `GenerateBatchRequest`)."""
    usd_per_hour: Finite | None = Field(None, ge=0)
    """What the worker costs, for the trainer's cost accounting (None: the trainer's default)."""
    device: str | None = Field(None, max_length=256)
    """What the worker generates on, e.g. "cuda:0 NVIDIA H100 80GB HBM3" or "cpu" (shown
    to operators; optional, so workers that predate it still register)."""
    node: str | None = Field(None, max_length=256)
    """The machine the worker runs on (hostname, or its Ray node)."""
    instance_type: str | None = Field(None, max_length=256)
    """The machine's kind (e.g. "g6e.xlarge"), for costs per node type."""
    pid: int | None = Field(None, ge=1, lt=2**63)
    log_path: str | None = Field(None, max_length=4096)
    """The worker's process id and log file on its node, so that an operator can find the
    process (None: not given, or its output is no file)."""
    relay_port: int | None = Field(None, ge=1, le=65535)
    """Where the worker serves the versions it holds to other workers (`transfer/relay.py`;
    the host is its URL's, TLS when the URL is https); None: it does not."""
    local: bool = False
    """The trainer's own engine (`polyrl worker --local`, on the trainer's device): the
    manager registers it as `local` and uses it only in the local window, when no other
    worker is left, or for a batch stalled past `local_fallback_s`."""

    @model_validator(mode="after")
    def _local_id_reserved(self) -> RegisterRequest:
        if self.worker_id == LOCAL_WORKER_ID and not self.local:
            raise ValueError(f"worker_id: {LOCAL_WORKER_ID!r} is reserved for the trainer's own engine")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parsed = urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) URL with a host: {value!r}")
        try:
            parsed.port  # noqa: B018 - raises on a bad port
        except ValueError as e:
            raise ValueError(f"bad port in {value!r}: {e}") from None
        return value


class RegisterResponse(_Message):
    worker_id: str
    """The id to use from now on (the manager may keep the proposed one or assign another)."""
    heartbeat_interval_s: float | None = Field(None, gt=0)
    """None: the worker keeps its configured interval."""


class Heartbeat(_Message):
    state: WorkerLifecycleState
    weight_version: WeightVersion
    num_running: Count
    num_waiting: Count
    gen_throughput: Finite
    """Generated tokens/s over the engine's recent window."""


class LeaveRequest(_Message):
    reason: str


# ------------------------------------------------------------------ trainer-facing batch API
#
# `POST {manager}/v1/batches` takes a BatchRequest and answers NDJSON: one GroupResult line
# per prompt as soon as its last sample finishes (completion order), then one BatchEnd
# line. A failed batch ends with a BatchFailed line instead; a stream that stops without
# either was cut, and the client treats it as a failure. In-process,
# `RolloutManager.generate` yields the same GroupResult objects and raises BatchError.

WorkerState = Literal["registering", "standby", "syncing", "active", "draining", "gone"]
"""`standby`: the trainer's own engine (the `local` worker) behind the latest version in a
run with no local window; it is synced only once placement needs it (registry.py)."""


class BatchPrompt(_Message):
    id: str = Field(min_length=1, max_length=256)
    """The client's name for the prompt, returned with its group."""
    input_ids: list[Int64] = Field(min_length=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Sample i uses seed + i wherever it runs, so a migrated sample continues the same
    random stream. Default: the batch's `sampling.seed`, else drawn by the manager."""
    max_new_tokens: int | None = Field(None, ge=1, lt=2**63)
    """This prompt's own token budget per sample, at most the batch's
    `sampling.max_new_tokens` (default: that)."""
    session: str | None = Field(None, max_length=256)
    """A conversation the prompt continues (an agent episode): it goes to the worker that
    served the session's last prompt, whose prefix cache holds the conversation so far,
    when that worker serves the batch's version and has a free slot; anywhere else
    otherwise (SGLang's routers call this cache-aware routing)."""


class BatchRequest(_Message):
    prompts: list[BatchPrompt] = Field(min_length=1)
    sampling: SamplingParams
    """How every sample is drawn; `sampling.n` samples per prompt (the GRPO group size).
    A prompt's own seed and budget, when it has them, replace the batch's."""
    min_weight_version: WeightVersion | None = None
    """Only workers at this weight version or newer serve the batch. Default: the
    manager's latest version at submission."""
    deadline_s: Finite | None = Field(None, gt=0)
    """Default: manager.batch_deadline_s."""

    @model_validator(mode="after")
    def _unique_ids(self) -> BatchRequest:
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"prompt ids must be unique; {dup!r} repeats")
        cap = self.sampling.max_new_tokens
        over = next((p for p in self.prompts if p.max_new_tokens is not None and p.max_new_tokens > cap), None)
        if over is not None:
            raise ValueError(f"prompt {over.id!r}: max_new_tokens {over.max_new_tokens} exceeds the batch's {cap}")
        return self


class Segment(_Message):
    """A run of consecutive tokens of one sample produced by one worker."""

    worker: str
    num_tokens: int


class SampleResultOut(_Message):
    index: int
    output_ids: list[int]
    """Every generated token, the stop token included (aligned with `logprobs`)."""
    logprobs: list[float]
    """Behaviour log-probs: log softmax(logits / temperature), before top-p/top-k."""
    finish_reason: Literal["stop", "length"]
    weight_versions: list[int]
    """The weight version that produced each token."""
    segments: list[Segment]
    """Which workers produced the tokens, in order; more than one when it migrated."""
    num_failures: int
    """Worker failures this sample survived."""
    queue_time_s: float
    """Submission to first placement."""
    latency_s: float
    """Submission to the last token."""
    routed_experts: str | None = None
    """With `sampling.return_routed_experts`: the experts of every position of prompt +
    output but the last (`polyrl.protocol.routes`); None when a worker reported none."""


class GroupResult(_Message):
    type: Literal["group"] = "group"
    prompt_id: str
    prompt_tokens: int
    samples: list[SampleResultOut]


class BatchEnd(_Message):
    type: Literal["end"] = "end"
    batch_id: str
    num_groups: int
    num_migrated: int
    """Sample moves to another worker (failures and hand-backs)."""
    elapsed_s: float


BatchFailureKind = Literal["deadline", "retry_budget", "invalid_request", "cancelled", "shutdown", "disconnected"]
"""`disconnected` is only raised by clients: the stream was cut before its last line."""


class BatchFailed(_Message):
    type: Literal["error"] = "error"
    batch_id: str
    kind: BatchFailureKind
    message: str


class BatchError(RuntimeError):
    """A batch ended without all its groups; `str()` says why and what is left."""

    def __init__(self, failure: BatchFailed) -> None:
        super().__init__(failure.message)
        self.failure = failure

    @property
    def kind(self) -> BatchFailureKind:
        return self.failure.kind


# ---------------------------------------------------------------------- status and versions


class WorkerInfo(_Message):
    worker_id: str
    url: str
    state: WorkerState
    weight_version: WeightVersion
    num_running: int
    num_waiting: int
    num_inflight: int
    """Samples this manager has on the worker now."""
    gen_throughput: float
    """Generated tokens/s, as the worker last reported."""
    joined_at: float
    """Unix time of registration."""
    last_heartbeat_age_s: float
    num_failures: int
    idle_s: float = 0.0
    """Seconds since registration that the worker was syncing or active with none of this
    manager's samples to run."""
    usd_per_hour: float | None = None
    node: str | None = None
    instance_type: str | None = None
    pid: int | None = None
    log_path: str | None = None
    """The process and its log file on `node` (as the worker registered them)."""


class LocalWindowReport(_Message):
    """The latest local window (hybrid mode): how long it was open and what closed it."""

    open_s: float
    closed_by: str


class LostWorker(_Message):
    """A worker that went without leaving: killed, crashed, cut off, silent."""

    worker_id: str
    lost_at: float
    """Unix time."""
    why: str
    num_samples: int
    """This manager's samples in flight on it then (any client's): they move to other workers."""


MAX_LOST_WORKERS = 16
"""How many of the latest lost workers a WorkerList names (it counts them all)."""


class WorkerList(_Message):
    latest_weight_version: WeightVersion
    workers: list[WorkerInfo]
    last_window: LocalWindowReport | None = None
    sync_s: dict[str, float] = {}
    """Worker id -> seconds from publishing the latest version to the worker serving it."""
    num_free_slots: int = 0
    """Samples the remote workers (active, or syncing and about to serve again) could
    start beyond what they run and what waits for them: room the trainer leaves unused."""
    num_migrations: int = 0
    """Sample moves to another worker since the manager started, for every client: the
    trainer's batches and the OpenAI/vLLM requests of environments (Atropos)."""
    num_lost_workers: int = 0
    """Workers gone without leaving since the manager started."""
    lost_workers: list[LostWorker] = Field([], max_length=MAX_LOST_WORKERS)
    """The latest of them, oldest first."""


class PublishVersion(_Message):
    """`POST {manager}/v1/weights/version`: the trainer has weights `version`; new batches
    need it by default and workers below it go to `syncing`."""

    version: WeightVersion
    on_device: bool = False
    """The trainer also holds `version` on its GPU, for same-host workers (NCCL, CUDA IPC)."""


class FleetDecision(BaseModel):
    """`POST {manager}/v1/fleet/decisions`: the trainer's autoscaler changed the fleet's
    size (`fleet.autoscale`), with why; the operator page lists the latest ones."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(ge=0)
    """The fleet's size when it decided."""
    target: int = Field(ge=0)
    reason: str = Field(max_length=1000)
    t: float = 0.0
    """Unix time, set by the manager when it arrives."""


class LearnerWaiting(_Message):
    """`POST {manager}/v1/learner_waiting`: the trainer's learner waits for groups; in
    hybrid fully asynchronous training the local window opens, and the unfinished samples
    of `prompt_ids` (groups the step cannot do without) move to the trainer's engine."""

    prompt_ids: list[str] = Field([], max_length=65536)


class DueGroupsRequest(_Message):
    """`POST {manager}/v1/groups/due`: which unfinished groups may hold a token of weight
    version `max_floor_version` or older (the trainer's staleness deadline)."""

    max_floor_version: Int64
    """The trainer's version less `rollout.max_staleness`: below 0 early in a run, so no
    `WeightVersion`."""


class DueGroups(_Message):
    prompt_ids: list[str]
    """The groups' prompt ids, over every open batch; a group counts once any of its
    samples was placed on a worker at that version or older."""


class PublisherEndpoint(_Message):
    """`POST {manager}/v1/publisher`: the trainer's weight publisher. The manager tells each
    worker that needs a version where to pull it, with a token made from `key` for that
    worker and version. Sent by the trainer on every (re)connection; it replaces the last."""

    groups: list[tuple[str, int]] = Field(min_length=1, max_length=64)
    """(host, port) that workers connect to, per publisher group."""
    key: str = Field(pattern=r"^[0-9a-f]{32,128}$")
    """The publisher's HMAC key, hex (the manager's API is authenticated)."""
    device_host_id: str | None = Field(None, max_length=256)
    device_gpu_uuid: str | None = Field(None, max_length=256)
    """Where the trainer holds versions on a GPU (None: it holds none there)."""
    tls: bool = False
    """The publisher speaks TLS only (`manager.transfer.tls`); workers are told so."""
