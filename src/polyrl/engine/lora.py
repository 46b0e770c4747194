"""LoRA adapters as weight versions: what a version holds, and how an engine applies one.

An adapter version is an ordinary weight version (a dict of tensors by name), so every
transfer path moves it unchanged, codecs and checksums included: the adapter matrices
by target module (`<module>.lora_A` [r, in], `<module>.lora_B` [out, r]) plus one uint8
tensor, `META_KEY`, holding the `LoraSpec` as JSON (base model identity, rank, alpha,
target modules) that the receiving engine checks before touching its weights.

The engine applies a version merged: it keeps an exact copy of the base weight of each
target module, and sets W = W_base + (alpha / r) * B @ A on every new version. Why merged
and not unmerged: decoding then costs exactly what the base model costs (no extra
matmuls per token, no batching by adapter), the engine's kernels and CUDA graphs stay
as they are, and each version costs one small matmul per target module (r * in * out
FLOPs). Starting from the kept base each time, not from the previous merged weight, keeps
versions from drifting by rounding. In float32 the merged forward matches the learner's
unmerged PEFT forward: `rollout/logprob_diff` 1.1e-7 to 1.5e-7 in every step of the CPU
end-to-end runs (tests/test_lora.py asserts < 1e-4). On the GPU the choice is still to be
confirmed by measurement (benchmarks/lora.py times the merge inside published -> serving).

PEFT is not needed here: workers only read tensors and `adapter_config.json`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polyrl.engine.types import RequestError
from polyrl.models.moe import attention_linears, has_moe

META_KEY = "__lora__"
"""The version's one non-weight tensor: the `LoraSpec` as UTF-8 JSON bytes (uint8)."""
A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"

FINGERPRINT_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""The config fields that identify a base model for an adapter: the shapes its matrices
must fit. Paths differ between the trainer's machine and a worker's, so they are not used."""


class AdapterError(RequestError):
    """An adapter this engine cannot apply (wrong base, rank, targets, shapes, or files):
    a refused request, which the worker's endpoints answer with a 4xx."""


class LoraSpec(BaseModel):
    """What a worker checks an adapter against before applying it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base_model: str
    """`base_fingerprint` of the base model's config."""
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    target_modules: tuple[str, ...]
    """The module names' last parts (q_proj, ...), sorted."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def mismatch(self, other: LoraSpec) -> str | None:
        """Why `other` cannot replace this adapter (None: it can). Alpha may change: it
        only scales the update; base, rank and target modules may not."""
        if other.base_model != self.base_model:
            return f"base model {other.base_model} is not this worker's {self.base_model}"
        if other.rank != self.rank:
            return f"rank {other.rank} does not match the served adapter's rank {self.rank}"
        if other.target_modules != self.target_modules:
            return f"target modules {list(other.target_modules)} do not match {list(self.target_modules)}"
        return None


def base_fingerprint(config: Any) -> str:
    """A short hash of the config fields that fix the base model's shapes (a transformers
    config object or its dict)."""
    values = config if isinstance(config, Mapping) else config.to_dict()
    text = json.dumps({k: values.get(k) for k in FINGERPRINT_KEYS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_adapter_version(weights: Mapping[str, torch.Tensor]) -> bool:
    return META_KEY in weights


def pack(spec: LoraSpec, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The version's tensors: {module: (A [r, in], B [out, r])} plus the spec."""
    out = {META_KEY: torch.frombuffer(bytearray(spec.model_dump_json().encode()), dtype=torch.uint8)}
    for module, (a, b) in pairs.items():
        out[module + A_SUFFIX], out[module + B_SUFFIX] = a, b
    return out


def unpack(weights: Mapping[str, torch.Tensor]) -> tuple[LoraSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Inverse of `pack`; raises AdapterError on a malformed version."""
    try:
        spec = LoraSpec.model_validate_json(bytes(weights[META_KEY].cpu().numpy().tobytes()))
    except (KeyError, ValidationError, UnicodeDecodeError) as e:
        raise AdapterError(f"adapter version without a valid {META_KEY} spec: {e}") from None
    stray = [k for k in weights if k != META_KEY and not k.endswith((A_SUFFIX, B_SUFFIX))]
    if stray:
        raise AdapterError(f"adapter version with tensors that are not LoRA matrices: {stray[:3]}")
    return spec, _pairs({k: t for k, t in weights.items() if k != META_KEY})


def target_names(modules: list[str] | tuple[str, ...] | set[str]) -> tuple[str, ...]:
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))


# ------------------------------------------------------------------------ PEFT directories

_PEFT_PREFIX = "base_model.model."


def read_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config.json, {module: (A, B)}) of a PEFT adapter directory, e.g. one that
    `polyrl train` or `PeftModel.save_pretrained` wrote. Raises AdapterError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
        tensors = load_file(root / "adapter_model.safetensors")
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise AdapterError(f"not a PEFT LoRA adapter directory: {path}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    return config, pairs_from_peft_state(tensors)


def pairs_from_peft_state(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} from PEFT's adapter state dict (`get_peft_model_state_dict`, or an
    `adapter_model.safetensors`): `base_model.model.<module>.lora_A.weight` and so on."""
    weights: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, kind = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"tensor {name} is not a LoRA A/B matrix (modules_to_save and biases are not supported)")
        weights[f"{module}.lora_{kind[0]}"] = t
    return _pairs(weights)


