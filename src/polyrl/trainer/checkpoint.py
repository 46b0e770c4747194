"""Checkpoints: the model in HF format plus everything needed to continue bit-for-bit.

Layout: `RUN_DIR/checkpoints/step_000050/{model/, trainer_state.pt}`; with LoRA, `adapter/`
(PEFT's format, adapters only) instead of `model/`, and only the adapters' optimizer state. A checkpoint is
written into a temporary directory and renamed into place, so a crash mid-save never
leaves a half checkpoint that resume would pick. The layout does not depend on the number
of ranks that trained (distributed.py gathers whole states), so a run resumes on any.
"""

from __future__ import annotations

import logging
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.protocol.version import WeightVersion
from polyrl.trainer.lora import save_merged

if TYPE_CHECKING:
    from peft import PeftModel

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
MODEL_DIR, ADAPTER_DIR = "model", "adapter"


@dataclass
class TrainState:
    """Where a resumed run continues from. Between steps (after `Run.end_step`) its fields
    agree with each other and with the model, optimizer and RNG: a save point."""

    step: int = 0  # steps completed
    cursor: int = 0  # prompts taken from the source
    weight_version: WeightVersion = 0
    """The policy's version, counted here and nowhere else in the trainer's process (it
    must survive a resume): the rollouts are told it by `publish`, the learner and the
    fully asynchronous feed are given it."""
    pending: list[int] = field(default_factory=list)
    """Fully asynchronous: prompts taken but not trained on (in flight), generated again on resume."""

    def next_version(self) -> WeightVersion:
        """The version of the weights the learner has just updated (one per step)."""
        self.weight_version += 1
        return self.weight_version


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_peft(model: object) -> bool:
    """Whether `model` is a PEFT wrapper. PEFT is imported where LoRA is applied
    (`trainer/lora.py`), not at the trainer's start: a run without LoRA never imports it,
    and a PeftModel exists only once it has been."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def save_hf(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    model_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """model_state: the whole weights of a sharded model (None: the model's own). A
    PeftModel saves its adapters only."""
    model.save_pretrained(out, state_dict=model_state, safe_serialization=True)
    tokenizer.save_pretrained(out)


def save_checkpoint(
    run_dir: Path,
    state: TrainState,
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    model_state: dict[str, torch.Tensor] | None = None,
    rng: dict[str, Any] | None = None,
) -> Path:
    """rng: the RNG states to resume with (None: the current ones)."""
    final = run_dir / "checkpoints" / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp / (ADAPTER_DIR if is_peft(model) else MODEL_DIR), model_state)
    torch.save(
        {
            "state": vars(state),
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": rng if rng is not None else rng_state(),
        },
        tmp / STATE_FILE,
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    log.info("saved checkpoint %s", final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [
        p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp")
    ]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """{"state": TrainState fields, "optimizer", "scheduler", "rng"}. Every rank reads it;
    mmap keeps that to one copy in the page cache."""
    return torch.load(ckpt / STATE_FILE, weights_only=False, mmap=True)  # our own file: RNG states need pickle


def export_final_model(
    run_dir: Path, ckpt: Path, *, peft: PeftModel | None, tokenizer: PreTrainedTokenizerBase, merged: bool
) -> Path:
    """The final checkpoint `ckpt`'s model (an HF directory with the tokenizer), as
    final_model/; with LoRA (`peft`), its adapter (PEFT's format), and with `merged` the
    merged model as final_model_merged/."""
    out = run_dir / "final_model"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(ckpt / (ADAPTER_DIR if peft is not None else MODEL_DIR), out)
    if peft is not None and merged:
        merged_dir = run_dir / "final_model_merged"
        shutil.rmtree(merged_dir, ignore_errors=True)
        save_merged(peft, tokenizer, merged_dir)
        log.info("merged model in %s", merged_dir)
    return out
