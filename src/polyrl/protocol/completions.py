"""Which weight versions generated a completion served on the OpenAI/vLLM routes: the key
that names a completion, and the manager's endpoint that the trainer asks.

    POST {manager}/v1/completions/versions   VersionsQuery -> VersionsReply

Why a lookup by token ids and not a field in the response: an Atropos environment builds
its scored group from the token ids (atroposlib's `ManagedServer`: prompt ids + the
server's output ids; its OpenAI class: its own tokenization of the text), and the Atropos
API keeps only the fields its `ScoredData` model knows (pydantic drops the rest). A
version field in the response would reach the trainer only from an environment written
to copy it somewhere. The token ids always reach it, so the serving side books each
completion under a hash of prompt + completion ids, and the trainer hashes each generated
span of a scored sequence the same way and asks.
"""

from __future__ import annotations

import hashlib
from array import array

from pydantic import BaseModel, ConfigDict, Field

MAX_KEYS = 1 << 16
"""Keys per query: a step's spans (a batch of 1024 sequences of 8 turns is 8192)."""

VersionRuns = list[tuple[int, int]]
"""Per-token weight versions, run-length coded: [(version, number of tokens), ...] in
token order (one or two runs: a version changes at most at an in-flight swap)."""


def sequence_key(token_ids: list[int]) -> str:
    """The name of a token sequence (prompt + completion): 128 bits of BLAKE2b over its
    ids as int64s. Two different sequences share one with probability ~2^-128."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def to_runs(versions: list[int]) -> VersionRuns:
    runs: VersionRuns = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


def from_runs(runs: VersionRuns) -> list[int]:
    return [v for v, num in runs for _ in range(num)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VersionsQuery(_Message):
    keys: list[str] = Field(max_length=MAX_KEYS)
    """`sequence_key` of context + generated span, one per span asked about."""


class VersionsReply(_Message):
    versions: list[VersionRuns | None]
    """Per key, in order: the versions of the completion booked under it (its last token
    is the key's sequence's last), or None when the server did not serve it (another
    server, a restarted one, or one that forgot it)."""
