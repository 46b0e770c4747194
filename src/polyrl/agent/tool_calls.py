"""Tool calls in a reply's text, in the format the model's chat template teaches it.

`hermes` is the format of Qwen2.5, Qwen3 and the Hermes models (vLLM's and SGLang's
`hermes` / `qwen25` parsers): each call a JSON object `{"name": ..., "arguments": {...}}`
between `<tool_call>` and `</tool_call>`; the text before the first call is the reply's
content. A call whose JSON does not parse stays in the content, so the environment sees
what the model wrote and the episode goes on (a malformed call is the model's mistake to
learn from, not an error).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's API gives it."""


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply's text; `parser` "none" finds no call."""
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    calls: list[ToolCall] = []
    for body in HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")].strip(), calls
