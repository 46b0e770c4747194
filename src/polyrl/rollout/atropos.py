"""A rollout whose groups come from an Atropos API server (`data.source = "atropos"`).

Atropos environments generate (through polyrl's manager or workers, which they call as
an OpenAI or vLLM server) and score their groups themselves; the trainer only pulls
finished batches. Weights still flow as in remote mode: every step's version is
published to the fleet through the manager, so the environments' next requests are
served by the new policy. Hence this wraps the fleet's rollout and takes over only
`generate`.

Atropos groups do not say which weights sampled them, and the Atropos API drops fields
it does not know, so the trainer asks the manager: it booked every completion it served
with the version of each token, under a hash of the token ids
(`protocol/completions.py`), and each generated span of a scored sequence is looked up
the same way, once per batch. Then `rollout/version_lag` is real, and only the tokens of
the learner's own version measure `rollout/logprob_diff`, so an environment generating
ahead of the trainer shows as lag, not as a mismatch. A group with any span neither the
manager nor a live worker served (another server, a worker that has left, a restarted
manager) is booked under the version the learner holds when the batch arrives, as before,
and counted in `rollout/unversioned_groups`; the truncated importance weight on
`inference_logprobs` (`algo.rollout_correction`) corrects for its lag either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from polyrl.config import RunConfig
from polyrl.data.atropos import Registration, ScoredGroup, check_group, span_keys, to_group, token_versions
from polyrl.data.atropos_client import AtroposClient
from polyrl.protocol.samples import Group, Prompt
from polyrl.protocol.version import WeightVersion
from polyrl.rollout.stats import RolloutStats

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from transformers import PreTrainedModel

    from polyrl.protocol.manager_api import FleetDecision, WorkerInfo
    from polyrl.protocol.sampling import SamplingParams
    from polyrl.rollout.remote import RemoteRollout

log = logging.getLogger("polyrl.atropos")


def registration(cfg: RunConfig, run_dir: Path, max_token_len: int, steps_done: int) -> Registration:
    """What the API is told: a step is `train_batch_size` groups of `rollout.n` sequences."""
    a = cfg.data.atropos
    return Registration(
        wandb_group=a.wandb_group,
        wandb_project=a.wandb_project,
        batch_size=cfg.trainer.train_batch_size * cfg.rollout.n,
        max_token_len=max_token_len,
        checkpoint_dir=str(run_dir / "checkpoints"),
        save_checkpoint_interval=cfg.trainer.save_every,
        starting_step=steps_done,
        num_steps=cfg.trainer.total_steps,
    )


class AtroposRollout:
    """`generate` from the Atropos API; publishing, workers and the learner's start go to
    the fleet's rollout (`inner`)."""

    shares_weights = False

    def __init__(
        self, inner: RemoteRollout, client: AtroposClient, vocab_size: int, temperature: float, steps_done: int
    ) -> None:
        self.inner, self.client = inner, client
        self.vocab_size, self.temperature = vocab_size, temperature
        self.steps_done = steps_done
        """Batches taken, the resumed run's too: the `starting_step` of a re-registration."""
        self.stats = RolloutStats()
        self._migrations_seen = 0
        """The manager's count of sample moves at the last look."""
        self.num_groups = 0
        self.num_dropped = 0
        self.num_unversioned = 0
        """Groups whose tokens' versions the manager could not tell (the run's count)."""
        self._warned_temperatures: set[float] = set()

    @classmethod
    def start(
        cls, inner: RemoteRollout, cfg: RunConfig, run_dir: Path, model: PreTrainedModel, steps_done: int
    ) -> AtroposRollout:
        """Register with the API (it then waits for the trainer's first `/batch` call
        before it lets environments register)."""
        max_token_len = cfg.data.atropos.max_token_len or model.config.max_position_embeddings
        client = AtroposClient(cfg.data.atropos, registration(cfg, run_dir, max_token_len, steps_done))
        try:
            client.register(steps_done)
        except BaseException:
            client.close()
            raise
        vocab_size = model.get_input_embeddings().num_embeddings
        rollout = cls(inner, client, vocab_size, cfg.rollout.temperature, steps_done)
        rollout._migrations_seen = inner.fleet().num_migrations  # a standalone manager's past is not ours
        return rollout

    @property
    def weight_version(self) -> WeightVersion:
        return self.inner.weight_version

    @property
    def num_instances(self) -> int:
        return len(self.inner.workers())

    def publish(self, weights: Mapping[str, torch.Tensor] | None, version: WeightVersion) -> None:
        self.inner.publish(weights, version)

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> Iterator[Group]:
        """The next batch's groups, polled for when first read; `prompts` must be empty
        (the environments choose them)."""
        assert not prompts, "Atropos environments choose the prompts"
        return self._groups()

    def _groups(self) -> Iterator[Group]:
        t0 = time.perf_counter()
        groups: list[Group] = []
        unversioned_before = self.num_unversioned
        while not groups:  # a batch of only dropped groups is no step: take the next one
            groups = self._convert(self.client.next_batch(self.steps_done))
            self.steps_done += 1
        num_samples = sum(len(g.samples) for g in groups)
        self.stats = stats = RolloutStats(
            gen_s=time.perf_counter() - t0,
            num_requested=num_samples,
            num_received=num_samples,
            num_unversioned_groups=self.num_unversioned - unversioned_before,
        )
        yield from groups
        self._note_fleet(stats)

    def _note_fleet(self, stats: RolloutStats) -> None:
        """The fleet's side of the step, as in remote mode (lost workers, weight sync, idle
        time). Samples migrated: those of the environments' requests that moved to another
        worker since the last batch arrived (the groups do not say which workers generated
        them)."""
        fleet = self.inner.note_fleet(stats)
        moved = fleet.num_migrations - self._migrations_seen
        stats.num_migrated = moved if moved >= 0 else fleet.num_migrations  # a restarted manager counts from 0
        self._migrations_seen = fleet.num_migrations

    def _convert(self, batch: list[dict[str, Any]]) -> list[Group]:
        version = self.weight_version
        scored = self._valid(batch)
        versions = self._versions(scored)
        self.num_unversioned += sum(v is None for v in versions)
        groups = [
            to_group(g, self.num_groups + i, version, v) for i, (g, v) in enumerate(zip(scored, versions, strict=True))
        ]
        self.num_groups += len(groups)
        return groups

    def _versions(self, scored: list[ScoredGroup]) -> list[list[list[int]] | None]:
        """Per group, its tokens' versions as the manager booked them (None: unknown); one
        call for the batch."""
        keys = [span_keys(g) for g in scored]
        flat = [k for group_keys in keys for seq_keys in group_keys for k in seq_keys]
        booked = self.inner.completion_versions(flat) if flat else []
        if booked is None:  # a manager without the bookings
            return [None] * len(scored)
        runs = iter(booked)
        return [
            token_versions(g, [[next(runs) for _ in seq_keys] for seq_keys in group_keys])
            for g, group_keys in zip(scored, keys, strict=True)
        ]

    def _valid(self, batch: list[dict[str, Any]]) -> list[ScoredGroup]:
        """The batch's groups the learner can train on; the others are logged and dropped."""
        max_token_len = self.client.registration.max_token_len
        groups: list[ScoredGroup] = []
        for raw in batch:
            try:
                scored = ScoredGroup.model_validate(raw)
            except ValidationError as e:
                problem = f"malformed: {e.errors()[0]['msg']}"
            else:
                problem = check_group(scored, self.vocab_size, max_token_len)
            if problem:
                self.num_dropped += 1
                log.warning("dropped an Atropos group (env %s): %s", raw.get("env_id"), problem)
                continue
            self._check_temperature(scored.temperature)
            groups.append(scored)
        return groups

    def _check_temperature(self, temperature: float | None) -> None:
        """The learner computes log-probs at rollout.temperature: an environment sampling at
        another one makes the importance weights compare different distributions."""
        if temperature is None or abs(temperature - self.temperature) < 1e-6:
            return
        if temperature not in self._warned_temperatures:
            self._warned_temperatures.add(temperature)
            log.warning(
                "an Atropos environment samples at temperature %g, the learner computes log-probs at "
                "rollout.temperature=%g: set them equal",
                temperature,
                self.temperature,
            )

    def learner_started(self) -> None:
        self.inner.learner_started()

    def fleet_decision(self, decision: FleetDecision) -> None:
        self.inner.fleet_decision(decision)

    def workers(self) -> list[WorkerInfo]:
        return self.inner.workers()

    def close(self) -> None:
        """Only the client: the fleet's rollout is closed by whoever started it."""
        self.client.close()
