"""Atropos's wire format, and its scored groups as polyrl groups.

An Atropos environment rolls out through an inference server (polyrl's manager or a
worker), scores its group itself and pushes it to the Atropos API server; the trainer
registers with that API and pulls batches of such groups (`atropos_client.py`). A group
is a list of sequences: `tokens`, `masks` (-100 where the token is context, the token id
where it was generated), `scores`, and optional per-token `advantages` and
`inference_logprobs` (aligned 1:1 with `tokens`), plus per-sequence `overrides`.

How a sequence becomes a polyrl `Sample`:
* its prompt is the leading run of -100 positions; the completion is everything after;
  -100 positions inside the completion (a tool's output between turns) stay in the
  sequence as context but out of the loss (`Sample.loss_mask`);
* `scores` are the group's rewards: the learner's usual GRPO group advantage applies,
  unless the environment sent its own per-token `advantages`;
* `overrides[i]["set_advantage_to_zero"]` zeroes sequence i's advantage (it stays in the
  batch, so the loss's token-mean denominator is what the environment sent); the other
  override keys are for Atropos's logging and are ignored here;
* `inference_logprobs` become the behaviour log-probs; without them the learner's own
  log-probs stand in (the sample counts as on-policy, importance weight 1);
* `ref_logprobs` are ignored: with `algo.kl_coef > 0` the learner computes its own
  reference log-probs from the initial model;
* the weight version of each generated token is not in the group: the manager booked it
  when it served the completion, and the trainer looks each generated span up by its
  token ids (`generated_spans`, `span_keys`, `token_versions`; `protocol/completions.py`
  says why). Context inside the completion takes the version of the token before it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from polyrl.protocol.completions import VersionRuns, from_runs, sequence_key
from polyrl.protocol.samples import Group, Prompt, Sample

CONTEXT = -100
"""The mask value of a position that is context, not generated (PyTorch's ignore index)."""


class Registration(BaseModel):
    """`POST /register`: every field is required by the API."""

    wandb_group: str
    wandb_project: str
    batch_size: int
    """Sequences per step (the API hands out whole groups adding up to this)."""
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    """Steps done before this registration (the resumed step)."""
    num_steps: int


class ScoredGroup(BaseModel):
    """One environment group as `GET /batch` returns it (keys polyrl does not use are
    accepted and dropped)."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any] | None] | None = None
    generation_params: dict[str, Any] | None = None
    env_id: int | None = None

    @field_validator("advantages", "inference_logprobs", "overrides", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        """BaseEnv's default `collect_trajectories` sends [] for "none"."""
        return None if value == [] else value

    @model_validator(mode="after")
    def _aligned(self) -> ScoredGroup:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a group without sequences")
        if len(self.masks) != n or len(self.scores) != n:
            raise ValueError(f"{n} token lists, {len(self.masks)} masks, {len(self.scores)} scores")
        for name in ("advantages", "inference_logprobs"):
            rows = getattr(self, name)
            if rows is not None and [len(r) for r in rows] != [len(t) for t in self.tokens]:
                raise ValueError(f"{name} are not aligned 1:1 with tokens")
        if [len(m) for m in self.masks] != [len(t) for t in self.tokens]:
            raise ValueError("masks are not aligned 1:1 with tokens")
        if self.overrides is not None and len(self.overrides) != n:
            raise ValueError(f"{len(self.overrides)} overrides for {n} sequences")
        return self

    @property
    def temperature(self) -> float | None:
        value = (self.generation_params or {}).get("temperature")
        return float(value) if value is not None else None


class BatchReply(BaseModel):
    """`GET /batch`: `batch` is null until enough groups are queued; an API that does not
    know the trainer (restarted, or reset) answers with status "error" instead."""

    model_config = ConfigDict(extra="ignore")

    batch: list[dict[str, Any]] | None = None
    """Groups, each parsed on its own (`ScoredGroup`): one malformed group is dropped, not the batch."""
    status: str | None = None
    message: str | None = None

    @property
    def is_unregistered(self) -> bool:
        return self.status == "error"


def prompt_length(masks: list[int]) -> int:
    """Leading context positions; at least 1, as the first token has nothing to be predicted from."""
    n = 0
    while n < len(masks) and masks[n] == CONTEXT:
        n += 1
    return max(n, 1)


def generated_spans(masks: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of generated positions after the prompt: one per turn."""
    spans: list[tuple[int, int]] = []
    begin: int | None = None
    for i in range(prompt_length(masks), len(masks)):
        if masks[i] != CONTEXT and begin is None:
            begin = i
        elif masks[i] == CONTEXT and begin is not None:
            spans.append((begin, i))
            begin = None
    if begin is not None:
        spans.append((begin, len(masks)))
    return spans


def span_keys(group: ScoredGroup) -> list[list[str]]:
    """Per sequence, the key of each generated span: context + the span, the sequence the
    server booked the turn's completion under."""
    return [
        [sequence_key(tokens[:end]) for _, end in generated_spans(masks)]
        for tokens, masks in zip(group.tokens, group.masks, strict=True)
    ]


def token_versions(group: ScoredGroup, runs: list[list[VersionRuns | None]]) -> list[list[int]] | None:
    """Per sequence, the weight version of each completion position, from the server's
    bookings of its spans (`runs`, aligned with `span_keys`); None if any span is unknown
    (the group is then unversioned as a whole: a partly known one would look fresher
    than it is)."""
    out: list[list[int]] = []
    for tokens, masks, seq_runs in zip(group.tokens, group.masks, runs, strict=True):
        spans, start = generated_spans(masks), prompt_length(masks)
        if not spans:
            return None
        known: list[int | None] = [None] * (len(tokens) - start)
        for (begin, end), booked in zip(spans, seq_runs, strict=True):
            versions = from_runs(booked) if booked is not None else []
            if len(versions) < end - begin:  # unknown, or the span is not a completion's tail
                return None
            known[begin - start : end - start] = versions[len(versions) - (end - begin) :]
        previous = next(v for v in known if v is not None)
        filled = []
        for v in known:
            previous = v if v is not None else previous
            filled.append(previous)
        out.append(filled)
    return out


def to_sample(group: ScoredGroup, i: int, version: int, versions: list[int] | None = None) -> tuple[list[int], Sample]:
    """Sequence i as (its prompt ids, its sample); `versions`: the weight version of each
    completion token (`token_versions`), or None: all are booked under `version`."""
    tokens, masks = group.tokens[i], group.masks[i]
    start = prompt_length(masks)
    completion = tokens[start:]
    trained = [m != CONTEXT for m in masks[start:]]
    has_logprobs = group.inference_logprobs is not None
    logprobs = group.inference_logprobs[i][start:] if has_logprobs else [0.0] * len(completion)
    advantages = group.advantages[i][start:] if group.advantages is not None else None
    if advantages is not None and is_zeroed(group, i):
        advantages = [0.0] * len(completion)
    sample = Sample(
        completion_ids=completion,
        logprobs=[float(x) for x in logprobs],
        finish_reason="stop",
        weight_versions=versions if versions is not None else [version] * len(completion),
        has_logprobs=has_logprobs,
        loss_mask=None if all(trained) else trained,
        advantages=advantages,
    )
    return tokens[:start], sample


def is_zeroed(group: ScoredGroup, i: int) -> bool:
    override = (group.overrides or [None] * len(group.tokens))[i] or {}
    return bool(override.get("set_advantage_to_zero", False))


def to_group(group: ScoredGroup, index: int, version: int, versions: list[list[int]] | None = None) -> Group:
    """The polyrl group of an Atropos group: the prompt is its first sequence's; a
    sequence with another context keeps its own (`Sample.prompt_ids`). `versions`: per
    sequence, as `to_sample`'s."""
    pairs = [to_sample(group, i, version, versions[i] if versions else None) for i in range(len(group.tokens))]
    prompt_ids = pairs[0][0]
    for ids, sample in pairs:
        if ids != prompt_ids:
            sample.prompt_ids = ids
    columns = {} if group.env_id is None else {"env_id": group.env_id}
    zeroed = [is_zeroed(group, i) for i in range(len(pairs))]
    return Group(
        prompt=Prompt(index=index, text="", prompt_ids=prompt_ids, columns=columns),
        samples=[s for _, s in pairs],
        rewards=[float(s) for s in group.scores],
        zero_advantage=zeroed if any(zeroed) else None,
    )


def check_group(group: ScoredGroup, vocab_size: int, max_token_len: int) -> str | None:
    """Why the learner cannot train on `group` (None: it can)."""
    longest = max(len(t) for t in group.tokens)
    if longest > max_token_len:
        return f"a sequence of {longest} tokens is longer than max_token_len={max_token_len}"
    bad = [t for seq in group.tokens for t in seq if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} is outside the model's vocabulary of {vocab_size}"
    return None
