"""The embedded continuous-batching engine: requests in, per-step sample deltas out.

Single-threaded by design: `step()` schedules one batch, runs one forward, samples, and
returns what each sample gained. `AsyncEngine` drives it from its own thread for the
HTTP worker; the trainer's local rollout calls `step()` directly.

On CUDA, decode steps overlap the host: a step launches the next decode, fed on the
device with the tokens the previous one sampled, before reading the previous one back and
turning it into deltas. The GPU never waits for the Python that schedules it; a sample
that stopped costs one wasted row in the step already launched. `step()` then returns the
deltas of the step before the one it launched.

Weight hot-swap (`update_weights`) happens between steps. Every generated token records
the version that produced it. What happens to requests in flight is `swap_policy`:
* recompute (default): their KV cache is dropped and recomputed under the new weights,
  so every token after the swap comes from exactly the new model;
* continue: they keep the KV computed by the old weights (cheapest; PipelineRL-style);
* abort: running samples finish with reason "abort" and their partial tokens, for the
  caller to resume elsewhere; queued requests are untouched.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from polyrl.config import EngineConfig, SwapPolicy
from polyrl.cpu_threads import measured
from polyrl.engine import fp8, projections
from polyrl.engine.block_manager import BlockManager, cdiv
from polyrl.engine.fp8 import Fp8Layer
from polyrl.engine.lora import AdapterMerger, base_fingerprint, is_adapter_version, unpack
from polyrl.engine.model_runner import ModelRunner, num_kv_blocks_for
from polyrl.engine.sampler import SamplingBatch, sample, top_logprobs
from polyrl.engine.scheduler import ScheduledSeq, Scheduler
from polyrl.engine.sequence import SeqStatus, Sequence
from polyrl.engine.types import EngineRequest, EngineStats, RequestError, SampleDelta
from polyrl.gc_heap import freeze_gc_heap
from polyrl.protocol.sampling import MAX_TOP_LOGPROBS

log = logging.getLogger(__name__)

MAX_SEED = 2**63
MAX_TOP_K = 2**63
"""top_k travels to the sampler in an int64 tensor; a larger value would overflow it
inside the engine loop (and stop the loop) instead of being refused here."""
MIN_TEMPERATURE = 1e-6
"""Below this, logits / temperature can overflow float32 and the log-probs come out
NaN; 0 is greedy."""
THROUGHPUT_WINDOW_S = 10.0


@dataclass
class InFlightStep:
    """A decode step launched on the device and not yet read back."""

    seqs: list[Sequence]
    token_ids: torch.Tensor  # [S] on the device: what a chained step feeds
    host: torch.Tensor  # [2, S] float64 token ids and log-probs, copied asynchronously
    done: torch.cuda.Event | None  # None on CPU, where the copy was synchronous
    sampling: SamplingBatch
    top: tuple[list[list[float]], list[list[int]]] | None = None  # [S, k] alternatives, on the host


class SharedWeightsOwner(Protocol):
    def release(self) -> None:
        """The engine no longer reads the shared weights (the device is synchronized)."""


def weights_dtype(cfg: EngineConfig, device_type: str) -> torch.dtype:
    """The dtype an engine on `device_type` holds its weights in (`engine.dtype`)."""
    return {
        "auto": torch.bfloat16 if device_type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
    }[cfg.dtype]


def model_eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        ids.update([value] if isinstance(value, int) else list(value or []))
    return tuple(sorted(ids))


class Engine:
    def __init__(self, model: PreTrainedModel, cfg: EngineConfig, compute_dtype: torch.dtype | None = None) -> None:
        """`compute_dtype` different from the weights' dtype runs the model under autocast
        (the trainer's float32 master weights generating in bfloat16)."""
        self.model, self.cfg = model, cfg
        param_dtype = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or param_dtype
        self.max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        self._autocast_dtype = self.compute_dtype if self.compute_dtype != param_dtype else None
        fp8_keys = [key for key in ("weight_dtype", "kv_cache_dtype") if getattr(cfg, key) == "fp8"]
        for key in fp8_keys:
            fp8.check_supported(self.device, self.compute_dtype, cfg.cuda_graphs, key)
        # q/k/v and gate/up side by side: one matmul each in the fused layers. The memory they
        # leave goes back to the device before the KV cache is sized from what is free.
        if projections.pack(model) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._fp8: list[Fp8Layer] = fp8.quantize_model(model) if cfg.weight_dtype == "fp8" else []
        self.blocks = BlockManager(0, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner: ModelRunner | None = None
        self.wake()
        if fp8_keys and self.runner.decode_graphs is None:
            raise ValueError(
                f"engine.{fp8_keys[0]} = 'fp8' runs in the engine's fused layers, which this model's shape has "
                "no path for (they need SwiGLU MLPs and a power-of-two head size of at least 16)"
            )
        self.vocab_size: int = model.config.vocab_size
        self.eos_token_ids = model_eos_ids(model)
        self.weight_version = 0
        self.weights_owner: SharedWeightsOwner | None = None
        """Set while the parameters are views of another process's buffer (`share_weights`)."""
        self.adapters: AdapterMerger | None = None
        """Set by the first adapter version (or by the worker, with the adapter it expects):
        it keeps the target modules' base weights (see `polyrl.lora`)."""
        self._requests: dict[str, list[Sequence]] = {}  # rid -> its unfinished sequences
        self._seq_ids = itertools.count()
        self._rng = random.Random()
        self.num_generated_tokens = 0
        self.num_steps = self.num_prefill_steps = self.num_prompt_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.overlap = cfg.overlap_decode == "on" or (cfg.overlap_decode == "auto" and self.device.type == "cuda")
        self._in_flight: InFlightStep | None = None
        self._chained_waits = 0  # overlapped steps launched while a request waited to be admitted
        self._ready: list[SampleDelta] = []  # read back outside `step` (by `sleep`), returned by the next
        freeze_gc_heap()
        graphs = "on" if self.runner.decode_graphs else "off"
        experts = ""
        if self.runner.is_moe:  # the Triton experts run in the fused layers, which come with the graphs
            triton_experts = self.runner.fused_moe and self.runner.decode_graphs is not None
            experts = ", experts: " + ("the engine's Triton kernels" if triton_experts else "the model's blocks")
        # how many sequences the cache holds at full length, against the batch asked for: a
        # cache that holds fewer preempts and recomputes at long lengths (vLLM logs the same)
        full = self.blocks.num_blocks / cdiv(self.max_model_len, cfg.block_size)
        log.info(
            "engine: %d KV blocks of %d tokens, context %d (%.1f sequences at full length, max_num_seqs %d), "
            "CUDA graphs %s%s",
            self.blocks.num_blocks,
            cfg.block_size,
            self.max_model_len,
            full,
            cfg.max_num_seqs,
            graphs,
            experts,
        )

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig) -> Engine:
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine.device: cuda requested but CUDA is not available")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype(cfg, device)).to(device).eval()
        model.requires_grad_(False)  # inference only: the engine may lay its parameters out (`projections.pack`)
        return cls(model, cfg)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- memory --------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV cache and the CUDA graphs (for a trainer sharing the GPU). Running
        samples keep their tokens and recompute their KV after `wake`; the next step wakes
        the engine by itself."""
        if self.runner is None:
            return
        self._ready += self._settle()
        self.scheduler.preempt_all()
        self.runner.close()
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Allocate the KV cache: as many blocks as before `sleep` (the first time: sized
        from the config or the free memory), fewer only if that much is no longer free."""
        if self.runner is not None:
            return
        cfg = self.cfg
        num_blocks = num_kv_blocks_for(
            self.model,
            cfg.num_kv_blocks,
            cfg.block_size,
            self.compute_dtype,
            cfg.max_num_seqs,
            self.max_model_len,
            cfg.kv_cache_memory_fraction if self.blocks.num_blocks == 0 else 0.95,
            cfg.cpu_kv_cache_gib,
            fp8_kv=cfg.kv_cache_dtype == "fp8",
        )
        if self.blocks.num_blocks:
            if num_blocks < self.blocks.num_blocks:
                log.warning("engine: memory for only %d of %d KV blocks after wake", num_blocks, self.blocks.num_blocks)
            num_blocks = min(num_blocks, self.blocks.num_blocks)
        self.blocks.resize(num_blocks)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            cfg.block_size,
            self.compute_dtype,
            self._autocast_dtype,
            cuda_graph_max_batch=cfg.max_num_seqs if cfg.cuda_graphs else 0,
            max_model_len=self.max_model_len,
            fp8_kv=cfg.kv_cache_dtype == "fp8",
            fp8_layers=self._fp8,
            moe_runner_backend=cfg.moe_runner_backend,
            attention_backend=cfg.attention_backend,
        )

    @property
    def has_work(self) -> bool:
        in_flight = self._in_flight is not None and any(s.status is SeqStatus.RUNNING for s in self._in_flight.seqs)
        return self.scheduler.has_work or in_flight or bool(self._ready)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, req: EngineRequest) -> None:
        """Raise RequestError with a client-facing message if `req` cannot run here."""
        s, ids = req.sampling, req.input_ids
        if not ids:
            raise RequestError("input_ids is empty")
        bad = next((t for t in list(ids) + list(s.stop_token_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if s.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1 (got {s.max_new_tokens})")
        if len(ids) + s.max_new_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        if not (s.temperature == 0 or MIN_TEMPERATURE <= s.temperature < float("inf")):
            raise RequestError(f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g}")
        if not 0 < s.top_p <= 1 or not 0 <= s.top_k < MAX_TOP_K or not 0 <= s.min_p <= 1:
            raise RequestError("need 0 < top_p <= 1, 0 <= top_k < 2**63 (0: off) and 0 <= min_p <= 1")
        if not 1 <= s.n <= self.cfg.max_num_seqs:
            raise RequestError(f"n must be in [1, {self.cfg.max_num_seqs}] (got {s.n})")
        if s.seed is not None and not 0 <= s.seed < MAX_SEED:
            raise RequestError("seed must be in [0, 2**63)")
        if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if cdiv(len(ids) + s.max_new_tokens, self.cfg.block_size) + s.n - 1 > self.blocks.num_blocks:
            raise RequestError("the request needs more KV cache than this engine has")

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        if req.rid in self._requests:
            raise RequestError(f"request id {req.rid!r} is already in flight")
        s = req.sampling
        stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos_token_ids))
        seed = s.seed if s.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            next(self._seq_ids),
            req.rid,
            0,
            list(req.input_ids),
            len(req.input_ids),
            s,
            seed,
            frozenset(stop_ids),
            num_forks=s.n,
        )
        self._requests[req.rid] = [seq]
        self.scheduler.add(seq)

    def abort(self, rid: str) -> list[SampleDelta]:
        """Finish every unfinished sample of `rid` with reason "abort" (partial tokens were
        already reported in earlier deltas)."""
        return [d for seq in list(self._requests.get(rid, [])) for d in self._abort_seq(seq)]

    def abort_all(self) -> list[SampleDelta]:
        return [d for rid in list(self._requests) for d in self.abort(rid)]

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[SampleDelta]:
        with measured(self.device):  # on a CPU another process may hold: torch's threads follow
            return self._step()

    def _step(self) -> list[SampleDelta]:
        self.wake()
        deltas, self._ready = self._ready, []
        chained = self._launch_chained() if self._in_flight is not None else None
        deltas += self._settle()  # while the chained step runs
        if chained is not None:
            self._in_flight = chained
            self.num_steps += 1
            return deltas
        batch = self.scheduler.schedule()
        if not batch:
            return deltas
        self.num_steps += 1
        prompt = sum(item.num_new_tokens for item in batch if not item.is_decode)
        if prompt:
            self.num_prefill_steps += 1
            self.num_prompt_tokens += prompt
        logits, sample_idx = self.runner.forward(batch)
        self._store_routes(batch)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.num_new_tokens > 1:  # a prefill chunk: its full blocks are readable now
                self.blocks.cache_computed(item.seq)
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, i in enumerate(sample_idx):
            for seq in self._fork(batch[i].seq):  # n samples share the prompt's logits row
                seqs.append(seq)
                rows.append(row)
        if not seqs:
            return deltas
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        params = self._sampling_batch(seqs)
        token_ids, logprobs = sample(logits, params)
        self._in_flight = self._read_back(seqs, token_ids, logprobs, params, logits)
        if self.overlap and len(seqs) == len(batch) and all(item.num_new_tokens == 1 for item in batch):
            return deltas  # a pure decode: the next step chains onto it
        return deltas + self._settle()

    def _admit_now(self) -> bool:
        """Whether to stop the chain of overlapped decodes for the scheduler to admit a
        waiting request: at once for a small batch or a handful of waiting samples, else
        after `admit_wait_steps` overlapped steps, so that arrivals are admitted together."""
        sched, cfg = self.scheduler, self.cfg
        if not sched.can_admit():
            self._chained_waits = 0
            return False
        if (
            self._chained_waits >= cfg.admit_wait_steps
            or len(sched.running) < cfg.admit_batch
            or sum(s.num_forks for s in itertools.islice(sched.waiting, cfg.admit_batch)) >= cfg.admit_batch
        ):
            self._chained_waits = 0
            return True
        self._chained_waits += 1
        return False

    def _launch_chained(self) -> InFlightStep | None:
        """Launch the decode after the one in flight, fed with its sampled tokens on the
        device; None when the next step needs the scheduler (a request it would admit,
        running samples the step in flight left out, too few free blocks, nothing left)."""
        prev, sched = self._in_flight, self.scheduler
        if not self.overlap or self._admit_now():
            return None
        # Samples that stopped on the step before are gone; those whose in-flight token is
        # their last are left out (a stop token is only seen on read-back: that row is wasted).
        live = [i for i, s in enumerate(prev.seqs) if s.status is SeqStatus.RUNNING]
        if len(live) != len(sched.running):
            return None
        keep = [i for i in live if prev.seqs[i].num_generated + 1 < prev.seqs[i].sampling.max_new_tokens]
        if not keep:
            return None
        seqs = [prev.seqs[i] for i in keep]
        needed = sum(self.blocks.blocks_needed(s, s.num_computed_tokens + 1) for s in seqs)
        if not self.blocks.can_allocate(needed):
            return None
        for s in seqs:
            self.blocks.allocate(s, s.num_computed_tokens + 1)
        same = len(keep) == len(prev.seqs)
        # (non_blocking: a plain copy to the device would wait for the step in flight)
        fed = prev.token_ids if same else prev.token_ids[torch.tensor(keep).to(self.device, non_blocking=True)]
        chained = [ScheduledSeq(s, 1) for s in seqs]
        logits, _ = self.runner.forward(chained, fed_ids=fed)
        self._store_routes(chained)
        for s in seqs:
            s.num_computed_tokens += 1
        params = prev.sampling
        params = replace(params, positions=params.positions + 1) if same else self._sampling_batch(seqs)
        return self._read_back(seqs, *sample(logits, params), params, logits)

    def _store_routes(self, batch: list[ScheduledSeq]) -> None:
        """The step's expert routes (rows in batch order) to the sequences that asked, at the
        positions fed (before they count as computed). Reading them back waits for the
        step: a request that asks gives up the overlap, as with top log-probs."""
        routes = self.runner.last_routes
        if routes is None:
            return
        routes, row = routes.cpu(), 0
        for item in batch:
            if item.seq.sampling.return_routed_experts:
                item.seq.store_routes(item.seq.num_computed_tokens, routes[row : row + item.num_new_tokens])
            row += item.num_new_tokens

    def _read_back(
        self,
        seqs: list[Sequence],
        token_ids: torch.Tensor,
        logprobs: torch.Tensor,
        params: SamplingBatch,
        logits: torch.Tensor,
    ) -> InFlightStep:
        """Start copying a step's tokens and log-probs to the host (one copy; token ids are
        exact in float64). Top log-probs, when asked for, are copied synchronously: the
        rare request that wants them gives up the step's overlap."""
        top = None
        if params.num_top_logprobs:
            values, ids = top_logprobs(logits, params)
            top = (values.tolist(), ids.tolist())
        both = torch.stack([token_ids.double(), logprobs.double()])
        if not both.is_cuda:
            return InFlightStep(seqs, token_ids, both, None, params, top)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlightStep(seqs, token_ids, host, done, params, top)

    def _settle(self) -> list[SampleDelta]:
        """Wait for the step in flight, if any, and turn its tokens into deltas (skipping
        samples finished or aborted since it was launched)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        if step.done is not None:
            step.done.synchronize()
        token_ids, logprobs = step.host.tolist()
        live = [i for i, s in enumerate(step.seqs) if s.status is SeqStatus.RUNNING]
        tops = None if step.top is None else [list(zip(step.top[1][i], step.top[0][i], strict=True)) for i in live]
        return self._postprocess(
            [step.seqs[i] for i in live], [int(token_ids[i]) for i in live], [logprobs[i] for i in live], tops
        )

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        dev = self.device
        params = [s.sampling for s in seqs]
        temperatures = [p.temperature for p in params]
        top_p, top_k, min_p = [p.top_p for p in params], [p.top_k for p in params], [p.min_p for p in params]
        # Rows of plain lists convert fastest; one float and one int copy to the device.
        floats = torch.tensor([temperatures, top_p, min_p], dtype=torch.float32).to(dev, non_blocking=True)
        # The position of the token being sampled: the one after the last fed.
        ints = torch.tensor([top_k, [s.seed for s in seqs], [s.num_computed_tokens for s in seqs]], dtype=torch.long)
        ints = ints.to(dev, non_blocking=True)
        return SamplingBatch(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            min_p=floats[2],
            seeds=ints[1],
            positions=ints[2],
            needs_truncation=any(p.truncates for p in params),
            all_greedy=not any(temperatures),
            num_top_logprobs=max(p.top_logprobs for p in params),
        )

    def _postprocess(
        self,
        seqs: list[Sequence],
        token_ids: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]]] | None = None,
    ) -> list[SampleDelta]:
        version, deltas = self.weight_version, []
        for row, (seq, token_id, logprob) in enumerate(zip(seqs, token_ids, logprobs)):
            seq.append(token_id, logprob, version)
            delta = SampleDelta(seq.rid, seq.index, [token_id], [logprob], [version])
            if seq.sampling.return_routed_experts:
                delta.routed_experts = seq.take_routes()
            if seq.sampling.top_logprobs and tops is not None:
                delta.top_logprobs = [tops[row][: seq.sampling.top_logprobs]]
            if seq.finish_reason is not None:
                delta.finish_reason, delta.matched_stop = seq.finish_reason, seq.matched_stop
                self._finish(seq)
            deltas.append(delta)
        self._count_tokens(len(seqs))
        return deltas

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Turn a shared-prefill parent into its n samples (itself first)."""
        seqs = [parent]
        for j in range(1, parent.num_forks):
            child = Sequence(
                next(self._seq_ids),
                parent.rid,
                parent.index + j,
                list(parent.token_ids),
                parent.num_prompt_tokens,
                parent.sampling,
                (parent.seed + j) % MAX_SEED,
                parent.stop_ids,
            )
            if parent.routes is not None:  # the shared prompt's, computed once
                child.routes, child.routes_sent = parent.routes.clone(), parent.routes_sent
            if self.blocks.can_allocate(1):
                copy = self.blocks.fork(parent, child)
                if copy is not None:
                    self.runner.copy_block(*copy)
                child.num_computed_tokens, child.status = parent.num_computed_tokens, SeqStatus.RUNNING
                self.scheduler.running.append(child)
            else:  # no block for the copy: the child recomputes its prompt later
                self.scheduler.waiting.appendleft(child)
            self._requests[parent.rid].append(child)
            seqs.append(child)
        parent.num_forks = 1
        return seqs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        live = self._requests[seq.rid]
        live.remove(seq)
        if not live:
            del self._requests[seq.rid]

    def _abort_seq(self, seq: Sequence) -> list[SampleDelta]:
        indices = range(seq.index, seq.index + seq.num_forks)  # an unforked parent stands for all n
        seq.finish_reason = "abort"
        self._finish(seq)
        return [SampleDelta(seq.rid, i, finish_reason="abort") for i in indices]

    # ---- weights -------------------------------------------------------------------------

    def update_weights(
        self, weights: Mapping[str, torch.Tensor] | None, version: int, policy: SwapPolicy | None = None
    ) -> list[SampleDelta]:
        """Load `weights` (all parameters, by HF name) as `version` and apply `policy`
        (default: `swap_policy`) to requests in flight. `weights=None`: the model was
        already updated in place (the colocated trainer). Returns the deltas of the step
        still in flight, if any, and of samples aborted by the policy."""
        if weights is not None:
            self._load_weights(weights)  # after the step in flight on the device's stream
        for layer in self._fp8:  # the 16-bit weights changed (here, or in place by the trainer)
            for matmul in layer.matmuls():
                matmul.requantize()
        deltas = self._ready + self._settle()  # the tokens in flight are the old version's
        self._ready = []
        old, self.weight_version = self.weight_version, version
        if weights is not None or version != old:
            self.blocks.invalidate()  # the cached KV is the old weights'
        policy = policy or self.cfg.swap_policy
        num_running = len(self.scheduler.running)
        if policy == "recompute":
            self.scheduler.preempt_all()
        elif policy == "abort":
            deltas += [d for seq in list(self.scheduler.running) for d in self._abort_seq(seq)]
        if weights is not None or num_running:
            log.debug("weights v%d -> v%d (%d running, policy %s)", old, version, num_running, policy)
        return deltas

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.unshare_weights()  # a copy lands in memory of our own, never in a buffer we only read
        if is_adapter_version(weights):
            self._load_adapter(weights)
            return
        if self.adapters is not None:  # a new base: adapters merge into it, with the same constraints
            self.adapters = AdapterMerger(self.model, self.adapters.fingerprint, self.adapters.spec)
        params = self._full_version_params(weights)
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)

    def _full_version_params(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
        """The parameters by name (tied names alias one), once `weights` is checked to
        cover them all with the right shapes; RequestError otherwise."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names alias one tensor
        unknown = [k for k in weights if k not in params]
        if unknown:
            raise RequestError(f"unknown parameter names: {unknown[:3]}{' ...' if len(unknown) > 3 else ''}")
        bad = [k for k, t in weights.items() if tuple(t.shape) != tuple(params[k].shape)]
        if bad:
            k = bad[0]
            raise RequestError(
                f"shape mismatch for {k}: got {tuple(weights[k].shape)}, model has {tuple(params[k].shape)}"
            )
        covered = {id(params[k]) for k in weights}
        missing = [k for k, p in self.model.named_parameters() if id(p) not in covered]
        if missing:
            raise RequestError(f"missing parameters: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        return params

    # ---- single copy: weights read in place from another process's buffer ---------------

    def can_share(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """Whether the engine could decode from `weights` in place (`share_weights`)."""
        return self._shared_params(weights) is not None

    def _shared_params(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Parameter] | None:
        """The parameters by name when `weights` can stand in for them: a full version, in
        the parameters' dtypes, on our device, and no adapters to merge; else None."""
        if self.adapters is not None or is_adapter_version(weights):
            return None
        try:
            params = self._full_version_params(weights)
        except RequestError:
            return None
        fits = all(t.dtype == params[k].dtype and t.device == params[k].device for k, t in weights.items())
        return params if fits else None

    def share_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, owner: SharedWeightsOwner
    ) -> list[SampleDelta]:
        """Point the parameters at `weights` (views of a buffer another process owns and
        rewrites in place, between our steps: see `transfer/cuda_ipc.py`) and free our
        own copy. `owner.release()` is called once the engine stops reading them
        (`unshare_weights`). The decode graphs are captured again: they hold the old
        addresses. Returns what `update_weights` returns."""
        params = self._shared_params(weights)
        if params is None:
            raise RequestError("these weights cannot be read in place (not a full version in the engine's dtypes)")
        previous = self.weights_owner
        self.quiesce()
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].data = tensor  # tied names: the same parameter, pointed twice
        self.weights_owner = owner
        if previous is not None:
            previous.release()
        self._weights_moved()
        return self.update_weights(None, version)

    def unshare_weights(self) -> None:
        """Copy the shared weights into memory of our own and let their owner go (before
        anything writes into the parameters)."""
        owner = self.weights_owner
        if owner is None:
            return
        self.quiesce()
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = p.data.clone()
        self.weights_owner = None
        self._weights_moved()
        owner.release()

    def quiesce(self) -> None:
        """Finish the step in flight (its deltas come with the next step) and wait for the
        device: from here until the next step nothing of ours reads the weights."""
        self._ready += self._settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _weights_moved(self) -> None:
        if self.weights_owner is None:  # our own copy again: side by side for the fused matmuls
            projections.pack(self.model)
        if self.runner is not None:
            self.runner.refresh_projections()
            if self.runner.decode_graphs is not None:
                self.runner.decode_graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the copy we no longer use goes back to the device

    def _load_adapter(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Merge an adapter version into the base weights (checked first: a refused one
        changes nothing)."""
        spec, pairs = unpack(weights)
        if self.adapters is None:
            self.adapters = AdapterMerger(self.model, base_fingerprint(self.model.config))
        self.adapters.apply(spec, pairs)

    # ---- stats ---------------------------------------------------------------------------

    def _count_tokens(self, num: int) -> None:
        now = time.monotonic()
        self.num_generated_tokens += num
        self._recent.append((now, num))
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def stats(self) -> EngineStats:
        recent = list(self._recent)
        span = (recent[-1][0] - recent[0][0]) if len(recent) > 1 else 0.0
        throughput = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            weight_version=self.weight_version,
            num_free_blocks=self.blocks.num_free,
            num_total_blocks=self.blocks.num_blocks,
            gen_throughput=throughput,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.blocks.num_queried_tokens,
            prefix_cache_hits=self.blocks.num_hit_tokens,
            num_steps=self.num_steps,
            num_prefill_steps=self.num_prefill_steps,
            num_prompt_tokens=self.num_prompt_tokens,
        )
