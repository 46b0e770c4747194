"""Attention over the paged KV cache, and the per-step metadata every layer shares.

A step's tokens are flat ([T, ...]) through the projections and MLPs; only attention
needs them per sequence. Sequences are split into two groups: decodes (one query token
each) and prefill chunks (several). A prefill group gathers its sequences' cached keys
and values by block into a padded [B, C, ...] view and runs one SDPA with a mask, so a
long prompt in the batch does not pad every decode to its length. The decode group does
the same on the PyTorch path; where the Triton kernels run (`kernel_decode`) it goes to
the paged decode kernel instead, which reads each sequence's own blocks in place. That
matters on a continuously fed worker: every step that admits a request is such a mixed
step, and gathering 256 decodes padded to the longest context moved about 20x the
bytes the kernel reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.engine import triton_ops
from polyrl.engine.block_manager import padded_tables


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [Tg] positions of this group's query tokens in the flat batch
    batch_index: torch.Tensor  # [Tg] row of each query token in the padded [B, Q] layout
    query_index: torch.Tensor  # [Tg] column of each query token
    block_tables: torch.Tensor  # [B, NB] cache blocks holding each sequence's context (0 where padded)
    mask: torch.Tensor | None  # [B, 1, Q, C] bool, True where a query may attend; C = NB * block_size
    num_seqs: int
    max_query_len: int
    context_lens: torch.Tensor | None = None  # [B] int32: a decode group for the paged kernel (no mask)

    @classmethod
    def build(
        cls,
        token_offsets: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        kernel_decode: bool = False,
    ) -> AttentionGroup:
        """Sequence b feeds `query_lens[b]` tokens starting at flat position
        `token_offsets[b]`; they are its last tokens of `context_lens[b]`. With
        `kernel_decode`, a group of decodes is built for the paged kernel: block tables and
        context lengths, no mask."""
        num_seqs, max_q, max_ctx = len(query_lens), max(query_lens), max(context_lens)
        max_blocks = -(-max_ctx // block_size)
        if kernel_decode and max_q == 1:
            return cls(
                token_index=torch.tensor(token_offsets).to(device),
                batch_index=torch.empty(0, dtype=torch.long),
                query_index=torch.empty(0, dtype=torch.long),
                block_tables=padded_tables(block_tables, max_blocks).to(device),
                mask=None,
                num_seqs=num_seqs,
                max_query_len=1,
                context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
            )
        token_index = torch.tensor([o + i for o, q in zip(token_offsets, query_lens) for i in range(q)])
        batch_index = torch.tensor([b for b, q in enumerate(query_lens) for _ in range(q)])
        query_index = torch.tensor([i for q in query_lens for i in range(q)])
        tables = padded_tables(block_tables, max_blocks).long()
        # the mask is made where it is used: made on the host, an 800-token chunk's was a
        # quarter of its step's host time in a profile on an H200 (BENCHMARKS.md, the MPS kill row)
        pos = torch.arange(max_blocks * block_size, device=device)  # [C]
        ctx = torch.tensor(context_lens).to(device)[:, None, None]  # [B, 1, 1]
        first = ctx - torch.tensor(query_lens).to(device)[:, None, None]  # [B, 1, 1] the first query's position
        last_query_pos = first + torch.arange(max_q, device=device)[None, :, None]
        mask = (pos[None, None, :] <= last_query_pos) & (pos[None, None, :] < ctx)  # [B, Q, C]
        return cls(
            token_index=token_index.to(device),
            batch_index=batch_index.to(device),
            query_index=query_index.to(device),
            block_tables=tables.to(device),
            mask=mask[:, None],
            num_seqs=num_seqs,
            max_query_len=max_q,
        )


@dataclass
class AttentionMetadata:
    """Everything about one step's layout, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot where each fed token's K/V is written
    groups: list[AttentionGroup]

    @property
    def is_pure_decode(self) -> bool:
        """One decode group covering every token in order: no gather/scatter needed."""
        return len(self.groups) == 1 and self.groups[0].max_query_len == 1


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NBLK, BS, KVH, D] one layer's keys
    v_cache: torch.Tensor,  # [NBLK, BS, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    k_scales: torch.Tensor | None = None,  # [NBLK, BS, KVH] float32: an FP8 cache's scales
    v_scales: torch.Tensor | None = None,
    decode_attention: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:  # [T, H, D]
    """`decode_attention`: the paged kernel for the decode groups (`ModelRunner.decode_attention`;
    default Triton's)."""
    decode_attention = decode_attention or triton_ops.paged_decode_attention
    fp8 = k_scales is not None
    # under autocast, RoPE in float32 promotes q past the cache's dtype; an FP8 cache is read as bf16
    q = q.to(torch.bfloat16 if fp8 else k_cache.dtype)
    out = q if meta.is_pure_decode else torch.empty_like(q)  # a pure decode returns from the loop
    for g in meta.groups:
        if g.context_lens is not None:  # decodes, each reading its own blocks in place
            q_group = q if meta.is_pure_decode else q[g.token_index]
            attn = decode_attention(
                q_group, k_cache, v_cache, g.block_tables, g.context_lens, scale, k_scales=k_scales, v_scales=v_scales
            )
            if meta.is_pure_decode:
                return attn
            out[g.token_index] = attn
            continue
        # Whole blocks are gathered (contiguous runs of BS * KVH * D values), not single slots.
        num_seqs, num_blocks = g.block_tables.shape
        shape = (num_seqs, num_blocks * k_cache.shape[1], *k_cache.shape[2:])  # [B, C, KVH, D]
        blocks = g.block_tables.view(-1)
        keys = k_cache.index_select(0, blocks).view(shape)  # [B, C, KVH, D]
        values = v_cache.index_select(0, blocks).view(shape)
        if fp8:  # scale each (slot, head) back
            keys = (keys.float() * k_scales.index_select(0, blocks).view(shape[:-1])[..., None]).to(q.dtype)
            values = (values.float() * v_scales.index_select(0, blocks).view(shape[:-1])[..., None]).to(q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, KVH, C, D]
        q_group = q if meta.is_pure_decode else q[g.token_index]  # [Tg, H, D]
        if g.max_query_len == 1:  # decodes: one query per sequence, already in row order
            queries = q_group[:, :, None]  # [B, H, 1, D]
        else:
            queries = q.new_zeros(g.num_seqs, g.max_query_len, *q.shape[1:])  # [B, Q, H, D]
            queries[g.batch_index, g.query_index] = q_group
            queries = queries.transpose(1, 2)  # [B, H, Q, D]
        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=keys.shape[1] != queries.shape[1]
        )  # [B, H, Q, D]
        if meta.is_pure_decode:
            return attn[:, :, 0]
        if g.max_query_len == 1:
            out[g.token_index] = attn[:, :, 0]
        else:
            out[g.token_index] = attn.transpose(1, 2)[g.batch_index, g.query_index]
    return out
