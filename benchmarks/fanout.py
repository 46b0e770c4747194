"""One version to many workers: the time from publish until the last worker holds it,
and the bytes the trainer's publisher sent, with the publisher's link capped.

Every worker is a process of its own that runs the real receiver (`transfer.receiver.pull`,
checksums and all) into its own buffer and checks the result bit for bit; it loads no
model. The publisher is the trainer's (`WeightPublisher`, its own serving process),
capped at `--cap-gbps` (`manager.transfer.max_send_gbps`), so that loopback behaves like
a link of that speed shared by every pull. The single-worker row is the baseline each
row is compared with.

Modes: `direct`, every worker pulling from the publisher, as polyrl does today. Relayed
versions (workers serving the versions they hold to other workers) are not built yet;
this is the baseline they are to beat.

    python benchmarks/fanout.py --workers 1 4 8 16 32 --version-mib 32 --cap-gbps 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from polyrl.transfer.manifest import flatten
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.wire import PullSource, checksum


def _worker(host: str, port: int, worker_id: str, token: str, version: int, streams: int, conn: Connection) -> None:
    """Waits for the go, pulls, answers (seconds from the go to verified, bytes, checksum ok)."""
    from polyrl.transfer.receiver import pull  # (the child's own import)

    conn.send("ready")
    expected = conn.recv()  # the go, with the xxh3 of the published buffer
    t0 = time.monotonic()
    got = pull(PullSource(host, port, worker_id=worker_id, token=token), version, num_streams=streams, timeout_s=600)
    took = time.monotonic() - t0
    conn.send((took, got.wire_bytes, checksum(memoryview(got.buffer.numpy())) == expected))


def version_weights(mib: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of `mib` MiB in all, in layers of 4 MiB (random values)."""
    g = torch.Generator().manual_seed(0)
    per = 2 * 2**20  # bf16 elements in 4 MiB
    return {f"layer{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(max(1, mib // 4))}


def run_direct(num_workers: int, weights: dict[str, torch.Tensor], cap_gbps: float, streams: int) -> dict:
    ctx = mp.get_context("spawn")
    with WeightPublisher(max_send_gbps=cap_gbps) as pub:
        info = pub.publish(weights, 1)
        expected = checksum(memoryview(flatten(weights, 1)[0].numpy()))
        host, port = pub.address
        procs, conns = [], []
        for i in range(num_workers):
            parent, child = ctx.Pipe()
            worker_id = f"w{i}"
            args = (host, port, worker_id, pub.grant(worker_id, 1), 1, streams, child)
            proc = ctx.Process(target=_worker, args=args, daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        try:
            for c in conns:
                if not c.poll(300):
                    raise RuntimeError("a worker process did not start within 300 s")
                c.recv()
            sent_before = pub.bytes_sent
            t0 = time.monotonic()
            for c in conns:
                c.send(expected)
            results = []
            for c in conns:
                if not c.poll(1800):
                    raise RuntimeError("a pull took over 1800 s")
                results.append(c.recv())
            all_synced_s = time.monotonic() - t0
            trainer_bytes = pub.bytes_sent - sent_before
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    if not all(ok for _, _, ok in results):
        raise RuntimeError("a worker's version did not match the published checksum")
    return {
        "mode": "direct",
        "workers": num_workers,
        "all_synced_s": all_synced_s,
        "first_synced_s": min(s for s, _, _ in results),
        "trainer_bytes": trainer_bytes,
        "version_bytes": info.manifest.total_bytes,
        "max_relay_bytes": 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--version-mib", type=int, default=32, help="the version's size")
    p.add_argument("--cap-gbps", type=float, default=1.0, help="the publisher's send cap")
    p.add_argument("--streams", type=int, default=4, help="TCP streams per pull")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    weights = version_weights(args.version_mib)
    rows = []
    for n in sorted(set(args.workers)):
        rows.append(run_direct(n, weights, args.cap_gbps, args.streams))
        print(f"direct, {n} workers: all synced in {rows[-1]['all_synced_s']:.2f} s", flush=True)
    base = next((r["all_synced_s"] for r in rows if r["workers"] == 1), rows[0]["all_synced_s"])
    cap_s = rows[0]["version_bytes"] / (args.cap_gbps * 1e9 / 8)
    print(
        f"\nversion {rows[0]['version_bytes'] / 2**20:.0f} MiB, publisher capped at {args.cap_gbps} Gbit/s "
        f"(one version at the cap: {cap_s:.2f} s), {args.streams} streams a pull"
    )
    print(
        "| mode | workers | all synced s | vs 1 worker | first synced s | trainer sent (versions) | most one relay sent |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['all_synced_s']:.2f} | {r['all_synced_s'] / base:.1f}x | "
            f"{r['first_synced_s']:.2f} | {r['trainer_bytes'] / r['version_bytes']:.1f} | "
            f"{r['max_relay_bytes'] / r['version_bytes']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"cap_gbps": args.cap_gbps, "streams": args.streams, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
