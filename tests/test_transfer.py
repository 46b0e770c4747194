"""The weight data plane: bit-exact pulls over several streams, and every way a pull can
go wrong (bad token, unknown version, corrupted chunk, truncated stream, garbage
description, a receiver dying mid-transfer) ending in TransferError with the
publisher still serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from polyrl.config import EngineConfig
from polyrl.engine.engine import Engine
from polyrl.transfer.manifest import flatten, unflatten
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.receive_pool import ReceiverPool
from polyrl.transfer.receiver import describe, pull
from polyrl.transfer.wire import (
    CHUNK_INDEX,
    CHUNKS_END,
    ENCODED_OPS,
    OP_CHUNKS,
    STATUS_OK,
    PullSource,
    TransferError,
    TransferInfo,
    checksum,
    chunk_checksums,
    combined_checksum,
    encode_request,
    read_reply_text,
    read_request,
    recv_exact,
    send_text,
)

CHUNK = 4096


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),  # odd sizes: chunks straddle tensors
        "b.bias": torch.randn(257, generator=g),
        "c.weight": torch.randn(128, 96, generator=g),
    }


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=2) as pub:
        yield pub


def source(pub: WeightPublisher, version: int, worker: str = "w1") -> PullSource:
    return PullSource(*pub.address, worker_id=worker, token=pub.grant(worker, version))


def assert_same(pulled: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert pulled.keys() == sent.keys()
    for name, t in sent.items():
        assert pulled[name].dtype == t.dtype and torch.equal(pulled[name].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("num_streams", [1, 3, 8])
def test_pull_is_bit_exact(publisher: WeightPublisher, num_streams: int) -> None:
    sent = weights()
    info = publisher.publish(sent, 1)
    assert info.num_chunks > 8  # every stream gets several chunks
    got = pull(source(publisher, 1), 1, num_streams=num_streams)
    assert got.manifest.version == 1
    assert_same(unflatten(got.buffer, got.manifest), sent)


def test_a_capped_publisher_sends_no_faster_than_its_cap_all_pulls_together() -> None:
    """`manager.transfer.max_send_gbps`: two raw pulls of 4 streams at once, then a zstd
    one, each bit-exact; the pulls at once took at least their bytes' time at the cap
    (less the first piece, which may go at once), and so did the encoded payload."""
    from polyrl.transfer.pacing import PACE_BYTES

    cap = 4e6  # bytes/s
    g = torch.Generator().manual_seed(0)
    sent = {"w": torch.randn(2**19, generator=g).to(torch.bfloat16), **weights()}  # 1 MiB and the odd sizes
    with WeightPublisher(chunk_bytes=64 * 1024, max_send_gbps=cap * 8 / 1e9) as pub:
        pub.publish(sent, 1)
        got: dict[str, object] = {}
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=lambda w=w: got.update({w: pull(source(pub, 1, w), 1, num_streams=4)}))
            for w in ("a", "b")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        together_s = time.monotonic() - t0
        t0 = time.monotonic()
        packed = pull(source(pub, 1, "c"), 1, codec="zstd")
        zstd_s = time.monotonic() - t0
    for w in ("a", "b"):
        assert_same(unflatten(got[w].buffer, got[w].manifest), sent)  # type: ignore[attr-defined]
    assert_same(unflatten(packed.buffer, packed.manifest), sent)
    total = packed.manifest.total_bytes
    assert together_s >= (2 * total - 64 * 1024) / cap, together_s
    assert packed.codec == "zstd" and packed.wire_bytes > 2 * PACE_BYTES
    assert zstd_s >= (packed.wire_bytes - PACE_BYTES) / cap, zstd_s


def test_two_receivers_at_once_and_a_late_joiner(publisher: WeightPublisher) -> None:
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
    assert publisher.versions == [2, 3]  # keep_versions=2
    results: dict[str, object] = {}

    def run(worker: str) -> None:
        results[worker] = pull(source(publisher, 3, worker), 3, num_streams=4)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for w in ("a", "b"):
        got = results[w]
        assert_same(unflatten(got.buffer, got.manifest), weights(3))  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match=r"version 1 is not held \(held: \[2, 3\]\)"):
        pull(source(publisher, 1), 1)


def test_bad_token_and_token_for_another_version_are_refused(publisher: WeightPublisher) -> None:
    publisher.publish(weights(), 1)
    publisher.publish(weights(), 2)
    host, port = publisher.address
    for token in ("nope", publisher.grant("w1", 2), publisher.grant("w2", 1)):
        with pytest.raises(TransferError, match="bad transfer token"):
            pull(PullSource(host, port, "w1", token), 1)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("flip", "chunk 3 .* failed its checksum"),  # a bit flipped in memory after the checksums were made
        ("twice", "distinct"),  # every chunk intact, but chunk 0 sent twice and chunk 1 never
    ],
)
def test_corrupted_chunk_or_a_bad_deal_is_rejected(mode: str, expected: str) -> None:
    evil = _Evil(weights(), mode)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with pytest.raises(TransferError, match=expected):
            pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "any"), 1, num_streams=2)
    finally:
        evil.shutdown()
        evil.server_close()


def test_receiver_dying_mid_transfer_does_not_hurt_the_publisher(publisher: WeightPublisher) -> None:
    sent = weights()
    publisher.publish(sent, 1)
    for _ in range(3):  # read a little of a stream, then vanish
        with socket.create_connection(publisher.address) as sock:
            sock.sendall(encode_request(OP_CHUNKS, 1, "w1", publisher.grant("w1", 1), 0, 1))
            assert sock.recv(100)
    got = pull(source(publisher, 1), 1, num_streams=4)
    assert_same(unflatten(got.buffer, got.manifest), sent)


class _Evil(socketserver.ThreadingTCPServer):
    """A publisher of v1 = `sent` that describes it truthfully, then misbehaves (`mode`):
    truncate, garbage (description), stall, flip (a bit of chunk 3), twice (chunk 0
    sent twice, chunk 1 never, each intact), or for an encoded op
    a payload with a wrong checksum (`bad-sum`) or well-framed garbage (`bad-payload`)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, sent: dict[str, torch.Tensor], mode: str) -> None:
        self.mode, self.release = mode, threading.Event()
        buffer, manifest = flatten(sent, 1)
        self.view = memoryview(buffer.numpy()).cast("B")
        sums = chunk_checksums(self.view, CHUNK)
        if mode == "flip":
            buffer[3 * CHUNK + 7] ^= 0x10
        self.info = TransferInfo(
            manifest=manifest, chunk_bytes=CHUNK, chunk_checksums=sums, buffer_checksum=combined_checksum(sums)
        )
        super().__init__(("127.0.0.1", 0), _EvilHandler)


