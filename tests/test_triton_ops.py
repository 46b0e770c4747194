"""The GPU decode path's Triton kernels against the PyTorch path they replace.

On CPU they run in Triton's interpreter (tests/conftest.py switches it on), on a GPU
compiled; the GPU-only parts (CUDA graphs, memory across sleep/wake) are at the end.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

pytest.importorskip("triton")

from polyrl.config import EngineConfig, TinyModelConfig
from polyrl.engine import triton_ops
from polyrl.engine.attention import AttentionGroup, AttentionMetadata, paged_attention
from polyrl.engine.cuda_graphs import DecodeMetadata, batch_buckets, decode_inputs
from polyrl.engine.engine import Engine
from polyrl.engine.sampler import SamplingBatch, sample
from polyrl.engine.types import EngineRequest
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.sampling import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def needs_cuda(test):
    """GPU-only: marked `gpu` (so `-m "not gpu"` leaves it out on a CPU machine instead of
    skipping it) and skipped where CUDA is missing."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def reference_attention(q, k_cache, v_cache, table, ctx, scale):
    """One sequence, by slot: softmax(q k^T) v over its first `ctx` cached tokens."""
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
    k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(q.shape[0] // num_kv, dim=1)  # [C, H, D]
    v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(q.shape[0] // num_kv, dim=1)
    weights = (torch.einsum("hd,chd->hc", q.float(), k) * scale).softmax(-1)
    return torch.einsum("hc,chd->hd", weights, v)


@pytest.mark.parametrize(
    "tile",
    [{}, {"block_n": 64, "num_warps": 4, "num_stages": 2}, {"heads_first": True}],
    ids=["default", "64/4/2", "heads first"],
)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_paged_decode_attention_matches_the_reference(dtype, tile):
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("bf16 tl.dot needs a GPU")
    g = torch.Generator().manual_seed(0)
    num_seqs, heads, kv_heads, head_dim, block_size, num_blocks = 6, 8, 2, 32, 4, 64
    q = torch.randn(num_seqs, heads, head_dim, generator=g).to(DEVICE, dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    ctx = [1, 4, 5, 0, 70, 33]  # one exact block, one past it, a padding row, several tiles of either width
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:20] for _ in range(num_seqs)]).int()
    out = triton_ops.paged_decode_attention(
        q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(ctx, device=DEVICE), 0.2, **tile
    )
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for b, c in enumerate(ctx):
        if c == 0:
            assert out[b].abs().max().item() == 0  # padding rows produce zeros, never NaN
            continue
        ref = reference_attention(q[b].cpu(), k_cache.cpu(), v_cache.cpu(), tables[b].tolist(), c, 0.2)
        assert (out[b].float().cpu() - ref).abs().max().item() < tol


@pytest.mark.parametrize("heads_first", [False, True], ids=["by head", "heads first"])
@pytest.mark.parametrize("value_size", [1.0, 1e-5])
@pytest.mark.parametrize(("kv_heads", "loop"), [(8, "fp8 few heads"), (4, "fp8 few heads"), (2, "fp8")])
def test_an_fp8_cache_is_read_as_its_dequantized_values(
    kv_heads: int, loop: str, value_size: float, heads_first: bool
) -> None:
    """Both FP8 loops (CUDA cores for one or two query heads a KV head, tensor cores for
    more) against float32 attention over the cache's e4m3 values times their scales, with
    values of unit size and of 1e-5 (the tensor cores take the values' weights in fp16,
    whose smallest normal number is 6e-5)."""
    assert triton_ops.decode_loop(True, 8 // kv_heads) == loop
    g = torch.Generator().manual_seed(0)
    num_seqs, heads, head_dim, block_size, num_blocks = 5, 8, 32, 4, 64
    q = torch.randn(num_seqs, heads, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    caches, scales = [], []
    for size in (1.0, value_size):  # keys, values: one scale per (slot, KV head), as the engine writes them
        x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * size
        scale = x.abs().amax(-1) / 448.0
        caches.append((x / scale[..., None]).to(torch.float8_e4m3fn).to(DEVICE))
        scales.append(scale.to(DEVICE))
    ctx = [1, 5, 0, 70, 33]
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:20] for _ in range(num_seqs)]).int()
    out = triton_ops.paged_decode_attention(
        q,
        *caches,
        tables.to(DEVICE),
        torch.tensor(ctx, device=DEVICE),
        0.2,
        k_scales=scales[0],
        v_scales=scales[1],
        heads_first=heads_first,
    )
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    k, v = ((c.float() * s[..., None]).cpu() for c, s in zip(caches, scales, strict=True))
    for b, c in enumerate(ctx):
        if c == 0:
            assert out[b].abs().max().item() == 0
            continue
        ref = reference_attention(q[b].float().cpu(), k, v, tables[b].tolist(), c, 0.2)
        # the values' size sets the output's, and so its tolerance (3e-2 for values of unit size)
        assert (out[b].float().cpu() - ref).abs().max().item() < 3e-2 * value_size, b


