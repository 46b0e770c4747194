"""The mixture-of-experts load-balancing loss as an option (`algo.router_aux_loss_coef`).

Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6: `num_experts * sum_e
f_e * P_e`, the share of routed tokens times the mean router probability per expert) keeps
experts evenly loaded during pretraining. RL recipes mostly leave it off (0, the default)
or small: the router already routes well, and the policy gradient alone may drift it.

The router logits are read by forward hooks on each layer's router (transformers'
`*TopKRouter`, whose first output they are), so the learner's forward (padded or packed)
stays the one that computes the log-probs; the loss itself is transformers' own
`load_balancing_loss_func` of the model's module.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

from polyrl.models.moe import moe_routers


class RouterLogits:
    """Records each MoE layer's router logits ([rows, num_experts]) during `recording()`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.routers = moe_routers(model)
        self.logits: list[torch.Tensor] = []
        self._on = False
        for router in self.routers:
            router.register_forward_hook(self._record)
        config = model.config
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self._loss = sys.modules[type(model).__module__].load_balancing_loss_func

    def _record(self, module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> None:
        if self._on:
            self.logits.append(output[0])

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        self.logits, self._on = [], True
        try:
            yield self.logits
        finally:
            self._on = False

    def loss(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The load-balancing loss of the recorded forward; `attention_mask` [B, L] leaves
        padding rows out (None: every row counts, as in a packed row)."""
        return self._loss(tuple(self.logits), self.num_experts, self.top_k, attention_mask)
