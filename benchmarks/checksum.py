"""What checking a weight pull costs one core of this host: xxh3_64 (the chunk checksum
every receiver computes, `transfer/pull_proc.py`) next to a plain copy of the same bytes,
the baseline (a receiver's kernel copies each byte out of the socket once).

For each piece size it measures, on one core: the hash of a piece that is in cache (the
same piece hashed again and again), the hash of a 1 GiB buffer walked piece by piece
(from DRAM), a copy of that buffer piece by piece, and a copy with each piece hashed
right after (a receiver's work per byte). The hash's share of a receiving core is about
copy / hash-from-cache.

The python-xxhash wheels pick SSE2, AVX2 or AVX-512 at run time from 4.1 on; 4.0 and
older run SSE2 only (about half the speed on an AVX2 host). The first line says which
one is installed.

    python benchmarks/checksum.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import xxhash

GIB = 1 << 30


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds


def measure(piece: int, buf: np.ndarray, src: np.ndarray, repeats: int) -> dict[str, float]:
    """Bytes/s of each way, best of `repeats`, for `piece`-sized steps over len(buf) bytes."""
    total = len(buf)
    view, hot = memoryview(buf), memoryview(buf[:piece])
    best = {"hash_cache": 0.0, "hash_dram": 0.0, "copy": 0.0, "copy_hash": 0.0}
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        for _ in range(total // piece):
            h.update(hot)
        best["hash_cache"] = max(best["hash_cache"], rate(total, time.perf_counter() - t0))
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        for i in range(0, total, piece):
            h.update(view[i : i + piece])
        best["hash_dram"] = max(best["hash_dram"], rate(total, time.perf_counter() - t0))
        t0 = time.perf_counter()
        for i in range(0, total, piece):
            np.copyto(buf[i : i + piece], src[i : i + piece])
        best["copy"] = max(best["copy"], rate(total, time.perf_counter() - t0))
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        for i in range(0, total, piece):
            np.copyto(buf[i : i + piece], src[i : i + piece])
            h.update(view[i : i + piece])
        best["copy_hash"] = max(best["copy_hash"], rate(total, time.perf_counter() - t0))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pieces-kib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--gib", type=float, default=1.0, help="buffer walked for the DRAM and copy rows")
    p.add_argument("--repeats", type=int, default=3, help="best of N")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    total = int(args.gib * GIB)
    pieces = [k * 1024 for k in args.pieces_kib]
    if not pieces or min(pieces) <= 0 or total < max(pieces):
        p.error(f"pieces must be positive and at most the buffer ({total} bytes)")
    total -= total % max(pieces)
    buf = np.ones(total, dtype=np.uint8)  # both touched: page faults stay out of the timings
    src = np.full(total, 3, dtype=np.uint8)
    print(
        f"python-xxhash {xxhash.VERSION} (xxHash {xxhash.XXHASH_VERSION}), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; one core, best of {args.repeats}"
    )
    print(f"{'piece':>9} {'hash, cache':>12} {'hash, DRAM':>11} {'copy':>8} {'copy+hash':>10} {'hash time/copy':>15}")
    rows = []
    for piece in pieces:
        r = measure(piece, buf, src, args.repeats)
        share = r["copy"] / r["hash_cache"]  # seconds of hashing per second of copying
        rows.append({"piece_bytes": piece, **{f"{k}_Bps": v for k, v in r.items()}, "hash_over_copy": share})
        print(
            f"{piece >> 10:>5} KiB {r['hash_cache'] / 1e9:>9.1f} GB/s {r['hash_dram'] / 1e9:>6.1f} GB/s "
            f"{r['copy'] / 1e9:>5.1f} GB/s {r['copy_hash'] / 1e9:>7.1f} GB/s {share:>14.0%}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"xxhash": xxhash.VERSION, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
