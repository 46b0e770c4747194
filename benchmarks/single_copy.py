"""The local engine with its own copy of the weights against the single-copy local engine
(it decodes from the trainer's published bf16 buffer in place), on one GPU.

    PYTHONPATH=src python benchmarks/single_copy.py --presets qwen3-0.6b qwen3-8b --json single_copy.json

The trainer is this process: float32 master weights of the preset's shape on cuda:0 and
a `WeightPublisher` whose `DeviceVersions` holds each version as one bf16 buffer. The
local engine is a worker process on the same GPU (an `Engine` with a fixed KV cache and
its `WeightReceiver`, no HTTP) that takes every version over CUDA IPC: `copy` copies
it into weights of its own (the old path), `single` keeps the trainer's buffer as its
weights and is paused for each in-place write.

Per preset and mode:
* `gpu_used_gib`: the device's used memory (every process) with both sides set up and
  v1 served; `worker_alloc_gib`: the worker's own allocations (weights + KV cache + graphs).
* `serving_ms`: from the start of the trainer's device publish to the engine serving
  the version: idle, and while it decodes a batch (`busy`). For `copy` that is the
  publish plus the worker's pull; the manager's request to the worker (a loopback HTTP
  call, a few ms) is left out, which favours `copy`. For `single` the publish returns
  when the engine serves the version.
* `decode_tok_s`: a greedy batch, to show that decoding from the trainer's buffer costs
  nothing; `logprobs`: the same batch's log-probs at every version, compared bit for bit
  between the modes (the engine computes with the same bf16 words).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model  # noqa: E402  (benchmarks/engine.py: the model shapes)

from polyrl.config import EngineConfig  # noqa: E402
from polyrl.engine.async_engine import AsyncEngine  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.engine.types import EngineRequest  # noqa: E402
from polyrl.protocol.sampling import SamplingParams  # noqa: E402
from polyrl.transfer.device import DeviceVersions  # noqa: E402
from polyrl.transfer.publisher import WeightPublisher  # noqa: E402
from polyrl.transfer.wire import PullSource  # noqa: E402
from polyrl.worker.weight_sync import WeightReceiver  # noqa: E402

GIB = 2**30
REPLY_TIMEOUT_S = 600


# ------------------------------------------------------------------------------- worker


async def generate(engine: AsyncEngine, tag: str, batch: int, new_tokens: int) -> tuple[float, list[list[float]]]:
    """Greedy `batch` x `new_tokens`; (tokens/s, log-probs per sequence)."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> list[float]:
        logprobs: list[float] = []
        prompt = [(i * 7919 + j * 104729) % 50000 + 1 for j in range(16)]
        async for deltas in engine.generate(EngineRequest(f"{tag}-{i}", prompt, sampling)):
            logprobs += [lp for d in deltas for lp in d.logprobs]
        return logprobs

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i) for i in range(batch)))
    return batch * new_tokens / (time.perf_counter() - t0), out


async def serve_commands(conn: Connection, preset: str) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = build_model(preset, device, torch.bfloat16)
    cfg = EngineConfig(num_kv_blocks=2048, block_size=16, max_num_seqs=256)
    engine = AsyncEngine(Engine(model, cfg))
    engine.start()
    receiver = WeightReceiver(engine)
    busy: asyncio.Task | None = None
    conn.send("ready")
    while (cmd := await asyncio.to_thread(conn.recv)) is not None:
        op = cmd["op"]
        if op == "sync":
            source = PullSource(cmd["host"], cmd["port"], "local", cmd["token"])
            pulled = await receiver.sync(source, cmd["version"], 1, 120.0, "raw", "cuda_ipc")
            torch.cuda.synchronize()
            conn.send({"done_at": time.monotonic(), "in_place": bool(pulled and pulled.in_place)})
        elif op == "mem":
            reserved = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            stats = torch.cuda.memory_stats()
            conn.send(
                {
                    "worker_alloc_gib": torch.cuda.memory_allocated() / GIB,
                    "worker_reserved_gib": torch.cuda.memory_reserved() / GIB,
                    "worker_reserved_before_empty_gib": reserved / GIB,
                    "worker_segments": stats.get("segment.all.current", 0),
                    "worker_inactive_split_gib": stats.get("inactive_split_bytes.all.current", 0) / GIB,
                }
            )
        elif op == "gen":
            tok_s, logprobs = await generate(engine, f"gen{cmd['tag']}", cmd["batch"], cmd["new_tokens"])
            conn.send({"tok_s": tok_s, "logprobs": logprobs, "version": engine.engine.weight_version})
        elif op == "busy":
            busy = asyncio.create_task(generate(engine, f"busy{cmd['tag']}", cmd["batch"], cmd["new_tokens"]))
            while engine.engine.stats().num_running < cmd["batch"]:  # decoding, not still admitting
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            conn.send("busy")
        elif op == "idle":
            assert busy is not None
            await busy
            conn.send({"version": engine.engine.weight_version})
    engine.shutdown()


def worker_main(conn: Connection, preset: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve_commands(conn, preset))


