"""From scored groups to padded micro-batches under a token budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from polyrl.protocol.samples import Group, Sample
from polyrl.protocol.version import WeightVersion


@dataclass
class SeqItem:
    """One sample, ready to train on."""

    token_ids: list[int]  # prompt + completion
    prompt_len: int
    behav_logp: list[float]  # one per completion token
    advantage: float
    current: list[bool] | None = None
    """Per completion token: sampled by the weights the learner held when its step began
    (None: every token). Only those measure the engine/trainer mismatch."""
    behav_known: bool = True
    """False: no behaviour log-probs came with the sample; the learner takes its own (the
    sample counts as on-policy for the weights the learner holds when it arrives)."""
    loss_mask: list[bool] | None = None
    """Per completion token: part of the loss (None: every token)."""
    token_advantages: list[float] | None = None
    """Per completion token; None: `advantage` for every token."""
    lags: list[int] | None = None
    """Per completion token: how many versions older than the learner's weights at the
    step's start its sampling weights were (None: all 0, or unknown)."""
    routes: np.ndarray | None = None
    """The engine's experts for positions 0 .. len(token_ids) - 2 ([rows, moe_layers * k]),
    for `algo.router_replay = "R3"` (None: not reported)."""

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_loss_tokens(self) -> int:
        """The completion tokens the loss counts (its token-mean denominator)."""
        return self.num_completion_tokens if self.loss_mask is None else sum(self.loss_mask)

    @property
    def num_current_tokens(self) -> int:
        if self.current is None and self.loss_mask is None:
            return self.num_completion_tokens
        current = self.current or [True] * self.num_completion_tokens
        counted = self.loss_mask or [True] * self.num_completion_tokens
        return sum(c and m for c, m in zip(current, counted, strict=True))


def group_items(
    group: Group, advantages: list[float], version: WeightVersion | None = None, drop_truncated: bool = False
) -> list[SeqItem]:
    """version: the learner's weight version at the step's start (None: no token lags).
    drop_truncated: leave out samples cut at their length budget (`algo.overlong_filter`)."""
    return [
        sample_item(group.prompt.prompt_ids if s.prompt_ids is None else s.prompt_ids, s, a, version)
        for s, a in zip(group.samples, advantages, strict=True)
        if s.completion_ids  # an empty completion carries no token to learn from
        and not (drop_truncated and s.finish_reason == "length")
    ]


def sample_item(prompt_ids: list[int], s: Sample, advantage: float, version: WeightVersion | None) -> SeqItem:
    current, lags = None, None
    if not s.has_logprobs:  # no engine log-probs: nothing to measure the mismatch with
        current = [False] * len(s.completion_ids)
    elif version is not None and any(v != version for v in s.weight_versions):
        current = [v == version for v in s.weight_versions]
        lags = [version - v for v in s.weight_versions]
    return SeqItem(
        prompt_ids + s.completion_ids,
        len(prompt_ids),
        s.logprobs,
        advantage,
        current,
        s.has_logprobs,
        s.loss_mask,
        s.advantages,
        lags,
        s.routed_experts,
    )


