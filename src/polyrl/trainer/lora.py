"""The learner's side of LoRA (`model.lora`): adapters applied with PEFT, saved and
loaded in PEFT's format, and published as adapter versions (`polyrl.engine.lora`).

PEFT injects its LoRA layers into the model it is given, in place: the learner and the
colocated engine keep calling the same HF model, whose target linears now add
scale * B(A(x)); the `PeftModel` wrapper is kept beside it for what only it does
(saving, state dicts, `disable_adapter()` for the KL reference, merging).
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import LoraConfig
from polyrl.engine.lora import LoraSpec, all_linear, base_fingerprint, pack, pairs_from_peft_state, target_names
from polyrl.models.moe import has_moe

if TYPE_CHECKING:
    from peft import PeftModel

# PEFT is imported by the functions that use it: every `polyrl train` imports this module,
# and a run without LoRA need not pay for PEFT's import at its start.

log = logging.getLogger(__name__)

ADAPTER = "default"
RANDOM_BASE = (
    "model.lora on the offline tiny model (no model.path), a random init: LoRA trains the decoder's linear layers only, "
    'the embeddings (tied to the LM head) stay random, and it barely learns (README "LoRA"); give it a model that '
    "knows the task as model.path, e.g. a full fine-tuning run's final_model"
)
"""Measured on the main job's task, 40 steps: reward 0.040 with LoRA against 0.39 with full
fine-tuning, and 0.057 with full fine-tuning that kept the embeddings frozen."""


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    """Freeze `model` and inject trainable adapters (B = 0: the policy starts as the base).
    On a mixture of experts, all-linear means the attention projections: the experts and
    the router stay frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules
    if targets == "all-linear" and has_moe(model):
        # PEFT would map "all-linear" on a mixture of experts to the experts' 3-D weights
        # and the router too (`target_parameters`), which engines cannot merge yet
        targets = list(all_linear(model))
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none"
    )
    with warnings.catch_warnings():
        # PEFT reads `model.is_gradient_checkpointing` (off here: the learner enables it
        # later, its own way), a property that transformers 5 deprecated: every LoRA run
        # printed its FutureWarning
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft = get_peft_model(model, peft_cfg, adapter_name=ADAPTER)
    reached = getattr(peft.peft_config[ADAPTER], "target_parameters", None)
    if reached:
        raise ValueError(
            f"model.lora.target_modules={cfg.target_modules} reaches the experts' or the router's weights "
            f"({', '.join(sorted(reached))}): engines merge adapters on linear layers only, so LoRA on a mixture "
            "of experts adapts its attention (all-linear, or q_proj, k_proj, v_proj, o_proj)"
        )
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.3f%%)",
        cfg.rank,
        cfg.alpha,
        ",".join(adapter_spec(peft).target_modules),
        num_trainable,
        num_total,
        100 * num_trainable / num_total,
    )
    return peft


def adapter_spec(peft: PeftModel) -> LoraSpec:
    cfg = peft.peft_config[ADAPTER]
    targets = cfg.target_modules if not isinstance(cfg.target_modules, str) else [cfg.target_modules]
    return LoraSpec(
        base_model=base_fingerprint(peft.get_base_model().config),
        rank=cfg.r,
        alpha=cfg.lora_alpha,
        target_modules=target_names(targets),
    )


def adapter_version(peft: PeftModel) -> dict[str, torch.Tensor]:
    """The adapters as a version to publish: the A/B matrices (detached, not copied) and
    the spec the workers check."""
    from peft import get_peft_model_state_dict

    return pack(adapter_spec(peft), pairs_from_peft_state(get_peft_model_state_dict(peft, adapter_name=ADAPTER)))


def adapters_off(peft: PeftModel):
    """The base model, for the KL reference: a context with every adapter disabled."""
    return peft.disable_adapter()


def load_adapter(peft: PeftModel, path: Path) -> None:
    """The adapter weights saved by `save_adapter`, exactly, into the injected layers."""
    from peft import set_peft_model_state_dict

    state = load_file(path / "adapter_model.safetensors", device=str(peft.get_base_model().device))
    result = set_peft_model_state_dict(peft, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing:
        raise ValueError(f"adapter in {path} lacks {missing[:3]}")


def save_merged(peft: PeftModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """The base with the adapter merged in, as a plain HF model. Merges a copy: the
    trainer's own model keeps its adapters (one more model's memory, at the end of a run)."""
    merged = copy.deepcopy(peft).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
