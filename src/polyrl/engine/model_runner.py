"""Runs a transformers decoder over the engine's paged KV cache.

The weights, norms, MLPs and rotary embedding are the transformers model's own modules;
only attention is the engine's (`attention.paged_attention`), because the KV layout is.
On CUDA with Triton, every step instead runs fused layers (`_fused_decoder`: the model's
Linears between Triton kernels for the norms, RoPE with the cache write, and SwiGLU), with
the Triton paged-attention kernel for decode steps replayed as CUDA graphs and SDPA over
the paged cache for prefill. That covers the Llama family (Llama, Mistral, Qwen2, Qwen3: pre-norm blocks, RoPE, GQA,
optional q/k norms and projection biases), which is what RL post-training uses today.
Qwen3-MoE's blocks run in the fused layers as the engine's Triton experts
(`fused_moe.py`: routing, grouping by expert and the expert GEMMs with no host sync, so
decode steps are captured too); elsewhere, and for large prefill chunks, they run as the
model's own blocks (transformers' experts).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from polyrl.engine import cuda_ops, fused_moe, projections, triton_ops
from polyrl.engine.attention import AttentionGroup, AttentionMetadata, paged_attention
from polyrl.engine.block_manager import cdiv
from polyrl.engine.cuda_graphs import DecodeGraphs, DecodeMetadata
from polyrl.engine.fp8 import FP8_MAX, Fp8Layer, Product, Rows
from polyrl.engine.scheduler import ScheduledSeq
from polyrl.models.moe import is_moe_block, moe_blocks, moe_routers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

log = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[str] = set()


def _norm(x: torch.Tensor | Product, norm: nn.Module, residual: torch.Tensor | None, fp8: bool) -> torch.Tensor | Rows:
    """A fused layer's RMSNorm (with the residual add when given); `fp8`: its output
    quantized per row in the same kernel, for the FP8 matmul that reads it. x may be an
    FP8 matmul's product, its scales applied by the same kernel."""
    dequant = None
    if isinstance(x, Product):
        x, dequant = x.out, (None if x.row is None else (x.row, x.col))
    if fp8:
        return triton_ops.rmsnorm_fp8(x, norm.weight, norm.variance_epsilon, residual, FP8_MAX, dequant)
    return triton_ops.rmsnorm(x, norm.weight, norm.variance_epsilon, residual, dequant)