def expert_routes(items: list[SeqItem], starts: list[int], num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The items' engine routes laid out as a forward's rows (item i's position p at row
    starts[i] + p): ([num_rows, width] int64, [num_rows] known). Rows no route covers
    (padding, each item's last token, items without routes) are unknown: the router's own
    choice stands there. None: no item has routes."""
    with_routes = [(start, it.routes) for start, it in zip(starts, items, strict=True) if it.routes is not None]
    if not with_routes:
        return None
    width = with_routes[0][1].shape[1]
    routes = np.zeros((num_rows, width), dtype=np.int64)
    known = np.zeros(num_rows, dtype=bool)
    for start, r in with_routes:
        routes[start : start + len(r)] = r
        known[start : start + len(r)] = True
    return torch.from_numpy(routes), torch.from_numpy(known)


def pack_micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Greedy packing in arrival order: a micro-batch's padded size (rows x longest) stays
    within `max_tokens`; a single longer sequence gets a micro-batch of its own."""
    batches: list[list[SeqItem]] = []
    current: list[SeqItem] = []
    longest = 0
    for item in items:
        new_longest = max(longest, len(item.token_ids))
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], len(item.token_ids)
        current.append(item)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    target_ids: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    mask: torch.Tensor  # [B, L-1] 1.0 where the target is a completion token
    behav_logp: torch.Tensor  # [B, L-1] engine log-probs aligned with target_ids
    advantages: torch.Tensor  # [B], or [B, L-1] when some item has per-token advantages
    current_mask: torch.Tensor  # [B, L-1] 1.0 where the target was sampled by the step's starting weights
    behav_known: torch.Tensor | None = None
    """[B, L-1] 1.0 where behav_logp is the engine's; None: everywhere (the learner fills the rest)."""
    lag: torch.Tensor | None = None
    """[B, L-1] int64 `SeqItem.lags` on the grid; None: every token's lag is 0."""
    old_logp: torch.Tensor | None = None  # [B, L-1]
    ref_logp: torch.Tensor | None = None  # [B, L-1]
    packed: Any = None
    """The same sequences as one padding-free row (packing.PackedRow), when trained packed."""
    routes: list[torch.Tensor] | None = None
    """`algo.router_replay`: the experts of each row in each MoE layer ([rows, k] per layer),
    replayed in the training forwards: the proximal forward's (R2), or the engine's (R3,
    from `expert_routes`, where `routes_known` says which rows have one)."""
    expert_routes: torch.Tensor | None = None
    """R3: the engine's routes of the rows the model runs on ([rows, moe_layers * k])."""
    routes_known: torch.Tensor | None = None
    """R3: [rows] bool, the rows `expert_routes` covers."""

    def to(self, device: torch.device) -> MicroBatch:
        moved = {
            k: (v if v is None or isinstance(v, int | float) else to_device(v, device)) for k, v in vars(self).items()
        }
        return MicroBatch(**moved)


def to_device(value: Any, device: torch.device) -> Any:
    """A CPU tensor copied to `device` without waiting: to CUDA through pinned memory (a
    pageable copy makes the host wait for the device, once per tensor: ~70 waits per
    mini-batch on the learner's hot path); anything else through its own `.to`."""
    if isinstance(value, torch.Tensor) and device.type == "cuda" and value.device.type == "cpu":
        return value.pin_memory().to(device, non_blocking=True)
    return value.to(device)


def collate(items: list[SeqItem], pad_id: int, with_routes: bool = True) -> MicroBatch:
    """Filled in numpy (a row assignment from a list is ~10x cheaper there than through
    torch.tensor), handed to torch without a copy."""
    rows, width = len(items), max(len(it.token_ids) for it in items)
    input_ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width - 1), dtype=np.float32)
    behav = np.zeros((rows, width - 1), dtype=np.float32)
    current = np.zeros((rows, width - 1), dtype=np.float32)
    is_per_token = any(it.token_advantages is not None for it in items)
    advantages = np.zeros((rows, width - 1), dtype=np.float32) if is_per_token else None
    behav_known = None if all(it.behav_known for it in items) else np.zeros((rows, width - 1), dtype=np.float32)
    lag = None if all(it.lags is None for it in items) else np.zeros((rows, width - 1), dtype=np.int64)
    for i, it in enumerate(items):
        n = len(it.token_ids)
        input_ids[i, :n] = it.token_ids
        attention_mask[i, :n] = 1
        # Target column t predicts token t+1: completion tokens sit at prompt_len-1 .. n-2.
        span = slice(it.prompt_len - 1, n - 1)
        mask[i, span] = 1.0 if it.loss_mask is None else it.loss_mask
        behav[i, span] = it.behav_logp
        current[i, span] = 1.0 if it.current is None else it.current
        if advantages is not None:
            advantages[i, span] = it.advantage if it.token_advantages is None else it.token_advantages
        if behav_known is not None:
            behav_known[i, span] = float(it.behav_known)
        if lag is not None and it.lags is not None:
            lag[i, span] = it.lags
    input_ids, attention_mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    mask, behav, current = torch.from_numpy(mask), torch.from_numpy(behav), torch.from_numpy(current)
    if advantages is None:  # one per sequence: [B]
        advantages = np.array([it.advantage for it in items], dtype=np.float32)
    advantages = torch.from_numpy(advantages)
    behav_known = None if behav_known is None else torch.from_numpy(behav_known)
    position_ids = torch.arange(width).expand(rows, width).contiguous()
    routed = expert_routes(items, [i * width for i in range(rows)], rows * width) if with_routes else None
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        target_ids=input_ids[:, 1:],
        mask=mask,
        behav_logp=behav,
        advantages=advantages,
        current_mask=current,
        behav_known=behav_known,
        lag=None if lag is None else torch.from_numpy(lag),
        expert_routes=None if routed is None else routed[0],
        routes_known=None if routed is None else routed[1],
    )
