"""What every part of the worker's API shares: its engine, tokenizer, identity and lifecycle.

Its own module, below the app (`server.py`) and the OpenAI- and vLLM-compatible backend
(`inference.py`) that both read it, so neither imports the other for it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.types import RequestError, SampleResult
from polyrl.httpapi import ApiError
from polyrl.inference.versions import VersionBook
from polyrl.protocol.worker_api import GenerateRequest, ServerInfo
from polyrl.transfer.relay import Relay
from polyrl.worker.protocol import text_token_ids
from polyrl.worker.weight_sync import WeightReceiver

LifecycleState = Literal["active", "draining"]


class WorkerState:
    """Everything the handlers share: the engine, the tokenizer, identity and lifecycle.

    `shutdown_requested` is set by POST /shutdown and by the signal handlers; the process
    owner (`run_worker`) waits on it and runs the drain.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        model_path: str,
        worker_id: str,
        tokenizer: Any | None,
        block_size: int,
        max_num_seqs: int,
        health_timeout_s: float = 10.0,
        token: str | None = None,
        stream_interval_s: float = 0.0,
        ca_file: str | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.engine = engine
        self.relay = relay
        """Serves the versions this worker pulls to other workers (`transfer/relay.py`)."""
        self.ca_file = ca_file
        """What a TLS publisher's certificate is verified against (`worker.tls.ca_file`)."""
        self.token = token
        """Required (as a bearer token) by the endpoints that act: generate, abort, load
        weights, shut down. A worker with a manager shares the manager's token; without
        one (standalone, loopback) it is open, as an SGLang server is."""
        self.model_path, self.worker_id, self.tokenizer = model_path, worker_id, tokenizer
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.health_timeout_s = health_timeout_s
        self.stream_interval_s = stream_interval_s
        """The least time between two chunks of one streamed generation (see WorkerConfig)."""
        self.lifecycle: LifecycleState = "active"
        self.shutdown_requested = asyncio.Event()
        self.shutdown_reason = ""
        self.num_open_generates = 0
        """/generate responses not yet fully sent; the drain waits for them to flush."""
        self.weight_receiver = WeightReceiver(engine, relay=relay)
        self.lora_name: str | None = None
        """The adapter loaded by name (`/v1/load_lora_adapter`), served merged; requests may
        name it as their model."""
        self.completions = VersionBook()
        """The completions served on the OpenAI/vLLM routes with their tokens' versions
        (an Atropos environment calling this worker directly); the manager asks for them
        on the trainer's behalf (`inference/versions.py`)."""

    @property
    def weight_version(self) -> int:
        return self.engine.engine.weight_version

    def request_shutdown(self, reason: str) -> None:
        """Refuse new work at once; `run_worker` sees the event and drains."""
        self.lifecycle = "draining"
        self.shutdown_reason = self.shutdown_reason or reason
        self.shutdown_requested.set()

    def require_active(self) -> None:
        if self.lifecycle != "active":
            raise ApiError(503, "worker is draining; send the request to another worker", "draining")

    def prompt_ids(self, body: GenerateRequest) -> list[int]:
        if body.input_ids is not None:
            return body.input_ids
        if self.tokenizer is None:
            raise RequestError("this worker has no tokenizer: send input_ids instead of text")
        return list(self.tokenizer(body.text)["input_ids"])

    def decode(self, result: SampleResult) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(text_token_ids(result), skip_special_tokens=False)

    def server_info(self) -> ServerInfo:
        stats = self.engine.stats()
        return ServerInfo(
            worker_id=self.worker_id,
            state=self.lifecycle,
            model_path=self.model_path,
            weight_version=stats.weight_version,
            num_running_reqs=stats.num_running,
            num_queued_reqs=stats.num_waiting,
            gen_throughput=stats.gen_throughput,
            num_generated_tokens=stats.num_generated_tokens,
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_steps=stats.num_steps,
            num_prefill_steps=stats.num_prefill_steps,
            num_prompt_tokens=stats.num_prompt_tokens,
            max_total_num_tokens=stats.num_total_blocks * self.block_size,
            kv_cache_usage=1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0,
            max_model_len=self.engine.engine.max_model_len,
            max_num_seqs=self.max_num_seqs,
        )
