"""Colocated rollout: the embedded engine generates with the trainer's own model.

This is the synchronous veRL-style baseline and the fallback when no rollout worker
exists. The engine shares the trainer's parameters (no copy), so publishing a new
version is a version bump; the engine's KV cache is its own. It yields whole groups in
completion order, like every other rollout source.

Log-probs are the engine's: log softmax(logits / temperature) of the sampled token,
before top-p/top-k truncation (see `polyrl.engine.types` and README "Log-probs").
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterator, Mapping

import torch
from transformers import PreTrainedModel

from polyrl.config import EngineConfig
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest, SampleResult
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.samples import Group, Prompt, Sample
from polyrl.protocol.sampling import SamplingParams
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.stats import RolloutStats


def to_sample(result: SampleResult, worker: str, gen_time_s: float) -> Sample:
    assert result.finish_reason is not None
    return Sample(
        completion_ids=result.token_ids,
        logprobs=result.logprobs,
        finish_reason=result.finish_reason,
        weight_versions=result.weight_versions,
        workers=[worker],
        gen_time_s=gen_time_s,
        routed_experts=torch.cat(result.routed_experts).flatten(1).numpy().astype("int32")
        if result.routed_experts
        else None,
    )


def engine_dtype(model: PreTrainedModel, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainer's engines hold their weights in. On CUDA with a lower compute
    dtype, an engine holds its own copy in that dtype: decoding from float32 master weights
    under autocast would cast every weight in every step (3x the memory traffic of a bf16
    decode, which is bandwidth-bound). On CPU the engine computes on the master weights."""
    param_dtype = next(model.parameters()).dtype
    return compute_dtype if model.device.type == "cuda" else param_dtype


def engine_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """An inference-only copy of the learner's model in `dtype`, for an engine of its own."""
    return copy.deepcopy(model).to(dtype).requires_grad_(False).eval()


def learner_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The learner's parameters by HF name, as a version to publish."""
    return {k: p.detach() for k, p in model.named_parameters()}


class LocalRollout:
    shares_weights = True
    """The engine generates a batch from the learner's weights as they are at `publish`:
    the caller must let a batch finish generating before the first update (the
    synchronous, colocated baseline)."""

    def __init__(self, engine: Engine, model: PreTrainedModel | None = None) -> None:
        """`model`: the learner's model, when the engine holds a copy of it (see
        `colocated`); None when the engine runs on the learner's own parameters."""
        self.engine, self.model = engine, model
        self.stats = RolloutStats()

    @classmethod
    def colocated(cls, model: PreTrainedModel, cfg: EngineConfig, compute_dtype: torch.dtype) -> LocalRollout:
        """The engine on the learner's parameters, or on a copy in `engine_dtype`.

        Both share the trainer's GPU with a fixed split, not by sleeping: the KV cache
        takes `engine.kv_cache_memory_fraction` of the memory free when the engine starts
        and keeps it; training uses what is left. Freeing the cache around each learner
        step (`Engine.sleep`) would also drop the CUDA graphs, and capturing them again
        costs 0.4-1.3 s per step (BENCHMARKS.md)."""
        dtype = engine_dtype(model, compute_dtype)
        if dtype == next(model.parameters()).dtype:
            return cls(Engine(model, cfg, compute_dtype))
        return cls(Engine(engine_copy(model, dtype), cfg, compute_dtype), model)

    @property
    def num_instances(self) -> int:
        return 1

    @property
    def weight_version(self) -> WeightVersion:
        return self.engine.weight_version

    def publish(self, weights: Mapping[str, torch.Tensor] | None, version: WeightVersion) -> None:
        """The trainer changed its parameters in place; tokens from now on are `version`.
        An engine on a copy loads them (a device-to-device copy and cast)."""
        if self.model is None and weights is None:
            self.engine.update_weights(None, version)
            return
        if weights is None:
            weights = learner_weights(self.model)
        self.engine.update_weights(weights, version)

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> Iterator[Group]:
        """Yield each prompt's group as soon as its last sample is finished."""
        t0 = time.perf_counter()
        self.stats = stats = RolloutStats(num_requested=len(prompts) * sampling.n)
        pending: dict[str, tuple[Prompt, list[SampleResult]]] = {}
        for p in prompts:
            rid = f"local-{p.index}"
            # seeds from the run's seeded (and checkpointed) RNG
            own = {"seed": random.getrandbits(63), "max_new_tokens": p.budget(sampling.max_new_tokens)}
            self.engine.add_request(EngineRequest(rid, p.prompt_ids, sampling.model_copy(update=own)))
            pending[rid] = (p, [SampleResult(rid, i, len(p.prompt_ids)) for i in range(sampling.n)])
        try:
            while pending:
                for d in self.engine.step():
                    prompt, results = pending[d.rid]
                    results[d.index].add(d)
                    if d.finished and all(r.finish_reason is not None for r in results):
                        del pending[d.rid]
                        elapsed = time.perf_counter() - t0
                        stats.first_group_s = stats.first_group_s or elapsed
                        stats.gen_s = elapsed
                        group = Group(prompt=prompt, samples=[to_sample(r, LOCAL_WORKER_ID, elapsed) for r in results])
                        stats.count(group)
                        yield group
        finally:
            for rid in pending:  # closed before its end: the rest is cancelled
                self.engine.abort(rid)

    def learner_started(self) -> None:
        pass  # the whole batch was generated before it (`shares_weights`)

    def workers(self) -> list:
        return []

    def fleet_decision(self, decision) -> None:
        pass  # no manager, no page

    def close(self) -> None:
        pass
