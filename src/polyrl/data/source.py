"""The prompt stream: a synthetic task or a local dataset, templated and tokenized.

The only state is `cursor` (prompts handed out so far): record `i` is a pure function of
the seed and `i`, so a checkpoint stores one integer and resume replays the same prompts.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from polyrl.config import ConfigError, DataConfig
from polyrl.data.tasks import get_task, task_record
from polyrl.protocol.samples import Prompt

log = logging.getLogger(__name__)

MATH_REWARD = "polyrl.data.math:math_reward"
MAX_SKIPS_IN_A_ROW = 1000


class PromptSource:
    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.cursor = 0
        self.num_skipped = 0
        self.max_prompt_tokens = cfg.max_prompt_tokens  # the run may lower it to fit the model
        if cfg.source == "agent":  # items for the episode function, as they are
            from polyrl.data.math import read_rows

            self._dataset = read_rows(cfg.path)
            self._task = None
            self.default_reward: str | None = None  # episodes return their rewards
        elif cfg.task == "dataset":
            if not cfg.path:
                raise ValueError("data.path: required when data.task = 'dataset'")
            from polyrl.data.math import load_prompt_dataset

            self._dataset = load_prompt_dataset(cfg)
            self._task = None
            self.default_reward = MATH_REWARD
        else:
            self._dataset = None
            self._task = get_task(cfg.task)
            self.default_reward = self._task.reward
        use_template = cfg.apply_chat_template
        self._chat = bool(tokenizer.chat_template) if use_template is None else use_template
        if self._chat and not tokenizer.chat_template:
            raise ValueError("data.apply_chat_template: the tokenizer has no chat template")

    def record(self, index: int) -> dict[str, Any]:
        if self._task is not None:
            return task_record(self._task, self.seed, index)
        epoch, pos = divmod(index, len(self._dataset))
        return dict(self._dataset[int(self._epoch_order(epoch)[pos])])

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        # A fresh permutation per epoch, fixed by (seed, epoch): resumable without state.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._dataset))

    def _budget(self, rec: dict[str, Any], index: int) -> int | None:
        """The record's own generation budget (`data.max_new_tokens_key`), taken out of
        the columns that go to rewards."""
        key = self.cfg.max_new_tokens_key
        if key is None:
            return None
        value = rec.pop(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # a column with a missing value somewhere is read as float
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"config error: data.max_new_tokens_key: prompt {index} has {key}={value!r}, not a positive integer"
            )
        return value

    def encode(self, text: str) -> list[int]:
        text = self.cfg.prompt_template.format(prompt=text)
        if self._chat:
            messages = [{"role": "user", "content": text}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(text).input_ids

    def prompt_at(self, index: int) -> Prompt | None:
        """Prompt `index` of the stream (None: longer than `max_prompt_tokens`). A pure
        function of the seed and `index`: a resumed run builds the prompts it had in flight."""
        rec = self.record(index)
        if self.cfg.source == "agent":  # the episode function renders its own messages
            return Prompt(index=index, text="", prompt_ids=[], columns=rec)
        budget = self._budget(rec, index)
        text = str(rec.pop("prompt"))
        ids = self.encode(text)
        if len(ids) > self.max_prompt_tokens:
            log.debug("skipping prompt %d: %d tokens > %d", index, len(ids), self.max_prompt_tokens)
            return None
        return Prompt(index=index, text=text, prompt_ids=ids, columns=rec, max_new_tokens=budget)

    def take(self, count: int) -> list[Prompt]:
        """The next `count` prompts; over-long ones are skipped (and counted), never cut."""
        prompts: list[Prompt] = []
        skipped_before = self.num_skipped
        skipped_in_a_row = 0
        while len(prompts) < count:
            prompt = self.prompt_at(self.cursor)
            self.cursor += 1
            if prompt is None:
                self.num_skipped += 1
                skipped_in_a_row += 1
                if skipped_in_a_row >= MAX_SKIPS_IN_A_ROW:
                    raise ConfigError(
                        f"config error: data.max_prompt_tokens: {skipped_in_a_row} prompts in a row are longer than "
                        f"{self.max_prompt_tokens} tokens (the limit, lowered to fit the model's context)"
                    )
                continue
            skipped_in_a_row = 0
            prompts.append(prompt)
        if self.num_skipped > skipped_before:
            log.warning(
                "skipped %d prompts longer than %d tokens", self.num_skipped - skipped_before, self.max_prompt_tokens
            )
        return prompts