def _pairs(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    a_names = {k.removesuffix(A_SUFFIX) for k in weights if k.endswith(A_SUFFIX)}
    b_names = {k.removesuffix(B_SUFFIX) for k in weights if k.endswith(B_SUFFIX)}
    if a_names != b_names:
        raise AdapterError(f"adapter tensors do not pair up as lora_A/lora_B: {sorted(a_names ^ b_names)[:3]}")
    return {m: (weights[m + A_SUFFIX], weights[m + B_SUFFIX]) for m in sorted(a_names)}


def spec_of_dir(
    config: dict[str, Any], pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], fingerprint: str, model_path: str
) -> LoraSpec:
    """The spec of a PEFT directory read by `read_adapter_dir`, for a worker whose base has
    `fingerprint` and was loaded from `model_path`. The adapter's base is identified by
    the config.json in `base_model_name_or_path` when that is a local directory, else by
    its name against the worker's model directory name (a hub id's last part)."""
    base = str(config.get("base_model_name_or_path") or "")
    base_config = Path(base) / "config.json"
    if base and base_config.is_file():
        base_model = base_fingerprint(json.loads(base_config.read_text()))
    elif base and Path(base).name == Path(model_path).name:
        base_model = fingerprint
    else:
        base_model = f"unknown ({base or 'no base_model_name_or_path'})"
    ranks = {a.shape[0] for a, _ in pairs.values()}
    rank = int(config.get("r") or next(iter(ranks), 0))
    if ranks != {rank}:
        raise AdapterError(
            f"adapter matrices have ranks {sorted(ranks)}, config says r={rank} (rank_pattern is not supported)"
        )
    alpha = float(config.get("lora_alpha") or rank)
    if config.get("use_rslora"):
        alpha = alpha * rank**0.5  # rsLoRA scales by alpha / sqrt(r)
    return LoraSpec(base_model=base_model, rank=rank, alpha=alpha, target_modules=target_names(pairs))


# ------------------------------------------------------------------------ engine side


def all_linear(model: torch.nn.Module) -> tuple[str, ...]:
    """What "all-linear" adapts: every linear layer of the decoder, as PEFT resolves it (the
    LM head excluded); on a mixture of experts, the attention projections (PEFT would also
    reach the experts' 3-D weights and the router, which merging here does not cover)."""
    if has_moe(model):
        return target_names(attention_linears(model))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return target_names([n for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)])


def expected_spec(model: torch.nn.Module, rank: int, alpha: float, target_modules: str | list[str]) -> LoraSpec:
    """The spec a worker configured with `model.lora` accepts (`all_linear` for "all-linear")."""
    if target_modules == "all-linear":
        targets = all_linear(model)
    else:
        targets = target_names(target_modules)
    return LoraSpec(base_model=base_fingerprint(model.config), rank=rank, alpha=alpha, target_modules=targets)


class AdapterMerger:
    """Applies adapter versions to an engine's model in place (merged; see the module
    docstring). It owns exact copies of the target modules' base weights, taken when it
    is made, and the spec of the adapter it serves: a later adapter must match it."""

    def __init__(self, model: torch.nn.Module, fingerprint: str, expected: LoraSpec | None = None) -> None:
        self.model, self.fingerprint = model, fingerprint
        self.spec = expected
        """The adapter being served (before the first one: the one configured, if any)."""
        self._modules = dict(model.named_modules())
        self._base: dict[str, torch.Tensor] = {}

    def check(self, spec: LoraSpec, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Raises AdapterError unless `apply` would succeed; changes nothing."""
        if spec.base_model != self.fingerprint:
            raise AdapterError(f"adapter for base model {spec.base_model}, this worker serves {self.fingerprint}")
        if self.spec is not None and (why := self.spec.mismatch(spec)):
            raise AdapterError(f"adapter refused: {why}")
        if target_names(pairs) != spec.target_modules:
            raise AdapterError(
                f"adapter tensors target {list(target_names(pairs))}, its spec says {list(spec.target_modules)}"
            )
        for name, (a, b) in pairs.items():
            module = self._modules.get(name)
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise AdapterError(f"adapter targets {name}, which is not a linear layer of this model")
            out_features, in_features = weight.shape
            if (
                a.dim() != 2
                or b.dim() != 2
                or a.shape != (spec.rank, in_features)
                or b.shape != (out_features, spec.rank)
            ):
                raise AdapterError(
                    f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank {spec.rank} "
                    f"and the layer's {in_features} -> {out_features}"
                )

    @torch.no_grad()
    def apply(self, spec: LoraSpec, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """W = W_base + scale * B @ A for each target module (others back to their base), as
        one GEMM per module writing straight into the weight: the product accumulates in
        float32 and the sum is rounded to the weight's dtype once (cuBLAS and CPU BLAS
        apply alpha and beta = 1 in float32), so no float32 temporaries the size of the
        weights. The adapter's matrices are copied to the device first, all of them
        queued at once (non-blocking from pinned memory)."""
        self.check(spec, pairs)
        for name in pairs:
            if name not in self._base:
                self._base[name] = self._modules[name].weight.detach().clone()
        on_device = {}
        for name, (a, b) in pairs.items():
            weight = self._modules[name].weight
            on_device[name] = tuple(t.to(weight.device, weight.dtype, non_blocking=True) for t in (a, b))
        for name, base in self._base.items():
            weight = self._modules[name].weight
            if name not in on_device:
                weight.copy_(base)
                continue
            a, b = on_device[name]
            torch.addmm(base, b, a, alpha=spec.scale, out=weight)  # never in place on the kept base
        self.spec = spec
