"""One sample being generated: its tokens, KV blocks and progress.

A sequence's state changes in one place only, `Engine._postprocess` (plus preemption and
abort in the scheduler), so the invariants below hold between steps:
`num_computed_tokens < num_tokens` while it is unfinished (the last token's KV is computed
by the step that feeds it), and `block_table` covers `num_computed_tokens`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from polyrl.engine.types import FinishReason
from polyrl.protocol.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    rid: str
    index: int  # sample index within its request
    token_ids: list[int]  # prompt (incl. resumed tokens) + generated here
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    num_forks: int = 1  # > 1: a shared-prefill parent; forks into samples index..index+num_forks-1
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    routes: torch.Tensor | None = None
    """`return_routed_experts`: [capacity, moe_layers, k] int16 on the host, row p the
    experts of position p once a step has fed it."""
    routes_sent: int = 0
    """Positions whose routes went out in a delta already."""
    block_keys: list[int] = field(default_factory=list)
    """The prefix cache's keys of its first full blocks, hashed once: a key depends only on
    the tokens up to its block's end, and tokens are only ever appended."""
    kv_epoch: int = -1
    """The weight version count (`BlockManager.epoch`) its KV blocks were first filled in:
    the prefix cache keeps them only if it is still the current one."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def store_routes(self, start: int, rows: torch.Tensor) -> None:
        """The routes of positions start.. (a recomputed position's overwrite its own)."""
        end = start + rows.shape[0]
        held = 0 if self.routes is None else len(self.routes)
        if held < end:  # grown by doubling: a decode step adds one row
            grown = rows.new_zeros((max(end, 2 * held), *rows.shape[1:]))
            if self.routes is not None:
                grown[:held] = self.routes
            self.routes = grown
        self.routes[start:end] = rows

    def take_routes(self) -> torch.Tensor | None:
        """The routes not yet sent, up to the position that produced the newest token."""
        if self.routes is None:
            return None
        end = self.num_tokens - 1
        taken = self.routes[self.routes_sent : end].clone()
        self.routes_sent = max(self.routes_sent, end)
        return taken

    def append(self, token_id: int, logprob: float, weight_version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.weight_versions.append(weight_version)
        if token_id in self.stop_ids:
            self.finish_reason, self.matched_stop = "stop", token_id
        elif self.num_generated >= self.sampling.max_new_tokens:
            self.finish_reason = "length"
