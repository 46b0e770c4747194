"""Telling mixture-of-experts layers apart, for the parts that treat them differently
(the engine's decode path and route capture, LoRA's targets, the learner's router hooks)."""

from __future__ import annotations

from torch import nn


def is_moe_block(mlp: nn.Module) -> bool:
    """A mixture-of-experts MLP (transformers' sparse blocks: a router `gate` and their
    `experts`), not a dense SwiGLU one."""
    return hasattr(mlp, "experts")


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """`model`'s (an HF causal LM's) mixture-of-experts MLPs, in layer order."""
    return [layer.mlp for layer in model.model.layers if is_moe_block(layer.mlp)]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s mixture-of-experts layers, in layer order: what the
    engine's route capture and the learner's replay and aux-loss hooks attach to."""
    return [mlp.gate for mlp in moe_blocks(model)]


def has_moe(model: nn.Module) -> bool:
    """Any decoder layer of `model` (an HF causal LM) is a mixture of experts."""
    return bool(moe_blocks(model))


def attention_linears(model: nn.Module) -> list[str]:
    """The attention projections' names (`q_proj`, ...): what LoRA adapts on a mixture of
    experts (`polyrl.trainer.lora.apply_lora`)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".self_attn." in name
        }
    )
