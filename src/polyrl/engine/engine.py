"""The embedded continuous-batching engine: requests in, per-step sample deltas out.

Single-threaded by design: `step()` schedules one batch, runs one forward, samples, and
returns what each sample gained. `AsyncEngine` drives it from its own thread for the
HTTP worker; the trainer's local rollout calls `step()` directly.

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

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from polyrl.config import EngineConfig
from polyrl.engine.block_manager import BlockManager, cdiv
from polyrl.engine.model_runner import ModelRunner, num_kv_blocks_for
from polyrl.engine.sampler import SamplingBatch, sample
from polyrl.engine.scheduler import Scheduler
from polyrl.engine.sequence import SeqStatus, Sequence
from polyrl.engine.types import EngineRequest, EngineStats, RequestError, SampleDelta

log = logging.getLogger(__name__)

MAX_SEED = 2**63
THROUGHPUT_WINDOW_S = 10.0


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
        self.blocks = BlockManager(0, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner: ModelRunner | None = None
        self.wake()
        self.vocab_size: int = model.config.vocab_size
        self.eos_token_ids = model_eos_ids(model)
        self.weight_version = 0
        self._requests: dict[str, list[Sequence]] = {}  # rid -> its unfinished sequences
        self._seq_ids = itertools.count()
        self._rng = random.Random()
        self.num_generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        graphs = "on" if self.runner.decode_graphs else "off"
        log.info("engine: %d KV blocks of %d tokens, context %d, CUDA graphs %s", self.blocks.num_blocks,
                 cfg.block_size, self.max_model_len, graphs)

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig) -> Engine:
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine.device: cuda requested but CUDA is not available")
        dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}[cfg.dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
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
            self.model, cfg.num_kv_blocks, cfg.block_size, self.compute_dtype, cfg.max_num_seqs, self.max_model_len,
            cfg.kv_cache_memory_fraction if self.blocks.num_blocks == 0 else 0.95, cfg.cpu_kv_cache_gib,
        )
        if self.blocks.num_blocks:
            if num_blocks < self.blocks.num_blocks:
                log.warning("engine: memory for only %d of %d KV blocks after wake", num_blocks, self.blocks.num_blocks)
            num_blocks = min(num_blocks, self.blocks.num_blocks)
        self.blocks.resize(num_blocks)
        self.runner = ModelRunner(
            self.model, num_blocks, cfg.block_size, self.compute_dtype, self._autocast_dtype,
            cuda_graph_max_batch=cfg.max_num_seqs if cfg.cuda_graphs else 0, max_model_len=self.max_model_len,
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

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
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < -1:
            raise RequestError("need temperature >= 0, 0 < top_p <= 1 and top_k >= -1")
        if not 1 <= s.n <= self.cfg.max_num_seqs:
            raise RequestError(f"n must be in [1, {self.cfg.max_num_seqs}] (got {s.n})")
        if s.seed is not None and not 0 <= s.seed < MAX_SEED:
            raise RequestError("seed must be in [0, 2**63)")
        if cdiv(len(ids) + s.max_new_tokens, self.cfg.block_size) + s.n - 1 > self.blocks.num_blocks:
            raise RequestError("the request needs more KV cache than this engine has")

    def add_request(self, req: EngineRequest) -> None:
        self.validate(req)
        if req.rid in self._requests:
            raise RequestError(f"request id {req.rid!r} is already in flight")
        s = req.sampling
        stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos_token_ids))
        seed = s.seed if s.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), req.rid, 0, list(req.input_ids), len(req.input_ids), s, seed,
                       frozenset(stop_ids), num_forks=s.n)
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
        self.wake()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits, sample_idx = self.runner.forward(batch)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, i in enumerate(sample_idx):
            for seq in self._fork(batch[i].seq):  # n samples share the prompt's logits row
                seqs.append(seq)
                rows.append(row)
        if not seqs:
            return []
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        token_ids, logprobs = sample(logits, self._sampling_batch(seqs))
        # One device-to-host copy for both (token ids are exact in float64).
        host = torch.stack([token_ids.double(), logprobs.double()]).cpu()
        return self._postprocess(seqs, [int(t) for t in host[0].tolist()], host[1].tolist())

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        dev = self.device
        params = [s.sampling for s in seqs]
        temperatures = [p.temperature for p in params]
        top_p, top_k = [p.top_p for p in params], [p.top_k for p in params]
        # Rows of plain lists convert fastest; one float and one int copy to the device.
        floats = torch.tensor([temperatures, top_p], dtype=torch.float32).to(dev, non_blocking=True)
        ints = torch.tensor([top_k, [s.seed for s in seqs], [s.num_tokens for s in seqs]], dtype=torch.long)
        ints = ints.to(dev, non_blocking=True)
        return SamplingBatch(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            seeds=ints[1],
            positions=ints[2],
            needs_truncation=any(p < 1 for p in top_p) or any(k > 0 for k in top_k),
            all_greedy=not any(temperatures),
        )

    def _postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float]) -> list[SampleDelta]:
        version, deltas = self.weight_version, []
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            seq.append(token_id, logprob, version)
            delta = SampleDelta(seq.rid, seq.index, [token_id], [logprob], [version])
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
                next(self._seq_ids), parent.rid, parent.index + j, list(parent.token_ids), parent.num_prompt_tokens,
                parent.sampling, (parent.seed + j) % MAX_SEED, parent.stop_ids,
            )
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

    def update_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> list[SampleDelta]:
        """Load `weights` (all parameters, by HF name) as `version` and apply `swap_policy`
        to requests in flight. `weights=None`: the model was already updated in place
        (the colocated trainer). Returns the deltas of samples aborted by the policy."""
        if weights is not None:
            self._load_weights(weights)
        old, self.weight_version = self.weight_version, version
        policy = self.cfg.swap_policy
        num_running = len(self.scheduler.running)
        deltas: list[SampleDelta] = []
        if policy == "recompute":
            self.scheduler.preempt_all()
        elif policy == "abort":
            deltas = [d for seq in list(self.scheduler.running) for d in self._abort_seq(seq)]
        if weights is not None or num_running:
            log.debug("weights v%d -> v%d (%d running, policy %s)", old, version, num_running, policy)
        return deltas

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names alias one tensor
        unknown = [k for k in weights if k not in params]
        if unknown:
            raise RequestError(f"unknown parameter names: {unknown[:3]}{' ...' if len(unknown) > 3 else ''}")
        bad = [k for k, t in weights.items() if tuple(t.shape) != tuple(params[k].shape)]
        if bad:
            k = bad[0]
            raise RequestError(f"shape mismatch for {k}: got {tuple(weights[k].shape)}, model has {tuple(params[k].shape)}")
        covered = {id(params[k]) for k in weights}
        missing = [k for k, p in self.model.named_parameters() if id(p) not in covered]
        if missing:
            raise RequestError(f"missing parameters: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)

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
        )
