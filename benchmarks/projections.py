"""The decode step's dense projections, by GEMM library, against their weight-read roofline.

    python benchmarks/projections.py [--preset qwen3-0.6b] [--batch 256 512] [--backends cublas,cublaslt,inductor] [--json PATH]
    python benchmarks/projections.py --device cpu   # tiny shape, torch's own CPU matmul: proves the script

At RL batch sizes a decode step's matmuls are bound by reading their weights, and at the
Qwen3-0.6B shape the engine's four GEMMs a layer (q/k/v fused, o, gate/up fused, down;
`polyrl/engine/projections.py`) took 0.80 ms of a 256-sequence step on an H200 where
reading their weights takes about 0.32 ms (BENCHMARKS.md). This times each of them at
the engine's own shapes and layout (a one-layer model of the preset, its projections
packed as the engine packs them) on each library torch can run them on:

* `cublas` and `cublaslt`: `F.linear` with `torch.backends.cuda.preferred_blas_library`;
* `inductor`: `torch.compile(mode="max-autotune-no-cudagraphs")`, which times cuBLAS
  against its own Triton GEMM templates for the shape and keeps the faster.

Each figure is a CUDA graph of `--calls` matmuls, replayed (best of 3), per matmul. The
roofline reads the weight and the activations in and out once at the copy bandwidth
measured in the same run; "a step" sums the four over the model's layers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from engine import PRESETS, copy_bandwidth, preset_config  # noqa: E402  (benchmarks/engine.py)
from moe_layer import graph_time  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from polyrl.engine import projections  # noqa: E402

BACKENDS = ("cublas", "cublaslt", "inductor")


def layer_weights(preset: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The preset's four projection weights of a layer, [out, in], as the engine reads them."""
    config = preset_config(preset, num_layers=1)
    config.vocab_size = 32  # one layer alone: no need for the 151k-row embedding
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.requires_grad_(False)  # an engine's model: `pack` leaves a learner's alone
    projections.pack(model)
    (fused,) = projections.fused(model)
    if fused.qkv is None or fused.gate_up is None:
        raise SystemExit(f"{preset}: the engine would not fuse this layer's projections")
    layer = model.model.layers[0]
    return {
        "qkv": fused.qkv.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": fused.gate_up.weight,
        "down": layer.mlp.down_proj.weight,
    }


def matmul(backend: str, x: torch.Tensor, w: torch.Tensor, preferred) -> Callable[[], torch.Tensor]:
    """A call of `x @ w.T` on `backend`; `preferred` is the process's BLAS library, which
    `default` and Inductor's ATen choice run on. The library is chosen again at every
    call: a CUDA graph captures whichever one ran at capture."""
    library = backend if backend in ("cublas", "cublaslt") else preferred
    linear = F.linear
    if backend == "inductor":
        linear = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)

    def call() -> torch.Tensor:
        torch.backends.cuda.preferred_blas_library(library)
        return linear(x, w)

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: qwen3-0.6b on CUDA, tiny on CPU")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 512], help="rows of each matmul (decoding sequences)")
    ap.add_argument(
        "--backends",
        help=f"comma-separated from {BACKENDS} and default (F.linear as torch picks); default: "
        "all three on CUDA, default on a CPU",
    )
    ap.add_argument("--calls", type=int, default=50, help="matmuls per timed CUDA graph")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("qwen3-0.6b" if cuda else "tiny")
    backends = args.backends.split(",") if args.backends else list(BACKENDS if cuda else ["default"])
    if unknown := set(backends) - {*BACKENDS, "default"}:
        raise SystemExit(f"unknown backends {sorted(unknown)}: choose from {BACKENDS} or default")
    if not cuda and {"cublas", "cublaslt"} & set(backends):
        raise SystemExit("cublas and cublaslt are CUDA's: on a CPU, choose from default and inductor")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = PRESETS[preset][1]
    weights = layer_weights(preset, device, dtype)
    bandwidth = copy_bandwidth(device) if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()} (CPU)"
    print(f"{preset} projections, {dtype}, {layers} layers; {name}; copy bandwidth "
          f"{bandwidth / 1e12 if bandwidth else 0:.2f} TB/s", flush=True)  # fmt: skip
    print("| batch | GEMM | in x out | roofline us | " + " | ".join(f"{b} us" for b in backends) + " | best |")
    print("|---|---|---|---|" + "---|" * len(backends) + "---|")
    rows: list[dict] = []
    preferred = torch.backends.cuda.preferred_blas_library()
    for batch in args.batch:
        step = {"batch": batch, "gemm": "a step", "roofline_us": 0.0 if bandwidth else None}
        step |= {f"{b}_us": 0.0 for b in backends}
        for gemm, w in weights.items():
            out_features, in_features = w.shape
            x = torch.randn(batch, in_features, device=device, dtype=dtype)
            need = (w.numel() + batch * (in_features + out_features)) * w.element_size()
            row = {"batch": batch, "gemm": gemm, "in": in_features, "out": out_features, "bytes": need}
            row["roofline_us"] = need / bandwidth * 1e6 if bandwidth else None
            reference = F.linear(x, w).float()
            for backend in backends:
                t0 = time.perf_counter()
                call = matmul(backend, x, w, preferred)
                row[f"{backend}_max_diff"] = (call().float() - reference).abs().max().item()  # compiles, tunes
                row[f"{backend}_setup_s"] = time.perf_counter() - t0
                row[f"{backend}_us"] = graph_time(call, device, args.calls if cuda else 1) * 1e6
                step[f"{backend}_us"] += row[f"{backend}_us"] * layers
            if bandwidth:
                step["roofline_us"] += row["roofline_us"] * layers
            rows.append(row)
            print(_line(row, f"{in_features} x {out_features}", backends), flush=True)
        rows.append(step)
        print(_line(step, f"{layers} layers", backends), flush=True)
    if args.json:
        meta = {"preset": preset, "device": name, "torch": torch.__version__, "bandwidth": bandwidth}
        args.json.write_text(json.dumps({"meta": {**meta, "calls": args.calls}, "rows": rows}, indent=1))
    return 0


def _line(row: dict, shape: str, backends: list[str]) -> str:
    """A table row, and its `best_of_roofline`: the fastest backend's share of the roofline."""
    times = [row[f"{b}_us"] for b in backends]
    roof = row["roofline_us"]
    row["best_of_roofline"] = roof / min(times) if roof else None
    cells = [str(row["batch"]), row["gemm"], shape, f"{roof:.1f}" if roof else "-", *(f"{t:.1f}" for t in times)]
    cells.append(f"{row['best_of_roofline']:.0%}" if roof else "-")
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
