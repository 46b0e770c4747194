"""The book of completions served on the OpenAI/vLLM routes and the weight versions of
their tokens, for the trainer to look Atropos groups up in (`protocol/completions.py`
says why by token ids).

Each finished completion is booked under two keys: prompt + every generated token (what
atroposlib's `ManagedServer` and vLLM-style clients put in a scored sequence, the stop
token included), and prompt + all but the last token (what an environment gets when it
tokenizes the returned text again: the stop token is not text). An exact key is never
replaced by a trimmed one. The same sequence served twice keeps the newest booking.

Bounded: the oldest bookings go first, past `max_keys` (~250 bytes each: 100k keys, ~25
MB, hold 50k completions, several steps of a large run, which is as far ahead as an
environment should generate).
"""

from __future__ import annotations

from collections import OrderedDict

from polyrl.protocol.completions import VersionRuns, sequence_key, to_runs

MAX_KEYS = 100_000


class VersionBook:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._runs: OrderedDict[str, VersionRuns] = OrderedDict()
        self._exact: set[str] = set()

    def __len__(self) -> int:
        return len(self._runs)

    def record(self, prompt_ids: list[int], token_ids: list[int], versions: list[int]) -> None:
        """Book one finished completion; one without a version per token is skipped."""
        if not token_ids or len(versions) != len(token_ids):
            return
        sequence = prompt_ids + token_ids
        if len(token_ids) > 1:
            self._put(sequence_key(sequence[:-1]), to_runs(versions[:-1]), exact=False)
        self._put(sequence_key(sequence), to_runs(versions), exact=True)

    def lookup(self, keys: list[str]) -> list[VersionRuns | None]:
        return [self._runs.get(k) for k in keys]

    def _put(self, key: str, runs: VersionRuns, exact: bool) -> None:
        if not exact and key in self._exact:
            return
        self._runs[key] = runs
        self._runs.move_to_end(key)
        if exact:
            self._exact.add(key)
        while len(self._runs) > self.max_keys:
            old, _ = self._runs.popitem(last=False)
            self._exact.discard(old)
