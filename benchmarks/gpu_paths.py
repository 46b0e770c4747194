"""Weight paths on one host, "published -> the worker's engine holds it", for a bf16
Qwen3-0.6B-shaped model (random weights): the TCP pull (pinned and pageable landing),
NCCL from the trainer's GPU to another one, CUDA IPC on the trainer's own GPU.

    PYTHONPATH=src python benchmarks/gpu_paths.py --json gpu_paths.json     # on a 2-GPU host
    PYTHONPATH=src python benchmarks/gpu_paths.py --device cpu              # smoke test: TCP + gloo

The trainer is this process (model on cuda:0, a `WeightPublisher` with `DeviceVersions`).
Each worker is a process with an `Engine` of the same shapes and the worker's own
`WeightReceiver` (no HTTP): on cuda:1 for TCP and NCCL, on cuda:0 for CUDA IPC (with one
GPU: TCP and IPC only, on cuda:0). Every version differs from the one before in every
nonzero word (the weights are negated), so a path that moved nothing fails the check.

Rows: `snapshot` copies of every tensor (device -> pinned host, device -> pageable host,
device -> one flat device buffer); then per path and run: `publish_s` (the trainer's
snapshot: host buffer + checksums for TCP, device buffer for NCCL/IPC), `sync_s` (the
worker's pull + copy into its engine), `total_s` (their sum: published -> engine holds
it), `exact` (every engine parameter's xxh3 equals the trainer's tensor's). Run 1 pays
the setup (pinned buffers, the NCCL pair); TCP workers double-buffer, so run 3 is the
first that allocates nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model  # noqa: E402  (benchmarks/engine.py: the model shapes)

from polyrl.config import EngineConfig  # noqa: E402
from polyrl.engine.async_engine import AsyncEngine  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.transfer.device import DeviceVersions, flatten_on  # noqa: E402
from polyrl.transfer.publisher import WeightPublisher  # noqa: E402
from polyrl.transfer.wire import PullSource  # noqa: E402
from polyrl.worker.weight_sync import WeightReceiver  # noqa: E402

REPLY_TIMEOUT_S = 300


def hashes(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: xxhash.xxh3_64_hexdigest(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        for k, t in named.items()
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------- worker


def worker_main(conn: Connection, preset: str, device_name: str) -> None:
    """A worker without HTTP: an engine, its WeightReceivers (pinned and pageable), and a
    pipe from the trainer naming each version to sync."""
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(preset, device, torch.bfloat16)
    engine = AsyncEngine(Engine(model, EngineConfig(num_kv_blocks=16, max_num_seqs=4, cuda_graphs=False)))
    engine.start()
    receivers = {pin: WeightReceiver(engine, pin_memory=pin) for pin in {False, device.type == "cuda"}}
    loop = asyncio.new_event_loop()
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        receiver = receivers[cmd["pin"]]
        source = PullSource(cmd["host"], cmd["port"], cmd["worker_id"], cmd["token"])
        sync(device)
        t0 = time.perf_counter()
        pulled = loop.run_until_complete(receiver.sync(source, cmd["version"], 8, 120.0, "raw", cmd["path"]))
        sync(device)
        seconds = time.perf_counter() - t0
        exact = hashes(dict(model.named_parameters())) == cmd["expect"]
        conn.send(
            {
                "sync_s": seconds,
                "codec": pulled.codec if pulled else None,
                "fallback": receiver.fallback,
                "exact": exact,
            }
        )
    engine.shutdown()


class Worker:
    def __init__(self, preset: str, device: str) -> None:
        self.device = device
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=worker_main, args=(child, preset, device), daemon=True)
        self.proc.start()

    def recv(self) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise RuntimeError(
                f"worker on {self.device} did not answer in {REPLY_TIMEOUT_S}s (alive: {self.proc.is_alive()})"
            )
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        self.proc.kill()


# ------------------------------------------------------------------------------ trainer


def snapshot_rows(params: dict[str, torch.Tensor], device: torch.device) -> list[dict[str, Any]]:
    """Best of 3: every tensor into a preallocated flat buffer."""
    flat, manifest = flatten_on(params, 0, device)
    targets = {"snapshot device->device (flat)": flat}
    if device.type == "cuda":
        targets["snapshot device->pinned host"] = torch.zeros(manifest.total_bytes, dtype=torch.uint8, pin_memory=True)
        targets["snapshot device->pageable host"] = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    rows = []
    for name, buffer in targets.items():
        best = float("inf")
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            for e, t in zip(manifest.tensors, params.values()):  # into pinned memory: queued DMA, one wait
                buffer[e.offset : e.offset + e.nbytes].copy_(
                    t.detach().reshape(-1).view(torch.uint8), non_blocking=buffer.is_pinned()
                )
            sync(device)
            best = min(best, time.perf_counter() - t0)
        rows.append(
            {
                "path": name,
                "worker": "-",
                "run": "best of 3",
                "publish_s": best,
                "sync_s": 0.0,
                "total_s": best,
                "bytes": sum(e.nbytes for e in manifest.tensors),
                "exact": True,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset", default=None, help="a preset of benchmarks/engine.py (default: qwen3-0.6b on cuda, tiny on cpu)"
    )
    p.add_argument("--runs", type=int, default=3, help="versions per path")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    preset = args.preset or ("qwen3-0.6b" if args.device == "cuda" else "tiny")
    logging.basicConfig(level=logging.WARNING)
    t_start = time.perf_counter()
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and num_gpus == 0:
        sys.exit("no CUDA device here: run with --device cpu (TCP + gloo only)")
    if args.device == "cuda" and num_gpus < 2:
        print(f"only {num_gpus} GPU(s) visible: the NCCL row needs 2 and is skipped; TCP runs to cuda:0", flush=True)
    trainer = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    peer_name = "cuda:1" if num_gpus >= 2 else ("cuda:0" if num_gpus == 1 else "cpu")
    workers = {"peer": Worker(preset, peer_name)}
    if num_gpus >= 2:
        workers["same"] = Worker(preset, "cuda:0")
    elif num_gpus == 1:
        workers["same"] = workers["peer"]
    model = build_model(preset, trainer, torch.bfloat16)
    params = dict(model.named_parameters())
    rows = snapshot_rows(params, trainer)
    plan = [("tcp pinned", "peer", "tcp", True), ("tcp pageable", "peer", "tcp", False)]
    plan += [("nccl" if args.device == "cuda" else "nccl (gloo)", "peer", "nccl", False)] if num_gpus != 1 else []
    plan += [("cuda_ipc", "same", "cuda_ipc", False)] if num_gpus >= 1 else []
    plan = [step for step in plan if args.device == "cuda" or not step[3]]  # pinned memory needs CUDA
    try:
        for w in set(workers.values()):
            assert w.recv() == "ready"
        rows += run_paths(plan, workers, params, trainer, args.runs)
    finally:
        for w in set(workers.values()):
            w.close()
    print_table(rows)
    wall_s = time.perf_counter() - t_start
    print(f"{preset}: {rows[0]['bytes'] / 1e6:.1f} MB per version; {num_gpus} GPU(s); whole run {wall_s:.1f}s")
    if args.json:
        meta = {
            "preset": preset,
            "device": args.device,
            "num_gpus": num_gpus,
            "torch": torch.__version__,
            "wall_s": wall_s,
        }
        if num_gpus:
            meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(num_gpus)]
        Path(args.json).write_text(json.dumps(meta | {"rows": rows}, indent=2))


def run_paths(
    plan: list[tuple[str, str, str, bool]],
    workers: dict[str, Worker],
    params: dict[str, torch.Tensor],
    trainer: torch.device,
    runs: int,
) -> list[dict[str, Any]]:
    rows, version = [], 0
    with WeightPublisher() as pub, torch.no_grad():
        # the copy path (benchmarks/single_copy.py measures the engine reading the buffer in place)
        pub.device = DeviceVersions(trainer, timeout_s=60, single_copy=False)
        for name, who, path, pin in plan:
            worker = workers[who]
            worker_id = f"{who}-{'pinned' if pin else 'pageable'}"
            for run in range(1, runs + 1):
                version += 1
                for t in params.values():
                    t.neg_()  # a new version: every nonzero word changes
                expect = hashes(params)
                sync(trainer)
                t0 = time.perf_counter()
                if path == "tcp":
                    pub.publish(params, version)
                else:
                    pub.device.publish(params, version)
                publish_s = time.perf_counter() - t0
                worker.conn.send(
                    {
                        "host": pub.address[0],
                        "port": pub.address[1],
                        "worker_id": worker_id,
                        "version": version,
                        "token": pub.grant(worker_id, version),
                        "path": path,
                        "pin": pin,
                        "expect": expect,
                    }
                )
                got = worker.recv()
                total = sum(t.numel() * t.element_size() for t in params.values())
                row = {
                    "path": name,
                    "worker": worker.device,
                    "run": str(run),
                    "publish_s": publish_s,
                    "bytes": total,
                    "total_s": publish_s + got["sync_s"],
                } | got
                if got["fallback"] or got["codec"] != (path if path != "tcp" else "raw"):
                    print(f"  {name} run {run}: came as {got['codec']} ({got['fallback']})", flush=True)
                rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'path':32} {'worker':8} {'run':9} {'publish_s':>10} {'sync_s':>9} {'total_s':>9} {'GB/s':>8}  exact")
    for r in rows:
        rate = r["bytes"] / r["total_s"] / 1e9 if r["total_s"] > 0 else float("inf")
        print(
            f"{r['path']:32} {r['worker']:8} {r['run']:9} {r['publish_s']:10.4f} {r['sync_s']:9.4f} "
            f"{r['total_s']:9.4f} {rate:8.1f}  {'yes' if r['exact'] else 'NO'}"
        )


if __name__ == "__main__":
    main()
