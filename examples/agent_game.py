"""A game of three moves, the environment answering each one, learned from scratch by the
tiny model.

    python examples/agent_game.py --run-dir DIR [key=value ...]

Echo: the environment calls a letter of "abcdef" and the model must call it back; the
environment answers each move with `ok` or `no` and the next letter. Three moves per
episode, each scored on its own by the main job's partial credit (the letter, and the
stop counting as one more), a third of the episode each: a model that answers every move
right and stops scores 1, one that stops after a letter it guesses 7/12 on average.

It trains the way the main job does and writes DIR/metrics.jsonl (see
`examples/agent_tool.py`, whose launcher and settings it uses).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from agent_tool import LETTERS, _match, main

MOVES = 3


async def play(client: Any, item: dict[str, Any]) -> list[float]:
    """One episode; its reward per move (their sum is the episode's reward)."""
    letters = item["letters"]
    messages: list[Any] = [{"role": "user", "content": letters[0]}]
    scores = []
    for move in range(MOVES):
        reply = await client.chat.completions.create(messages=messages)
        answer = reply.choices[0].message.content or ""
        right = letters[move]
        scores.append(_match(answer, right, reply.choices[0].finish_reason) / MOVES)
        if move + 1 < MOVES:
            verdict = "ok" if answer == right else "no"
            messages += [reply.choices[0].message, {"role": "user", "content": f"{verdict} {letters[move + 1]}"}]
    return scores


def write_items(path: Path, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"letters": [rng.choice(LETTERS) for _ in range(MOVES)]}) + "\n")


if __name__ == "__main__":
    main("agent_game", write_items)
