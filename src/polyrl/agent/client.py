"""The client an episode function plays with: `openai.AsyncOpenAI`'s chat interface,
recording the episode token-in, token-out.

    reply = await client.chat.completions.create(messages=messages, tools=tools)
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": ..., "content": "42"}]
    reply = await client.chat.completions.create(messages=messages, tools=tools)

An episode is one conversation that only grows: each call's `messages` are the last
call's, its reply, and what the environment says next. The engine is sent token ids,
the episode's transcript so far plus the new messages rendered by the chat template
(`render.py`), so the sequence the learner trains on is exactly what was sampled. A
call past the episode's bounds (`data.agent_max_turns` calls, `data.agent_max_tokens`
tokens in all) raises `EpisodeLimit` in the episode function.

Sampling is the run's (`rollout.*`): the learner computes log-probs at
`rollout.temperature`, so a call asking for another temperature, several choices,
streaming or stop strings is refused, as an OpenAI server refuses what it cannot honour.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from polyrl.agent.render import Renderer
from polyrl.agent.tool_calls import parse_tool_calls
from polyrl.agent.transcript import Transcript

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion
    from transformers import PreTrainedTokenizerBase

    from polyrl.protocol.samples import Sample

Generate = Callable[[list[int], int], Awaitable["Sample"]]
"""(prompt token ids, most new tokens) -> the engine's reply, one sample: how the client reaches the
fleet (`rollout/agent.py`) or, in tests, one engine."""

IGNORED = {"model", "tool_choice", "parallel_tool_calls", "user", "metadata", "store", "extra_body", "timeout"}
"""Arguments that change nothing here (`tool_choice` stays the model's: it decides)."""


class EpisodeLimit(Exception):
    """The episode reached `data.agent_max_turns` or `data.agent_max_tokens`: catch it to
    score the episode as it stands; left uncaught, the episode counts with reward 0."""


class AgentClient:
    def __init__(
        self,
        generate: Generate,
        tokenizer: PreTrainedTokenizerBase,
        renderer: Renderer,
        *,
        episode_id: str,
        temperature: float,
        max_new_tokens: int,
        max_turns: int,
        max_tokens: int,
        tool_parser: str = "hermes",
    ) -> None:
        self._generate, self.tokenizer, self.renderer = generate, tokenizer, renderer
        self.episode_id, self.temperature, self.max_new_tokens = episode_id, temperature, max_new_tokens
        self.max_turns, self.max_tokens, self.tool_parser = max_turns, max_tokens, tool_parser
        self.transcript = Transcript()
        self._said: list[dict[str, Any]] = []
        """The conversation the last call saw, and its reply: what the next call extends."""
        self._last_reply_len = 0
        self.chat = _Chat(self)

    async def create(
        self,
        *,
        messages: list[Any],
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        temperature: float | None = None,
        n: int | None = None,
        stream: bool | None = None,
        **extra: Any,
    ) -> ChatCompletion:
        self._check(temperature, n, stream, extra)
        conversation = [_as_dict(m) for m in messages]
        t = self.transcript
        if t.num_calls >= self.max_turns:
            raise EpisodeLimit(f"episode {self.episode_id}: data.agent_max_turns = {self.max_turns} calls reached")
        if t.num_calls == 0:
            context = self.renderer.first(conversation, tools)
        else:
            new = self._new_messages(conversation)
            last_reply = t.ids[len(t.ids) - self._last_reply_len :] if self._last_reply_len else []
            context = self.renderer.after_reply(last_reply, new, tools)
        room = self.max_tokens - len(t) - len(context)
        if room < 1:
            raise EpisodeLimit(f"episode {self.episode_id}: data.agent_max_tokens = {self.max_tokens} tokens reached")
        asked = max_completion_tokens or max_tokens
        budget = min(self.max_new_tokens, room, asked or self.max_new_tokens)
        reply = await self._generate(t.context + context, budget)  # (a failed call leaves no trace)
        t.add_context(context)
        t.add_reply(reply)
        self._last_reply_len = len(reply.completion_ids)
        completion = self._completion(reply, len(t) - len(reply.completion_ids))
        self._said = [*conversation, completion.choices[0].message.model_dump(exclude_none=True)]
        return completion

    def _check(self, temperature: float | None, n: int | None, stream: bool | None, extra: dict[str, Any]) -> None:
        if temperature is not None and abs(temperature - self.temperature) > 1e-6:
            raise ValueError(
                f"temperature={temperature}: agent episodes sample at rollout.temperature={self.temperature}, "
                "where the learner computes its log-probs"
            )
        if n not in (None, 1):
            raise ValueError("n: an agent episode is one conversation (rollout.n episodes make the group)")
        if stream:
            raise ValueError("stream: agent episodes take whole replies")
        refused = sorted(k for k, v in extra.items() if k not in IGNORED and v is not None)
        if refused:
            raise ValueError(f"unsupported argument(s) for agent episodes: {', '.join(refused)}")

    def _new_messages(self, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages after the last reply; the conversation before them must be the one
        already sent, and the last reply."""
        said = len(self._said)
        before, reply, new = conversation[: said - 1], conversation[said - 1 : said], conversation[said:]
        if [_key(m) for m in before] != [_key(m) for m in self._said[:-1]] or (
            not reply or reply[0].get("role") != "assistant"
        ):
            raise ValueError(
                f"episode {self.episode_id}: messages must extend the last call's messages and its reply "
                "(an episode is one conversation that only grows)"
            )
        if not new:
            raise ValueError(f"episode {self.episode_id}: no new message after the last reply")
        return new

    def _completion(self, reply: Sample, prompt_tokens: int) -> ChatCompletion:
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice
        from openai.types.completion_usage import CompletionUsage

        try:  # openai >= 1.99 (custom tools came then)
            from openai.types.chat.chat_completion_message_function_tool_call import (
                ChatCompletionMessageFunctionToolCall as ToolCallModel,
            )
            from openai.types.chat.chat_completion_message_function_tool_call import Function
        except ImportError:
            from openai.types.chat.chat_completion_message_tool_call import (
                ChatCompletionMessageToolCall as ToolCallModel,
            )
            from openai.types.chat.chat_completion_message_tool_call import Function

        ids = reply.completion_ids
        if ids and ids[-1] in self.renderer.stop_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text, self.tool_parser)
        turn = self.transcript.num_calls
        tool_calls = [
            ToolCallModel(
                id=f"call_{self.episode_id}_{turn}_{i}",
                type="function",
                function=Function(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(calls)
        ]
        message = ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls or None)
        return ChatCompletion(
            id=f"chatcmpl-{self.episode_id}-{turn}",
            object="chat.completion",
            created=int(time.time()),
            model="polyrl",
            choices=[Choice(index=0, message=message, finish_reason="tool_calls" if calls else reply.finish_reason)],
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=len(reply.completion_ids),
                total_tokens=prompt_tokens + len(reply.completion_ids),
            ),
        )


class _Completions:
    def __init__(self, client: AgentClient) -> None:
        self.create = client.create


class _Chat:
    def __init__(self, client: AgentClient) -> None:
        self.completions = _Completions(client)


def _as_dict(message: Any) -> dict[str, Any]:
    if isinstance(message, dict):
        return message
    if hasattr(message, "model_dump"):  # the openai client's own message objects
        return message.model_dump(exclude_none=True)
    raise TypeError(f"a message must be a dict or an openai message object, not {type(message).__name__}")


def _key(message: dict[str, Any]) -> tuple[Any, Any]:
    return message.get("role"), message.get("content")
