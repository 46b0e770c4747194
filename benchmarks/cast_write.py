"""Writing a version into the single-copy buffer: the float32 -> bf16 cast-and-copy of every
tensor (`polyrl.transfer.device.write_flat`) against its two plain alternatives, a `copy_`
per tensor and one `torch._foreach_copy_` for all, on the same tensors in one run.

The tensors have the shapes of a Qwen3 checkpoint (random values); each way runs
`--repeats` times, alternating, and the table gives the fastest and the median time and
the bandwidth of the fastest (4 bytes read and 2 written per element).

    python benchmarks/cast_write.py [--presets qwen3-0.6b qwen3-8b] [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from polyrl.transfer.device import write_flat

PRESETS = {  # hidden, intermediate, layers, q width, kv width, vocab, tied embeddings
    "qwen3-0.6b": (1024, 3072, 28, 2048, 1024, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 4096, 1024, 151936, False),
}


def shapes(preset: str) -> list[tuple[int, ...]]:
    h, inter, layers, q, kv, vocab, tied = PRESETS[preset]
    out: list[tuple[int, ...]] = [(vocab, h)] * (1 if tied else 2)
    for _ in range(layers):
        out += [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h,), (h,), (128,), (128,)]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(preset: str, device: torch.device, repeats: int) -> list[dict]:
    src = {f"t{i}": torch.randn(s, device=device) for i, s in enumerate(shapes(preset))}
    dst = {k: torch.empty(v.shape, device=device, dtype=torch.bfloat16) for k, v in src.items()}
    elements = sum(t.numel() for t in src.values())
    ways: dict[str, Callable[[], object]] = {
        "copy_ per tensor": lambda: [dst[k].copy_(v) for k, v in src.items()],
        "one foreach": lambda: torch._foreach_copy_(list(dst.values()), list(src.values())),
        "write_flat": lambda: write_flat(dst, src),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():  # warm-up
        way()
    for _ in range(repeats):
        for name, way in ways.items():
            sync(device)
            t0 = time.perf_counter()
            way()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    for k in src:
        assert torch.equal(dst[k], src[k].to(torch.bfloat16))
    return [
        {
            "preset": preset,
            "way": name,
            "tensors": len(src),
            "elements": elements,
            "min_ms": 1e3 * min(ts),
            "median_ms": 1e3 * statistics.median(ts),
            "tb_s": 6 * elements / min(ts) / 1e12,
        }
        for name, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    print(f"{'preset':<12} {'way':<18} {'tensors':>8} {'min ms':>8} {'median ms':>10} {'TB/s':>6}")
    for preset in args.presets:
        for r in measure(preset, device, args.repeats):
            rows.append(r)
            print(
                f"{r['preset']:<12} {r['way']:<18} {r['tensors']:>8} {r['min_ms']:>8.2f} "
                f"{r['median_ms']:>10.2f} {r['tb_s']:>6.2f}"
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()}
        Path(args.json).write_text(json.dumps({"meta": meta | {"torch": torch.__version__}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
