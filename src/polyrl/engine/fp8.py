"""FP8 rollout weights (`engine.weight_dtype = "fp8"`): the engine decodes with FP8 matmuls.

At RL batch sizes a decode step reads every weight once, and on Hopper an FP8 matmul
also has twice the bf16 tensor-core rate, so halving the weights' bytes shortens the
step. The trainer stays bf16/fp32: the engine keeps the model's own 16-bit weights as
they arrive with each version (the weight transfer, LoRA merges and the colocated
trainer's in-place updates all write those) and quantizes them again after every update
(`requantize`), into FP8 copies it reads from then on.

Scheme: e4m3 weights with one scale per output channel; activations quantized per token
(row) at run time, by one Triton kernel (its scale is the row's absolute maximum over
448, e4m3's largest value); `torch._scaled_mm` multiplies with both scale vectors and
writes bf16. The decoder layers' seven projections are quantized; the embedding, the LM
head and the norms stay 16-bit (as vLLM's and SGLang's FP8 checkpoints keep them), and
so do a mixture of experts' expert weights (not Linears). The quantized copies keep their
storage across versions, so CUDA graphs captured against them stay valid.

The behaviour log-probs the engine reports are the FP8 model's own, so the learner's
rollout correction (`algo.rollout_correction`) sees the gap to its own policy, which
`rollout/logprob_diff` shows.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.engine import triton_ops

FP8 = torch.float8_e4m3fn
FP8_MAX = triton_ops.FP8_MAX
Rows = tuple[torch.Tensor, torch.Tensor]
"""Activations quantized per row: (e4m3 [T, K], float32 scales [T, 1]). The engine's
fused layers make them in the kernel before the matmul (the RMSNorm, SwiGLU's product),
so that only the attention output is quantized by a kernel of its own."""


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


class Fp8Linear(nn.Linear):
    """An `nn.Linear` (its class swapped in place: the parameters, their names and the
    modules around it are unchanged) that multiplies with an FP8 copy of its weight."""

    qweight: torch.Tensor  # [out, in] e4m3
    wscale: torch.Tensor  # [1, out] float32

    def requantize(self) -> None:
        """Quantize the 16-bit weight again, into the same storage."""
        with torch.no_grad():
            w = self.weight.float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX  # [out, 1]
            self.qweight.copy_((w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8))  # e4m3fn has no inf
            self.wscale.copy_(scale.t())

    def forward(self, x: torch.Tensor | Rows) -> torch.Tensor:
        """x [..., in], or rows already quantized by the kernel before (`Rows`)."""
        if isinstance(x, tuple):
            return self._matmul(*x)
        shape = x.shape
        out = self._matmul(*quantize_rows(x.reshape(-1, shape[-1])))
        return out.reshape(*shape[:-1], out.shape[-1])

    def _matmul(self, xq: torch.Tensor, xscale: torch.Tensor) -> torch.Tensor:
        out = torch._scaled_mm(
            xq, self.qweight.t(), scale_a=xscale, scale_b=self.wscale, out_dtype=torch.bfloat16
        )  # [T, out]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out


class Fp8Fused(nn.Module):
    """Several projections of one input (q, k and v; gate and up) as one FP8 matmul: the
    input is quantized once, and one larger GEMM replaces several small ones (a decode
    step's GEMMs are small-tiled and launch-bound at RL batch sizes). The source Linears
    keep their 16-bit weights, which versions overwrite; `requantize` reads them."""

    def __init__(self, sources: list[nn.Linear]) -> None:
        super().__init__()
        self.sources = sources  # a plain list: not submodules, so no parameter is renamed
        self.sizes = [m.weight.shape[0] for m in sources]
        rows, cols = sum(self.sizes), sources[0].weight.shape[1]
        device = sources[0].weight.device
        self.register_buffer("qweight", torch.empty(rows, cols, dtype=FP8, device=device), persistent=False)
        self.register_buffer("wscale", torch.empty(1, rows, dtype=torch.float32, device=device), persistent=False)
        biases = [m.bias for m in sources]
        self.has_bias = all(b is not None for b in biases)
        self.register_buffer(
            "bias", torch.empty(rows, dtype=torch.bfloat16, device=device) if self.has_bias else None, persistent=False
        )
        self.requantize()

    def requantize(self) -> None:
        with torch.no_grad():
            start = 0
            for m, size in zip(self.sources, self.sizes, strict=True):
                w = m.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX
                self.qweight[start : start + size].copy_((w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8))
                self.wscale[:, start : start + size].copy_(scale.t())
                if self.has_bias:
                    self.bias[start : start + size].copy_(m.bias)
                start += size

    def forward(self, x: torch.Tensor | Rows) -> list[torch.Tensor]:
        """x [T, in] (or already quantized: `Rows`) -> one [T, out_i] view per source."""
        xq, xscale = x if isinstance(x, tuple) else quantize_rows(x)
        out = torch._scaled_mm(xq, self.qweight.t(), scale_a=xscale, scale_b=self.wscale, out_dtype=torch.bfloat16)
        if self.has_bias:
            out = out + self.bias
        return list(out.split(self.sizes, dim=1))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]), one scale per row."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        triton_ops.quantize_rows_fp8(x, q, scale, FP8_MAX)
    return q, scale


def quantize_model(model: nn.Module) -> list[Fp8Linear | Fp8Fused]:
    """Quantize the decoder layers' projections: q, k and v fused into one FP8 matmul
    (`self_attn.fp8_qkv`), gate and up into another (`mlp.fp8_gate_up`), which the
    engine's fused layers call; o and down swapped to `Fp8Linear` in place."""
    swapped: list[Fp8Linear | Fp8Fused] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.fp8_qkv = Fp8Fused([attn.q_proj, attn.k_proj, attn.v_proj])
        swapped.append(attn.fp8_qkv)
        if type(getattr(mlp, "gate_proj", None)) is nn.Linear:
            mlp.fp8_gate_up = Fp8Fused([mlp.gate_proj, mlp.up_proj])
            swapped.append(mlp.fp8_gate_up)
        for parent in (attn, mlp):
            for name in ("o_proj", "down_proj"):
                module = getattr(parent, name, None)
                if type(module) is not nn.Linear:
                    continue
                module.__class__ = Fp8Linear
                out_features, in_features = module.weight.shape
                device = module.weight.device
                module.register_buffer(
                    "qweight", torch.empty(out_features, in_features, dtype=FP8, device=device), persistent=False
                )
                module.register_buffer(
                    "wscale", torch.empty(1, out_features, dtype=torch.float32, device=device), persistent=False
                )
                module.requantize()
                swapped.append(module)
    return swapped


def restore_model(model: nn.Module) -> None:
    """Undo `quantize_model`: the 16-bit Linears again, the FP8 copies dropped (for a
    benchmark or test that runs the same model with and without FP8 weights)."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in ("fp8_qkv", "fp8_gate_up"):
                if hasattr(parent, name):
                    delattr(parent, name)
            for module in parent.children():
                if isinstance(module, Fp8Linear):
                    del module.qweight, module.wscale
                    module.__class__ = nn.Linear