def test_a_mixed_step_attends_the_same_with_its_decodes_on_the_paged_kernel():
    """A step with prefill chunks and decodes (every step that admits a request on a busy
    worker): the decode group on the paged kernel gives what the gather-and-SDPA path
    gives, rows in place and the prefill chunks untouched."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 32, 4, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[0:10], perm[10:12], perm[12:20], perm[20:30], perm[30:34]]
    # (tokens fed this step, context after it): decode, prefill chunk, decode, resumed chunk, decode
    rows = [(1, 37), (5, 5), (1, 29), (7, 40), (1, 16)]
    offsets, t = [], 0
    for fed, _ in rows:
        offsets.append(t)
        t += fed
    q = torch.randn(t, heads, head_dim, generator=g).to(DEVICE)

    def meta(kernel_decode: bool) -> AttentionMetadata:
        groups = []
        for decode in (True, False):
            pick = [i for i, (fed, _) in enumerate(rows) if (fed == 1) == decode]
            groups.append(
                AttentionGroup.build(
                    [offsets[i] for i in pick],
                    [rows[i][0] for i in pick],
                    [rows[i][1] for i in pick],
                    [tables[i] for i in pick],
                    block_size,
                    DEVICE,
                    kernel_decode=kernel_decode,
                )
            )
        return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE), groups=groups)

    kernel, sdpa = meta(True), meta(False)
    assert kernel.groups[0].context_lens is not None and kernel.groups[0].mask is None
    assert kernel.groups[1].context_lens is None  # prefill chunks stay on SDPA
    out = paged_attention(q, k_cache, v_cache, kernel, 0.2)
    ref = paged_attention(q, k_cache, v_cache, sdpa, 0.2)
    assert torch.allclose(out, ref, atol=1e-5)
    one = reference_attention(q[0].cpu(), k_cache.cpu(), v_cache.cpu(), tables[0], 37, 0.2)
    assert (out[0].cpu() - one).abs().max().item() < 1e-5


def test_fused_sample_draws_what_the_torch_sampler_draws():
    g = torch.Generator().manual_seed(1)
    rows, vocab = 12, 5000  # more than one 4096-wide tile, with a ragged last one
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    temperature = torch.tensor([0, 1, 0.7, 1, 2, 0, 1, 1, 0.5, 1, 1, 1.3], device=DEVICE)
    seeds = torch.tensor([1, 2, 3, 2**62 + 5, 7, 9, 2**63 - 1, 0, 11, 12, 13, 14], device=DEVICE)
    positions = torch.tensor([0, 5, 9, 100, 3, 4, 2**33 + 1, 7, 8, 9, 10, 11], device=DEVICE)
    params = SamplingBatch(
        temperature.cpu(),
        torch.ones(rows),
        torch.zeros(rows, dtype=torch.long),
        torch.zeros(rows),
        seeds.cpu(),
        positions.cpu(),
        needs_truncation=False,
        all_greedy=False,
    )
    ref_tokens, ref_logprobs = sample(logits.cpu(), params)  # the PyTorch path on CPU
    # One program a row; the default split (eight slices of 1,024, three past the end of the
    # 5,000); four slices of 4,096-wide tiles, of which two are past the end.
    for splits, block_v in ((1, 1024), (None, 1024), (4, 4096)):
        tokens, logprobs = triton_ops.fused_sample(logits, temperature, seeds, positions, splits, block_v)
        assert tokens.cpu().tolist() == ref_tokens.tolist()
        assert torch.allclose(logprobs.cpu(), ref_logprobs, atol=1e-5)
    # A tie goes to the lowest index, as with torch.argmax.
    flat = torch.zeros(1, vocab, device=DEVICE)
    tok, lp = triton_ops.fused_sample(flat, torch.zeros(1, device=DEVICE), seeds[:1], positions[:1])
    assert tok.item() == 0 and abs(lp.item() + torch.log(torch.tensor(float(vocab))).item()) < 1e-4


def test_batch_buckets_cover_every_size():
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_buckets(256)[-1] == 256
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]


def tiny_engine(tmp_path, **cfg) -> Engine:
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(hidden_size=64, intermediate_size=128))  # head_dim 16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    model.requires_grad_(False)  # the engine's own: q/k/v and gate/up packed for the fused matmuls
    return Engine(model, EngineConfig(block_size=4, max_num_batched_tokens=64, **cfg))


def test_the_decode_step_on_the_triton_kernel_matches_the_eager_step(tmp_path):
    """What the CUDA graph captures (`_decode_logits` over DecodeMetadata) gives the eager
    path's logits for the same step, padding rows included."""
    engine = tiny_engine(tmp_path, cuda_graphs=False, overlap_decode="off")  # nothing in flight to schedule around
    s = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    for i, p in enumerate([[1, 5, 6], [1, *range(3, 20)], [1, 7]]):
        engine.add_request(EngineRequest(str(i), p, s))
    for _ in range(4):
        engine.step()  # prefills, then a few decodes
    batch = engine.scheduler.schedule()
    assert all(item.num_new_tokens == 1 and item.seq.num_uncomputed == 1 for item in batch)
    runner = engine.runner
    assert all(p.qkv is not None and p.gate_up is not None for p in runner.projections)
    eager, _ = runner.forward(batch)
    scratch = engine.blocks.num_blocks * engine.cfg.block_size
    inputs, tables = decode_inputs(batch, 4, engine.cfg.block_size, scratch)  # one padding row
    inputs, tables = inputs.to(DEVICE), tables.to(DEVICE)
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32, device=DEVICE)])
    with torch.inference_mode():
        logits = runner._decode_logits(inputs[0], inputs[1], DecodeMetadata(inputs[2], tables, inputs[3]))
    assert torch.allclose(logits[:3].float(), eager.float(), atol=1e-4)
    assert torch.isfinite(logits[3]).all()


