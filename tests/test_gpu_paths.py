"""The same-host GPU weight paths (`transfer/nccl.py`, `transfer/cuda_ipc.py`) behind the
publisher's control channel.

On CPU the NCCL path runs the same code over gloo: bit-exact round trips, the pair kept
across versions, a refused token, a receiver that stalls or is SIGKILLed mid-transfer
(only its own pair breaks; the publisher serves the next pull), the worker's fallback
to TCP, the manager's choice of path, and a real worker process taking the path.
CUDA IPC and NCCL proper are `gpu` tests, skipped without CUDA (and NCCL without 2 GPUs).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_manager import TOKEN, fast_cfg, wait_active, workers_of
from test_worker import WorkerProcess, _tiny, _wait_until
from torch.distributed import TCPStore

from polyrl.config import EngineConfig, ManagerConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.manager.main import ManagerThread
from polyrl.manager.weight_sync import PublisherSync
from polyrl.protocol.worker_api import UpdateWeightsResponse
from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.identity import DeviceIdentity, host_id
from polyrl.transfer.manifest import unflatten
from polyrl.transfer.nccl import NcclOffer, NcclReceiver, PairGroup
from polyrl.transfer.publisher import WeightPublisher
from polyrl.transfer.wire import (
    OP_NCCL,
    READY,
    PullSource,
    TransferError,
    connect,
    encode_request,
    read_reply_text,
)
from polyrl.worker.weight_sync import WeightReceiver

CPU = torch.device("cpu")


def weights(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(rows, 33, generator=g).to(torch.bfloat16),  # odd sizes: entries are padded
        "b.bias": torch.randn(257, generator=g),
        "c.steps": torch.arange(5, dtype=torch.int64) + seed,
    }


def assert_same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert got.keys() == sent.keys()
    for name, t in sent.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8))


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    with WeightPublisher() as pub:
        pub.device = DeviceVersions(CPU, timeout_s=5.0)
        yield pub


def source(pub: WeightPublisher, version: int, worker: str = "w1", token: str | None = None) -> PullSource:
    return PullSource(*pub.address, worker_id=worker, token=token or pub.grant(worker, version))


def test_nccl_path_over_gloo_is_bit_exact_and_keeps_its_pair(publisher: WeightPublisher) -> None:
    receiver = NcclReceiver()
    assert publisher.device is not None
    for version in (1, 2, 3):
        sent = weights(version)
        publisher.device.publish(sent, version)
        got = receiver.pull(source(publisher, version), version, CPU, timeout_s=10)
        assert got.codec == "nccl" and got.manifest.version == version
        assert_same(unflatten(got.buffer, got.manifest), sent)
        if version == 1:
            session = receiver._group.session  # type: ignore[union-attr]
    assert receiver._group is not None and receiver._group.session == session  # one pair, set up once
    assert publisher.device.versions == [3]  # keep_versions=1
    receiver.close()


def test_nccl_refuses_bad_token_and_unheld_version(publisher: WeightPublisher) -> None:
    assert publisher.device is not None
    publisher.device.publish(weights(), 1)
    receiver = NcclReceiver()
    with pytest.raises(TransferError, match="bad transfer token"):
        receiver.pull(source(publisher, 1, token="0" * 64), 1, CPU, timeout_s=5)
    with pytest.raises(TransferError, match="bad transfer token"):  # a token is for one version
        receiver.pull(source(publisher, 1, token=publisher.grant("w1", 2)), 1, CPU, timeout_s=5)
    with pytest.raises(TransferError, match="not held on the device"):
        receiver.pull(source(publisher, 7), 7, CPU, timeout_s=5)
    assert not publisher.device.nccl._pairs  # nothing was set up for a refused request
    with WeightPublisher() as plain, pytest.raises(TransferError, match="no versions on a GPU"):
        receiver.pull(source(plain, 1), 1, CPU, timeout_s=5)


def _half_open_pair(pub: WeightPublisher, version: int, worker: str) -> tuple[socket.socket, PairGroup]:
    """A receiver that joins its pair and says READY, then never receives."""
    sock = connect(*pub.address, timeout_s=5)
    sock.sendall(encode_request(OP_NCCL, version, worker, pub.grant(worker, version), base=-1))
    status, text = read_reply_text(sock)
    assert status == 0, text
    offer = NcclOffer.model_validate_json(text)
    store = TCPStore(pub.address[0], offer.store_port, is_master=False)
    group = PairGroup(store, offer.session, 1, offer.backend, 5.0)
    sock.sendall(READY)
    return sock, group


def test_a_stalled_receiver_times_out_alone(publisher: WeightPublisher) -> None:
    publisher.device = DeviceVersions(CPU, timeout_s=3.0)
    sent = weights(rows=2**17)  # 8 MiB: more than the sockets buffer, so the send has to wait for a reader
    publisher.device.publish(sent, 1)
    sock, group = _half_open_pair(publisher, 1, "stalled")
    t0 = time.monotonic()
    got = NcclReceiver().pull(source(publisher, 1, "w2"), 1, CPU, timeout_s=10)  # another worker meanwhile
    assert_same(unflatten(got.buffer, got.manifest), sent)
    assert publisher.device.nccl._pairs["stalled"].busy.locked()  # served while the stalled one still waits
    _wait_until(lambda: "stalled" not in publisher.device.nccl._pairs, 10, "stalled pair dropped")  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 6  # its own timeout ended it
    status, text = read_reply_text(sock)
    assert status != 0 and b"nccl transfer failed" in text
    group.close()
    sock.close()


KILLABLE_RECEIVER = """
import sys, time, torch
from torch.distributed import TCPStore
from polyrl.transfer.nccl import NcclOffer, PairGroup
from polyrl.transfer.wire import OP_NCCL, READY, connect, encode_request, read_reply_text
host, port, worker, token = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sock = connect(host, port, 10)
sock.sendall(encode_request(OP_NCCL, 1, worker, token, base=-1))
status, text = read_reply_text(sock)
offer = NcclOffer.model_validate_json(text)
group = PairGroup(TCPStore(host, offer.store_port, is_master=False), offer.session, 1, offer.backend, 30)
sock.sendall(READY)
print("ready", flush=True)
time.sleep(60)  # SIGKILLed here, while the publisher is sending
"""


def test_a_receiver_killed_mid_transfer_breaks_only_its_pair(publisher: WeightPublisher) -> None:
    publisher.device = DeviceVersions(CPU, timeout_s=30.0)  # the kill, not a timeout, must end it
    sent = weights(rows=2**18)  # 16 MiB
    publisher.device.publish(sent, 1)
    args = [*map(str, publisher.address), "doomed", publisher.grant("doomed", 1)]
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE_RECEIVER, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        _wait_until(lambda: publisher.device.nccl._pairs["doomed"].busy.locked(), 10, "publisher sending")  # type: ignore[union-attr]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        _wait_until(lambda: "doomed" not in publisher.device.nccl._pairs, 10, "dead pair dropped")  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 10  # the dead peer is noticed, not waited out
    finally:
        proc.kill()
        proc.wait()
    receiver = NcclReceiver()  # the publisher goes on: another worker, and the same id again
    for worker in ("w2", "doomed"):
        got = receiver.pull(source(publisher, 1, worker), 1, CPU, timeout_s=10)
        assert_same(unflatten(got.buffer, got.manifest), sent)
        receiver.close()


# ------------------------------------------------------------------------ worker side


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    model = _tiny(tmp_path_factory.mktemp("gpu_paths_model"))
    # a CPU engine on every machine: these tests run the NCCL code over gloo (the CUDA paths
    # have their own tests below)
    engine = AsyncEngine(Engine.from_pretrained(str(model), EngineConfig(max_num_seqs=4, device="cpu")))
    engine.start()
    yield engine
    engine.shutdown()


def engine_weights(engine: AsyncEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in engine.engine.model.named_parameters()}


def test_receiver_loads_over_nccl_and_falls_back_to_tcp(engine: AsyncEngine) -> None:
    receiver = WeightReceiver(engine)
    assert receiver.identity == DeviceIdentity(host_id=host_id(), gpu_uuid=None) and not receiver.pin_memory
    base = engine.engine.weight_version

    async def sync(pub: WeightPublisher, version: int, path: str) -> str:
        pulled = await receiver.sync(source(pub, version), version, 2, 10.0, "raw", path)  # type: ignore[arg-type]
        assert pulled is not None and engine.engine.weight_version == version
        return pulled.codec

    with WeightPublisher() as pub:
        pub.device = DeviceVersions(CPU)
        for step, path, expect in [(1, "nccl", "nccl"), (2, "cuda_ipc", "raw"), (3, "nccl", "raw")]:
            version = base + step
            sent = engine_weights(engine, version)
            pub.publish(sent, version)
            if step != 3:  # v3 is not on the device: nccl is refused, the pull goes over TCP
                pub.device.publish(sent, version)
            assert asyncio.run(sync(pub, version, path)) == expect
            assert (receiver.fallback is None) == (expect == "nccl")
            assert_same({k: p.detach() for k, p in engine.engine.model.named_parameters()}, sent)
    assert receiver._failed_paths == {"cuda_ipc", "nccl"}


def test_publisher_sync_picks_the_path() -> None:
    cfg = ManagerConfig()
    with WeightPublisher() as pub:
        sync = PublisherSync(SimpleNamespace(cfg=cfg), pub)  # type: ignore[arg-type]
        here = DeviceIdentity(host_id="host-a", gpu_uuid="GPU-0")
        assert sync.path_for("w", 1) == "tcp"  # the trainer holds nothing on a GPU
        pub.device = DeviceVersions(CPU)
        pub.device.identity = here
        pub.device.publish(weights(), 1)
        cases = [
            (None, "tcp"),  # the worker has not said where it is (its first pull)
            (DeviceIdentity(host_id="host-a", gpu_uuid="GPU-0"), "cuda_ipc"),
            (DeviceIdentity(host_id="host-a", gpu_uuid="GPU-1"), "nccl"),
            (DeviceIdentity(host_id="host-b", gpu_uuid="GPU-1"), "tcp"),
            (DeviceIdentity(host_id="host-a", gpu_uuid=None), "tcp"),  # a CPU worker beside a GPU trainer
        ]
        for identity, path in cases:
            sync.devices.pop("w", None)
            if identity is not None:
                sync.devices["w"] = identity
            assert sync.path_for("w", 1) == path, identity
        sync.devices["w"] = DeviceIdentity(host_id="host-a", gpu_uuid="GPU-1")
        assert sync.path_for("w", 2) == "tcp"  # v2 is not on the device
        cfg.transfer.gpu_paths = False
        assert sync.path_for("w", 1) == "tcp"
        cfg.transfer.gpu_paths = True
        sync._note(
            "w",
            "nccl",
            UpdateWeightsResponse(
                success=True, message="nccl failed", weight_version=1, path="tcp", device=sync.devices["w"]
            ),
        )
        assert sync.path_for("w", 1) == "tcp" and "w" in sync.tcp_only


def test_real_worker_takes_the_nccl_path_after_its_first_pull(tmp_path: Path) -> None:
    """publish_version -> PublisherSync: the first pull is TCP (the worker's reply says
    where it is), the next one is NCCL (gloo here), and the worker serves it."""
    model = _tiny(tmp_path / "model")
    reference = Engine.from_pretrained(str(model), EngineConfig(max_num_seqs=4, device="cpu"))
    params = {k: p.detach().clone() for k, p in reference.model.named_parameters()}
    with ManagerThread(fast_cfg()) as mt, WeightPublisher() as pub:
        pub.device = DeviceVersions(CPU)
        sync = PublisherSync(mt.manager, pub, codec="raw")
        mt.add_sync_hook(sync)
        # a CPU worker on every machine, so the pair runs gloo (on a GPU host it would be CUDA)
        proc = WorkerProcess(model, "--manager", mt.url, "--token", TOKEN, "--worker-id", "w1", 'engine.device="cpu"')
        try:
            proc.wait_ready()
            wait_active(mt, "w1")
            for version in (1, 2):
                new = {k: v + 0.01 * version for k, v in params.items()}
                pub.publish(new, version)
                pub.device.publish(new, version)
                mt.publish_version(version)
                _wait_until(lambda: workers_of(mt)["w1"]["weight_version"] == version, 30, f"w1 at v{version}")  # noqa: B023
                assert ("nccl" in sync.last_message["w1"]) == (version == 2), sync.last_message["w1"]
        finally:
            proc.kill()
    assert sync.devices["w1"] == DeviceIdentity(host_id=host_id(), gpu_uuid=None) and not sync.tcp_only


# ----------------------------------------------------------------------------- on CUDA

CONSUMER = """
import sys, torch, xxhash
from polyrl.transfer.cuda_ipc import IpcVersion
from polyrl.transfer.device import gpu_uuid
from polyrl.transfer.nccl import NcclReceiver
from polyrl.transfer.wire import PullSource
path, host, port, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), torch.device(sys.argv[4])
receiver = NcclReceiver()
for version, token in zip((1, 2), sys.argv[5:7]):
    source = PullSource(host, port, "gpu-w", token)
    if path == "cuda_ipc":
        shared = IpcVersion.open(source, version, device, gpu_uuid(device))
        data = shared.buffer[: shared.manifest.total_bytes].cpu()
        shared.close()
    else:
        data = receiver.pull(source, version, device).buffer.cpu()
    print(xxhash.xxh3_64_hexdigest(data.numpy().tobytes()), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cuda_ipc", "nccl"])
def test_gpu_paths_between_processes(path: str) -> None:
    """Two versions to a process on the trainer's GPU (IPC) or on the next one (NCCL, the
    second over the same pair), bit for bit."""
    import xxhash

    if not torch.cuda.is_available() or (path == "nccl" and torch.cuda.device_count() < 2):
        pytest.skip(f"{path} needs {'2 GPUs' if path == 'nccl' else 'CUDA'}")
    trainer = torch.device("cuda", 0)
    with WeightPublisher() as pub:
        pub.device = DeviceVersions(trainer, keep_versions=2, timeout_s=60)
        expected = []
        for version in (1, 2):
            pub.device.publish({k: v.to(trainer) for k, v in weights(version).items()}, version)
            expected.append(xxhash.xxh3_64_hexdigest(pub.device._held[version].buffer.cpu().numpy().tobytes()))
        args = [path, *map(str, pub.address), "cuda:0" if path == "cuda_ipc" else "cuda:1"]
        tokens = [pub.grant("gpu-w", v) for v in (1, 2)]
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CONSUMER), *args, *tokens],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected
