"""Routing replay within the trainer (`algo.router_replay = "R2"`, verl's name).

A mixture of experts routes each token to its top-k experts, and a small change of the
router's weights can change that choice: after the first of several PPO epochs, the
current policy may route a token through other experts than the proximal policy did, so
the ratio pi / pi_old compares two different sub-networks and swings far more than the
update itself moved (the reason Qwen's GSPO paper gives for its "Routing Replay"). R2
records the experts each token went through in the proximal (old log-prob) forward and
makes every training forward of the same micro-batch use them: the routing weights are
the current router's probabilities of those experts, so the router still learns through
them. With one PPO epoch the training forward is itself the proximal one, and R2 changes
nothing. R3 (rollout routing replay, arXiv 2510.23027) replays the rollout engine's experts
instead, in every forward of the learner, the proximal one included: the engine and the
learner then run the same sub-network, whatever the last update did to the routers.

Hooks on each layer's router (transformers' `*TopKRouter`, whose outputs are logits,
routing weights and expert indices) record and replace; they stay set through the
backward pass, so a checkpointed layer recomputes with the same experts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from polyrl.models.moe import moe_routers


class RouterReplay:
    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("algo.router_replay needs a mixture-of-experts model (this one has no router)")
        self.norm_topk = bool(getattr(model.config, "norm_topk_prob", False))
        self._recorded: list[torch.Tensor] | None = None
        self._replaying: list[torch.Tensor] | None = None
        self._known: torch.Tensor | None = None
        self.num_experts_per_tok = model.config.num_experts_per_tok
        self.num_changed = torch.zeros((), dtype=torch.float64)
        """Rows (token x layer) replayed whose current router would have chosen other experts."""
        self.num_rows = 0
        for i, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, i))

    def _hook(self, layer: int, module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]):  # noqa: ANN202
        logits, weights, indices = output
        if self._recorded is not None:
            self._recorded.append(indices.detach())
            return None
        if self._replaying is None:
            return None
        forced = self._replaying[layer]
        if self._known is not None:  # rows without a replayed route keep their own
            forced = torch.where(self._known[:, None], forced, indices)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        forced_weights = probs.gather(-1, forced)
        if self.norm_topk:
            forced_weights = forced_weights / forced_weights.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            changed = (indices.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
            self.num_changed = self.num_changed.to(changed.device) + changed.sum()
            self.num_rows += changed.numel()
        return logits, forced_weights.to(weights.dtype), forced

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the experts of one forward: one [rows, k] tensor per MoE layer."""
        recorded: list[torch.Tensor] = []
        self._recorded = recorded
        try:
            yield recorded
        finally:
            self._recorded = None

    def replay(self, routes: list[torch.Tensor] | None, known: torch.Tensor | None = None) -> None:
        """Forwards from now on use `routes` ([rows, k] per MoE layer) where `known` ([rows]
        bool; None: everywhere), else their own router's choice (routes None: everywhere)."""
        self._replaying, self._known = routes, known

    def engine_routes(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """R3: [rows, moe_layers * k] as reported by engines -> [rows, k] per MoE layer."""
        per_layer = flat.view(flat.shape[0], len(self.routers), self.num_experts_per_tok)
        return list(per_layer.unbind(1))

    def take_changed_frac(self) -> float | None:
        """The share of replayed rows whose own routing differed, since the last call."""
        if not self.num_rows:
            return None
        frac = float(self.num_changed) / self.num_rows
        self.num_changed, self.num_rows = torch.zeros((), dtype=torch.float64), 0
        return frac
