"""Weight pulls over TCP: bytes/s of `polyrl.transfer` next to a raw-socket ceiling
measured in the same run with the same number of streams.

The ceiling is N threads sending from one buffer into N threads doing recv_into one
preallocated buffer over loopback, nothing else: blocking sockets, each receive waiting
for its whole piece in one call (MSG_WAITALL). It is the best of three piece sizes (the
pull's chunk, 1 MiB, the stream's whole share), each best of --repeats, and of each way
of sending in `--ceiling-send`: sendall from memory, and sendfile from a memfd (which
on loopback spares the sender its copy, as it does the publisher's with
`--send-mode sendfile`).
The pull adds the protocol, the per-chunk xxh3 checksums and the whole-buffer checksum.
The pull is the best of as many tries as each way of sending gets (3 x --repeats), the
two taking turns; `median` is the median over those rounds of pull / ceiling.
`--ceiling-memory shared` also measures the ceiling between shared-memory buffers (a
memfd on each side, as the publisher sends from and the receiver processes land in),
next to the default private (anonymous) buffers, to tell the memory's cost from the
protocol's.
By default both senders (the publisher and the raw one) run in a child process, as the
trainer does; `--sender thread` puts them in this process. Either way the publisher
serves from its own process (`transfer/serve.py`), sending each chunk with `sendall`
from its shared memory or `sendfile` from the memfd (`--send-mode`). The pull is
received by threads of this process, or by a pool of receiver processes writing into a
shared-memory landing buffer, as a worker does for a large version (`--receiver`):
`process` hashes each stream on a second thread of its process, `process-inline` after
each piece on the receiving thread (the way before), `worker` picks one of the two per
pull as a worker does.

    python benchmarks/transfer.py --sizes-gib 1 --streams 1 8 16 --send-mode sendall sendfile --json out.json

`--links plain tls` measures every row twice in the same run: plain TCP, then each stream
wrapped in TLS (`manager.transfer.tls`) with a throwaway certificate made by `openssl`
(`polyrl.tls.self_signed`); the ceiling stays plain TCP, so `pull/ceiling` of the tls rows
is what encryption leaves of the link, and the summary gives tls / plain per row. The
publisher then sends with `sendall` only (sendfile would bypass TLS).

`--codecs` (alias `--delta`) also measures the codecs on a realistic update: bf16 weights
of Qwen3-0.6B's shapes (random values, std 0.02), fp32 master copies, one torch Adam step
at lr 1e-6 on random gradients, cast back to bf16. It reports the wire bytes against raw
and the encode/decode seconds of the lossless delta (against the version before), of
zstd over byte planes (the whole version), and of the lossy int8 codec (with its error).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from polyrl.transfer import pull_proc
from polyrl.transfer.manifest import Manifest, flatten
from polyrl.transfer.publisher import SEND_MODE, WeightPublisher
from polyrl.transfer.receive_pool import ReceiverPool
from polyrl.transfer.receiver import pull
from polyrl.transfer.shm import SharedBuffer
from polyrl.transfer.wire import PullSource

TlsFiles = dict[str, str]


SEND_PRIVATE, SEND_SHARED, SEND_FILE = 0, 1, 2


class CeilingSender:
    """The raw-socket sender: connection i of n asks for bytes [i*share, (i+1)*share) of
    `src` (or of its copy in shared memory) in `piece`-sized sends (header: i, n, piece,
    how), one thread each. how: SEND_PRIVATE and SEND_SHARED send with sendall from
    memory, SEND_FILE with sendfile from the shared copy's memfd."""

    def __init__(self, src: memoryview) -> None:
        self.src = src
        self.shared = SharedBuffer("polyrl-bench-ceiling", len(src))
        self.shared.tensor.numpy()[:] = memoryview(src).cast("B")
        self.shared_view = memoryview(self.shared.tensor.numpy()).cast("B")
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        with conn:
            i, n, piece, how = struct.unpack("!HHQB", conn.recv(13, socket.MSG_WAITALL))
            total = len(self.src)
            share = -(-total // n)
            first, end = i * share, min((i + 1) * share, total)
            if how == SEND_FILE:
                for start in range(first, end, piece):
                    stop = min(start + piece, end)
                    while start < stop:
                        start += os.sendfile(conn.fileno(), self.shared.fd, start, stop - start)
                return
            view = (self.shared_view if how == SEND_SHARED else self.src)[first:end]
            for start in range(0, len(view), piece):
                conn.sendall(view[start : start + piece])


def raw_ceiling(port: int, num_streams: int, dst: memoryview, piece: int, how: int = SEND_PRIVATE) -> float:
    """Bytes/s of plain loopback TCP from a CeilingSender: blocking sockets, each piece
    received with one recv_into(MSG_WAITALL), one thread per stream; `how`: SEND_SHARED
    sends from the sender's shared-memory copy (pass a shared `dst` too), SEND_FILE with
    sendfile from it."""
    total = len(dst)
    share = -(-total // num_streams)

    def receive(i: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(struct.pack("!HHQB", i, num_streams, piece, how))
            view = dst[i * share : min((i + 1) * share, total)]
            for start in range(0, len(view), piece):
                part, got = view[start : start + piece], 0
                while got < len(part):
                    got += sock.recv_into(part[got:], 0, socket.MSG_WAITALL)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=receive, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total / (time.perf_counter() - t0)


@dataclass
class Sender:
    """Where the bytes come from: a published version and a raw sender over its buffer."""

    source: PullSource
    ceiling_port: int
    total_bytes: int
    chunk_bytes: int
    publish_s: float


@contextmanager
def serve_version(
    total: int, chunk_bytes: int, send_mode: str = SEND_MODE, tls: TlsFiles | None = None
) -> Iterator[Sender]:
    """Publish `total` bytes of weights and serve them (pulls and the raw ceiling) while
    the context is open; pulls over TLS with `tls`."""
    weights = {"w": torch.randn(total // 4)}
    cert = (tls["cert"], tls["key"]) if tls else None
    with WeightPublisher(chunk_bytes=chunk_bytes, keep_versions=1, send_mode=send_mode, tls=cert) as pub:
        t0 = time.perf_counter()
        info = pub.publish(weights, 1)
        publish_s = time.perf_counter() - t0
        ceiling = CeilingSender(memoryview(flatten(weights, 1)[0].numpy()).cast("B"))
        source = PullSource(
            *pub.address,
            worker_id="bench",
            token=pub.grant("bench", 1),
            tls=tls is not None,
            ca_file=tls["ca"] if tls else None,
        )
        try:
            yield Sender(source, ceiling.port, info.manifest.total_bytes, info.chunk_bytes, publish_s)
        finally:
            ceiling.listener.close()
            ceiling.shared.close()


def _sender_process(total: int, chunk_bytes: int, send_mode: str, tls: TlsFiles | None, conn: Connection) -> None:
    with serve_version(total, chunk_bytes, send_mode, tls) as sender:
        conn.send(sender)
        conn.recv()  # serve until the parent says stop (or dies: EOFError)


@contextmanager
def sender(total: int, chunk_bytes: int, where: str, send_mode: str, tls: TlsFiles | None = None) -> Iterator[Sender]:
    """A Sender in this process (`thread`: it shares the receiver's GIL) or in a child
    process (`process`: as deployed, the trainer's publisher and a worker's receiver are
    different processes)."""
    if where == "thread":
        with serve_version(total, chunk_bytes, send_mode, tls) as here:
            yield here
        return
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_sender_process, args=(total, chunk_bytes, send_mode, tls, child), daemon=True
    )
    proc.start()
    try:
        if not parent.poll(600):
            raise TimeoutError("the sender process did not publish within 600 s")
        yield parent.recv()
    finally:
        with suppress(OSError):  # a child that died has closed its end
            parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


QWEN3_0_6B = {"vocab": 151936, "hidden": 1024, "layers": 28, "inter": 3072, "q": 2048, "kv": 1024, "head_dim": 128}


def qwen3_shapes(c: dict[str, int]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab"], c["hidden"]),
        "model.norm.weight": (c["hidden"],),
    }
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (c["q"], c["hidden"]),
            p + "self_attn.k_proj.weight": (c["kv"], c["hidden"]),
            p + "self_attn.v_proj.weight": (c["kv"], c["hidden"]),
            p + "self_attn.o_proj.weight": (c["hidden"], c["q"]),
            p + "self_attn.q_norm.weight": (c["head_dim"],),
            p + "self_attn.k_norm.weight": (c["head_dim"],),
            p + "mlp.gate_proj.weight": (c["inter"], c["hidden"]),
            p + "mlp.up_proj.weight": (c["inter"], c["hidden"]),
            p + "mlp.down_proj.weight": (c["hidden"], c["inter"]),
            p + "input_layernorm.weight": (c["hidden"],),
            p + "post_attention_layernorm.weight": (c["hidden"],),
        }
    return shapes


def adam_step_versions(lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(bf16 before, bf16 after one Adam step), tensor by tensor to bound memory."""
    g = torch.Generator().manual_seed(0)
    before, after = {}, {}
    for name, shape in qwen3_shapes(QWEN3_0_6B).items():
        init = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
        master = torch.nn.Parameter(init)
        before[name] = master.detach().to(torch.bfloat16)
        master.grad = torch.randn(shape, generator=g) * 1e-3
        torch.optim.Adam([master], lr=lr).step()
        after[name] = master.detach().to(torch.bfloat16)
    return before, after


def measure_codecs(lr: float) -> dict[str, dict[str, float]]:
    """The delta of one Adam step, then the whole-version codecs on its result."""
    from polyrl.transfer.delta import apply_delta, encode_delta
    from polyrl.transfer.manifest import flatten

    before, after = adam_step_versions(lr)
    old, _ = flatten(before, 0)
    new, manifest = flatten(after, 1)
    del before, after
    t0 = time.perf_counter()
    payload = encode_delta(old.numpy(), new.numpy())
    encode_s = time.perf_counter() - t0
    out = torch.empty_like(new)
    t0 = time.perf_counter()
    changed = apply_delta(old.numpy(), payload, out.numpy())
    apply_s = time.perf_counter() - t0
    assert torch.equal(out, new), "delta round trip is not bit-exact"
    raw = new.numel()
    print(f"\ndelta, Qwen3-0.6B shapes (bf16), one Adam step at lr {lr:g}:")
    print(
        f"  raw {raw / 1e6:.1f} MB, delta {len(payload) / 1e6:.1f} MB = {len(payload) / raw:.1%} of raw; "
        f"{changed / (raw // 2):.2%} of the bf16 words changed; encode {encode_s:.2f}s, apply {apply_s:.2f}s"
    )
    result = {
        "raw_bytes": raw,
        "delta_bytes": len(payload),
        "fraction": len(payload) / raw,
        "changed_words": changed,
        "encode_s": encode_s,
        "apply_s": apply_s,
    }
    return {"delta": result, **measure_whole_codecs(new, manifest)}


def measure_whole_codecs(new: torch.Tensor, manifest: Manifest) -> dict[str, dict[str, float]]:
    """zstd (lossless, checked bit-exact) and int8 (lossy: its worst error per row step)."""
    from polyrl.transfer.compress import decode_zstd, encode_zstd
    from polyrl.transfer.manifest import unflatten
    from polyrl.transfer.publisher import word_bytes
    from polyrl.transfer.quantize import decode_int8, encode_int8

    raw, out, results = new.numel(), torch.empty_like(new), {}
    for name, encode, decode in (
        ("zstd", lambda: encode_zstd(new.numpy(), word_bytes(manifest)), lambda p: decode_zstd(p, out.numpy())),
        ("int8", lambda: encode_int8(new, manifest), lambda p: decode_int8(p, manifest, out)),
    ):
        t0 = time.perf_counter()
        payload = encode()
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        decode(payload)
        decode_s = time.perf_counter() - t0
        results[name] = {
            "bytes": len(payload),
            "fraction": len(payload) / raw,
            "encode_s": encode_s,
            "decode_s": decode_s,
        }
        if name == "zstd":
            assert torch.equal(out, new), "zstd round trip is not bit-exact"
            note = "bit-exact"
        else:
            worst = max(
                ((a.float() - b.float()).abs().amax(1) / (b.float().abs().amax(1) / 127).clamp_min(1e-30)).max().item()
                for a, b in zip(unflatten(out, manifest).values(), unflatten(new, manifest).values())
                if b.dim() == 2
            )
            results[name]["worst_error_in_steps"] = worst
            note = f"LOSSY: worst error {worst:.2f} of a row's int8 step"
        print(
            f"  {name}: {len(payload) / 1e6:.1f} MB = {len(payload) / raw:.1%} of raw; encode {encode_s:.2f}s, "
            f"decode {decode_s:.2f}s; {note}"
        )
    return results


def measure_rows(src: Sender, args: argparse.Namespace, row: dict[str, object]) -> list[dict[str, object]]:
    """For each stream count: the raw ceiling and the pull with each receiver, taking
    turns (a round is one try of each ceiling way and piece, then one pull of each
    receiver), so a host that gets busier or quieter during the run weighs on both alike.
    Each row is the best of its tries; `median_fraction` is the median over rounds of the
    receiver's pull against that round's best ceiling. The pull lands in a buffer reused
    across pulls, as a worker's does: for `process`, a shared-memory landing buffer of a
    pool started once (as WeightReceiver does), its processes started by a first pull
    that is not counted."""
    if src.source.tls:
        print(f"  TLS session: {negotiated(src.source)}", flush=True)
    recv_buffer = torch.empty(src.total_bytes, dtype=torch.uint8)  # reused, as a worker does
    recv_buffer.fill_(0)  # touch the pages once, for both rows
    dst = memoryview(recv_buffer.numpy()).cast("B")
    shared_dst = SharedBuffer("polyrl-bench-landing", src.total_bytes) if "shared" in args.ceiling_memory else None
    if shared_dst is not None:
        shared_dst.tensor.fill_(0)  # its pages faulted in before the first try, as recv_buffer's
    shared_view = memoryview(shared_dst.tensor.numpy()).cast("B") if shared_dst is not None else None
    rows = []
    pieces = (src.chunk_bytes, 2**20, src.total_bytes)  # the ceiling is the best of three ways
    sends = {"sendall": SEND_PRIVATE, "sendfile": SEND_FILE}
    try:
        for n in args.streams:
            receivers = [
                Receiver(src, n, how, recv_buffer, procs)
                for how in args.receiver
                for procs in (args.receive_processes if how != "thread" else [0])
            ]
            try:
                rounds: list[dict[str, float]] = []  # per round: each ceiling way's best, each receiver's rate
                for _ in range(args.repeats):
                    for piece in pieces:
                        got = {
                            name: raw_ceiling(src.ceiling_port, n, dst, piece, sends[name])
                            for name in args.ceiling_send
                        }
                        if shared_view is not None:
                            got["shared"] = raw_ceiling(src.ceiling_port, n, shared_view, piece, SEND_SHARED)
                        got |= {r.label: r.pull() for r in receivers}
                        rounds.append(got)
            finally:
                for r in receivers:
                    r.close()
            by_send = {name: max(g[name] for g in rounds) for name in args.ceiling_send}
            ceiling = max(by_send.values())
            print("  ceiling at %d streams: %s" % (n, ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in by_send.items())))
            for r in receivers:
                rate = max(g[r.label] for g in rounds)
                fractions = sorted(g[r.label] / max(g[k] for k in args.ceiling_send) for g in rounds)
                median = fractions[len(fractions) // 2]
                result = row | {
                    "receiver": r.how,
                    "processes": r.processes,
                    "streams": n,
                    "ceiling_Bps": ceiling,
                    "pull_Bps": rate,
                    "fraction": rate / ceiling,
                    "median_fraction": median,
                    "publish_s": src.publish_s,
                    "tries": len(rounds),
                    "ceiling_by_send_Bps": by_send,
                }
                shared = ""
                if shared_view is not None:
                    shared_ceiling = max(g["shared"] for g in rounds)
                    result |= {"shared_ceiling_Bps": shared_ceiling, "fraction_of_shared": rate / shared_ceiling}
                    shared = f"{shared_ceiling / 1e9:>10.2f} {rate / shared_ceiling:>9.0%}"
                rows.append(result)
                print(
                    f"{row['size_gib']:>6.2f}Gi {row['link']:>5} {row['sender']:>7} {row['send_mode']:>8} {r.label:>17} {n:>7} "
                    f"{ceiling / 1e9:>13.2f} {rate / 1e9:>10.2f} {rate / ceiling:>12.0%} {median:>8.0%} {shared}",
                    flush=True,
                )
    finally:
        if shared_view is not None:
            shared_view.release()
        if shared_dst is not None:
            shared_dst.close()
    return rows


class Receiver:
    """One receiver row: threads of this process, or a pool of receiver processes with a
    landing buffer of their own (started by a first pull that is not counted)."""

    def __init__(self, src: Sender, num_streams: int, how: str, recv_buffer: torch.Tensor, processes: int) -> None:
        self.src, self.num_streams, self.how = src, num_streams, how
        self.pool: ReceiverPool | None = None
        self.processes = min(processes or num_streams, num_streams, os.cpu_count() or 1) if how != "thread" else 0
        self.label = f"{how}/{self.processes}" if self.processes else how
        self.into = recv_buffer
        if how != "thread":
            self.pool = ReceiverPool(self.processes, pipelined={"process": True, "process-inline": False}.get(how))
            landing = self.pool.landing(src.total_bytes, pin=False)
            landing.tensor.fill_(0)
            self.into = landing.tensor
            self.pull()

    def pull(self) -> float:
        return pull(
            self.src.source, 1, num_streams=self.num_streams, timeout_s=120, into=self.into, pool=self.pool
        ).bytes_per_s

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def ssl_summary(context: ssl.SSLContext) -> str:
    """What OpenSSL offers first: TLS 1.3's AES-GCM with AES-NI on x86 servers."""
    return f"{ssl.OPENSSL_VERSION}; ciphers {', '.join(c['name'] for c in context.get_ciphers()[:3])}, ..."


def negotiated(source: PullSource) -> str:
    """The protocol and cipher the publisher and a receiver agree on."""
    from polyrl.tls import client_context

    with client_context(source.ca_file).wrap_socket(
        socket.create_connection((source.host, source.port)), server_hostname=source.host
    ) as sock:
        name, version, bits = sock.cipher()  # type: ignore[misc]
    return f"{version} {name} ({bits}-bit)"


def print_tls_cost(rows: list[dict[str, object]]) -> None:
    """tls / plain for each (size, sender, receiver, streams) measured both ways."""
    plain = {_key(r): r for r in rows if r["link"] == "plain"}
    pairs = [(plain[_key(r)], r) for r in rows if r["link"] == "tls" and _key(r) in plain]
    if not pairs:
        return
    print(
        f"\n{'size':>8} {'sender':>7} {'receiver':>8} {'streams':>7} {'plain GB/s':>11} {'tls GB/s':>9} {'tls/plain':>10}"
    )
    for p, t in pairs:
        ratio = t["pull_Bps"] / p["pull_Bps"]  # type: ignore[operator]
        t["tls_over_plain"] = ratio
        print(
            f"{p['size_gib']:>6.2f}Gi {p['sender']:>7} {p['receiver']:>8} {p['streams']:>7} "
            f"{p['pull_Bps'] / 1e9:>11.2f} {t['pull_Bps'] / 1e9:>9.2f} {ratio:>10.0%}"
        )  # type: ignore[operator]


def _key(row: dict[str, object]) -> tuple[object, ...]:
    return row["size_gib"], row["sender"], row["send_mode"], row["receiver"], row["streams"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--chunk-mib", type=int, default=8)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds per piece size: each round tries every ceiling way once and pulls once with every receiver",
    )
    p.add_argument(
        "--hash-piece-kib",
        type=int,
        default=0,
        help="receive+hash piece size of every receiver (0: its default); set >= chunk to hash whole chunks",
    )
    p.add_argument(
        "--sender",
        nargs="+",
        choices=["process", "thread"],
        default=["process"],
        help="process: the publisher and the raw sender in a child process, as deployed; thread: in this "
        "process, sharing the receiver's GIL (the shape of the earlier figures)",
    )
    p.add_argument(
        "--send-mode",
        nargs="+",
        choices=["sendall", "sendfile"],
        default=[SEND_MODE],
        help="how the publisher process sends chunks: sendall from its mapping, or sendfile from the memfd (default: the product's)",
    )
    p.add_argument(
        "--receiver",
        nargs="+",
        choices=["thread", "worker", "process", "process-inline"],
        default=["thread", "worker"],
        help="thread: one thread per stream in this process; process: a pool of receiver processes "
        "(one per stream, up to the cores) pulling into shared memory, each stream hashing on a second thread; "
        "process-inline: the same, each stream hashing on its receiving thread; worker: the same pool as a "
        "worker runs it (pipelined when the host has two cores per stream: pull_proc.spare_cores_for_checking)",
    )
    p.add_argument(
        "--receive-processes",
        type=int,
        nargs="+",
        default=[0],
        help="receiver processes of the process rows, each value its own row (0: one per stream, up to the "
        "cores, as a worker picks by default)",
    )
    p.add_argument(
        "--ceiling-send",
        nargs="+",
        choices=["sendall", "sendfile"],
        default=["sendall", "sendfile"],
        help="the ways the raw sender tries; the ceiling is the best of them",
    )
    p.add_argument(
        "--ceiling-memory",
        nargs="+",
        choices=["private", "shared"],
        default=["private"],
        help="shared: also measure the ceiling between memfd buffers (the pull/ceiling column stays private)",
    )
    p.add_argument(
        "--links",
        nargs="+",
        choices=["plain", "tls"],
        default=["plain"],
        help="plain TCP and/or TLS on every stream (manager.transfer.tls), same sizes and streams",
    )
    p.add_argument(
        "--codecs", "--delta", dest="codecs", action="store_true", help="also measure the codecs (see above)"
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    if args.hash_piece_kib:
        pull_proc.HASH_PIECE = args.hash_piece_kib * 1024

    tls = None
    if "tls" in args.links:
        import tempfile

        from polyrl.tls import client_context, self_signed

        tls = self_signed(Path(tempfile.mkdtemp(prefix="polyrl-bench-tls-")))
        print(f"TLS: {ssl_summary(client_context(tls['ca']))}")
    rows = []
    print(
        f"{'size':>8} {'link':>5} {'sender':>7} {'send':>8} {'receiver/procs':>17} {'streams':>7} {'ceiling GB/s':>13} {'pull GB/s':>10} {'pull/ceiling':>13} {'median':>8}"
        + (f" {'shm ceil':>10} {'pull/shm':>9}" if "shared" in args.ceiling_memory else "")
    )
    for size_gib in args.sizes_gib:
        total = int(size_gib * 2**30) // 4 * 4
        for where in args.sender:
            for mode in args.send_mode:
                for link in args.links:
                    if link == "tls" and mode == "sendfile":
                        continue  # TLS always sends with sendall
                    with sender(total, args.chunk_mib * 2**20, where, mode, tls if link == "tls" else None) as src:
                        row = {"size_gib": size_gib, "link": link, "sender": where, "send_mode": mode}
                        rows += measure_rows(src, args, row)
                    print(
                        f"  publish (snapshot + checksums) of {size_gib:g} GiB: {src.publish_s:.2f}s ({where}, {link})"
                    )
    print_tls_cost(rows)
    codecs = measure_codecs(args.lr) if args.codecs else {}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, **codecs}, indent=2))


if __name__ == "__main__":
    main()