class Worker:
    def __init__(self, preset: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, preset), daemon=True)
        self.proc.start()
        assert self.recv() == "ready"

    def ask(self, **cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv()

    def recv(self) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise RuntimeError(f"the worker did not answer in {REPLY_TIMEOUT_S}s (alive: {self.proc.is_alive()})")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(60)
        self.proc.kill()


# ------------------------------------------------------------------------------ trainer


def run_mode(preset: str, mode: str, versions: int, batch: int, new_tokens: int) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()  # the run before left nothing cached that this one could be carved from
    master = build_model(preset, device, torch.float32)  # the learner's float32 weights
    params = {k: p.detach() for k, p in master.named_parameters()}
    bf16_bytes = sum(p.numel() * 2 for p in params.values())
    worker = Worker(preset)
    row: dict[str, Any] = {"preset": preset, "mode": mode, "bf16_weights_gib": bf16_bytes / GIB}
    serving: dict[str, list[float]] = {"idle": [], "busy": []}
    logprobs, tok_s = [], []
    steps: list[dict[str, float]] = []
    """single: each in-place write's pause, write and serving parts (ms)."""
    try:
        with WeightPublisher() as pub:
            pub.device = DeviceVersions(device, timeout_s=120, single_copy=mode == "single")

            def publish(version: int) -> float:
                """Seconds from the device publish to the engine serving `version`."""
                with torch.no_grad():
                    for p in params.values():
                        p.add_(1e-3)  # every version differs
                torch.cuda.synchronize()
                t0 = time.monotonic()
                pub.device.publish(params, version, torch.bfloat16)
                if mode == "single" and version > 1:
                    seconds = time.monotonic() - t0  # returns once the engine serves it
                    steps.append({k: v * 1e3 for k, v in pub.device.last_write.items()})
                    return seconds
                got = worker.ask(
                    op="sync",
                    host=pub.address[0],
                    port=pub.address[1],
                    version=version,
                    token=pub.grant("local", version),
                )
                row.setdefault("in_place", got["in_place"])
                return got["done_at"] - t0

            publish(1)
            del master  # keep `params` (the master weights) only
            torch.cuda.empty_cache()
            row |= worker.ask(op="mem")
            free, total = torch.cuda.mem_get_info(device)
            row["gpu_used_gib"] = (total - free) / GIB
            row["trainer_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
            row["by_process_mib"] = by_process(worker.proc.pid)
            row["trainer_alloc_gib"] = torch.cuda.memory_allocated(device) / GIB
            for version in range(2, versions + 1):
                serving["idle"].append(publish(version))
                for repeat in range(2):  # the second: the engine's own run-to-run floor
                    got = worker.ask(op="gen", tag=f"{version}.{repeat}", batch=batch, new_tokens=new_tokens)
                    assert got["version"] == version, got
                    logprobs.append(got["logprobs"])
                    tok_s.append(got["tok_s"])
            for version in range(versions + 1, 2 * versions + 1):
                assert worker.ask(op="busy", tag=version, batch=batch, new_tokens=4 * new_tokens) == "busy"
                serving["busy"].append(publish(version))
                worker.ask(op="idle")
            row["in_place_leases"] = pub.device.num_leases
            pub.device.close()
    finally:
        worker.close()
    row |= {
        "serving_ms_idle": [s * 1e3 for s in serving["idle"]],
        "serving_ms_busy": [s * 1e3 for s in serving["busy"]],
        "decode_tok_s": max(tok_s),
        "in_place_write_ms": steps,
    }
    return row | {"_logprobs": logprobs}


def by_process(worker_pid: int) -> dict[str, int]:
    """nvidia-smi's memory per process (MiB), the trainer's and the worker's."""
    import os
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    names = {os.getpid(): "trainer", worker_pid: "worker"}
    return {
        names.get(int(pid), pid.strip()): int(mib)
        for pid, mib in (line.split(",") for line in out.splitlines() if "," in line)
    }


def max_diff(a: list, b: list) -> float:
    """The largest |difference| between two runs' log-probs (versions x sequences x tokens)."""
    return max(
        abs(x - y) for va, vb in zip(a, b, strict=True) for sa, sb in zip(va, vb) for x, y in zip(sa, sb, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    p.add_argument("--versions", type=int, default=4, help="versions timed idle (and as many busy)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("the single-copy engine shares a CUDA buffer between processes: run this on a GPU")
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for preset in args.presets:
        by_mode = {
            mode: run_mode(preset, mode, args.versions, args.batch, args.new_tokens) for mode in ("copy", "single")
        }
        a, b = by_mode["copy"].pop("_logprobs"), by_mode["single"].pop("_logprobs")
        for mode, row in by_mode.items():
            runs = a if mode == "copy" else b
            row["logprob_max_diff_vs_copy"] = max_diff(a[0::2], runs[0::2]) if mode == "single" else 0.0
            row["logprob_max_diff_repeat"] = max_diff(runs[0::2], runs[1::2])
            rows.append(row)
        saved = by_mode["copy"]["gpu_used_gib"] - by_mode["single"]["gpu_used_gib"]
        print(
            f"{preset}: single copy frees {saved:.2f} GiB of the GPU (one bf16 copy: {by_mode['copy']['bf16_weights_gib']:.2f} GiB)"
        )
    print(
        f"{'preset':12} {'mode':7} {'GPU used GiB':>12} {'worker GiB':>10} {'serving ms idle':>22} "
        f"{'serving ms busy':>22} {'decode tok/s':>12} {'logprob diff':>12} {'rerun diff':>10}"
    )
    for r in rows:
        idle, busy = r["serving_ms_idle"], r["serving_ms_busy"]
        print(
            f"{r['preset']:12} {r['mode']:7} {r['gpu_used_gib']:12.2f} {r['worker_alloc_gib']:10.2f} "
            f"{min(idle):10.2f}-{max(idle):<10.2f} {min(busy):10.2f}-{max(busy):<10.2f} "
            f"{r['decode_tok_s']:12.0f} {r['logprob_max_diff_vs_copy']:12.3g} {r['logprob_max_diff_repeat']:10.3g}"
        )
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        Path(args.json).write_text(json.dumps(meta | {"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
