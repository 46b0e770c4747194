"""An agent that must call a tool and use its answer, learned from scratch by the tiny model.

    python examples/agent_tool.py --run-dir DIR [key=value ...]

A lookup tool. Each item holds a key and a value, one letter each of "abcdef", drawn
independently, so the value is nowhere but in the tool's answer. The user names the
key; the model's first reply is its call to `lookup`, the key it asks for; the tool
answers with the value (a `tool` message) when that is the item's key, and the episode
ends otherwise; the model's next reply should be the value. Rewards per call, each by
the main job's partial credit (characters in place, the stop counting as one more, so
that a random model finds the signal): up to 0.3 for the call, up to 0.7 for the answer.
Only an agent that calls with the right key and repeats the tool's answer reaches 1; a
model that guesses the value after a right call scores 0.3 + 0.7 x 7/12 on average.

The tiny model's character tokenizer cannot write the JSON of a real tool call
(`<tool_call>{"name": ...}` in Qwen's format, which `data.agent_tool_parser = "hermes"`
reads for real models), so the call is the reply's text itself; the episode's turns,
masks and log-probs are exactly what they are with real tool calls.

It trains the way the main job does (`polyrl train`: two workers, the manager) on a
tiny model with a chat template, and writes DIR/metrics.jsonl; extra arguments are
`polyrl train` overrides. The settings below differ from the main job's, each for a
measured reason (BENCHMARKS.md, "The agent examples reach the bar"):
* a wider tiny model (hidden size 256, not 96) at `trainer.lr` 5e-4: at 96, repeating a
  letter through the chat template took about 160 steps even as a one-call episode, and
  the 3-move game stayed at chance for 200;
* `algo.adv_estimator = "turn_grpo"` with `algo.gamma = 0`: each call is compared with
  the group's calls of the same turn on its own reward, so the call's and the answer's
  credit do not blur into each other (the game stayed at chance with one advantage per
  episode);
* `algo.entropy_coef = 0.03`: at 0.01 the lookup learned five letters and collapsed onto
  `a` for the sixth (0.79 after 200 steps), a group then having nothing to compare.
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

LETTERS = "abcdef"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the value of a key", "parameters": {}}}]


async def play(client: Any, item: dict[str, Any]) -> list[float]:
    """One episode: the call, then, if the tool found the key, the answer; a reward per call."""
    messages: list[Any] = [{"role": "user", "content": item["key"]}]
    reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
    call = reply.choices[0].message.content or ""
    rewards = [0.3 * _match(call, item["key"], reply.choices[0].finish_reason)]
    if call != item["key"]:
        return rewards  # the tool knows no such key: the episode is over
    messages += [reply.choices[0].message, {"role": "tool", "content": item["value"]}]
    reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
    answer = reply.choices[0].message.content or ""
    return [*rewards, 0.7 * _match(answer, item["value"], reply.choices[0].finish_reason)]


def _match(text: str, target: str, finish_reason: str) -> float:
    """The main job's partial credit (`char_match_reward`): characters in place, the stop
    counting as one more."""
    return char_match_reward([""], [text], [target], [finish_reason])[0]


def write_items(path: Path, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"key": rng.choice(LETTERS), "value": rng.choice(LETTERS)}) + "\n")


def train(module: str, run_dir: Path, write: Any, overrides: list[str]) -> int:
    """`polyrl train` on a tiny model with this module's `play`, as the main job runs."""
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
        "model.tiny.hidden_size=256",
        "model.tiny.intermediate_size=512",
        "manager.port=0",  # any free port
        "rollout.max_new_tokens=4",
        "trainer.train_batch_size=8",
        "trainer.ppo_mini_batch_size=8",
        "trainer.lr=5e-4",
        "algo.adv_estimator=turn_grpo",
        "algo.gamma=0",
        "algo.entropy_coef=0.03",
        "trainer.total_steps=120",
        *overrides,
    ]
    return subprocess.call(command, env=env)


def main(module: str, write: Any) -> None:
    doc = sys.modules["__main__"].__doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="polyrl train overrides")
    args = parser.parse_args()
    sys.exit(train(module, Path(args.run_dir), write, args.overrides))


if __name__ == "__main__":
    main("agent_tool", write_items)
