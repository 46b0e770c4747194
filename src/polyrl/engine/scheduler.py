"""Which sequences run in the next step, and how many tokens each.

One step is one forward over a flat batch of tokens: a decode feeds 1 token, a prefill a
chunk of its prompt. Running sequences go first (oldest first), so decodes are never
starved by new prompts; then waiting sequences are admitted while the token budget,
the sequence cap and free KV blocks allow, each starting from the cached blocks its
tokens match (block_manager.py: automatic prefix caching). A waiting sequence whose next
block another running sequence is computing waits for it instead of computing it again
(the episodes of one GRPO group arrive together with the same opening: one computes it,
the rest read it, as SGLang's in-batch prefix sharing does). When blocks run out, the
newest running sequence is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed later (its tokens are kept, and sampling is keyed by
position, so the result does not change).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from polyrl.engine.block_manager import BlockManager
from polyrl.engine.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)

_LOGGED = frozenset(10**i for i in range(12))
"""Preemption counts that get a log line: 1, 10, 100, ... (one line per order of magnitude)."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """One token, the sequence's last: what a captured decode step feeds. Anything
        else computes prompt tokens (a prefill chunk, a moved sample's re-prefill)."""
        return self.num_new_tokens == 1 and self.seq.num_uncomputed == 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        """Sequences preempted for want of KV blocks (not the engine's own `preempt_all`)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, num_new):
                break  # seq itself was preempted (it was the newest)
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        computing = self._blocks_in_progress() if self.waiting else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A sequence that reports its routes computes every position itself.
            matching = self.blocks.prefix_caching and not seq.sampling.return_routed_experts
            if matching:
                self.blocks.match_prefix(seq)
            if matching and computing and self.blocks.next_key(seq) in computing:
                self.blocks.release_match(seq)
                deferred.append(self.waiting.popleft())  # its next block is on the way
                continue
            if not self._admissible(budget):
                if matching:
                    self.blocks.release_match(seq)
                break
            self.waiting.popleft()
            num_new = min(seq.num_uncomputed, budget)
            self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if self.blocks.prefix_caching:
                computing.update(self.blocks.keys_to_compute(seq))
        self.waiting.extendleft(reversed(deferred))
        return batch

    def _blocks_in_progress(self) -> set[int]:
        """Keys of the full prompt blocks running prefills have still to compute."""
        if not self.blocks.prefix_caching:
            return set()
        return {
            key
            for seq in self.running
            if seq.num_uncomputed > 1 and seq.kv_epoch == self.blocks.epoch
            for key in self.blocks.keys_to_compute(seq)
        }

    def can_admit(self) -> bool:
        """Whether the next `schedule()` would start a waiting sequence (with every running
        one decoding)."""
        return self._admissible(self.max_num_batched_tokens - len(self.running))

    def _admissible(self, budget: int) -> bool:
        if not self.waiting or budget <= 0 or not self._has_seq_room(self.waiting[0]):
            return False
        seq = self.waiting[0]
        num_new = min(seq.num_uncomputed, budget)
        # Room for the forks' copied last blocks too, so a shared prefill can fork.
        needed = self.blocks.blocks_needed(seq, seq.num_computed_tokens + num_new) + seq.num_forks - 1
        return self.blocks.can_allocate(needed)

    def _has_seq_room(self, seq: Sequence) -> bool:
        return not self.running or len(self.running) + seq.num_forks <= self.max_num_seqs

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Preempt from the tail until `seq` has its blocks; False if `seq` was preempted."""
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, seq.num_computed_tokens + num_new)):
            victim = self.running[-1]
            self.preempt(victim)
            self.num_preemptions += 1
            if self.num_preemptions in _LOGGED:
                log.warning(
                    "engine: KV cache full, a running sequence gave its blocks back and will recompute "
                    "(%d so far; more engine.num_kv_blocks or fewer engine.max_num_seqs avoid it)",
                    self.num_preemptions,
                )
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Drop every running sequence's KV (they recompute it on their next turn), in order."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