def qwen3_model(device, dtype, layers=4, vocab=4096):
    """Qwen3-0.6B's layer shape (hidden 1024, head_dim 128, GQA 2:1), random weights."""
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)
    return model.to(device)


def generate(engine, prompts, sampling):
    out: dict[tuple[str, int], list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, sampling))
    while engine.has_work:
        for d in engine.step():
            tokens, logprobs = out.setdefault((d.rid, d.index), ([], []))
            tokens += d.token_ids
            logprobs += d.logprobs
    return [out[k] for k in sorted(out, key=lambda k: (int(k[0]), k[1]))]


@needs_cuda
def test_cuda_graph_engine_greedy_equals_hf_generate_in_float32():
    """Token-exact against HF in float32, where rounding cannot flip a greedy choice."""
    model = qwen3_model("cuda", torch.float32)
    engine = Engine(model, EngineConfig(max_num_seqs=64, max_model_len=512))
    assert engine.runner.decode_graphs is not None
    prompts = torch.randint(3, 4096, (16, 24), generator=torch.Generator().manual_seed(0)).tolist()
    results = generate(engine, prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    assert engine.runner.decode_graphs.graphs  # the decode steps ran as graphs
    hf = model.generate(
        torch.tensor(prompts, device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, 24:].tolist()
    assert [tokens for tokens, _ in results] == hf


@needs_cuda
def test_cuda_graph_engine_in_bf16_matches_a_full_forward():
    """bf16: every greedy token is the full forward's argmax up to bf16 resolution (random
    weights give near-ties, so paths may part at one), and log-probs agree to bf16 level."""
    model = qwen3_model("cuda", torch.bfloat16)
    engine = Engine(model, EngineConfig(max_num_seqs=64, max_model_len=512))
    prompts = torch.randint(3, 4096, (16, 24), generator=torch.Generator().manual_seed(0)).tolist()
    results = generate(engine, prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    for p, (tokens, logprobs) in zip(prompts, results):
        with torch.inference_mode():
            logits = model(torch.tensor([p + tokens], device="cuda")).logits[0, len(p) - 1 : -1].float()
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        tol = 0.02 + logits.abs().amax(-1) / 64  # bf16 resolves a logit of size L to about L / 128
        assert (logits.amax(-1) - logits.gather(-1, chosen)[:, 0] < tol).all()
        ref = logits.log_softmax(-1).gather(-1, chosen)[:, 0]
        assert ((ref - torch.tensor(logprobs, device="cuda")).abs() < tol).all()


@needs_cuda
def test_cuda_graphs_give_the_eager_engines_samples():
    """Sampled (T=1, n=4) in float32: the graph path draws exactly what the eager path draws."""
    model = qwen3_model("cuda", torch.float32, layers=2)
    prompts = torch.randint(3, 4096, (6, 17), generator=torch.Generator().manual_seed(1)).tolist()
    s = SamplingParams(max_new_tokens=24, temperature=1.0, n=4, seed=5, ignore_eos=True)
    fast = generate(Engine(model, EngineConfig(max_model_len=512)), prompts, s)
    slow = generate(Engine(model, EngineConfig(max_model_len=512, cuda_graphs=False)), prompts, s)
    assert [t for t, _ in fast] == [t for t, _ in slow]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(fast, slow) for a, b in zip(la, lb)) < 1e-3
    # Overlapped decoding (the CUDA default) changes when tokens are read back, never which.
    in_order = generate(Engine(model, EngineConfig(max_model_len=512, overlap_decode="off")), prompts, s)
    assert in_order == fast


@needs_cuda
def test_kv_cache_frees_and_regrows_across_weight_swaps_without_leaking():
    gc.collect()  # earlier tests' garbage must not be freed in the middle of the measurement
    model = qwen3_model("cuda", torch.bfloat16, layers=2)
    engine = Engine(model, EngineConfig(max_model_len=512, kv_cache_memory_fraction=0.2))
    runner = weakref.ref(engine.runner)
    engine.sleep()
    assert runner() is None  # freed by reference counting, not left for the garbage collector
    prompts = [[5, 6, 7, 8]] * 8
    s = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, ignore_eos=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    held = []
    for version in range(1, 21):
        engine.sleep()
        asleep = torch.cuda.memory_allocated()
        engine.update_weights(weights, version)
        results = generate(engine, prompts, s)
        assert all(len(t) == 16 for t, _ in results)
        held.append((asleep, torch.cuda.memory_allocated()))
    steady = held[1:]  # the first cycle also creates the graphs' lasting state (capture stream, cuBLAS)
    assert max(a for a, _ in steady) - min(a for a, _ in steady) < 2**20, held  # asleep: the same bytes
    assert max(b for _, b in steady) - min(b for _, b in steady) < 2**20, held  # awake: the same cache again
    assert held[0][1] - held[0][0] > 2**30, held  # and the cache was real (20% of free memory)


def test_silu_mul_reads_the_two_halves_of_one_output() -> None:
    """The FP8 engine's gate and up come out of one matmul as column slices of a [T, 2I]
    tensor; silu_mul reads them in place and writes a contiguous [T, I]."""
    from polyrl.engine import triton_ops

    if not triton_ops.available("cpu"):
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")
    both = torch.randn(5, 2 * 24)
    gate, up = both.split(24, dim=1)
    out = triton_ops.silu_mul(gate, up)
    assert out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)


def test_kernels_that_read_an_fp8_product_apply_its_scales_as_the_scaled_matmul_would() -> None:
    """The FP8 engine's matmuls run with unit scales and leave the activations' row scales
    and the weights' column scales to the kernel that reads their output next. The norm and
    RoPE with the cache write give what they give on the product scaled first
    (`fp8.Product.scaled`), bit for bit (SwiGLU's FP8 kernel: tests/test_fp8.py, GPU)."""
    from polyrl.engine.fp8 import Product

    if not triton_ops.available(DEVICE.type):
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter computes in float32
    g = torch.Generator().manual_seed(0)

    def product(t: int, n: int) -> Product:  # values as an e4m3 x e4m3 product would have
        out = (torch.randn(t, n, generator=g) * 3000).to(DEVICE, dtype)
        return Product(
            out, torch.rand(t, 1, generator=g).to(DEVICE) / 100, torch.rand(1, n, generator=g).to(DEVICE) / 100
        )

    t, heads, kv_heads, d = 6, 4, 2, 16
    # the norm after o and down, with the residual add
    p = product(t, 64)
    weight = (torch.rand(64, generator=g) + 0.5).to(DEVICE, dtype)
    res = torch.randn(t, 64, generator=g).to(DEVICE, dtype)
    res_a, res_b = res.clone(), res.clone()
    got = triton_ops.rmsnorm(p.out, weight, 1e-6, res_a, dequant=(p.row, p.col))
    want = triton_ops.rmsnorm(p.scaled(), weight, 1e-6, res_b)
    assert torch.equal(got, want) and torch.equal(res_a, res_b)
    assert not torch.equal(triton_ops.rmsnorm(p.out, weight, 1e-6, res.clone()), want)  # the scales do matter

    # q, k and v of one matmul: RoPE with Qwen3's q/k norms, keys and values into the cache
    qkv = product(t, (heads + 2 * kv_heads) * d)
    cols = qkv.col.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q, k, v = (x.view(t, -1, d) for x in qkv.out.split([heads * d, kv_heads * d, kv_heads * d], dim=1))
    sq, sk, sv = (x.view(t, -1, d) for x in qkv.scaled().split([heads * d, kv_heads * d, kv_heads * d], dim=1))
    pos = torch.arange(t, device=DEVICE, dtype=torch.float32)[:, None] * torch.rand(d, generator=g).to(DEVICE)
    cos, sin = pos.cos().to(dtype), pos.sin().to(dtype)
    slots = torch.tensor([3, 0, 7, 1, 5, 2], device=DEVICE)
    q_norm, k_norm = ((torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    caches = [torch.zeros(8, kv_heads, d, device=DEVICE, dtype=dtype) for _ in range(4)]
    got = triton_ops.rope_and_cache(q, k, v, cos, sin, slots, *caches[:2], q_norm, k_norm, dequant=(qkv.row, *cols))
    want = triton_ops.rope_and_cache(sq, sk, sv, cos, sin, slots, *caches[2:], q_norm, k_norm)
    assert torch.equal(got, want)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[1].abs().sum() > 0
