"""Paged KV-cache bookkeeping: which physical blocks hold which sequence's tokens.

Blocks are reference counted so the `n` samples of one prompt share the prompt's blocks;
only a partially filled last block is copied when a sequence forks (copy on fork, so no
later write can reach a shared block). Check-then-act pairs (`can_allocate`/`allocate`)
keep the scheduler free of half-done allocations.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import torch

from polyrl.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """[len(tables), width] int32 host tensor: each block table cut or zero-padded to
    `width`. Built flat (one numpy pass over the blocks, one masked store) rather than
    from a padded nested list, which torch converts element by element: for 512 tables of
    up to 72 blocks, 2.4 ms against 0.4 ms on a 2-core box. In a profile of a tiny model's
    decoding engine on an H100 host, the nested list was about a quarter of its step."""
    lens = np.fromiter((min(len(t), width) for t in tables), dtype=np.int64, count=len(tables))
    blocks = np.fromiter(
        itertools.chain.from_iterable(t[:width] if len(t) > width else t for t in tables),
        dtype=np.int32,
        count=int(lens.sum()),
    )
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = blocks  # row-major: each row's blocks in order
    return torch.from_numpy(out)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def resize(self, num_blocks: int) -> None:
        """Start over with `num_blocks` blocks; only when no sequence holds any."""
        assert self.num_free == self.num_blocks, "resize with blocks in use"
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its table covers `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's computed blocks with `child`. Returns (src, dst) when the last
        block is partial and was given a fresh copy the caller must fill, else None."""
        assert not child.block_table
        num_full = parent.num_computed_tokens // self.block_size
        for block in parent.block_table[:num_full]:
            self.ref_counts[block] += 1
            child.block_table.append(block)
        if num_full == len(parent.block_table):
            return None
        src = parent.block_table[num_full]
        self.allocate(child, (num_full + 1) * self.block_size)
        return src, child.block_table[-1]