class _EvilHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Evil = self.server  # type: ignore[assignment]
        req, sock = read_request(self.request), self.request
        if req.op in ENCODED_OPS:
            payload = b"PRZ1" + bytes(40) if server.mode == "bad-payload" else bytes(server.view)
            good = checksum(payload) if server.mode == "bad-payload" else 12345
            sock.sendall(bytes([STATUS_OK]) + len(payload).to_bytes(8, "big") + good.to_bytes(8, "big") + payload)
        elif req.op != OP_CHUNKS:
            text = server.info.model_dump_json().encode()
            if server.mode == "garbage":
                text = text.replace(b'"total_bytes"', b'"total_bites"')
            send_text(sock, STATUS_OK, text)
        elif server.mode in ("flip", "twice"):  # a fixed share per stream is one way to deal
            sock.sendall(bytes([STATUS_OK]))
            for index in range(req.stream, server.info.num_chunks, req.num_streams):
                sent = 0 if server.mode == "twice" and index == 1 else index  # chunk 0 twice, no chunk 1
                sock.sendall(CHUNK_INDEX.pack(sent) + server.view[slice(*server.info.chunk_range(sent))])
            sock.sendall(CHUNK_INDEX.pack(CHUNKS_END))
        else:
            sock.sendall(bytes([STATUS_OK]))
            start, end = server.info.chunk_range(req.stream)
            sock.sendall(
                CHUNK_INDEX.pack(req.stream) + server.view[start : start + (end - start) // 2]
            )  # half, then hang up
            if server.mode == "stall":  # ... or keep the connection open and send nothing more
                server.release.wait(30)


@pytest.mark.parametrize("mode", ["truncate", "garbage"])
def test_truncated_stream_or_bad_description_is_rejected(mode: str) -> None:
    evil = _Evil(weights(), mode)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        src = PullSource("127.0.0.1", evil.server_address[1], "w1", "any")
        expected = "connection closed after" if mode == "truncate" else "bad description"
        with pytest.raises(TransferError, match=expected):
            pull(src, 1, num_streams=2)
    finally:
        evil.shutdown()
        evil.server_close()


def test_a_publisher_that_stalls_mid_chunk_times_the_pull_out() -> None:
    """The data sockets wait in the kernel (SO_RCVTIMEO, MSG_WAITALL), not in Python's
    poll: a sender that goes quiet half way through a chunk still ends the pull."""
    evil = _Evil(weights(), "stall")
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="TimeoutError"):
            pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "any"), 1, num_streams=2, timeout_s=0.5)
        assert time.monotonic() - start < 10
    finally:
        evil.release.set()
        evil.shutdown()
        evil.server_close()


def small_window(address: tuple[str, int]) -> socket.socket:
    """A connection whose receive buffer stays small (set before connecting, so the
    kernel does not grow it to tens of MB): a sender to it blocks soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(address)
    return sock


def _read_dealt(sock: socket.socket, chunk: int) -> list[int]:
    """The chunk indices one stream of op 2 is dealt, reading it to its end."""
    assert recv_exact(sock, 1) == bytes([STATUS_OK])
    dealt = []
    while (index := CHUNK_INDEX.unpack(recv_exact(sock, 4))[0]) != CHUNKS_END:
        recv_exact(sock, chunk)
        dealt.append(index)
    return dealt


def test_the_publisher_deals_a_pulls_chunks_to_whichever_stream_reads() -> None:
    """Two streams of one pull: the one that reads gets nearly everything, the stalled one
    the little it was dealt before it stopped; together every chunk exactly once. A third
    stream, or one that disagrees on the count, is refused."""
    chunk, n = 2**20, 32  # the stalled stream's kernel buffers hold a few MiB
    with WeightPublisher(chunk_bytes=chunk) as pub:
        pub.publish({"w": torch.randn(n * chunk // 4)}, 1)
        token = pub.grant("w1", 1)
        with small_window(pub.address) as slow, socket.create_connection(pub.address) as fast:
            slow.sendall(encode_request(OP_CHUNKS, 1, "w1", token, 1, 2, base=42))
            time.sleep(0.5)  # its first chunk is dealt and fills its window
            fast.sendall(encode_request(OP_CHUNKS, 1, "w1", token, 0, 2, base=42))
            fast_got = _read_dealt(fast, chunk)
            slow_got = _read_dealt(slow, chunk)
        assert sorted(fast_got + slow_got) == list(range(n))
        assert len(fast_got) >= 3 * n // 4, (fast_got, slow_got)
        for counts in ((3, 2), (2, 2, 2)):  # streams that disagree on their number; one too many
            opened = [small_window(pub.address) for _ in counts]
            try:
                for i, (sock, num) in enumerate(zip(opened, counts)):
                    sock.sendall(encode_request(OP_CHUNKS, 1, "w1", token, min(i, num - 1), num, base=len(counts)))
                    # its OK comes once it has joined: only then does the next ask, so the last one is
                    # the one refused (a sleep here let a starved publisher take them out of order)
                    if sock is not opened[-1]:
                        assert recv_exact(sock, 1) == bytes([STATUS_OK])
                status, text = read_reply_text(opened[-1])
                assert status != STATUS_OK and b"does not fit" in text
            finally:
                for sock in opened:
                    sock.close()


def test_a_request_in_another_wire_version_is_refused_saying_so(publisher: WeightPublisher) -> None:
    publisher.publish(weights(), 1)
    with socket.create_connection(publisher.address) as sock:
        sock.sendall(b"PRLW2\n" + encode_request(OP_CHUNKS, 1, "w1", publisher.grant("w1", 1))[len(b"PRLW2\n") :])
        status, text = read_reply_text(sock)
    assert status != STATUS_OK and b"PRLW2" in text and b"upgrade" in text


def _peer_tcp_state(sock: socket.socket) -> str | None:
    """The TCP state (/proc/net/tcp's hex code: 01 established, 04 FIN_WAIT1 once closed)
    of the other end of `sock`'s loopback connection, read off the kernel's table: the
    other end's close shows there while the data before its FIN still waits for us."""

    def hex_address(address: tuple[str, int]) -> str:
        return "%08X:%04X" % (struct.unpack("=I", socket.inet_aton(address[0]))[0], address[1])

    theirs, ours = hex_address(sock.getpeername()), hex_address(sock.getsockname())
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:  # sl local_address rem_address st ...
            fields = line.split()
            if fields[1] == theirs and fields[2] == ours:
                return fields[3]
    return None


def test_publisher_gives_up_on_a_receiver_that_stops_reading() -> None:
    """A receiver that asks for chunks and never reads them costs the publisher one thread
    for about its io timeout (the kernel's send timeout), not forever: it hangs up."""
    sent = {"w": torch.randn(16 * 2**20 // 4)}  # 16 MiB: far more than loopback's socket buffers hold
    with WeightPublisher(chunk_bytes=2**20, io_timeout_s=0.5) as pub:
        pub.publish(sent, 1)
        with small_window(pub.address) as sock:
            assert _peer_tcp_state(sock) == "01"  # the publisher's end, established
            sock.sendall(encode_request(OP_CHUNKS, 1, "w1", pub.grant("w1", 1), 0, 1))
            # read nothing until the publisher hangs up, which takes about 2 s on an idle box
            # (the kernel lets a little more in now and then, and each send's timeout starts
            # over): a fixed 3 s sleep left 1 s for a starved publisher to begin, and past it
            # we read the whole version. 20 s: still short of the default io timeout (30 s).
            _wait_for(lambda: _peer_tcp_state(sock) != "01", 20, "the publisher to hang up")
            sock.settimeout(10)
            received = 0
            while data := sock.recv(2**20):  # what was in flight, then the publisher's hang-up
                received += len(data)
            assert received < 16 * 2**20
        assert pub.bytes_sent < 16 * 2**20
        got = pull(PullSource(*pub.address, "w2", pub.grant("w2", 1)), 1, num_streams=2)
        assert torch.equal(unflatten(got.buffer, got.manifest)["w"], sent["w"])


def test_publisher_groups_each_serve_every_version() -> None:
    """Two groups (the seeds' sender groups): two listeners, the same versions, and a
    worker pulls whole from either one."""
    sent = weights()
    with pytest.raises(ValueError, match="group_hosts"):
        WeightPublisher(num_groups=2, group_hosts=["127.0.0.1"])
    with WeightPublisher(chunk_bytes=CHUNK, num_groups=2, group_hosts=["127.0.0.1", "127.0.0.1"]) as pub:
        assert len(pub.addresses) == 2 and pub.addresses[0] != pub.addresses[1] and pub.address == pub.addresses[0]
        pub.publish(sent, 1)
        for g, (host, port) in enumerate(pub.addresses):
            got = pull(PullSource(host, port, f"w{g}", pub.grant(f"w{g}", 1)), 1, num_streams=3)
            assert_same(unflatten(got.buffer, got.manifest), sent)
        wait_for_count(lambda: pub.bytes_sent, 2 * got.manifest.total_bytes)


def test_unreachable_publisher_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="cannot reach the publisher"):
        describe(PullSource("127.0.0.1", port, "w", "t"), 1, timeout_s=2)


def test_pulled_weights_load_into_an_engine(tiny_model_dir, publisher: WeightPublisher) -> None:
    target = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=2))
    new = {k: torch.randn_like(p) for k, p in target.model.named_parameters()}  # tied weights once
    publisher.publish(new, 5)
    got = pull(source(publisher, 5), 5, num_streams=4)
    target.update_weights(unflatten(got.buffer, got.manifest), 5)
    assert target.weight_version == 5
    for name, param in target.model.named_parameters():
        assert torch.equal(param, new[name].to(param.dtype))


# ------------------------------------------------------------------------------------ delta


def small_step(w: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy where `fraction` of the entries moved (the rest bit-identical)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in w.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(mask, (t.float() + 0.5).to(t.dtype), t)
    return out


def test_delta_codec_round_trip_and_refuses_garbage() -> None:
    from polyrl.transfer.delta import apply_delta, encode_delta
    from polyrl.transfer.manifest import flatten

    old, _ = flatten(weights(), 1)
    new, _ = flatten(small_step(weights(), 0.05), 2)
    payload = encode_delta(old.numpy(), new.numpy())
    assert len(payload) < 0.2 * new.numel()
    out = torch.empty_like(new)
    changed = apply_delta(old.numpy(), payload, out.numpy())
    assert torch.equal(out, new) and 0 < changed < new.numel() // 2 // 10
    same = encode_delta(old.numpy(), old.numpy())
    apply_delta(old.numpy(), same, out.numpy())
    assert torch.equal(out, old)
    for bad in (payload[:10], payload[:-3], payload[:40] + bytes(len(payload) - 40)):
        with pytest.raises(ValueError):
            apply_delta(old.numpy(), bad, out.numpy())
    with pytest.raises(ValueError, match="does not fit"):
        apply_delta(old[:-64].numpy(), payload, out[:-64].numpy())


def test_delta_codec_reads_format_1() -> None:
    """Format 1 (new values as they are) from an older publisher still applies exactly."""
    import struct

    import numpy as np
    import zstandard

    from polyrl.transfer.delta import apply_delta
    from polyrl.transfer.manifest import flatten

    old, _ = flatten(weights(), 1)
    new, _ = flatten(small_step(weights(), 0.05), 2)
    b16, n16 = old.numpy().view(np.uint16), new.numpy().view(np.uint16)
    positions = np.flatnonzero(b16 != n16)
    gaps = zstandard.ZstdCompressor().compress(np.diff(positions, prepend=0).astype(np.uint32).tobytes())
    values = zstandard.ZstdCompressor().compress(n16[positions].tobytes())
    payload = struct.pack("!4sQQQQ", b"PRD1", b16.size, positions.size, len(gaps), len(values)) + gaps + values
    out = torch.empty_like(new)
    assert apply_delta(old.numpy(), payload, out.numpy()) == positions.size
    assert torch.equal(out, new)


def test_delta_pull_is_bit_exact_and_small(publisher: WeightPublisher) -> None:
    v1, v2 = weights(), small_step(weights(), 0.02)
    publisher.publish(v1, 1)
    publisher.publish(v2, 2)
    held = pull(source(publisher, 1), 1)
    got = pull(source(publisher, 2), 2, base=(1, held.buffer))
    assert got.codec == "delta" and got.wire_bytes < 0.2 * got.manifest.total_bytes
    assert_same(unflatten(got.buffer, got.manifest), v2)
    assert_same(unflatten(held.buffer, held.manifest), v1)  # the base is left intact


def test_delta_falls_back_to_raw_and_catches_a_wrong_base(publisher: WeightPublisher) -> None:
    for v in (1, 2, 3):
        publisher.publish(small_step(weights(), 0.02, seed=v), v)
    stale = pull(source(publisher, 2), 2).buffer
    got = pull(source(publisher, 3), 3, base=(1, stale.clone()))  # v1 is no longer held: raw
    assert got.codec == "raw"
    assert_same(unflatten(got.buffer, got.manifest), small_step(weights(), 0.02, seed=3))
    wrong = stale.clone()
    wrong[100] ^= 1  # the receiver's copy of v2 is not exactly v2 (e.g. a restarted trainer's v2)
    got = pull(source(publisher, 3), 3, base=(2, wrong))
    assert got.codec == "raw"  # the delta gave a wrong chunk 0: pulled whole instead
    assert_same(unflatten(got.buffer, got.manifest), small_step(weights(), 0.02, seed=3))


def test_zstd_pull_is_bit_exact_and_smaller_than_raw(publisher: WeightPublisher) -> None:
    sent = {name: (t * 0.02).to(torch.bfloat16) for name, t in weights().items()}  # weight-like values
    publisher.publish(sent, 1)
    got = pull(source(publisher, 1), 1, codec="zstd")
    assert got.codec == "zstd" and not got.lossy and got.wire_bytes < 0.8 * got.manifest.total_bytes
    assert_same(unflatten(got.buffer, got.manifest), sent)
    # No base held by the publisher any more: the delta falls back to the whole-version codec.
    got = pull(source(publisher, 1), 1, base=(0, got.buffer.clone()), codec="zstd")
    assert got.codec == "zstd"


def test_int8_pull_is_marked_lossy_and_off_by_at_most_half_a_step(publisher: WeightPublisher) -> None:
    sent = weights()
    publisher.publish(sent, 1)
    got = pull(source(publisher, 1), 1, codec="int8")
    assert got.codec == "int8" and got.lossy and got.wire_bytes < 0.5 * got.manifest.total_bytes
    out = unflatten(got.buffer, got.manifest)
    for name, t in sent.items():
        assert out[name].dtype == t.dtype
        if t.dim() != 2:
            assert torch.equal(out[name], t)  # biases and norms travel as they are
            continue
        ref = t.float()
        step = ref.abs().amax(dim=1, keepdim=True) / 127
        err = (out[name].float() - ref).abs()
        assert (err <= step / 2 * 1.01 + ref.abs() * 2**-8).all()  # half a step, plus the dtype's own rounding
        assert not torch.equal(out[name], t)  # and it is lossy


@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_corrupted_or_undecodable_payloads_are_rejected(codec: str) -> None:
    for mode, error in (("bad-sum", f"{codec} payload failed its checksum"), ("bad-payload", f"bad {codec} payload")):
        evil = _Evil(weights(), mode)  # bytes changed on the way; well-framed garbage
        threading.Thread(target=evil.serve_forever, daemon=True).start()
        try:
            with pytest.raises(TransferError, match=error):
                pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "any"), 1, codec=codec)
        finally:
            evil.shutdown()
            evil.server_close()


