"""An agent that must call a tool and use its answer, learned from scratch by the tiny model.

    python examples/agent_tool.py --run-dir DIR [key=value ...]

Each item holds a secret word (2-3 letters of "abcdef") that the model never sees unless
it asks the tool. The model asks by replying `?`; the environment then answers with a
`tool` message holding the word, and the model's next reply should be that word.
Reward: up to 0.3 for the call and, once the tool has answered, up to 0.7 for the reply,
each by the main job's partial credit (characters in place, the stop counting as one
more, so that a random model finds the signal). Only an agent that calls the tool and
copies its answer reaches 1; one that answers without the tool gets at most 0.3.

The tiny model's character tokenizer cannot write the JSON of a real tool call
(`<tool_call>{"name": ...}` in Qwen's format, which `data.agent_tool_parser = "hermes"`
reads for real models), so the call here is the reply's text itself (`?`); the episode's
turns, masks and log-probs are exactly what they are with real tool calls.

It trains the way the main job does (`polyrl train`: two workers, the manager, the tiny
model with a chat template) and writes DIR/metrics.jsonl; extra arguments are `polyrl
train` overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from polyrl.data.tasks import char_match_reward

CALL = "?"
TOOLS = [{"type": "function", "function": {"name": "get", "description": "the secret word", "parameters": {}}}]


async def play(client: Any, item: dict[str, Any]) -> float:
    """One episode: ask, maybe call the tool, answer."""
    messages: list[Any] = [{"role": "user", "content": "word?"}]
    reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
    said = reply.choices[0].message.content or ""
    if said != CALL:
        return 0.3 * _match(said, CALL, reply.choices[0].finish_reason)
    messages += [reply.choices[0].message, {"role": "tool", "content": item["secret"]}]
    reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
    return 0.3 + 0.7 * _match(reply.choices[0].message.content or "", item["secret"], reply.choices[0].finish_reason)


def _match(text: str, target: str, finish_reason: str) -> float:
    """The main job's partial credit (`char_match_reward`): characters in place, the stop
    counting as one more."""
    return char_match_reward([""], [text], [target], [finish_reason])[0]


def write_items(path: Path, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"secret": "".join(rng.choices("abcdef", k=rng.randint(2, 3)))}) + "\n")


def train(module: str, run_dir: Path, write: Any, overrides: list[str]) -> int:
    """`polyrl train` on the tiny model with this module's `play`, as the main job runs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    items = run_dir / "items.jsonl"
    write(items)
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "train",
        "--run-dir",
        str(run_dir),
        "data.source=agent",
        f"data.agent={module}:play",
        f"data.path={items}",
        "model.tiny.chat_template=true",
        "manager.port=0",  # any free port
        "rollout.max_new_tokens=6",
        "trainer.train_batch_size=8",
        "trainer.ppo_mini_batch_size=8",
        # both turns follow "assistant: ": at the default 0.003 the reply after the tool
        # collapsed onto the call's text, and with no spread in a group GRPO had no gradient
        "algo.entropy_coef=0.01",
        "trainer.total_steps=200",
        *overrides,
    ]
    return subprocess.call(command, env=env)


def main(module: str, write: Any) -> None:
    parser = argparse.ArgumentParser(description=(sys.modules["__main__"].__doc__ or "").splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="polyrl train overrides")
    args = parser.parse_args()
    sys.exit(train(module, Path(args.run_dir), write, args.overrides))


if __name__ == "__main__":
    main("agent_tool", write_items)
