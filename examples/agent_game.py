"""A game of three moves, the environment answering each one, learned from scratch by the
tiny model.

    python examples/agent_game.py --run-dir DIR [key=value ...]

Echo: the environment calls a word (2-3 letters of "abcdef") and the model must call it
back; the environment answers each move with `ok` or `no` and the next word. Three moves
per episode; the reward is the mean over the moves of the main job's partial credit
(characters in place, the stop counting as one more), so a model that answers all three
moves right and stops scores 1 (one reward for the whole episode, as GRPO takes it).

It trains the way the main job does and writes DIR/metrics.jsonl (see
`examples/agent_tool.py`, whose launcher it uses).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from agent_tool import _match, main

MOVES = 3


async def play(client: Any, item: dict[str, Any]) -> list[float]:
    """One episode; its reward per move (their sum is the episode's reward)."""
    words = item["words"]
    messages: list[Any] = [{"role": "user", "content": words[0]}]
    scores = []
    for move in range(MOVES):
        reply = await client.chat.completions.create(messages=messages)
        answer = reply.choices[0].message.content or ""
        right = words[move]
        scores.append(_match(answer, right, reply.choices[0].finish_reason) / MOVES)
        if move + 1 < MOVES:
            verdict = "ok" if answer == right else "no"
            messages += [reply.choices[0].message, {"role": "user", "content": f"{verdict} {words[move + 1]}"}]
    return scores


def write_items(path: Path, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            words = ["".join(rng.choices("abcdef", k=rng.randint(2, 3))) for _ in range(MOVES)]
            f.write(json.dumps({"words": words}) + "\n")


if __name__ == "__main__":
    main("agent_game", write_items)
