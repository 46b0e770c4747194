"""Messages between a rollout worker and the rollout manager (protocol version 1).

Endpoints, all `POST` with `Authorization: Bearer <token>`:

* `{manager}/v1/workers/register`              RegisterRequest -> RegisterResponse
* `{manager}/v1/workers/{worker_id}/heartbeat` Heartbeat (404: the manager forgot the worker,
  which registers again)
* `{manager}/v1/workers/{worker_id}/leave`     LeaveRequest

Every model forbids unknown fields, so a worker and a manager of different versions fail
on the first message with a 422 naming the field instead of misreading each other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1

WorkerLifecycleState = Literal["active", "draining"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Message):
    protocol_version: Literal[1] = PROTOCOL_VERSION
    worker_id: str
    url: str
    """Where the manager reaches the worker's HTTP API."""
    model_path: str
    weight_version: int
    max_num_seqs: int
    max_model_len: int


class RegisterResponse(_Message):
    worker_id: str
    """The id to use from now on (the manager may keep the proposed one or assign another)."""
    heartbeat_interval_s: float | None = Field(None, gt=0)
    """None: the worker keeps its configured interval."""


class Heartbeat(_Message):
    state: WorkerLifecycleState
    weight_version: int
    num_running: int
    num_waiting: int
    gen_throughput: float
    """Generated tokens/s over the engine's recent window."""


class LeaveRequest(_Message):
    reason: str
