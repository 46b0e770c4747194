"""Encrypted links and bounded connections: `polyrl train` through a TLS manager and TLS
workers with a self-signed CA (weights pulled over TLS too: nothing but TLS records on
the wire), clients without the CA refused; the weight data plane over TLS bit-exact, a
plaintext receiver refused; and slow-drip clients closed on time while the number of
open connections stays bounded."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_e2e import QUICK, _check_every_step
from test_manager import TOKEN, fast_cfg
from test_train import _metrics
from test_transfer import CHUNK, assert_same, pool, weights  # noqa: F401 - a fixture

import polyrl.launch.supervisor
from polyrl.config import HttpLimitsConfig, TlsConfig, load_config
from polyrl.manager.main import ManagerThread
from polyrl.protocol.manager_api import PublisherEndpoint
from polyrl.status import StatusError, fetch
from polyrl.tls import http_client
from polyrl.trainer.loop import train
from polyrl.transfer.manifest import unflatten
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.receive_pool import ReceiverPool
from polyrl.transfer.receiver import pull
from polyrl.transfer.wire import PullSource, TransferError


class _Tap(socketserver.ThreadingTCPServer):
    """A relay between the workers and the weight publisher (a NAT or port forward would
    sit there) that keeps what the publisher sent on each connection: the bytes on the wire,
    as an eavesdropper on the link reads them."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Relay)
        self.upstream, self.port = upstream, self.server_address[1]
        self.sent: list[bytes] = []
        """Per connection, every byte the publisher sent, once it closed."""
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self.serve_forever, args=(0.1,), name="tls-tap", daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        for sock in self.sockets:  # unblocks a relay still reading, so server_close's join returns
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.server_close()