def test_auto_codec_encodes_only_after_a_slow_raw_pull() -> None:
    from polyrl.worker.weight_sync import SLOW_BELOW_BYTES_PER_S, WeightReceiver

    receiver = WeightReceiver(engine=None)  # type: ignore[arg-type]
    assert receiver._plan("auto") == (False, "raw")  # nothing measured yet
    receiver._raw_bytes_per_s = SLOW_BELOW_BYTES_PER_S * 4
    assert receiver._plan("auto") == (False, "raw")
    receiver._raw_bytes_per_s = SLOW_BELOW_BYTES_PER_S / 4
    assert receiver._plan("auto") == (True, "zstd")  # a delta when it holds a base, else zstd
    assert receiver._plan("delta") == (True, "raw") and receiver._plan("int8") == (False, "int8")


def _weight_slots(name: str = "polyrl-weights") -> int:
    """Shared-memory buffers (memfds) called `name`* this process holds."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(name in link for link in links)


def test_a_dropped_version_is_served_to_its_reader_and_its_slot_reused_after() -> None:
    """Snapshots land in the slot of a dropped version (no new shared memory per version),
    but never in one a pull is still reading: that pull gets the version it asked for."""
    chunk, size, before = 2**20, 16 * 2**20, _weight_slots()  # more than the socket buffers hold

    def version(v: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((size // 4,), float(v))}

    with WeightPublisher(keep_versions=1, chunk_bytes=chunk) as pub:
        for v in (1, 2, 3):
            pub.publish(version(v), v)
        assert _weight_slots() - before == 2  # v3 went into v1's slot
        with small_window(pub.address) as sock:  # a slow pull of v3 ...
            sock.sendall(encode_request(OP_CHUNKS, 3, "w1", pub.grant("w1", 3), 0, 1))
            assert recv_exact(sock, 1) == bytes([STATUS_OK])
            got = bytearray(size)
            assert CHUNK_INDEX.unpack(recv_exact(sock, 4)) == (0,)  # one stream: dealt every chunk, in order
            got[:4096] = recv_exact(sock, 4096)
            for v in (4, 5, 6):  # ... while v3 is dropped and newer versions come
                pub.publish(version(v), v)
            got[4096:chunk] = recv_exact(sock, chunk - 4096)
            for index in range(1, size // chunk):
                assert CHUNK_INDEX.unpack(recv_exact(sock, 4)) == (index,)
                got[index * chunk : (index + 1) * chunk] = recv_exact(sock, chunk)
            assert CHUNK_INDEX.unpack(recv_exact(sock, 4)) == (CHUNKS_END,)
        assert torch.equal(torch.frombuffer(got, dtype=torch.float32), version(3)["w"])
        assert _weight_slots() - before == 3  # v3's slot was kept while read
        # the publisher process frees it once it sees the close (sendfile: the pages were
        # in the socket's queue until then), and tells this side
        _wait_for(lambda: len(pub._free) == 2, 5, "v3's slot and v5's to come free")
        for v in (7, 8, 9):
            pub.publish(version(v), v)
        assert _weight_slots() - before == 3  # and reused once free
    assert _weight_slots() == before


# ------------------------------------------------------------------------ the publisher process


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie (not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _wait_for(condition, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_publisher_process_killed_is_restarted_on_the_same_port_with_its_versions() -> None:
    """kill -9 of the process that serves pulls: the trainer's side notices, starts another
    on the same listening socket and announces the versions it holds; pulls work again,
    bit-exact, without the trainer doing anything."""
    before = _weight_slots()
    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=2) as pub:
        for v in (1, 2):
            pub.publish(weights(v), v)
        first = pub.pid
        assert first is not None
        os.kill(first, 9)
        start = time.monotonic()
        while True:
            try:
                got = pull(source(pub, 2), 2, num_streams=3, timeout_s=5)
                break
            except TransferError:
                assert time.monotonic() - start < 30, "no pull worked within 30 s of the kill"
                time.sleep(0.1)
        assert_same(unflatten(got.buffer, got.manifest), weights(2))
        assert pub.pid != first and pub.restarts == 1 and pub.versions == [1, 2]
        assert pub.last_recovery_s is not None and pub.last_recovery_s < 30
        pub.publish(weights(3), 3)  # and publishing goes on
        got = pull(source(pub, 3), 3, num_streams=2)
        assert_same(unflatten(got.buffer, got.manifest), weights(3))
        second = pub.pid
    assert second is not None and not _alive(second) and not _alive(first)
    assert _weight_slots() == before  # no shared memory left mapped


_TRAINER = """
import sys, time, torch
from polyrl.transfer.publisher import WeightPublisher
pub = WeightPublisher().start()
pub.publish({"w": torch.ones(1024)}, 1)
print(pub.pid, flush=True)
time.sleep(60)
"""


def wait_for_count(count, expected: int, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """The publisher process counts a chunk once its send returns, which may come after
    the receiver already has it: wait for the count, then require it exact."""
    deadline = time.monotonic() + timeout_s
    while count() < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert count() == expected


def test_sendfile_serves_the_same_bytes() -> None:
    """The publisher process's other way to send chunks: from the memfd, by the kernel."""
    with pytest.raises(ValueError, match="send_mode"):
        WeightPublisher(send_mode="splice")
    with WeightPublisher(chunk_bytes=CHUNK, send_mode="sendfile") as pub:
        pub.publish(weights(), 1)
        got = pull(source(pub, 1), 1, num_streams=3)
        assert_same(unflatten(got.buffer, got.manifest), weights())
        wait_for_count(lambda: pub.bytes_sent, got.manifest.total_bytes)


