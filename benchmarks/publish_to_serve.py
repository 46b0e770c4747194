"""Time from "version published" to "worker serving it", through the real path:
WeightPublisher snapshot -> manager.publish_version -> PublisherSync grants a token ->
`polyrl worker` pulls over TCP (raw the first time, then deltas) -> engine swap ->
manager marks it synced.

    python benchmarks/publish_to_serve.py --preset qwen3-0.6b --versions 4 --json out.json

Each later version is one Adam-like step at `--lr` on fp32 master weights (every entry
moves by lr), cast to bf16, so most bf16 words stay the same, as after a small RL step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model  # noqa: E402  (benchmarks/engine.py: the model presets)

from polyrl.config import ManagerConfig  # noqa: E402
from polyrl.manager.main import ManagerThread  # noqa: E402
from polyrl.manager.weight_sync import PublisherSync  # noqa: E402
from polyrl.transfer.publisher import WeightPublisher  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="a preset of benchmarks/engine.py")
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--codec", choices=["auto", "raw", "delta"], default="auto")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.preset, torch.device("cpu"), torch.bfloat16)
        model.save_pretrained(tmp)
        master = {k: p.detach().float().clone() for k, p in model.named_parameters()}
        del model
        rows = []
        cfg = ManagerConfig(port=0, token="bench", heartbeat_interval_s=0.5)
        cfg.transfer.streams_per_group = args.streams
        with ManagerThread(cfg) as mt, WeightPublisher() as pub:
            sync = PublisherSync(mt.manager, pub, pull_timeout_s=600, codec=args.codec)
            mt.add_sync_hook(sync)
            cmd = [
                sys.executable,
                "-m",
                "polyrl.cli",
                "worker",
                "--model",
                tmp,
                "--manager",
                mt.url,
                "--token",
                "bench",
                "--port",
                "0",
                "--worker-id",
                "w",
                "engine.max_num_seqs=8",
            ]
            worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait(lambda: state(mt) == ("active", 0), 600, worker)
                g = torch.Generator().manual_seed(0)
                for version in range(1, args.versions + 1):
                    if version == 1:  # a fresh random version: every word differs
                        for t in master.values():
                            t.add_(torch.randn(t.shape, generator=g) * 0.01)
                    else:  # one small step: every entry moves by +-lr
                        for t in master.values():
                            t.add_(torch.sign(torch.randn(t.shape, generator=g)) * args.lr)
                    t0 = time.perf_counter()
                    info = pub.publish({k: t.to(torch.bfloat16) for k, t in master.items()}, version)
                    snapshot_s = time.perf_counter() - t0
                    serve_s, message = announce_and_wait(mt, sync, worker, version)
                    rows.append(
                        {
                            "version": version,
                            "bytes": info.manifest.total_bytes,
                            "snapshot_s": snapshot_s,
                            "publish_to_serving_s": serve_s,
                            "worker_said": message,
                        }
                    )
                    print(
                        f"v{version}: {info.manifest.total_bytes / 1e6:.0f} MB, snapshot {snapshot_s:.2f}s, "
                        f"published -> serving {serve_s:.2f}s ({message})",
                        flush=True,
                    )
            finally:
                worker.terminate()
                worker.wait(timeout=60)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


def announce_and_wait(
    mt: ManagerThread, sync: PublisherSync, worker: subprocess.Popen, version: int
) -> tuple[float, str]:
    """Tell the manager that `version` (already published) is current and wait until the
    worker serves it: the seconds that took, and what the worker said of its pull."""
    t0 = time.perf_counter()
    mt.publish_version(version)
    wait(lambda: state(mt) == ("active", version), 600, worker)
    return time.perf_counter() - t0, sync.last_message.get("w", "")


def state(mt: ManagerThread) -> tuple[str, int] | None:
    workers = mt.worker_list().workers
    return (workers[0].state, workers[0].weight_version) if workers else None


def wait(predicate, timeout_s: float, worker: subprocess.Popen) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline or worker.poll() is not None:
            raise RuntimeError("the worker did not get there (exited or timed out)")
        time.sleep(0.005)


if __name__ == "__main__":
    main()
