"""The decode step as CUDA graphs: one replay instead of ~15 kernel launches per layer.

A pure-decode step (every sequence feeds exactly its last token) has a fixed shape per
batch size, so it is captured once per padded size ("bucket") and replayed with the step's
inputs copied into static buffers. Padding rows have context length 0 (the attention
kernel writes zeros for them) and write their K/V into a scratch block that no sequence
owns. Graphs are captured lazily, the first time a bucket is needed, into one shared
memory pool; the logits land in one static buffer shared by all buckets.

The graphs hold the addresses of the weights and the KV cache: weight updates copy in
place (`Engine._load_weights`), and freeing the KV cache drops the graphs with it.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.engine.block_manager import padded_tables
from polyrl.engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


@dataclass
class DecodeMetadata:
    """A pure-decode step's layout, read by the Triton paged attention kernel."""

    slot_mapping: torch.Tensor  # [B] int64 cache slot of each fed token
    block_tables: torch.Tensor  # [B, max blocks] int32
    context_lens: torch.Tensor  # [B] int64, 0 for padding rows


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for all warm-ups: cuBLAS keeps a workspace (32 MiB on
    Hopper) per stream it has seen, so a fresh stream per capture leaks one each time."""
    return torch.cuda.Stream(device)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two up to 16, then multiples of 16."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


def decode_inputs(
    batch: list[ScheduledSeq], size: int, block_size: int, scratch_slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors for a pure-decode step padded to `size` rows: [4, size] int64 (token
    ids, positions, cache slots, context lengths) and the block tables [len(batch), W] int32.
    Each sequence feeds the token at `num_computed_tokens`; one the host has not read back
    yet (an overlapped step) is left 0 here and copied in on the device."""
    pad = size - len(batch)
    seqs = [item.seq for item in batch]
    positions = [s.num_computed_tokens for s in seqs]
    ids = [s.token_ids[p] if p < len(s.token_ids) else 0 for s, p in zip(seqs, positions)] + [0] * pad
    slots = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)]
    ctx = [p + 1 for p in positions] + [0] * pad
    tables = [s.block_table for s in seqs]
    inputs = torch.tensor([ids, positions + [0] * pad, slots + [scratch_slot] * pad, ctx], dtype=torch.long)
    return inputs, padded_tables(tables, max(len(t) for t in tables))


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_slot: int,
        vocab_size: int,
        logits_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`forward(ids [B], positions [B], meta, out=logits [B, V])` is the step to capture,
        a method of the runner that owns these graphs: held weakly, so that dropping the
        runner frees its KV cache at once rather than at the next garbage collection."""
        self.forward = weakref.WeakMethod(forward)
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        # ids, positions, slots, context lengths: one host tensor, one copy per step.
        self.inputs = torch.zeros(4, self.max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits = torch.empty(self.max_batch, vocab_size, dtype=logits_dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s = 0.0

    def reset(self) -> None:
        """Drop the captured graphs (the weights moved: they hold the old addresses); each
        batch size is captured again on first use."""
        self.graphs.clear()
        self.pool = None

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, batch: list[ScheduledSeq], fed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(batch), V] for a pure-decode batch of at most `max_batch` sequences;
        `fed_ids` [len(batch)] on the device are the tokens fed (default: from the host)."""
        size = self.bucket(len(batch))
        graph = self.graphs.get(size) or self._capture(size)
        inputs, tables = decode_inputs(batch, size, self.block_size, self.scratch_slot)
        self.inputs[:, :size].copy_(inputs, non_blocking=True)
        if fed_ids is not None:
            self.inputs[0, : len(batch)].copy_(fed_ids)
        self.block_tables[: len(batch), : tables.shape[1]].copy_(tables, non_blocking=True)
        graph.replay()
        return self.logits[: len(batch)]

    def _step(self, size: int) -> None:
        meta = DecodeMetadata(self.inputs[2, :size], self.block_tables[:size], self.inputs[3, :size])
        self.forward()(self.inputs[0, :size], self.inputs[1, :size], meta, out=self.logits[:size])

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        self.inputs[:, :size] = 0
        self.inputs[2, :size] = self.scratch_slot  # capture on padding: nothing real is written
        stream = _warmup_stream(self.inputs.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture: Triton JIT, cuBLAS heuristics
            self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(size)
        self.pool = graph.pool()
        self.graphs[size] = graph
        elapsed = time.perf_counter() - start
        self.capture_s += elapsed
        log.debug("captured the decode step for batch %d in %.2f s", size, elapsed)
        return graph
