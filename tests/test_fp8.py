"""FP8 rollout weights (`engine.weight_dtype = "fp8"`, `polyrl/engine/fp8.py`).

On CPU: the refusal, with a message that says what is needed. On a GPU with FP8 tensor
cores (`gpu` tests, skipped elsewhere): the quantization's error bounds, the FP8 engine's
log-probs against the bf16 engine's on the same tokens, and a new version quantized
again into the storage the CUDA graphs read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fp8 import bf16_logprobs, generate  # noqa: E402  (benchmarks/fp8.py: run to the end, score with bf16)

from polyrl.config import ConfigError, EngineConfig, TinyModelConfig, load_config
from polyrl.engine.engine import Engine
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.sampling import SamplingParams

HAS_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not HAS_FP8, reason="needs a CUDA GPU of compute capability 8.9+")

# head size 64 (the fused kernels take powers of two), sizes multiples of 16 (FP8 matmuls)
SHAPE = TinyModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("fp8") / "model", SHAPE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine's device resolves to CUDA here")
def test_cpu_engine_refuses_fp8_weights_and_says_what_is_needed(model_dir: Path) -> None:
    # engine.device = "auto" resolves to the CPU only when the engine starts
    with pytest.raises(ValueError, match=r"weight_dtype = 'fp8'.*CUDA GPU with FP8 tensor cores.*runs on cpu"):
        Engine.from_pretrained(str(model_dir), EngineConfig(weight_dtype="fp8"))


@pytest.mark.parametrize("key", ["weight_dtype", "kv_cache_dtype"])
def test_the_config_refuses_fp8_on_a_cpu_engine(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, ["engine.device=cpu", f"engine.{key}=fp8"])
    with pytest.raises(ConfigError, match=key):
        load_config(None, ["engine.dtype=float32", f"engine.{key}=fp8"])
    assert getattr(load_config(None, [f"engine.{key}=fp8"]).engine, key) == "fp8"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine's device resolves to CUDA here")
def test_cpu_engine_refuses_an_fp8_kv_cache(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype = 'fp8'.*CUDA GPU"):
        Engine.from_pretrained(str(model_dir), EngineConfig(kv_cache_dtype="fp8"))


@gpu
def test_fp8_quantization_error_is_bounded() -> None:
    from polyrl.engine.fp8 import quantize_rows

    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, 37, device="cuda")[:, None]
    q, scale = quantize_rows(x)
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 of each row's largest value
    err = (back - x.float()).abs().amax(dim=1) / x.float().abs().amax(dim=1)
    assert float(err.max()) <= 2**-4, err


@gpu
def test_the_fused_kernels_quantize_as_the_separate_kernel_does() -> None:
    """The RMSNorm and SwiGLU kernels that write FP8 rows give what quantizing their
    16-bit output separately gives, bit for bit."""
    from polyrl.engine import triton_ops
    from polyrl.engine.fp8 import FP8_MAX, quantize_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(19, 320, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.rand(320, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    res_a, res_b = res.clone(), res.clone()
    q, scale = triton_ops.rmsnorm_fp8(x, weight, 1e-6, res_a, FP8_MAX)
    q_ref, scale_ref = quantize_rows(triton_ops.rmsnorm(x, weight, 1e-6, res_b))
    assert torch.equal(res_a, res_b) and torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    both = torch.randn(19, 2 * 384, device="cuda", generator=g, dtype=torch.bfloat16)
    gate, up = both.split(384, dim=1)
    q, scale = triton_ops.silu_mul_fp8(gate, up, FP8_MAX)
    q_ref, scale_ref = quantize_rows(triton_ops.silu_mul(gate, up))
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@gpu
def test_an_fp8_matmul_leaves_its_scales_to_the_kernel_that_reads_it() -> None:
    """The matmul runs with unit scales; its products, scaled, are the e4m3 values' product
    with both scales (in float32 here: the tensor cores' fast accumulation and two bf16
    roundings apart), and SwiGLU reading the unscaled products gives what it gives on the
    scaled ones, bit for bit. With a bias the scales are applied in the matmul (the bias
    comes after them)."""
    from torch import nn

    from polyrl.engine import triton_ops
    from polyrl.engine.fp8 import FP8_MAX, Fp8Matmul, quantize_rows

    torch.manual_seed(0)
    x = torch.randn(19, 256, device="cuda", dtype=torch.bfloat16)
    for bias in (False, True):
        linears = [nn.Linear(256, 384, bias=bias, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        matmul = Fp8Matmul(linears)
        gate, up = matmul(x)
        xq, xs = quantize_rows(x)
        want = (xq.float() @ matmul.qweight.float().t()) * xs * matmul.wscale  # outputs of about 0.6
        if bias:
            assert gate.row is None and up.row is None
            want = want + matmul.bias.float()
        else:
            assert gate.row is not None and not torch.equal(gate.out, gate.scaled())
        got = torch.cat([gate.scaled(), up.scaled()], dim=1).float()
        torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-2)
    gate, up = Fp8Matmul([nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(2)])(x)
    q, scale = triton_ops.silu_mul_fp8(gate.out, up.out, FP8_MAX, (gate.row, gate.col, up.col))
    q_ref, scale_ref = triton_ops.silu_mul_fp8(gate.scaled(), up.scaled(), FP8_MAX)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@gpu
def test_an_fp8_cache_serves_forks_and_prefix_hits(model_dir: Path) -> None:
    """n = 4 samples of one prompt share its blocks (a partial last block is copied, its
    scales too), and a second turn reads the first turn's blocks from the prefix cache;
    the log-probs the engine reports stay near the bf16 model's on the same tokens."""
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, n=4, seed=3)
    engine = Engine.from_pretrained(str(model_dir), EngineConfig(num_kv_blocks=128, kv_cache_dtype="fp8"))
    scorer = Engine.from_pretrained(str(model_dir), EngineConfig(num_kv_blocks=16)).model
    prompt = list(range(3, 3 + 21))  # a partial last block
    [first] = generate(engine, [prompt], sampling)
    turn2 = prompt + first[0][0] + [5, 6, 7]
    [second] = generate(engine, [turn2], sampling)
    assert engine.stats().prefix_cache_hits >= 16  # the first turn's full block
    diffs = [
        abs(a - b)
        for context, samples in ((prompt, first), (turn2, second))
        for ids, lps in samples
        for a, b in zip(lps, bf16_logprobs(scorer, context, ids), strict=True)
    ]
    assert sum(diffs) / len(diffs) < 0.05, max(diffs)


