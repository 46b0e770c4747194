"""What a run learns: its prompts (`PromptSource`, fitted to the model's context) and
the reward functions that score their completions (`RewardPool`)."""

from __future__ import annotations

import logging

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import SCORED_SOURCES, RunConfig
from polyrl.data.rewards import RewardPool
from polyrl.data.source import PromptSource

log = logging.getLogger(__name__)


def prompts_and_rewards(
    cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel
) -> tuple[PromptSource, RewardPool | None]:
    """The prompt source (at its first prompt) and the reward pool: `reward.functions`, or
    the data source's own; none for a source in `SCORED_SOURCES` (its pool would start a
    process, and import the math reward's libraries, for nothing). The caller closes the pool."""
    source = PromptSource(cfg.data, tokenizer, cfg.trainer.seed)
    fit_prompts_to_context(source, model, cfg.rollout.max_new_tokens)
    if cfg.data.source in SCORED_SOURCES:
        return source, None
    functions = cfg.reward.functions or [source.default_reward]
    pool = RewardPool(functions, cfg.reward.weights, cfg.reward.num_workers, cfg.reward.timeout_s)
    return source, pool


def fit_prompts_to_context(source: PromptSource, model: PreTrainedModel, max_new_tokens: int) -> None:
    """Prompt + completion must fit the model's positions: lower the prompt limit if needed."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context is None:
        return
    if max_new_tokens >= context:
        raise ValueError(f"rollout.max_new_tokens ({max_new_tokens}) leaves no room in the model's {context} positions")
    if source.max_prompt_tokens + max_new_tokens > context:
        source.max_prompt_tokens = context - max_new_tokens
        log.info("prompts limited to %d tokens to fit the model's %d positions", source.max_prompt_tokens, context)