def test_sendall_without_tls_serves_the_same_bytes_and_waits_for_no_receiver() -> None:
    """The other way to send chunks, `manager.transfer.send_mode="sendall"`, which otherwise
    runs only under TLS: bit-exact over several streams. Its chunks are copies in the socket,
    so a stream ends at CHUNKS_END and the publisher closes it without waiting for the
    receiver, where sendfile's must wait for the receiver to close (the test below): the
    publisher closing first shows the sendall path served the stream."""
    with WeightPublisher(chunk_bytes=CHUNK, send_mode="sendall") as pub:
        pub.publish(weights(), 1)
        got = pull(source(pub, 1), 1, num_streams=4)
        assert_same(unflatten(got.buffer, got.manifest), weights())
        wait_for_count(lambda: pub.bytes_sent, got.manifest.total_bytes)
        stream = b""
        with socket.create_connection(pub.address, timeout=3) as sock:
            sock.sendall(encode_request(OP_CHUNKS, 1, "w2", pub.grant("w2", 1), 0, 1))
            try:
                while data := sock.recv(65536):  # to the publisher's close: we never close first
                    stream += data
            except TimeoutError:
                pytest.fail(f"the publisher waited for our close after {len(stream)} bytes, as sendfile does")
        total, num_chunks = got.manifest.total_bytes, -(-got.manifest.total_bytes // CHUNK)
        assert len(stream) == 1 + total + CHUNK_INDEX.size * (num_chunks + 1)  # status, then each chunk after its index
        assert stream.startswith(bytes([STATUS_OK])) and stream.endswith(CHUNK_INDEX.pack(CHUNKS_END))
        wait_for_count(lambda: pub.bytes_sent, 2 * total)


def test_sendfile_keeps_the_version_until_the_receiver_has_closed() -> None:
    """With sendfile the socket's queue still holds the slot's pages when the last call
    returns: the version's slot must not be rewritten until the receiver has everything
    (it closes), even once newer versions have dropped the version."""
    with WeightPublisher(keep_versions=1, chunk_bytes=CHUNK, send_mode="sendfile") as pub:
        pub.publish({"w": torch.ones(CHUNK)}, 1)  # 4 whole chunks
        slot = pub._held[1]
        with socket.create_connection(pub.address) as sock:
            sock.sendall(encode_request(OP_CHUNKS, 1, "w1", pub.grant("w1", 1), 0, 1))
            assert sorted(_read_dealt(sock, CHUNK)) == [0, 1, 2, 3]  # every chunk, then CHUNKS_END
            pub.publish({"w": torch.zeros(CHUNK)}, 2)  # drops v1, whose pull has not closed yet
            time.sleep(0.5)
            assert slot not in pub._free
        _wait_for(lambda: slot in pub._free, 5, "v1's slot to come free once its receiver closed")


def _memfds(pids: list[int] | None = None) -> dict[tuple[str, int, int], set[int]]:
    """polyrl's shared memory (memfds named polyrl-*: `transfer/shm.py`, the publisher's stats
    page) that `pids` hold (default: every process we may look at), through an open fd or a
    mapping: either keeps a memfd alive. (name, device, inode) -> the pids holding it; the
    inode tells one run's buffers from another's of the same name."""
    held: dict[tuple[str, int, int], set[int]] = {}
    for pid in pids if pids is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to look at
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("/memfd:polyrl"):
                        stat = os.stat(f"/proc/{pid}/fd/{fd}")
                        held.setdefault((link.split()[0][7:], stat.st_dev, stat.st_ino), set()).add(pid)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:  # address perms offset major:minor inode path
                    fields = line.split()
                    if len(fields) >= 6 and fields[5].startswith("/memfd:polyrl"):
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        held.setdefault((fields[5][7:], os.makedev(major, minor), int(fields[4])), set()).add(pid)
    return held


def test_publisher_process_dies_with_the_trainer() -> None:
    """kill -9 of the trainer: the publisher process goes too (PR_SET_PDEATHSIG), leaving
    no process and no shared memory (memfds die with their last holder, so none of the
    trainer's may be held by any process after)."""
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), line
        child = int(line)
        assert _alive(child)
        held = set(_memfds([trainer.pid]))
        assert {name for name, _, _ in held} == {"polyrl-publisher-stats", "polyrl-weights-1"}, held
        assert held <= set(_memfds([child]))  # the publisher process has them too: the scan sees another's
        trainer.kill()
        trainer.wait(10)
        _wait_for(lambda: not held & set(_memfds()), 10, "no process to hold the dead trainer's memfds")
        _wait_for(lambda: not _alive(child), 10, "the publisher process to die with its trainer")
    finally:
        trainer.kill()
        trainer.wait(10)
        if child is not None and _alive(child):  # it outlived the trainer (the test failed): not left behind
            os.kill(child, 9)


