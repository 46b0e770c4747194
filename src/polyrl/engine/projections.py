"""A decoder layer's q/k/v projections as one matmul, and gate/up as another, on the
parameters' own memory.

At RL batch sizes a decode step's matmuls are small, and cuBLAS runs several small ones
slower than one of their summed width: on an H200 at the Qwen3-0.6B shape, seven GEMMs a
layer took 1.15 ms a step at batch 256 and the same work as four GEMMs 0.83 ms
(BENCHMARKS.md, "The 0.6B decode step's projections and attention tiles, probed").

The fused matmul needs its weights in one tensor, without a second copy of them: the
engine's fused layers read the model's own parameters, which every weight version, LoRA
merge and single-copy share writes or points at. So `pack` moves a layer's q, k and v
weights (and gate and up) into one buffer and makes the parameters views of it (the same
Parameter objects, so a version's in-place copy lands there too), and `fused` finds such
runs of adjacent parameters, which is also how the trainer's published buffer lays them
out when the engine reads it in place. A model whose parameters require grad belongs to a
learner (the colocated engine on the learner's own weights): `pack` leaves it alone, and
its layers keep their separate matmuls unless their weights already lie side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


@dataclass
class FusedLinear:
    """Several Linears of one input as one matmul over adjacent weights (and biases)."""

    weight: torch.Tensor  # [sum of out, in]: a view spanning the sources' weights
    bias: torch.Tensor | None
    sizes: list[int]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, in] -> one [T, out_i] column slice per source."""
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=1))


@dataclass
class LayerProjections:
    qkv: FusedLinear | None
    gate_up: FusedLinear | None


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (none for a model outside the Llama family's layout: the engine
    refuses it with its own message)."""
    return list(getattr(getattr(model, "model", None), "layers", None) or [])


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    found = [getattr(module, n, None) for n in names]
    return found if all(type(m) is nn.Linear for m in found) else None


def adjacent(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One view over `tensors` concatenated along dim 0 when they already lie that way in
    one storage (contiguous, same dtype and trailing shape, each starting where the one
    before ends); else None. All None (no biases): None."""
    first = tensors[0]
    if first is None or any(t is None for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.device != first.device
            or t.shape[1:] != first.shape[1:]
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _fuse(linears: list[nn.Linear] | None) -> FusedLinear | None:
    if linears is None:
        return None
    weight = adjacent([m.weight for m in linears])
    biases = [m.bias for m in linears]
    bias = adjacent(biases)  # None as well where none has a bias
    if weight is None or (bias is None and any(b is not None for b in biases)):
        return None
    return FusedLinear(weight, bias, [m.weight.shape[0] for m in linears])


def fused(model: nn.Module) -> list[LayerProjections]:
    """Each decoder layer's fused matmuls where its weights allow them (None where not:
    that layer runs its Linears one by one)."""
    out = []
    for layer in _layers(model):
        out.append(
            LayerProjections(qkv=_fuse(_linears(layer.self_attn, ATTENTION)), gate_up=_fuse(_linears(layer.mlp, MLP)))
        )
    return out


@torch.no_grad()
def pack(model: nn.Module) -> int:
    """Lay every layer's q/k/v and gate/up parameters side by side in one buffer each
    (the parameters become views of it; their old memory is freed), unless they already
    are or the model trains. Returns how many groups moved."""
    if any(p.requires_grad for p in model.parameters()):
        return 0
    moved = 0
    for layer in _layers(model):
        for module, names in ((layer.self_attn, ATTENTION), (layer.mlp, MLP)):
            linears = _linears(module, names)
            if linears is None:
                continue
            for kind in ("weight", "bias"):
                params = [getattr(m, kind) for m in linears]
                if any(p is None for p in params) or adjacent(params) is not None:
                    continue
                if len({id(p) for p in params}) < len(params):
                    continue  # a parameter shared between two of them: leave the layer as it is
                buffer = torch.cat([p.data for p in params])
                start = 0
                for p in params:
                    p.data = buffer[start : start + p.shape[0]].view(p.shape)
                    start += p.shape[0]
                moved += 1
    return moved
