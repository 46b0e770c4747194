"""The environment's side of each turn, in tokens, from the model's chat template.

The first call's prompt is the template applied to its messages. For every later call
only the messages added since the last reply are rendered, and appended to the tokens
the engine already holds: rendering the whole conversation again would tokenize the
model's own text a second time, and a re-tokenized reply is not, in general, the token
sequence that was sampled (nor are its log-probs known). The new messages are rendered
after a fixed stand-in conversation (one user message and one assistant reply) and cut
off where the stand-in ends, so the template renders them as it would in place (a tool
message after an assistant turn, say); the template's closing of the real reply (Qwen's
newline after `<|im_end|>`, the tiny model's `|`) is taken from how it closes the
stand-in reply, less the stop token the engine already sampled.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

STAND_IN_USER = {"role": "user", "content": "x"}
STAND_IN_REPLY = "x"


class TemplateError(ValueError):
    """The chat template cannot be applied turn by turn (see `Renderer`)."""


class Renderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_token_ids: tuple[int, ...]) -> None:
        if not tokenizer.chat_template:
            raise TemplateError("agent episodes need a tokenizer with a chat template")
        self.tokenizer, self.stop_token_ids = tokenizer, set(stop_token_ids)
        base = self._text([STAND_IN_USER], None, True)
        replied = self._text([STAND_IN_USER, _assistant(STAND_IN_REPLY)], None, False)
        if not replied.startswith(base) or STAND_IN_REPLY not in replied[len(base) :]:
            raise TemplateError("the chat template does not render an assistant reply after its generation prompt")
        turn = replied[len(base) :]
        self.closing = turn[turn.index(STAND_IN_REPLY) + len(STAND_IN_REPLY) :]
        """What the template writes after a reply's text (end-of-turn marker, newline)."""

    def _text(self, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids if text else []

    def first(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The first call's prompt: the whole conversation, templated, ready for a reply."""
        return self._encode(self._text(messages, tools, True))

    def after_reply(self, reply_ids: list[int], new: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The tokens that follow a sampled reply for the next call: the template's closing
        of the reply (less a stop token the engine sampled, which closes it already), the
        `new` messages, and the generation prompt."""
        closing = self.closing
        if reply_ids and reply_ids[-1] in self.stop_token_ids:
            stop = self.tokenizer.decode(reply_ids[-1:])
            if closing.startswith(stop):
                closing = closing[len(stop) :]
        before = [STAND_IN_USER, _assistant(STAND_IN_REPLY)]
        head = self._text(before, tools, False)
        full = self._text(before + new, tools, True)
        if not full.startswith(head):
            raise TemplateError(
                "the chat template renders a conversation's start differently once more messages follow, so "
                "turns cannot be appended token by token"
            )
        return self._encode(closing + full[len(head) :])


def _assistant(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}
