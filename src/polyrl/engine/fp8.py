"""FP8 rollout weights (`engine.weight_dtype = "fp8"`): the engine decodes with FP8 matmuls.

At RL batch sizes a decode step reads every weight once, and on Hopper an FP8 matmul
also has twice the bf16 tensor-core rate, so halving the weights' bytes shortens the
step. The trainer stays bf16/fp32: the engine keeps the model's own 16-bit weights as
they arrive with each version (the weight transfer, LoRA merges and the colocated
trainer's in-place updates all write those) and quantizes them again after every update
(`requantize`), into FP8 copies only its fused layers read. The model's modules are not
touched, so a trainer whose model the engine shares (local and hybrid modes) still
trains through its own 16/32-bit Linears.

Scheme: e4m3 weights with one scale per output channel; activations quantized per token
(row) at run time, their scale the row's absolute maximum over 448 (e4m3's largest
value). A decoder layer's seven projections become four matmuls (q, k and v one; o;
gate and up one; down), and the kernels before three of them write FP8 rows themselves
(the RMSNorms, SwiGLU's product: `Rows`); only the attention output is quantized by a
kernel of its own. `torch._scaled_mm` multiplies the e4m3 values with unit scales, and
the two scale vectors are applied by the kernel that reads the product next (the norms,
RoPE, SwiGLU: `Product`): at decode batch sizes cuBLAS's kernels for one scale per
tensor were up to 1.4x faster than its row- and channel-scaled ones on an H200. The
matmuls accumulate in the tensor cores' fast mode (`use_fast_accum`, the default of
torchao's dynamic FP8 inference config), another few percent (BENCHMARKS.md, "FP8
matmuls with their scales applied by the next kernel"). The embedding, the LM head and
the norms stay 16-bit (as vLLM's and SGLang's FP8 checkpoints keep them), and so do a
mixture of experts' expert weights (not Linears). The FP8 copies keep their storage
across versions, so CUDA graphs captured against them stay valid.

The behaviour log-probs the engine reports are the FP8 model's own, so the learner's
rollout correction (`algo.rollout_correction`) sees the gap to its own policy, which
`rollout/logprob_diff` shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from polyrl.engine import triton_ops

FP8 = torch.float8_e4m3fn
FP8_MAX = triton_ops.FP8_MAX
Rows = tuple[torch.Tensor, torch.Tensor]
"""Activations quantized per row: (e4m3 [T, K], float32 scales [T, 1]). The engine's
fused layers make them in the kernel before the matmul (the RMSNorm, SwiGLU's product),
so that only the attention output is quantized by a kernel of its own."""


class Product(NamedTuple):
    """One source Linear's share of an FP8 matmul with its scales not yet applied: the
    output is `out * row * col`, rounded to bf16. The next kernel (`triton_ops`' norms,
    RoPE and SwiGLU take `row`/`col`) applies them as it loads `out`, so no pass of its
    own is spent on them. `row` and `col` are None where `out` is already scaled (a
    matmul with a bias)."""

    out: torch.Tensor  # [T, N] bf16: the e4m3 rows times the e4m3 weights, unscaled
    row: torch.Tensor | None  # [T, 1] float32: the activations' scales
    col: torch.Tensor | None  # [1, N] float32: the weights' scales (a view of the matmul's)

    def scaled(self) -> torch.Tensor:
        """The true output [T, N] bf16, in PyTorch: what the fused readers are tested against."""
        if self.row is None:
            return self.out
        return (self.out.float() * self.row * self.col).to(self.out.dtype)


def check_supported(device: torch.device, compute_dtype: torch.dtype, cuda_graphs: bool, key: str) -> None:
    """Raise ValueError unless this engine can run `engine.<key> = "fp8"`: CUDA with FP8
    tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell), Triton, the
    fused layers, bf16 compute."""
    why = None
    if device.type != "cuda":
        why = f"it needs a CUDA GPU with FP8 tensor cores, and this engine runs on {device.type}"
    elif torch.cuda.get_device_capability(device) < (8, 9):
        why = f"it needs compute capability 8.9 or newer (Ada, Hopper), this GPU has {torch.cuda.get_device_capability(device)}"
    elif not triton_ops.available("cuda"):
        why = "it needs Triton (for the activation quantization kernel)"
    elif not cuda_graphs:
        why = "it runs in the engine's fused layers, which engine.cuda_graphs = false turns off"
    elif compute_dtype != torch.bfloat16:
        why = f"it needs engine.dtype bfloat16 (the engine computes in {compute_dtype})"
    if why:
        raise ValueError(f"engine.{key} = 'fp8': {why}; use engine.{key} = 'auto'")


class Fp8Matmul:
    """One or more Linears of the same input (q, k and v; gate and up; o alone) as one FP8
    matmul: the input is quantized once, and one larger GEMM replaces several small ones
    (a decode step's GEMMs are small-tiled at RL batch sizes). The Linears keep their
    16-bit weights, which versions overwrite; `requantize` reads them."""

    def __init__(self, sources: list[nn.Linear]) -> None:
        self.sources = sources
        self.sizes = [m.weight.shape[0] for m in sources]
        rows, cols = sum(self.sizes), sources[0].weight.shape[1]
        device = sources[0].weight.device
        self.qweight = torch.empty(rows, cols, dtype=FP8, device=device)  # [out, in] e4m3
        self.wscale = torch.empty(1, rows, dtype=torch.float32, device=device)
        has_bias = [m.bias is not None for m in sources]
        if any(has_bias) and not all(has_bias):
            raise ValueError("a fused FP8 matmul needs all or none of its Linears with a bias")
        self.bias = torch.empty(rows, dtype=torch.bfloat16, device=device) if all(has_bias) else None
        self.unit = torch.ones((), dtype=torch.float32, device=device)  # the matmul's own scales
        self.requantize()

    def requantize(self) -> None:
        """Quantize the 16-bit weights again, into the same storage."""
        with torch.no_grad():
            start = 0
            for m, size in zip(self.sources, self.sizes, strict=True):
                w = m.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX  # [out, 1]
                q = (w / scale).clamp_(-FP8_MAX, FP8_MAX)  # e4m3fn has no inf: a value past the top is NaN
                self.qweight[start : start + size].copy_(q.to(FP8))
                self.wscale[:, start : start + size].copy_(scale.t())
                if self.bias is not None:
                    self.bias[start : start + size].copy_(m.bias)
                start += size

    def __call__(self, x: torch.Tensor | Rows) -> list[Product]:
        """x [T, in] (or rows already quantized: `Rows`) -> one [T, out_i] product per
        source, its scales left to the reader (see `Product`; with a bias they are applied
        here, by the row/channel-scaled matmul, since the bias must come after them)."""
        xq, xscale = x if isinstance(x, tuple) else quantize_rows(x)
        w = self.qweight.t()
        if self.bias is not None:
            out = torch._scaled_mm(
                xq, w, scale_a=xscale, scale_b=self.wscale, out_dtype=torch.bfloat16, use_fast_accum=True
            )
            return [Product(part, None, None) for part in (out + self.bias).split(self.sizes, dim=1)]
        out = torch._scaled_mm(
            xq, w, scale_a=self.unit, scale_b=self.unit, out_dtype=torch.bfloat16, use_fast_accum=True
        )
        cols = self.wscale.split(self.sizes, dim=1)
        return [Product(part, xscale, col) for part, col in zip(out.split(self.sizes, dim=1), cols, strict=True)]


@dataclass
class Fp8Layer:
    """One decoder layer's FP8 matmuls; the MLP's are None for a mixture of experts."""

    qkv: Fp8Matmul
    o: Fp8Matmul
    gate_up: Fp8Matmul | None
    down: Fp8Matmul | None

    def matmuls(self) -> list[Fp8Matmul]:
        return [m for m in (self.qkv, self.o, self.gate_up, self.down) if m is not None]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]), one scale per row."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        triton_ops.quantize_rows_fp8(x, q, scale, FP8_MAX)
    return q, scale


def quantize_model(model: nn.Module) -> list[Fp8Layer]:
    """FP8 copies of every decoder layer's projections (the model itself is unchanged)."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dense = type(getattr(mlp, "gate_proj", None)) is nn.Linear
        layers.append(
            Fp8Layer(
                qkv=Fp8Matmul([attn.q_proj, attn.k_proj, attn.v_proj]),
                o=Fp8Matmul([attn.o_proj]),
                gate_up=Fp8Matmul([mlp.gate_proj, mlp.up_proj]) if dense else None,
                down=Fp8Matmul([mlp.down_proj]) if dense else None,
            )
        )
    return layers
