"""Colocated rollout: the trainer's own model generates with HF `generate`.

This is the synchronous veRL-style baseline and the fallback when no rollout worker
exists. It yields whole groups, like every other rollout source. The embedded
continuous-batching engine replaces the `generate` call without changing this contract.

Log-prob definition (shared with the learner): log softmax(logits / temperature) of the
sampled token, *before* top-p/top-k truncation. Truncation only narrows where sampling
looks; the learner cannot reproduce a truncated support cheaply, so both sides use the
untruncated tempered distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel

from polyrl.models.precision import autocast
from polyrl.rollout.types import Group, Prompt, Sample, SamplingParams


class LocalRollout:
    def __init__(
        self, model: PreTrainedModel, pad_id: int, batch_size: int, compute_dtype: torch.dtype = torch.float32
    ) -> None:
        self.model, self.pad_id, self.batch_size = model, pad_id, batch_size
        self.compute_dtype = compute_dtype
        self.weight_version = 0

    @property
    def num_instances(self) -> int:
        return 1

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> Iterator[Group]:
        """Yield each prompt's group as soon as its last sample is generated."""
        # Sequence j belongs to prompt j // n; chunks keep that order, so groups finish in order.
        flat = [p for p in prompts for _ in range(n)]
        done: list[Sample] = []
        for start in range(0, len(flat), self.batch_size):
            done += self._generate_batch(flat[start : start + self.batch_size], params)
            while len(done) >= n:
                group_samples, done = done[:n], done[n:]
                yield Group(prompt=prompts[0], samples=group_samples)
                prompts = prompts[1:]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[Prompt], params: SamplingParams) -> list[Sample]:
        t0 = time.perf_counter()
        device = self.model.device
        max_len = max(len(p.prompt_ids) for p in prompts)
        # Left padding: every sequence's first generated token sits at the same column.
        input_ids = torch.full((len(prompts), max_len), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, max_len - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attention_mask[i, max_len - len(p.prompt_ids) :] = 1
        stop_ids = list(params.stop_token_ids)
        # A fresh config: the model's own generation_config may carry repetition penalties or
        # n-gram bans that would change sampling without changing the log-probs we report.
        gen_cfg = GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with autocast(device, self.compute_dtype):
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen_cfg
            )
        new_ids = out.sequences[:, max_len:]  # [B, T]
        # One [B, V] step at a time: stacking all steps would hold a [B, T, V] float copy.
        logp = torch.stack(
            [
                torch.log_softmax(step_logits.float() / params.temperature, dim=-1)
                .gather(-1, new_ids[:, t : t + 1])
                .squeeze(-1)
                for t, step_logits in enumerate(out.logits)
            ],
            dim=1,
        ).cpu()  # [B, T] raw (untruncated) tempered log-probs of the sampled tokens
        new_ids = new_ids.cpu()
        elapsed = time.perf_counter() - t0
        return [
            self._to_sample(new_ids[i].tolist(), logp[i].tolist(), stop_ids, params, elapsed)
            for i in range(len(prompts))
        ]

    def _to_sample(
        self, ids: list[int], logps: list[float], stop_ids: list[int], params: SamplingParams, gen_s: float
    ) -> Sample:
        stop_at = next((i for i, t in enumerate(ids) if t in stop_ids), None)
        if stop_at is not None:
            ids, logps, reason = ids[: stop_at + 1], logps[: stop_at + 1], "stop"
        else:
            reason = "length"
        assert len(ids) <= params.max_new_tokens
        return Sample(
            completion_ids=ids,
            logprobs=logps,
            finish_reason=reason,
            weight_versions=[self.weight_version] * len(ids),
            workers=["local"],
            gen_time_s=gen_s,
        )