def run_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One layer's MLP on [T, hidden]; transformers' MoE blocks take [B, T, hidden]."""
    return mlp(x[None])[0] if is_moe_block(mlp) else mlp(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] (transformers' rotate-half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def kv_bytes_per_token(model: PreTrainedModel, dtype: torch.dtype, fp8_kv: bool = False) -> int:
    """A token's K and V over all layers; an FP8 cache: a byte a value, and a float32
    scale a head."""
    attn = model.model.layers[0].self_attn
    num_kv_heads = model.config.num_key_value_heads
    per_head = attn.head_dim + 4 if fp8_kv else attn.head_dim * dtype.itemsize
    return len(model.model.layers) * 2 * num_kv_heads * per_head


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        autocast_dtype: torch.dtype | None,
        cuda_graph_max_batch: int = 0,
        max_model_len: int = 0,
        fp8_kv: bool = False,
        fp8_layers: list[Fp8Layer] | None = None,
        moe_runner_backend: str = "auto",
        attention_backend: str = "triton",
    ) -> None:
        """`cuda_graph_max_batch` > 0 replays decode steps of up to that many sequences as
        CUDA graphs (CUDA with Triton only; elsewhere it is ignored). `fp8_kv`: the cache
        holds e4m3 values with a float32 scale per (slot, KV head) (`engine.kv_cache_dtype`),
        which only the fused layers write and read. `fp8_layers`: the decoder layers' FP8
        matmuls (`engine.weight_dtype`), which the fused layers run instead of the
        model's projections. `moe_runner_backend` (`engine.moe_runner_backend`): "auto"
        runs a mixture of experts' blocks in the fused layers as the engine's Triton experts
        where they apply, "model" as the model's own blocks. `attention_backend`
        (`engine.attention_backend`): the decode steps' paged attention kernel."""
        model_type = model.config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported by the engine (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if getattr(model.config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the engine")
        self.model, self.block_size = model, block_size
        self.fp8_layers = fp8_layers or None
        self._routes: list[torch.Tensor] | None = None
        self.last_routes: torch.Tensor | None = None
        """[rows, moe_layers, k] int16: the experts of the last forward's rows, when one of
        its sequences asked for them (`return_routed_experts`); else None."""
        routers = moe_routers(model)
        self.is_moe = bool(routers)
        self.fused_moe = (
            self.is_moe
            and moe_runner_backend == "auto"
            and triton_ops.available(model.device.type)
            and all(fused_moe.supports(mlp, model.config.hidden_act) for mlp in moe_blocks(model))
        )
        """The fused layers run the MoE blocks with `fused_moe` (up to `FUSED_MAX_PAIRS`
        token-expert pairs a forward; larger prefills take the model's blocks)."""
        for router in routers:
            router.register_forward_hook(self._record_routes)
        self.device = model.device
        self.autocast_dtype = autocast_dtype
        self.projections = projections.fused(model)
        """Each layer's q/k/v and gate/up as one matmul where their weights lie side by side
        (`projections.pack`); the fused layers use them. `refresh_projections` after the
        parameters move."""
        attn = model.model.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        # One block more than the block manager hands out: the scratch block that padding
        # rows of a captured decode step write into.
        num_slots = (num_blocks + 1) * block_size
        shape = (len(model.model.layers), 2, num_slots, model.config.num_key_value_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn if fp8_kv else kv_dtype, device=self.device)
        self.kv_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device) if fp8_kv else None
        """[layers, 2, slots, KVH]: the FP8 cache's scales (None for a 16/32-bit cache)."""
        self.decode_attention = self._decode_kernel(attention_backend, model, block_size, fp8_kv)
        """The paged decode kernel (`triton_ops.paged_decode_attention`'s contract)."""
        self.decode_graphs: DecodeGraphs | None = None
        if (
            cuda_graph_max_batch > 0
            and self.device.type == "cuda"
            and triton_ops.available("cuda")
            and self.supports_fused_decode(model, cuda_graph_max_batch)
        ):
            self.decode_graphs = DecodeGraphs(
                self._decode_logits,
                cuda_graph_max_batch,
                cdiv(max_model_len, block_size),
                block_size,
                num_blocks * block_size,
                model.config.vocab_size,
                model.lm_head.weight.dtype if autocast_dtype is None else autocast_dtype,
                self.device,
            )

    def _decode_kernel(
        self, backend: str, model: PreTrainedModel, block_size: int, fp8_kv: bool
    ) -> Callable[..., torch.Tensor]:
        """The CUDA kernel where `backend` asks for it and it can serve this engine (for
        "cuda", or else a refusal with the reason), Triton's otherwise."""
        if backend == "triton":
            return triton_ops.paged_decode_attention
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        reason = cuda_ops.unsupported(self.device, self.head_dim, heads, kv_heads, block_size, self.kv_cache.dtype)
        if reason is None:
            try:
                cuda_ops.compile_for(self.device, fp8_kv, heads, kv_heads, block_size)
            except (RuntimeError, OSError) as e:  # no NVRTC library, or no CUDA headers for it
                reason = f"NVRTC could not compile it: {e}"
        if reason is None:
            return cuda_ops.paged_decode_attention
        if backend == "cuda":
            raise ValueError(f"engine.attention_backend = 'cuda', but the CUDA decode kernel cannot serve it: {reason}")
        if self.device.type == "cuda" and reason not in _FALLBACKS_LOGGED:  # once, not at every wake
            _FALLBACKS_LOGGED.add(reason)
            log.info("engine: decode attention on the Triton kernel, since the CUDA one cannot serve it: %s", reason)
        return triton_ops.paged_decode_attention

    def refresh_projections(self) -> None:
        self.projections = projections.fused(self.model)

    def supports_fused_decode(self, model: PreTrainedModel, max_batch: int) -> bool:
        """The fused decode step covers the family's common shape: SwiGLU MLPs and a
        power-of-two head size; anything else decodes eagerly. A CUDA graph holds a mixture
        of experts when its decode steps of up to `max_batch` rows run the engine's Triton
        experts, or else with transformers' `grouped_mm` experts (sort by expert, offsets by
        `histc`, no host sync); the `eager` experts loop over `nonzero`, which reads back
        to the host."""
        if getattr(model.config, "hidden_act", None) != "silu" or not triton_ops.supports(self.head_dim):
            return False
        if not self.is_moe:
            return True
        if self.fused_moe and max_batch * model.config.num_experts_per_tok <= fused_moe.FUSED_MAX_PAIRS:
            return True
        return getattr(model.config, "_experts_implementation", None) == "grouped_mm"

    def _record_routes(self, module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> None:
        """A router's forward hook: its expert indices ([rows, k], its third output)."""
        if self._routes is not None:
            self._routes.append(output[2])

    def close(self) -> None:
        """Drop the KV cache and the graphs now (the graphs refer back to this runner, so
        the pair would otherwise wait for the garbage collector)."""
        self.decode_graphs = None
        self.kv_cache = self.kv_scales = None

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.kv_cache[:, :, dst * bs : (dst + 1) * bs] = self.kv_cache[:, :, src * bs : (src + 1) * bs]
        if self.kv_scales is not None:
            self.kv_scales[:, :, dst * bs : (dst + 1) * bs] = self.kv_scales[:, :, src * bs : (src + 1) * bs]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # No weight-cast cache: it must not outlive a CUDA graph capture.
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def is_graph_decode(self, batch: list[ScheduledSeq], fed_ids: torch.Tensor | None = None) -> bool:
        graphs = self.decode_graphs
        return (
            graphs is not None
            and len(batch) <= graphs.max_batch
            and (fed_ids is not None or all(item.is_decode for item in batch))
        )

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq], fed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """Feed every scheduled chunk; returns logits [S, V] (the model's dtype) for the
        sequences whose chunk reached their last token (they sample next), and the batch
        indices of those. `fed_ids` [len(batch)], on the device, makes the step a decode
        whose tokens the host has not read back yet (the engine's overlapped step): each
        sequence feeds it at position `num_computed_tokens`."""
        # A captured step runs no router hooks, so a step whose routes are wanted runs eagerly.
        wants_routes = self.is_moe and any(item.seq.sampling.return_routed_experts for item in batch)
        if not wants_routes and self.is_graph_decode(batch, fed_ids):
            return self.decode_graphs.run(batch, fed_ids), list(range(len(batch)))
        self._routes, self.last_routes = ([] if wants_routes else None), None
        try:
            return self._forward(batch, fed_ids)
        finally:
            if wants_routes:
                self.last_routes = torch.stack(self._routes, dim=1).to(torch.int16)
            self._routes = None

    def _forward(self, batch: list[ScheduledSeq], fed_ids: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch)
        if fed_ids is not None:
            input_ids = fed_ids
        with self._autocast():
            if self.decode_graphs is not None:  # CUDA with Triton: fused layers, the paged kernel for decodes

                def attend(layer_idx: int, q: torch.Tensor) -> torch.Tensor:
                    return paged_attention(
                        q,
                        *self._blocked_cache(layer_idx),
                        meta,
                        self.scale,
                        **self._blocked_scales(layer_idx),
                        decode_attention=self.decode_attention,
                    )

                hidden = self._fused_decoder(input_ids, positions, meta.slot_mapping, attend)[sample_rows]
            else:
                hidden = self._decoder(input_ids, positions, meta)  # [T, hidden]
                hidden = self.model.model.norm(hidden[sample_rows])  # [S, hidden]
            logits = self.model.lm_head(hidden)
        return logits, sample_seqs

    def _blocked_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as [blocks, block_size, KVH, D]."""
        k_cache, v_cache = self.kv_cache[layer_idx]
        blocked = (-1, self.block_size, *k_cache.shape[1:])
        return k_cache.view(blocked), v_cache.view(blocked)

    def _blocked_scales(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """An FP8 cache's scales of one layer as [blocks, block_size, KVH], as keyword
        arguments of the attention functions (none for a 16/32-bit cache)."""
        if self.kv_scales is None:
            return {}
        k_scales, v_scales = self.kv_scales[layer_idx]
        blocked = (-1, self.block_size, k_scales.shape[-1])
        return {"k_scales": k_scales.view(blocked), "v_scales": v_scales.view(blocked)}

    def _decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The captured decode step: every row feeds one token and samples. `out`: the
        logits' buffer (the graphs' static one), which the LM head writes directly where it
        can (a plain Linear without bias, in the logits' dtype): at batch 512 copying them
        cost 0.07 ms a step."""

        def attend(layer_idx: int, q: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self._blocked_cache(layer_idx)
            return self.decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale, **self._blocked_scales(layer_idx)
            )

        with self._autocast():
            hidden = self._fused_decoder(input_ids, positions, meta.slot_mapping, attend)
            head = self.model.lm_head
            if out is None:
                return head(hidden)
            if type(head) is nn.Linear and head.bias is None and hidden.dtype == head.weight.dtype == out.dtype:
                return torch.mm(hidden, head.weight.t(), out=out)
            return out.copy_(head(hidden))

    def _fused_decoder(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The decoder with fused Triton kernels, final norm included ([T, hidden]). The
        model's own weights do the matmuls (q/k/v and gate/up as one each where
        `projections` has them); norms, RoPE, the cache write and the SwiGLU
        product are fused (about 12 kernels a layer instead of 50: a decode step is
        launch-bound long before it is bandwidth-bound, and so is prefill on the host).
        `attend(layer, rotated q [T, H, D])` is attention over the cache, written by then."""
        inner = self.model.model
        layers = inner.layers
        residual = inner.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = inner.rotary_emb(residual, positions[None])
        cos, sin = cos[0], sin[0]
        fp8_layers = self.fp8_layers or [None] * len(layers)  # FP8 weights: norms write FP8 rows
        hidden = _norm(residual, layers[0].input_layernorm, None, fp8_layers[0] is not None)
        for layer_idx, (layer, fp8) in enumerate(zip(layers, fp8_layers, strict=True)):
            if layer_idx:  # the previous block's residual add, fused with this block's norm
                hidden = _norm(hidden, layer.input_layernorm, residual, fp8 is not None)
            hidden = self._fused_attention(layer.self_attn, hidden, cos, sin, slot_mapping, layer_idx, attend, fp8)
            mlp = layer.mlp
            fp8_mlp = fp8 is not None and fp8.gate_up is not None
            hidden = _norm(hidden, layer.post_attention_layernorm, residual, fp8_mlp)
            if is_moe_block(mlp):
                hidden = self._moe(mlp, hidden)
            elif fp8_mlp:
                gate, up = fp8.gate_up(hidden)
                dequant = None if gate.row is None else (gate.row, gate.col, up.col)
                (hidden,) = fp8.down(triton_ops.silu_mul_fp8(gate.out, up.out, FP8_MAX, dequant))
            else:
                gate_up = self.projections[layer_idx].gate_up
                gate, up = gate_up(hidden) if gate_up is not None else (mlp.gate_proj(hidden), mlp.up_proj(hidden))
                hidden = mlp.down_proj(triton_ops.silu_mul(gate, up))
        return _norm(hidden, inner.norm, residual, False)

    def _moe(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A fused layer's mixture of experts: the engine's Triton experts where they apply
        (their routes go to `_routes` directly: the router's hook does not run), else the
        model's block. The Triton experts leave their k outputs a token unsummed ([T, k,
        hidden]): the next `_norm`'s residual add sums them."""
        if self.fused_moe and x.shape[0] * mlp.gate.top_k <= fused_moe.FUSED_MAX_PAIRS:
            return fused_moe.moe_forward(mlp, x, self._routes, summed=False)
        return run_mlp(mlp, x)

    def _fused_attention(
        self,
        attn: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        layer_idx: int,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
        fp8: Fp8Layer | None = None,
    ) -> torch.Tensor | Product:
        num_tokens = x[0].shape[0] if isinstance(x, tuple) else x.shape[0]
        fused = self.projections[layer_idx].qkv
        dequant = None
        if fp8 is not None:  # products whose scales the RoPE kernel applies
            qkv = fp8.qkv(x)
            if qkv[0].row is not None:
                dequant = (qkv[0].row, *(p.col for p in qkv))
            qkv = [p.out for p in qkv]
        elif fused is not None:
            qkv = fused(x)
        else:
            qkv = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (t.view(num_tokens, -1, self.head_dim) for t in qkv)
        k_cache, v_cache = self.kv_cache[layer_idx]  # [S, KVH, D]
        has_norm = hasattr(attn, "q_norm")
        q = triton_ops.rope_and_cache(
            q,
            k,
            v,
            cos,
            sin,
            slot_mapping,
            k_cache,
            v_cache,
            attn.q_norm.weight if has_norm else None,
            attn.k_norm.weight if has_norm else None,
            attn.q_norm.variance_epsilon if has_norm else 1e-6,
            *(self.kv_scales[layer_idx] if self.kv_scales is not None else (None, None)),
            dequant=dequant,
        )
        out = attend(layer_idx, q).reshape(num_tokens, -1)
        return fp8.o(out)[0] if fp8 is not None else attn.o_proj(out)  # o's product: the next norm scales it

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
            fed = seq.token_ids[start:end]
            input_ids += fed if len(fed) == num_new else [0] * num_new  # an overlapped decode: fed_ids
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if end >= seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(i)
        dev = self.device
        # One host tensor and one copy for the three per-token arrays.
        ids, pos, slot_mapping = torch.tensor([input_ids, positions, slots], dtype=torch.long).to(dev).unbind(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            groups=[
                AttentionGroup.build(*g, bs, dev, kernel_decode=self.decode_graphs is not None)
                for g in groups.values()
                if g[0]
            ],
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
            hidden = hidden + run_mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return hidden

    def _attention(
        self,
        attn: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        layer_idx: int,
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
        out = paged_attention(
            q, *self._blocked_cache(layer_idx), meta, self.scale, decode_attention=self.decode_attention
        )  # [T, H, D]
        return attn.o_proj(out.reshape(num_tokens, -1))


def num_kv_blocks_for(
    model: PreTrainedModel,
    cfg_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int,
    memory_fraction: float,
    cpu_gib: float,
    fp8_kv: bool = False,
) -> int:
    """The configured number of KV blocks, or one sized from the device's memory. On CUDA
    that is `memory_fraction` of the free memory, but never more than twice what
    `max_num_seqs` full-length sequences take (the rest is room for the prefix cache): a
    small model would otherwise take half the GPU, and the next engine started on the
    same GPU (the trainer's local worker next to launched workers) would not fit."""
    if cfg_blocks:
        return cfg_blocks
    block_bytes = kv_bytes_per_token(model, kv_dtype, fp8_kv) * block_size
    wanted = max_num_seqs * cdiv(max_model_len, block_size)
    if model.device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(model.device)
        return max(1, min(2 * wanted, int(free_bytes * memory_fraction) // block_bytes))
    return max(1, min(wanted, int(cpu_gib * 2**30) // block_bytes))
