"""The policy's weight version: which weights produced a token, and which weights a
worker serves.

Version 0 is the run's initial weights (the model it started from, or with LoRA its
fresh adapters); the trainer publishes version v after its v-th training step (all of a
step's mini-batch updates make one version). One object in the trainer's process counts
it: the checkpointed `TrainState` (`polyrl.trainer.checkpoint`), so a resumed run goes
on from its checkpoint's version (the numbers of steps lost after it are used again).
The rollout sources and the manager only pass on what they were given.

Every role relies on three things:
* monotonic: in one trainer process, a published version is never followed by a lower
  one (it may be published again: a restarted manager is told the latest one once
  more), so "at v or newer" means "has v's weights or later ones", and the lowest
  version among a sample's tokens says how far it lags;
* non-negative: 0 is the lowest; a negative number is never a version (the staleness
  limit `v - k` may be, so it is an `Int64`, not a version);
* fits an int64, as every integer on the wire does (`protocol.manager_api.Int64`): the
  weight transfer packs it as an i64 (`transfer/wire.py`).

`WeightVersion` is `int` to Python and to type checkers (no wrapper to build or unwrap),
and in a pydantic model it is a field checked against the last two. Per-token lists of
versions on the wire stay `list[int]`: checking each element more than doubles the time
to parse them, and the manager parses every stream chunk.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

WeightVersion = Annotated[int, Field(ge=0, lt=2**63)]
