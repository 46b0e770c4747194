"""The kernel benchmarks run to their table on this machine (`--device cpu`), so that a GPU
session finds them working: `benchmarks/paged_decode.py` (the paged decode kernels alone,
in Triton's interpreter here, the CUDA kernel's rows skipped with the reason) and
`benchmarks/projections.py` (the decode step's projection matmuls at the engine's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--device", "cpu", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| shape |" in proc.stdout or "| batch |" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def test_paged_decode_benchmark_checks_each_kernel_against_float32(tmp_path):
    result = run("paged_decode.py", "--tiles", "default,defaulth,cuda:1/3", tmp_path=tmp_path)
    rows = {(r["kv"], r["tile"]): r for r in result["rows"]}
    # "default" is Triton's tile for the loop reading each cache (16/2/4 for 16 bits, 32/1/3 for FP8)
    expected = {"bf16": ("16/2/4", "16/2/4h", "cuda:1/3"), "fp8": ("32/1/3", "32/1/3h", "cuda:1/3")}
    assert set(rows) == {(kv, tile) for kv, tiles in expected.items() for tile in tiles}
    for (kv, tile), row in rows.items():
        if tile.startswith("cuda"):
            assert "CUDA devices" in row["skipped"]  # said why, not run
            continue
        assert row["error"] < (1e-5 if kv == "bf16" else 2e-2), row  # float32 in the interpreter; e4m3's rounding
        assert row["us"] > 0 and row["counted_bytes"] > 0


def test_paged_decode_benchmark_refuses_a_bad_tile(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "paged_decode.py"), "--device", "cpu", "--tiles", "16/3/1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "powers of two" in proc.stderr


def test_projections_benchmark_times_the_engines_four_matmuls(tmp_path):
    result = run("projections.py", "--batch", "8", tmp_path=tmp_path)
    rows = result["rows"]
    assert [r["gemm"] for r in rows] == ["qkv", "o", "gate_up", "down", "a step"]
    # the tiny preset: hidden 96, 4 query and 2 KV heads of 24 (q, k, v: 96 + 48 + 48), MLP 192 (gate, up)
    assert [(r["in"], r["out"]) for r in rows[:4]] == [(96, 192), (96, 96), (96, 384), (192, 96)]
    assert all(r["default_max_diff"] == 0.0 for r in rows[:4])  # the timed call is the reference's matmul
    assert rows[4]["default_us"] > 0