class _Relay(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        tap: _Tap = self.server  # type: ignore[assignment]
        with socket.create_connection(tap.upstream, timeout=30) as upstream:
            tap.sockets += [self.request, upstream]
            to_publisher = threading.Thread(target=_pump, args=(self.request, upstream, bytearray()))
            to_publisher.start()
            tap.sent.append(_pump(upstream, self.request, bytearray()))
            to_publisher.join()


def _pump(src: socket.socket, dst: socket.socket, kept: bytearray) -> bytes:
    """Forward until `src` ends, keeping what passed; then end that way of `dst` too."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            kept += data
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
    return bytes(kept)


def _tls_records(stream: bytes) -> list[tuple[int, int]]:
    """(content type, length) of the TLS records `stream` is made of, end to end (the last
    may be cut short: a pull the run's end cut off); fails at the first byte that is not a
    record header (plaintext: a status byte, JSON, weights)."""
    records, i = [], 0
    while i < len(stream):
        head = stream[i : i + 5]
        # handshake 0x16, application data 0x17, alert 0x15, change cipher spec 0x14; version 3.1-3.4
        assert head[0] in (0x14, 0x15, 0x16, 0x17) and head[1:2] in (b"", b"\x03") and head[2:3] <= b"\x04", (
            f"not a TLS record at byte {i} of {len(stream)}: {stream[i : i + 16]!r}"
        )
        length = int.from_bytes(head[3:], "big")
        assert length <= 2**14 + 2048, f"a TLS record of {length} bytes at byte {i}"
        records.append((head[0], length))
        i += 5 + length
    return records


@pytest.mark.slow
def test_train_through_a_tls_manager_and_workers(
    tmp_path: Path, tls_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manager, local worker and a launched worker serve HTTPS with a certificate of our
    own CA; the trainer and the workers verify it; weights travel over TLS: every byte the
    publisher sends is inside a TLS record (a relay between it and the workers reads the
    wire). A client without the CA is refused, and plain HTTP on the HTTPS port gets nothing."""
    run_dir = tmp_path / "run"
    tls = [f'manager.tls.{k}_file="{tls_files[v]}"' for k, v in (("cert", "cert"), ("key", "key"), ("ca", "ca"))]
    overrides = [
        *QUICK,
        "trainer.total_steps=2",
        "fleet.num_workers=1",
        "manager.transfer.tls=true",
        f'manager.token="{TOKEN}"',
        *tls,
    ]
    seen: dict[str, object] = {}
    taps: list[_Tap] = []

    def through_a_tap(**fields: object) -> PublisherEndpoint:
        """The trainer's endpoint, its one group's address replaced by a relay's: the
        manager sends every worker there, so every pull crosses the tap."""
        (publisher,) = fields["groups"]  # type: ignore[misc]
        taps.append(_Tap(tuple(publisher)))
        return PublisherEndpoint(**{**fields, "groups": [("127.0.0.1", taps[-1].port)]})  # type: ignore[arg-type]

    monkeypatch.setattr(polyrl.launch.supervisor, "PublisherEndpoint", through_a_tap)

    def on_step_end(step: int, metrics: dict[str, float]) -> None:
        if step != 1:
            return
        info = json.loads((run_dir / "manager.json").read_text())
        url = seen["url"] = info["url"]
        assert info["ca_file"] == tls_files["ca"]
        seen["fleet"] = fetch(url, TOKEN, ca_file=tls_files["ca"])  # `polyrl status --ca-file`
        with pytest.raises(StatusError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch(url, TOKEN)  # the system's trust store does not know our CA
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url.replace('https://', 'http://')}/health")

    try:
        train(load_config(None, overrides), run_dir, on_step_end=on_step_end)
    finally:
        for tap in taps:
            tap.close()
    rows = _metrics(run_dir)
    _check_every_step(rows)
    assert [r["rollout/local_samples"] for r in rows] == [0, 0]  # the launched worker served every sample
    assert str(seen["url"]).startswith("https://127.0.0.1:")
    assert {w.worker_id for w in seen["fleet"].workers} >= {"w0", "local"}  # type: ignore[attr-defined]
    worker_log = (run_dir / "workers" / "w0.log").read_text()
    assert "serving on https://" in worker_log
    pulled = re.search(r"pulled v1(?: as \S+)?(?: from \S+)?: ([\d.]+) MB", worker_log)
    assert pulled, worker_log
    # the weights: every connection to the publisher opens with its handshake (0x16) and
    # carries only TLS records, no plaintext manifest; they hold at least w0's v1
    (tap,) = taps
    assert tap.sent
    records = [_tls_records(stream) for stream in tap.sent]
    assert all(r[0][0] == 0x16 for r in records), [stream[:16] for stream in tap.sent]
    assert not [stream for stream in tap.sent if b'"tensors"' in stream or b'"dtype"' in stream]
    encrypted = sum(length for r in records for kind, length in r if kind == 0x17)
    assert encrypted >= float(pulled[1]) * 1e6 * 0.95, (encrypted, pulled[0])


@pytest.fixture
def tls_publisher(tls_files: dict[str, str]) -> Iterator[WeightPublisher]:
    with WeightPublisher(chunk_bytes=CHUNK, tls=(tls_files["cert"], tls_files["key"])) as pub:
        yield pub


def test_weight_pulls_over_tls_are_bit_exact_and_plaintext_is_refused(
    tls_publisher: WeightPublisher,
    tls_files: dict[str, str],
    pool: ReceiverPool,  # noqa: F811
) -> None:
    sent = weights(7)
    tls_publisher.publish(sent, 1)
    host, port = tls_publisher.address
    ok = PullSource(host, port, "w1", tls_publisher.grant("w1", 1), tls=True, ca_file=tls_files["ca"])
    for streams in (1, 4):
        got = pull(ok, 1, num_streams=streams)  # threads of this process
        assert_same(unflatten(got.buffer, got.manifest), sent)
    landing = pool.landing(got.manifest.total_bytes, pin=False)
    got = pull(ok, 1, num_streams=3, into=landing.tensor, pool=pool)  # receiver processes
    assert got.buffer.data_ptr() == landing.tensor.data_ptr()
    assert_same(unflatten(got.buffer, got.manifest), sent)
    t0 = time.monotonic()
    with pytest.raises(TransferError):  # plaintext against TLS: the handshake fails, the pull ends at once
        pull(PullSource(host, port, "w1", ok.token), 1, num_streams=2, timeout_s=5)
    with pytest.raises(TransferError, match="CERTIFICATE_VERIFY_FAILED"):  # TLS without our CA
        pull(PullSource(host, port, "w1", ok.token, tls=True), 1, num_streams=2, timeout_s=5)
    assert time.monotonic() - t0 < 4
    got = pull(ok, 1, num_streams=2)  # the publisher still serves
    assert_same(unflatten(got.buffer, got.manifest), sent)


def _drip(port: int, context: ssl.SSLContext | None, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while chunk := sock.recv(4096):
        parts.append(chunk)
    return b"".join(parts)


@pytest.mark.parametrize(("with_tls", "parser"), [(False, "auto"), (True, "auto"), (False, "h11")])
def test_slow_drip_clients_are_closed_and_connections_are_bounded(
    with_tls: bool, parser: str, tls_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers dripped and stalled, a body cut short, a connection that sends nothing:
    all closed after their timeouts (408 where no response began). One connection over
    the limit gets 503 at once; a normal request succeeds before and after. With
    uvicorn's h11 parser too (what it uses where httptools is not installed)."""
    if parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        monkeypatch.setattr("polyrl.serving.AutoHTTPProtocol", H11Protocol)
    tls = (
        TlsConfig(cert_file=tls_files["cert"], key_file=tls_files["key"], ca_file=tls_files["ca"])
        if with_tls
        else TlsConfig()
    )
    limits = HttpLimitsConfig(max_connections=8, header_timeout_s=0.6, body_timeout_s=0.6)
    context = ssl.create_default_context(cafile=tls_files["ca"]) if with_tls else None
    with ManagerThread(fast_cfg(tls=tls, http=limits)) as mt, http_client(tls.ca_file, base_url=mt.url) as client:
        port = int(mt.url.rsplit(":", 1)[1])
        t0 = time.monotonic()
        stalled = [_drip(port, context, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(5)]
        stalled.append(_drip(port, context, b""))  # connects, says nothing
        body = json.dumps({"worker_id": "w"}).encode()
        head = f"POST /v1/workers/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        stalled.append(
            _drip(port, context, head.encode() + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode() + body[:3])
        )
        assert client.get("/health").status_code == 200  # the 8th connection: still served
        over = _drip(port, context, b"")
        assert _read_all(over).startswith(b"HTTP/1.1 503 "), "a 9th connection is refused"
        replies = [_read_all(s) for s in stalled]  # each ends when the service closes it
        elapsed = time.monotonic() - t0
        assert all(r.startswith(b"HTTP/1.1 408 ") for r in replies[:6]), replies
        assert b"200 OK" not in replies[6]  # the cut body never reached a handler's success
        assert 0.5 < elapsed < 3.0, elapsed
        for s in [*stalled, over]:
            s.close()
        deadline = time.monotonic() + 5
        while len(mt.service.server.server_state.connections) > 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        assert len(mt.service.server.server_state.connections) <= 1  # type: ignore[union-attr]
        assert client.get("/health").status_code == 200


def test_tls_config_errors_name_the_key(tmp_path: Path, tls_files: dict[str, str]) -> None:
    from polyrl.config import ConfigError

    cases = {
        "manager.transfer.tls=true": "manager.transfer.tls needs manager.tls.cert_file",
        f'manager.tls.cert_file="{tls_files["cert"]}"': "cert_file and key_file go together",
        f'manager.tls.ca_file="{tmp_path / "nope.pem"}"': "manager.tls.ca_file: Value error, not a file",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    cfg = load_config(
        None, [f'manager.tls.{k}_file="{tls_files[k]}"' for k in ("cert", "key")] + ["manager.transfer.tls=true"]
    )
    assert cfg.manager.tls.enabled and cfg.manager.transfer.tls


def test_a_certificate_that_does_not_verify_is_not_retried(tls_files: dict[str, str]) -> None:
    """A wrong CA file is a setting to fix, not an outage: the trainer's link and a worker's
    registration stop at once with a message naming the key, where a refused connection
    would be retried."""
    import asyncio

    from polyrl.config import ConfigError
    from polyrl.protocol.manager_api import Heartbeat, RegisterRequest
    from polyrl.rollout.manager_link import ManagerLink
    from polyrl.worker.manager_client import ManagerClient, ManagerRejected, ManagerSession

    tls = TlsConfig(cert_file=tls_files["cert"], key_file=tls_files["key"])
    with ManagerThread(fast_cfg(tls=tls)) as mt:
        link = ManagerLink(mt.url, TOKEN, retry_s=30)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="CERTIFICATE_VERIFY_FAILED.*manager.tls.ca_file"):
            link.workers()
        link.close()
        registration = RegisterRequest(
            worker_id="w", url="https://127.0.0.1:9", model_path="m", weight_version=0, max_num_seqs=1, max_model_len=8
        )

        async def register() -> None:
            client = ManagerClient(mt.url, TOKEN, 5.0)
            try:
                beat = Heartbeat(state="active", weight_version=0, num_running=0, num_waiting=0, gen_throughput=0.0)
                await ManagerSession(client, lambda: registration, lambda: beat, 1.0).register()
            finally:
                await client.aclose()

        with pytest.raises(ManagerRejected, match="worker.tls.ca_file"):
            asyncio.run(register())
        assert time.monotonic() - t0 < 5
        assert ManagerLink(mt.url, TOKEN, ca_file=tls_files["ca"]).workers().workers == []


def test_a_relay_serves_over_tls_with_its_workers_certificate(
    tls_publisher: WeightPublisher, tls_files: dict[str, str]
) -> None:
    """A worker that serves HTTPS relays over TLS too: a receiver that verifies it against
    the CA pulls bit-exact; a plaintext one is refused."""
    from polyrl.transfer.relay import Relay
    from polyrl.transfer.wire import relay_key, transfer_token

    sent = weights(3)
    tls_publisher.publish(sent, 1)
    key = relay_key(tls_publisher.key, "r")
    upstream = PullSource(*tls_publisher.address, "r", tls_publisher.grant("r", 1), tls=True, ca_file=tls_files["ca"])
    with Relay(key=key, tls_cert_file=tls_files["cert"], tls_key_file=tls_files["key"]) as relay:
        pull(upstream, 1, num_streams=2, watcher=relay.watch(1))
        token = transfer_token(key, "w", 1)
        got = pull(PullSource(*relay.address, "w", token, tls=True, ca_file=tls_files["ca"]), 1, num_streams=3)
        assert_same(unflatten(got.buffer, got.manifest), sent)
        with pytest.raises(TransferError):
            pull(PullSource(*relay.address, "w", token), 1, num_streams=2, timeout_s=5)
