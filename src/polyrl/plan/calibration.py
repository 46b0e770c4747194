"""The measured rates the fleet model runs on, as one small JSON file.

`polyrl plan calibrate` writes it on the machine it runs on (the engine's decode step
against its batch, its prefill rate, the learner's tokens/s); the GPU benchmarks can
write the same file from their own measurements. Everything is per process at full
speed, alone on its device: what processes cost each other when they share one is
`Placement`'s business, not the calibration's.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DecodePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1)
    step_s: float = Field(gt=0)
    """One decode step of `batch` running sequences (one token each)."""


class Calibration(BaseModel):
    """Rates of one engine and one learner on one kind of device."""

    model_config = ConfigDict(extra="forbid")

    device: str
    """What was measured, in words (`NVIDIA H200, MPS 50%`, `2-core CPU`)."""
    model: str
    """The model the rates are for (its shape or name)."""
    decode: list[DecodePoint] = Field(min_length=1)
    """A worker's decode step against its batch."""
    trainer_decode: list[DecodePoint] | None = None
    """The colocated engine's, when it differs: in the trainer's process, with its threads
    and no HTTP stream (a hybrid or fully asynchronous run's trainer engine is a worker
    process, timed as `decode`); None: as `decode`."""
    decode_context: float = Field(0.0, ge=0)
    """Tokens of context per sequence, on average, while `decode` was timed."""
    decode_kv_s_per_token: float = Field(0.0, ge=0)
    """Decode-step seconds per token of context the batch holds beyond `decode_context`
    per sequence: reading the KV cache, which on a GPU at RL lengths outweighs the weights
    (`calibrate --context`). 0: the step does not depend on context."""
    prefill_tokens_per_s: float = Field(gt=0)
    learner_tokens_per_s: float = Field(gt=0)
    """Forward and backward (with the old log-probs' forward) of prompt and response tokens."""
    learner_compile_s: float = Field(0.0, ge=0)
    """The run's first mini-batch's extra time (compiling, on a GPU): the fleet runs
    ahead meanwhile, and a fully asynchronous run starts with that backlog."""
    optimizer_step_s: float = Field(0.0, ge=0)
    """Fixed cost of each optimizer step (the mini-batch's), beyond the tokens."""
    version_bytes: int = Field(0, ge=0)
    """Bytes a worker pulls for a new version."""
    pull_gbps: float = Field(10.0, gt=0)
    """A worker's pull bandwidth (Gbit/s)."""
    worker_start_s: float = Field(0.0, ge=0)
    """A new worker's time from its start to serving (process, model, graphs): what a
    replacement for a preempted one takes, beyond its launch."""
    swap_s: float = Field(0.0, ge=0)
    """A worker's pause to load a pulled version, between two decode steps."""
    step_overhead_s: float = Field(0.0, ge=0)
    """Per step, outside generation and training: scoring, publishing, bookkeeping."""
    publish_s: float = Field(0.0, ge=0)
    """The trainer's publish of a version for the workers to pull, each step of a run
    with workers (the learner waits for it): the host snapshot, its copy out of the
    device and its checksums. 0.2 s a step at 0.6B on an H200, 6% of an MPS row's step
    (BENCHMARKS.md); `calibrate --served` times it."""
    prefill_step_s: float = Field(0.0, ge=0)
    """What a decode step costs more when it also computes prompt tokens (a new group's
    prefill, a moved sample's re-prefill), beyond those tokens at `prefill_tokens_per_s`:
    on CUDA such a step runs eagerly, outside the captured graphs and the overlap
    (`calibrate --served --context` on a GPU). 0: every step runs alike (a CPU engine)."""
    host_cores: float | None = Field(None, gt=0)
    """Set when every process shares one host's cores (the CPU box): the engines and the
    learner then run slower as their demands add up past this. None: each worker has a
    device of its own and only the trainer's engine shares the learner's."""
    shared_gpu: bool = False
    """Every process (the learner, the trainer's engine, the workers) is a client of one
    GPU, each capped at a share of its SMs (MPS): they run side by side, and cost each
    other what the two factors below say (`calibrate --corun` measures them)."""
    learner_slowdown_per_engine: float = Field(0.0, ge=0)
    """With `shared_gpu`: the learner's work takes (1 + this x engines decoding) of its
    time alone."""
    gpu_clients: float | None = Field(None, gt=0)
    """With `shared_gpu`: how many clients' SM shares the GPU holds (100 over
    `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`: 2 at 50%). With more clients busy while the learner
    trains, each busy client gets its part of them: at most this over the busy clients."""
    engine_slowdown_beside_learner: float = Field(0.0, ge=0)
    """With `shared_gpu`: an engine's decode step takes (1 + this) of its time alone
    while the learner trains (decoding reads memory, training computes: on an H200 under
    MPS at 50% each, 0 and 0.05)."""
    engine_cores: float = Field(1.0, gt=0)
    learner_cores: float = Field(1.0, gt=0)
    """The learner's threads at full speed (shared hosts: torch's intra-op threads)."""
    learner_one_thread_tokens_per_s: float | None = Field(None, gt=0)
    """Shared hosts: the learner's rate on one thread, where the trainer's thread governor
    (`polyrl.cpu_threads`) puts it while the workers hold cores; between one thread and
    `learner_cores` the model interpolates. None: proportional to the threads."""
    stream_cpu_s_per_token: float = Field(0.0, ge=0)
    """Host CPU seconds to read one streamed token (shared hosts only). The model charges it
    twice per token, each on a core of its own: the manager reads each worker's stream as it
    decodes, and the trainer's reader takes each finished group whole, one at a time, before
    the learner has it."""

    @model_validator(mode="after")
    def _sorted(self) -> Calibration:
        for name in ("decode", "trainer_decode"):
            points = getattr(self, name)
            if points is not None:
                points.sort(key=lambda p: p.batch)
                if len({p.batch for p in points}) != len(points):
                    raise ValueError(f"{name}: one point per batch size")
        return self

    def decode_step_s(self, batch: int, trainer: bool = False, context: float | None = None) -> float:
        """Interpolated linearly between measured batches, and beyond the largest along
        the last two points' slope (at least flat). `trainer`: the trainer's own engine.
        `context`: tokens the batch holds in all; its KV reads beyond the calibration's
        own context add `decode_kv_s_per_token` each (fewer take it off, down to a
        quarter of the step)."""
        pts = self.trainer_decode if trainer and self.trainer_decode else self.decode
        if batch <= pts[0].batch or len(pts) == 1:
            step = pts[0].step_s
        else:
            i = bisect.bisect_left([p.batch for p in pts], batch)
            a, b = (pts[i - 1], pts[i]) if i < len(pts) else (pts[-2], pts[-1])
            slope = max(0.0, (b.step_s - a.step_s) / (b.batch - a.batch))
            step = a.step_s + slope * (batch - a.batch)
        if context is None or not self.decode_kv_s_per_token:
            return step
        return max(0.25 * step, step + self.decode_kv_s_per_token * (context - batch * self.decode_context))

    def learner_speed(self, threads: float) -> float:
        """The learner's speed on `threads` threads, as a share of its speed on
        `learner_cores`."""
        full = self.learner_cores
        if threads >= full:
            return 1.0
        one = (self.learner_one_thread_tokens_per_s or self.learner_tokens_per_s / full) / self.learner_tokens_per_s
        if full <= 1:
            return one
        return one + (1.0 - one) * (threads - 1) / (full - 1)

    def pull_s(self) -> float:
        return self.version_bytes * 8 / (self.pull_gbps * 1e9) + self.swap_s

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"calibration file {path}: {e}") from None
