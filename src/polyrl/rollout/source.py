"""Where a step's groups come from: the interface every rollout source implements.

Kept apart from the records it hands out (`polyrl.protocol.samples`) because it also
carries the step's `RolloutStats`, which count those records: the records stay below both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from polyrl.protocol.manager_api import FleetDecision, WorkerInfo
    from polyrl.protocol.samples import Group, Prompt
    from polyrl.protocol.sampling import SamplingParams
    from polyrl.protocol.version import WeightVersion
    from polyrl.rollout.stats import RolloutStats


class Rollout(Protocol):
    """Where a step's groups come from: the colocated engine (`LocalRollout`) or the
    manager and its workers (`RemoteRollout`)."""

    shares_weights: bool
    """The engine reads the learner's own parameters: a batch must finish generating
    before the first update."""
    stats: RolloutStats
    """The step's generation, once its batch has been read."""

    @property
    def weight_version(self) -> WeightVersion:
        """The last version `publish` was given: what batches submitted now are generated
        with. The trainer's `TrainState` counts versions; a rollout only keeps what it was
        told."""

    @property
    def num_instances(self) -> int: ...

    def publish(self, weights: Mapping[str, torch.Tensor] | None, version: WeightVersion) -> None:
        """Weights `version` (`weights`, or with None the learner's own) for every engine;
        batches submitted from now on are generated with it. The order is the weight
        publisher's: `WeightPublisher.publish(state_dict, version)`."""

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> Iterator[Group]:
        """Submit now (`sampling.n` samples per prompt, the group size); each prompt's group
        as soon as its last sample is done."""

    def learner_started(self) -> None:
        """The learner is about to take its first update of the step."""

    def workers(self) -> list[WorkerInfo]:
        """The rollout workers now (none colocated)."""

    def fleet_decision(self, decision: FleetDecision) -> None:
        """The autoscaler changed the fleet's size: tell the manager, for its operator page."""

    def close(self) -> None: ...
