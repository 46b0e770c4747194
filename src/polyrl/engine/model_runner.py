"""Runs a transformers decoder over the engine's paged KV cache.

The weights, norms, MLPs and rotary embedding are the transformers model's own modules;
only attention is the engine's (`attention.paged_attention`), because the KV layout is.
That covers the Llama family (Llama, Mistral, Qwen2, Qwen3: pre-norm blocks, RoPE, GQA,
optional q/k norms and projection biases), which is what RL post-training uses today.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import PreTrainedModel

from polyrl.engine.attention import AttentionGroup, AttentionMetadata, paged_attention
from polyrl.engine.block_manager import cdiv
from polyrl.engine.scheduler import ScheduledSeq

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] (transformers' rotate-half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def kv_bytes_per_token(model: PreTrainedModel, dtype: torch.dtype) -> int:
    attn = model.model.layers[0].self_attn
    num_kv_heads = model.config.num_key_value_heads
    return len(model.model.layers) * 2 * num_kv_heads * attn.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype, autocast_dtype: torch.dtype | None
    ) -> None:
        model_type = model.config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported by the engine (supported: {SUPPORTED_MODEL_TYPES})")
        if getattr(model.config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the engine")
        self.model, self.block_size = model, block_size
        self.device = model.device
        self.autocast_dtype = autocast_dtype
        attn = model.model.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        num_slots = num_blocks * block_size
        shape = (len(model.model.layers), 2, num_slots, model.config.num_key_value_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.kv_cache[:, :, dst * bs : (dst + 1) * bs] = self.kv_cache[:, :, src * bs : (src + 1) * bs]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Feed every scheduled chunk; returns float32 logits [S, V] for the sequences whose
        chunk reached their last token (they sample next), and the batch indices of those."""
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch)
        with self._autocast():
            hidden = self._decoder(input_ids, positions, meta)  # [T, hidden]
            hidden = self.model.model.norm(hidden[sample_rows])  # [S, hidden]
            logits = self.model.lm_head(hidden)
        return logits.float(), sample_seqs

    def _prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        groups: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
        for i, item in enumerate(batch):
            seq, start, num_new = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            end = start + num_new
            offsets, qlens, ctxlens, tables = groups[num_new == 1]
            offsets.append(len(input_ids))
            qlens.append(num_new)
            ctxlens.append(end)
            tables.append(seq.block_table)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(i)
        dev = self.device
        # One host tensor and one copy for the three per-token arrays.
        ids, pos, slot_mapping = torch.tensor([input_ids, positions, slots], dtype=torch.long).to(dev).unbind(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            groups=[AttentionGroup.build(*g, bs, dev) for g in groups.values() if g[0]],
        )
        return ids, pos, meta, torch.tensor(sample_rows, dtype=torch.long).to(dev), sample_seqs

    def _decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = inner.rotary_emb(hidden, positions[None])  # [1, T, D]
        cos, sin = cos[0], sin[0]
        for layer_idx, layer in enumerate(inner.layers):
            residual = hidden
            hidden = self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, meta, layer_idx)
            hidden = residual + hidden
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def _attention(
        self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, layer_idx: int
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = attn.q_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H, D]
        k = attn.k_proj(x).view(num_tokens, -1, self.head_dim)  # [T, KVH, D]
        v = attn.v_proj(x).view(num_tokens, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = self.kv_cache[layer_idx]  # [S, KVH, D] each, S = num_blocks * block_size
        k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        blocked = (-1, self.block_size, *k_cache.shape[1:])
        out = paged_attention(q, k_cache.view(blocked), v_cache.view(blocked), meta, self.scale)  # [T, H, D]
        return attn.o_proj(out.reshape(num_tokens, -1))


def num_kv_blocks_for(model: PreTrainedModel, cfg_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      max_num_seqs: int, max_model_len: int, memory_fraction: float, cpu_gib: float) -> int:
    """The configured number of KV blocks, or one sized from the device's memory."""
    if cfg_blocks:
        return cfg_blocks
    block_bytes = kv_bytes_per_token(model, kv_dtype) * block_size
    if model.device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(model.device)
        return max(1, int(free_bytes * memory_fraction) // block_bytes)
    wanted = max_num_seqs * cdiv(max_model_len, block_size)
    return max(1, min(wanted, int(cpu_gib * 2**30) // block_bytes))
