"""One version to many workers: the time from publish until the last worker holds it,
and the bytes the trainer's publisher sent, with the publisher's link capped.

Every worker is a process of its own that runs the real receiver (`transfer.receiver.pull`,
checksums and all) into its own buffer and checks the result bit for bit; it loads no
model. The publisher is the trainer's (`WeightPublisher`, its own serving process),
capped at `--cap-gbps` (`manager.transfer.max_send_gbps`), so that loopback behaves like
a link of that speed shared by every pull. The single-worker row is the baseline each
row is compared with.

Modes: `direct`, every worker pulling from the publisher; `relay`, the workers in the
manager's tree (`manager/relay_plan.py`, `--fan-out`), each serving the version on from
its own relay (`transfer/relay.py`) as the chunks check out, with its link capped the
same, and its parent's ancestors then the publisher as fallbacks.

    python benchmarks/fanout.py --workers 1 4 8 16 32 --version-mib 32 --cap-gbps 0.1 --json out.json

The version's chunks are `--chunk-kib` (256 KiB by default: 128 chunks in 32 MiB; a
16 GB version in the publisher's 8 MiB chunks has 2000). A relay forwards a chunk once
it has it whole, so what a level adds is about one chunk's time. On a small box, keep
the cap times the number of workers within what its cores can copy and checksum
(BENCHMARKS.md: at 1 Gbit/s, 32 relays on 2 cores are bound by the cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from polyrl.manager.relay_plan import depth, relay_chains
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.wire import PullSource, chunk_checksums, combined_checksum, relay_key, transfer_token


def _worker(worker_id: str, cap_gbps: float | None, streams: int, conn: Connection) -> None:
    """Starts its relay (when `cap_gbps` is not None), says where it is, waits for its
    sources and the go, pulls, answers (seconds from the go to verified, bytes on the
    wire, checksum ok); then serves until told to stop, and says what its relay sent."""
    from polyrl.transfer.receiver import pull  # (the child's own import)
    from polyrl.transfer.relay import Relay

    relay = Relay(max_send_gbps=cap_gbps) if cap_gbps is not None else None
    conn.send(relay.address if relay is not None else None)
    key = conn.recv()  # the relay's key (a worker has it from before the version exists)
    if relay is not None:
        relay.key = key
    conn.send("ready")
    sources, expected = conn.recv()  # the go: where to pull from, and the published buffer's checksum
    t0 = time.monotonic()
    got = pull(
        sources[0],
        1,
        num_streams=streams,
        timeout_s=600,
        fallbacks=sources[1:],
        watcher=relay.watch(1) if relay is not None else None,
    )
    took = time.monotonic() - t0
    chunk_bytes, buffer_checksum = expected  # the whole buffer, padding between tensors included
    sums = chunk_checksums(memoryview(got.buffer.numpy()), chunk_bytes)
    conn.send((took, got.wire_bytes, combined_checksum(sums) == buffer_checksum))
    conn.recv()  # every worker has it
    conn.send(relay.bytes_sent if relay is not None else 0)
    if relay is not None:
        relay.close()


def version_weights(mib: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of `mib` MiB in all, in layers of 4 MiB (random values)."""
    g = torch.Generator().manual_seed(0)
    per = 2 * 2**20  # bf16 elements in 4 MiB
    return {f"layer{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(max(1, mib // 4))}


def run(mode: str, num_workers: int, weights: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    relayed = mode == "relay"
    with WeightPublisher(max_send_gbps=args.cap_gbps, chunk_bytes=args.chunk_kib * 1024) as pub:
        info = pub.publish(weights, 1)
        expected = (info.chunk_bytes, info.buffer_checksum)
        host, port = pub.address
        ids = [f"w{i}" for i in range(num_workers)]
        procs, conns = [], []
        for worker_id in ids:
            parent, child = ctx.Pipe()
            cap = args.cap_gbps if relayed else None
            proc = ctx.Process(target=_worker, args=(worker_id, cap, args.streams, child), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        try:
            relays = {}
            for worker_id, c in zip(ids, conns, strict=True):
                if not c.poll(300):
                    raise RuntimeError("a worker process did not start within 300 s")
                relays[worker_id] = c.recv()
                c.send(relay_key(pub.key, worker_id))
            for c in conns:
                c.recv()
            chains = relay_chains(ids, args.fan_out) if relayed else {w: [] for w in ids}
            sent_before = pub.bytes_sent
            t0 = time.monotonic()
            for worker_id, c in zip(ids, conns, strict=True):
                sources = [
                    PullSource(
                        *relays[r], worker_id=worker_id, token=transfer_token(relay_key(pub.key, r), worker_id, 1)
                    )
                    for r in chains[worker_id]
                ]
                sources.append(PullSource(host, port, worker_id=worker_id, token=pub.grant(worker_id, 1)))
                c.send((sources, expected))
            results = []
            for c in conns:
                if not c.poll(1800):
                    raise RuntimeError("a pull took over 1800 s")
                results.append(c.recv())
            all_synced_s = time.monotonic() - t0
            trainer_bytes = pub.bytes_sent - sent_before
            for c in conns:
                c.send("stop")
            relay_bytes = [c.recv() for c in conns]
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    if not all(ok for _, _, ok in results):
        raise RuntimeError("a worker's version did not match the published checksum")
    return {
        "mode": mode,
        "workers": num_workers,
        "fan_out": args.fan_out if relayed else None,
        "levels": depth(num_workers, args.fan_out if relayed else num_workers),
        "all_synced_s": all_synced_s,
        "first_synced_s": min(s for s, _, _ in results),
        "synced_s": [round(s, 3) for s, _, _ in results],  # in the plan's order (the chain's, relayed)
        "trainer_bytes": trainer_bytes,
        "version_bytes": info.manifest.total_bytes,
        "max_relay_bytes": max(relay_bytes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--version-mib", type=int, default=32, help="the version's size")
    p.add_argument("--cap-gbps", type=float, default=1.0, help="the publisher's send cap")
    p.add_argument("--streams", type=int, default=4, help="TCP streams per pull")
    p.add_argument("--chunk-kib", type=int, default=256, help="the publisher's chunk size")
    p.add_argument("--modes", nargs="+", default=["direct", "relay"], choices=["direct", "relay"])
    p.add_argument("--fan-out", type=int, default=1, help="relayed: children per sender (1: a chain)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    weights = version_weights(args.version_mib)
    rows = []
    for mode in args.modes:
        for n in sorted(set(args.workers)):
            rows.append(run(mode, n, weights, args))
            print(f"{mode}, {n} workers: all synced in {rows[-1]['all_synced_s']:.2f} s", flush=True)
    single = [r["all_synced_s"] for r in rows if r["workers"] == 1 and r["mode"] == "direct"]
    base = single[0] if single else rows[0]["all_synced_s"]
    cap_s = rows[0]["version_bytes"] / (args.cap_gbps * 1e9 / 8)
    print(
        f"\nversion {rows[0]['version_bytes'] / 2**20:.0f} MiB, publisher capped at {args.cap_gbps} Gbit/s "
        f"(one version at the cap: {cap_s:.2f} s), {args.streams} streams a pull, chunks of {args.chunk_kib} KiB; "
        f"relays capped the same, fan-out {args.fan_out}; 'vs 1 worker': against the direct single pull"
    )
    print(
        "| mode | workers | levels | all synced s | vs 1 worker | first synced s | trainer sent (versions) "
        "| most one relay sent |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['levels']} | {r['all_synced_s']:.2f} | "
            f"{r['all_synced_s'] / base:.2f}x | "
            f"{r['first_synced_s']:.2f} | {r['trainer_bytes'] / r['version_bytes']:.1f} | "
            f"{r['max_relay_bytes'] / r['version_bytes']:.1f} |"
        )
    if args.json:
        meta = {"cap_gbps": args.cap_gbps, "streams": args.streams, "chunk_kib": args.chunk_kib}
        args.json.write_text(json.dumps(meta | {"fan_out": args.fan_out, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