_RECEIVER = """
import sys
from polyrl.transfer.receiver import pull
from polyrl.transfer.wire import PullSource
pull(PullSource("127.0.0.1", int(sys.argv[1]), "dying", sys.argv[2]), 1, num_streams=4)
"""


def test_a_receiver_killed_mid_pull_does_not_disturb_other_pulls() -> None:
    sent = {"w": torch.randn(32 * 2**20 // 4)}
    with WeightPublisher(chunk_bytes=2**20) as pub:
        pub.publish(sent, 1)
        pid = pub.pid
        dying = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(pub.address[1]), pub.grant("dying", 1)])
        try:
            _wait_for(lambda: pub.bytes_sent > 0, 30, "the dying receiver to start pulling")
        finally:
            dying.kill()
            dying.wait(10)
        got = pull(source(pub, 1), 1, num_streams=3)
        assert torch.equal(unflatten(got.buffer, got.manifest)["w"], sent["w"])
        assert pub.pid == pid and pub.restarts == 0


# ------------------------------------------------------------------------ receiver processes


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReceiverPool]:
    import polyrl.transfer.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "MIN_POOL_BYTES", 0)  # small versions too, here
    pool = ReceiverPool(2)
    yield pool
    pool.close()


def test_receiver_processes_pull_bit_exact_into_shared_memory(publisher: WeightPublisher, pool: ReceiverPool) -> None:
    before = _weight_slots("polyrl-landing")
    for v in (1, 2):
        publisher.publish(weights(v), v)
    landing = pool.landing(publisher.publish(weights(3), 3).manifest.total_bytes, pin=False)
    for version, streams in ((2, 1), (3, 5)):  # 5 streams over 2 processes
        got = pull(source(publisher, version), version, num_streams=streams, into=landing.tensor, pool=pool)
        assert got.buffer.data_ptr() == landing.tensor.data_ptr()  # landed in the shared buffer
        assert_same(unflatten(got.buffer, got.manifest), weights(version))
    assert len(pool.pids) == 2
    with pytest.raises(TransferError, match="bad transfer token"):
        pull(PullSource(*publisher.address, "w1", "nope"), 3, num_streams=3, into=landing.tensor, pool=pool)
    pids = pool.pids
    pool.close()
    assert not any(_alive(pid) for pid in pids) and _weight_slots("polyrl-landing") == before


