"""Padding-free micro-batches: sequences concatenated into one row [1, T], position ids
restarting at 0 per sequence, attention kept inside each sequence.

On the long-tail lengths of reasoning RL (lognormal, up to 8k) a padded micro-batch is
mostly padding; packed, every token computed is a real one. The attention function
registered here reads the documents' bounds from the `packed_docs` keyword that the
model's forward hands down to every attention call.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.9
    varlen_attn = None

from polyrl.trainer.batching import MicroBatch, SeqItem, collate, expert_routes, to_device

ATTN_NAME = "polyrl_packed"
PAD_MULTIPLE = 128
"""The packed row is padded to a multiple of this (flex attention's block size), so fewer
distinct shapes reach compiled code; the padding is a document of its own."""


def pack_by_tokens(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Greedy packing in arrival order: a micro-batch's total tokens stay within
    `max_tokens` (no padding to count); a single longer sequence gets one of its own."""
    batches: list[list[SeqItem]] = []
    current: list[SeqItem] = []
    total = 0
    for item in items:
        if current and total + len(item.token_ids) > max_tokens:
            batches.append(current)
            current, total = [], 0
        current.append(item)
        total += len(item.token_ids)
    if current:
        batches.append(current)
    return batches


@dataclass
class PackedDocs:
    """Where the documents of a packed row are, in the form the attention backend needs."""

    backend: str  # "sdpa" (a loop over documents, exact, for CPU), "flex" or "varlen"
    lengths: tuple[int, ...]  # tokens per document, the padding last
    cu_seqlens: torch.Tensor | None = None  # [D+1] int32, varlen
    max_len: int = 0
    block_mask: object | None = None  # flex BlockMask
    varlen_kwargs: dict | None = None
    traced: bool = False
    """varlen only: attention runs inside the compiled layer's graph (torch's varlen op is a
    custom op with a fake kernel), so a layer is one graph forward and one backward instead
    of two around an eager call."""


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    head_rows: torch.Tensor  # [N] row positions whose next token is a counted target
    head_targets: torch.Tensor  # [N]
    grid_index: torch.Tensor  # [N] flat index of each into the padded [B, L-1] grid
    lengths: tuple[int, ...]

    def to(self, device: torch.device) -> PackedRow:
        moved = {k: (to_device(v, device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return PackedRow(**moved)


def pack_row(items: list[SeqItem], pad_id: int) -> PackedRow:
    """The items as one row, plus where their counted targets (completion tokens) sit in
    it and in the padded grid of `collate`, which keeps the loss's inputs.

    Built with numpy: from Python lists through torch.tensor this took 22 ms per 16k-token
    micro-batch, which the GPU spent idle at the start of every learner step."""
    width = max(len(it.token_ids) for it in items)
    lengths = [len(it.token_ids) for it in items]
    starts = np.cumsum([0, *lengths[:-1]])
    ids = np.concatenate([np.asarray(it.token_ids, dtype=np.int64) for it in items])
    pos = np.concatenate([np.arange(n) for n in lengths])
    # Position t predicts token t+1; completion targets are tokens prompt_len .. n-1.
    rows = np.concatenate([np.arange(s + it.prompt_len - 1, s + n - 1) for s, n, it in zip(starts, lengths, items)])
    grid = np.concatenate(
        [
            np.arange(i * (width - 1) + it.prompt_len - 1, i * (width - 1) + n - 1)
            for i, (n, it) in enumerate(zip(lengths, items))
        ]
    )
    targets = ids[rows + 1]
    pad = -len(ids) % PAD_MULTIPLE
    if pad:
        ids = np.concatenate([ids, np.full(pad, pad_id, dtype=np.int64)])
        pos = np.concatenate([pos, np.arange(pad)])
        lengths.append(pad)
    return PackedRow(
        input_ids=torch.from_numpy(ids).unsqueeze(0),
        position_ids=torch.from_numpy(pos.astype(np.int64)).unsqueeze(0),
        head_rows=torch.from_numpy(rows.astype(np.int64)),
        head_targets=torch.from_numpy(targets),
        grid_index=torch.from_numpy(grid.astype(np.int64)),
        lengths=tuple(lengths),
    )


def collate_packed(items: list[SeqItem], pad_id: int) -> MicroBatch:
    """The padded micro-batch of `collate` for the loss's per-token inputs ([B, L-1], small),
    with the packed row that the model actually runs on."""
    mb = collate(items, pad_id, with_routes=False)
    mb.packed = pack_row(items, pad_id)
    lengths = [len(it.token_ids) for it in items]  # the routes in the packed row's layout
    routed = expert_routes(items, np.cumsum([0, *lengths[:-1]]).tolist(), mb.packed.input_ids.shape[1])
    if routed is not None:
        mb.expert_routes, mb.routes_known = routed
    return mb


# ---------------------------------------------------------------------------------------------
# Attention over packed documents
# ---------------------------------------------------------------------------------------------


def _varlen_kwargs() -> dict | None:
    """Causal and GQA keywords of torch's varlen_attn, whose signature moved between
    releases (is_causal, then window_size; enable_gqa later); None without it."""
    if varlen_attn is None:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def _document_ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    sizes = torch.tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)  # [T]


def make_docs(lengths: tuple[int, ...], backend: str, device: torch.device, traced: bool = False) -> PackedDocs:
    """Build once per micro-batch what every layer's attention call reuses."""
    docs = PackedDocs(backend, lengths, max_len=max(lengths), traced=traced and backend == "varlen")
    if backend == "varlen":
        docs.varlen_kwargs = _varlen_kwargs()
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        docs.cu_seqlens = to_device(cu, device)  # [D+1]
    elif backend == "flex":
        doc = _document_ids(lengths, device)  # [T]

        def same_doc_causal(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        T = sum(lengths)
        docs.block_mask = create_block_mask(same_doc_causal, None, None, T, T, device=device)
    elif backend != "sdpa":
        raise ValueError(f"unknown packed attention backend {backend!r}")
    return docs


@functools.cache
def _compiled_flex():
    """flex_attention compiled once (uncompiled, it materialises the scores); shapes that
    vary from micro-batch to micro-batch make it dynamic after the first recompile."""
    return torch.compile(flex_attention)


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_flash: bool) -> tuple[torch.Tensor, ...]:
    """Under autocast, Qwen3's q/k norms hand float32 queries and keys beside bf16 values:
    SDPA autocasts itself, flex and varlen need one dtype (and flash a 16-bit one)."""
    device = q.device.type
    dt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else v.dtype
    if is_flash and dt not in (torch.bfloat16, torch.float16):
        dt = torch.bfloat16
    return q.to(dt), k.to(dt), v.to(dt)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None), causal within
    each document of `packed_docs`; without it, plain causal SDPA (right padding only)."""
    docs: PackedDocs | None = kwargs.get("packed_docs")
    if docs is not None and docs.traced:
        return _varlen(query, key, value, docs, scaling), None
    return _eager_attention(query, key, value, attention_mask, scaling, docs)


def _varlen(query, key, value, docs: PackedDocs, scaling) -> torch.Tensor:
    query, key, value = _same_dtype(query, key, value, is_flash=True)
    groups = query.shape[1] // key.shape[1]
    kw = docs.varlen_kwargs
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if "enable_gqa" not in kw:
        k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = varlen_attn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len, scale=scaling, **kw)
    return out.unsqueeze(0)  # [1, T, Hq, D]


@torch.compiler.disable
def _eager_attention(query, key, value, attention_mask, scaling, docs: PackedDocs | None):
    """Outside compiled layers (a graph break): the varlen op (untraced) and compiled flex
    run as they are, and per-micro-batch lengths never become guards of the layer's graph."""
    if docs is not None and docs.backend == "varlen":
        return _varlen(query, key, value, docs, scaling), None
    groups = query.shape[1] // key.shape[1]
    if docs is not None and docs.backend == "flex":
        query, key, value = _same_dtype(query, key, value, is_flash=False)
    if docs is None:
        k, v = _repeat_kv(key, groups, 1), _repeat_kv(value, groups, 1)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=attention_mask, scale=scaling, is_causal=attention_mask is None
        )
    elif docs.backend == "flex":
        out = _compiled_flex()(query, key, value, block_mask=docs.block_mask, scale=scaling, enable_gqa=True)
    else:
        k, v = _repeat_kv(key, groups, 1), _repeat_kv(value, groups, 1)
        parts, start = [], 0
        for n in docs.lengths:
            s = slice(start, start + n)
            q_s, k_s, v_s = query[:, :, s], k[:, :, s], v[:, :, s]  # [1, H, n, D]
            parts.append(F.scaled_dot_product_attention(q_s, k_s, v_s, scale=scaling, is_causal=True))
            start += n
        out = torch.cat(parts, dim=2)  # [1, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through `packed_attention` (the engine's own attention
    is not affected: it calls the projections, not the HF attention forward).

    No mask function is registered under the name, on purpose: transformers then builds
    no mask for it (`_preprocess_mask_arguments` returns early for an attention it has no
    mask function for). With one registered, every forward given position ids and no
    mask ran `find_packed_sequence_indices`, whose `.all()` made the host wait for the
    device once per micro-batch, so the learner could never queue the next forward while
    the last backward ran (16% of its main thread's samples on the H100, BENCHMARKS.md)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception:  # noqa: BLE001 - older transformers: set the config as it would
        model.config._attn_implementation = ATTN_NAME
    assert model.config._attn_implementation == ATTN_NAME, model.config._attn_implementation


def default_backend(device: torch.device, compute_dtype: torch.dtype) -> str:
    """varlen (flash attention inside torch) for bf16/fp16 compute on CUDA where torch has
    it, else flex; otherwise the exact per-sequence SDPA loop (CPU, and float32 on CUDA,
    which flash attention would round to bf16)."""
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    return "varlen" if _varlen_kwargs() is not None else "flex"