@gpu
def test_an_fp8_engine_leaves_the_model_it_shares_unchanged(model_dir: Path) -> None:
    """Local and hybrid modes hand the trainer's own model to the engine: its forward (the
    learner's) stays 16-bit, whatever the engine multiplies in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    tokens = torch.arange(3, 40, device="cuda")[None]
    with torch.no_grad():
        before = model(tokens).logits
        names = [n for n, _ in model.named_parameters()]
        Engine(model, EngineConfig(num_kv_blocks=64, weight_dtype="fp8", kv_cache_dtype="fp8"))
        assert torch.equal(model(tokens).logits, before)
    assert [n for n, _ in model.named_parameters()] == names


@gpu
def test_a_model_shape_without_the_fused_layers_is_refused(tmp_path: Path) -> None:
    odd = save_tiny_model(tmp_path / "odd", TinyModelConfig())  # head size 24: no fused path
    with pytest.raises(ValueError, match="power-of-two head size"):
        Engine.from_pretrained(str(odd), EngineConfig(weight_dtype="fp8"))


@gpu
@pytest.mark.parametrize("weights,kv", [("fp8", "auto"), ("auto", "fp8"), ("fp8", "fp8")])
def test_fp8_engine_logprobs_are_near_the_bf16_engines_and_follow_new_versions(
    model_dir: Path, weights: str, kv: str
) -> None:
    """The FP8 engine samples; the bf16 model scores the same tokens in one forward: their
    log-probs agree within FP8's rounding. Then a new version (random weights) reaches
    both, and they agree again: the FP8 copies were quantized again in place, under the
    captured CUDA graphs (and the FP8 cache, emptied by the version, was written anew)."""
    bf16 = Engine.from_pretrained(str(model_dir), EngineConfig(num_kv_blocks=256))
    fp8 = Engine.from_pretrained(
        str(model_dir), EngineConfig(num_kv_blocks=256, weight_dtype=weights, kv_cache_dtype=kv)
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 40, (16, 12), generator=g).tolist()
    for version in (1, 2):
        sampled = generate(fp8, prompts, SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=0))
        diffs = []
        for p, [(ids, lps)] in zip(prompts, sampled, strict=True):
            diffs += [abs(a - b) for a, b in zip(lps, bf16_logprobs(bf16.model, p, ids), strict=True)]
        mean = sum(diffs) / len(diffs)
        assert mean < 0.05, (version, mean, max(diffs))
        new = {k: torch.randn_like(v) * 0.05 for k, v in bf16.model.state_dict().items() if k != "lm_head.weight"}
        bf16.update_weights(new, version + 1)
        fp8.update_weights(new, version + 1)