def test_a_receiver_process_killed_mid_pull_fails_that_pull_only(
    publisher: WeightPublisher, pool: ReceiverPool
) -> None:
    """A pull whose receiver process dies ends in TransferError (not a hang); the next
    pull gets a new process and is bit-exact."""
    evil = _Evil(weights(), "stall")  # half a chunk per stream, then silence: the pull is stuck mid-way
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    landing = pool.landing(publisher.publish(weights(), 1).manifest.total_bytes, pin=False)
    outcome: list[BaseException] = []

    def stuck_pull() -> None:
        try:
            pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "any"), 1, 2, 20, into=landing.tensor, pool=pool)
        except BaseException as e:  # noqa: BLE001 (checked below)
            outcome.append(e)

    try:
        puller = threading.Thread(target=stuck_pull)
        puller.start()
        _wait_for(lambda: len(pool.pids) == 2, 30, "both receiver processes")
        time.sleep(0.5)  # both are blocked mid-chunk
        victim = pool.pids[0]
        os.kill(victim, 9)
        puller.join(15)
        assert not puller.is_alive() and isinstance(outcome[0], TransferError) and "died" in str(outcome[0])
    finally:
        evil.release.set()
        evil.shutdown()
        evil.server_close()
    got = pull(source(publisher, 1), 1, num_streams=2, into=landing.tensor, pool=pool)
    assert_same(unflatten(got.buffer, got.manifest), weights())
    assert victim not in pool.pids


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_receiver_processes_reject_a_corrupted_or_cut_stream(
    mode: str, pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import polyrl.transfer.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "MIN_POOL_BYTES", 0)
    evil = _Evil(weights(), mode)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    pool = ReceiverPool(2, pipelined=pipelined)
    try:
        landing = pool.landing(evil.info.manifest.total_bytes, pin=False)
        expected = r"chunk 3 \(bytes 12288-16384\) failed its checksum" if mode == "flip" else "connection closed after"
        with pytest.raises(TransferError, match=expected):
            pull(PullSource("127.0.0.1", evil.server_address[1], "w1", "any"), 1, 2, 10, into=landing.tensor, pool=pool)
    finally:
        pool.close()
        evil.shutdown()
        evil.server_close()


@pytest.mark.parametrize("bad_byte", [None, 4 * 1000 + 3 * 64 + 5])
@pytest.mark.parametrize("pipelined", [True, False])
def test_a_stream_checks_every_piece_of_the_chunks_it_is_dealt(bad_byte: int | None, pipelined: bool) -> None:
    """Chunks of many pieces (the last one short), dealt out of order: each is checked
    over exactly its bytes, and a bad one stops the stream."""
    from polyrl.transfer import pull_proc

    data = bytearray(os.urandom(10_000))
    chunks = pull_proc.Chunks(1000, 10_000, [checksum(bytes(data[i : i + 1000])) for i in range(0, 10_000, 1000)])
    order = [7, 0, 4, 9, 2]  # this stream's deal
    if bad_byte is not None:
        data[bad_byte] ^= 0x01
    wire = b"".join(CHUNK_INDEX.pack(i) + data[i * 1000 : (i + 1) * 1000] for i in order) + CHUNK_INDEX.pack(CHUNKS_END)
    ours, theirs = socket.socketpair()
    sender = threading.Thread(target=lambda: (theirs.sendall(wire), theirs.close()), daemon=True)
    sender.start()
    got = bytearray(len(data))
    receive = pull_proc._receive_pipelined if pipelined else pull_proc._receive_inline
    try:
        if bad_byte is None:
            assert receive(ours, chunks, memoryview(got), 64) == order
            assert all(got[i * 1000 : (i + 1) * 1000] == data[i * 1000 : (i + 1) * 1000] for i in order)
        else:
            with pytest.raises(pull_proc.PullFailed, match=r"chunk 4 \(bytes 4000-5000\) failed its checksum"):
                receive(ours, chunks, memoryview(got), 64)
    finally:
        ours.close()
        sender.join(10)


class _Engine:
    """What WeightReceiver needs of an AsyncEngine: a version, a device, update_weights."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(weight_version=0, device=torch.device("cpu"))
        self.loaded: dict[str, torch.Tensor] = {}

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int, policy: str | None = None) -> None:
        self.loaded = {k: t.clone() for k, t in tensors.items()}
        self.engine.weight_version = version


def test_worker_lands_large_versions_in_two_shared_buffers_taking_turns(
    publisher: WeightPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    import polyrl.transfer.receiver as receiver_module
    import polyrl.worker.weight_sync as weight_sync_module
    from polyrl.worker.weight_sync import WeightReceiver

    for module in (receiver_module, weight_sync_module):
        monkeypatch.setattr(module, "MIN_POOL_BYTES", 0)  # "large" here: anything
    before = _weight_slots("polyrl-landing")
    engine = _Engine()
    receiver = WeightReceiver(engine, receive_processes=2)  # type: ignore[arg-type]
    landed = []
    try:
        for v in (1, 2, 3, 4):
            publisher.publish(weights(v), v)
            pulled = asyncio.run(receiver.sync(source(publisher, v), v, 3, 10.0, "raw"))
            assert pulled is not None and pulled.codec == "raw"
            assert_same(engine.loaded, weights(v))
            landed.append(pulled.buffer.data_ptr())
        assert len(set(landed)) == 2 and landed[0] == landed[2] and landed[1] == landed[3]  # double-buffered
        assert _weight_slots("polyrl-landing") - before == 2
    finally:
        receiver.close()
    assert _weight_slots("polyrl-landing") == before
