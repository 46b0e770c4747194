"""The single-copy local engine: an engine that decodes from the trainer's published
buffer in place, and the lease that lets the trainer write each next version into that
buffer safely (`transfer/cuda_ipc.py`, `transfer/device.py`, `worker/weight_sync.py`).

CUDA IPC itself needs a GPU (the `gpu` test at the end). On CPU the same protocol runs
over a socket pair, with the engine's parameters pointed at a CPU buffer that the
"trainer" (this test) writes in place: the engine must pause before every write, serve
the new version after it, never be written to without having paused, and stop when the
trainer dies mid-write. A copy loaded from elsewhere (TCP) must never land in the
trainer's buffer. The trainer's side: its device copy is in the engines' dtype, its TCP
copy in the compute dtype.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from test_engine import GREEDY, PROMPTS, run, spicy_model

from polyrl.config import EngineConfig, TinyModelConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest
from polyrl.models.tiny import save_tiny_model
from polyrl.transfer.cuda_ipc import HeldVersion, Lease
from polyrl.transfer.device import DeviceVersions
from polyrl.worker.weight_sync import WeightReceiver

CPU = torch.device("cpu")
CFG = EngineConfig(max_num_seqs=4, num_kv_blocks=64, block_size=4, device="cpu")


def version_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A full version for `model` (every parameter by name), random but deterministic."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0)
        for k, p in model.named_parameters(remove_duplicate=False)
    }


def lease_on(versions: DeviceVersions) -> HeldVersion:
    """A lease on the newest held buffer over a socket pair: the publisher's end is
    registered as if a worker had answered HOLD, the worker's end is returned."""
    trainer_end, worker_end = socket.socketpair()
    held = versions._held[max(versions._held)]
    versions._add_lease(held, Lease(trainer_end, versions.timeout_s), "w")
    return HeldVersion(worker_end, held.buffer, held.manifest, versions.timeout_s)


def buffer_of(versions: DeviceVersions) -> torch.Tensor:
    return versions._held[max(versions._held)].buffer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = save_tiny_model(
        tmp_path_factory.mktemp("single_copy"), TinyModelConfig(hidden_size=64, intermediate_size=128)
    )
    return spicy_model(path)


@pytest.fixture
def engine(tiny_model: torch.nn.Module) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(Engine(copy.deepcopy(tiny_model), CFG))
    engine.start()
    yield engine
    engine.shutdown()


def greedy_tokens(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict:
    """What an engine holding its own copy of `weights` generates (the reference)."""
    reference = Engine(copy.deepcopy(model), CFG)
    reference.update_weights(weights, 1)
    results = run(reference, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
    return {k: r.token_ids for k, r in results.items()}


def generated(engine: AsyncEngine) -> dict:
    done = threading.Event()
    out: dict = {}

    def go() -> None:
        out.update({k: r.token_ids for k, r in run(engine.engine, requests).items()})
        done.set()

    requests = [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]
    engine.submit(go).result(timeout=60)  # on the engine thread, between its steps
    assert done.is_set()
    return out


# ------------------------------------------------------------------------------ protocol


def test_the_trainer_writes_in_place_only_after_the_lease_paused() -> None:
    versions = DeviceVersions(CPU, timeout_s=5.0)
    versions.publish({"w": torch.zeros(1000)}, 1)
    held = lease_on(versions)
    buffer = buffer_of(versions)
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["announced"] = held.next_write()
        time.sleep(0.3)  # a long engine step: the trainer must wait for it
        seen["before_pause"] = held.buffer.view(torch.float32)[:1000].abs().sum().item()
        seen["written"] = held.paused()
        seen["after"] = held.buffer.view(torch.float32)[:1000].clone()
        held.serving()

    thread = threading.Thread(target=worker)
    thread.start()
    t0 = time.monotonic()
    versions.publish({"w": torch.ones(1000)}, 2)
    waited = time.monotonic() - t0
    thread.join(5)
    assert seen["announced"] == 2 and seen["written"] is True
    assert seen["before_pause"] == 0.0  # nothing was written while the engine could still read
    assert torch.equal(seen["after"], torch.ones(1000))
    assert waited >= 0.3 and buffer_of(versions).data_ptr() == buffer.data_ptr()  # in place
    assert versions.versions == [2] and versions.num_leases == 1
    assert set(versions.last_write) == {"pause_s", "write_s", "serving_s"}


def test_a_silent_lease_makes_the_trainer_write_a_new_buffer_and_leave_the_old_one_alone() -> None:
    versions = DeviceVersions(CPU, timeout_s=0.3)
    versions.publish({"w": torch.zeros(1000)}, 1)
    held = lease_on(versions)  # nobody answers on the worker's end
    old = buffer_of(versions)
    versions.publish({"w": torch.ones(1000)}, 2)
    assert buffer_of(versions).data_ptr() != old.data_ptr()
    assert torch.equal(old.view(torch.float32)[:1000], torch.zeros(1000))  # never touched
    assert torch.equal(buffer_of(versions).view(torch.float32)[:1000], torch.ones(1000))
    assert held.next_write() == 2 and held.paused() is False  # then RETIRED: keep reading the old one
    assert versions.num_leases == 0


@pytest.mark.parametrize("how", ["released", "killed"])
def test_a_lease_whose_worker_let_go_or_died_lets_the_trainer_write_at_once(how: str) -> None:
    versions = DeviceVersions(CPU, timeout_s=5.0)
    versions.publish({"w": torch.zeros(10)}, 1)
    held = lease_on(versions)
    buffer = buffer_of(versions)
    if how == "released":
        held.release()  # DONE: it stopped reading
    else:
        held.sock.close()  # what the kernel does for a worker killed -9: the connection ends
    t0 = time.monotonic()
    versions.publish({"w": torch.ones(10)}, 2)
    assert time.monotonic() - t0 < 1.0 and buffer_of(versions).data_ptr() == buffer.data_ptr()
    assert versions.num_leases == 0


def test_a_new_layout_or_a_transfer_in_flight_is_handled() -> None:
    versions = DeviceVersions(CPU, timeout_s=5.0)
    versions.publish({"w": torch.zeros(10)}, 1)
    held = lease_on(versions)
    entry = versions._held[1]
    entry.readers += 1  # an NCCL broadcast or an IPC copy still reads the buffer

    def reader_done() -> None:
        time.sleep(0.3)
        with versions._cv:
            entry.readers -= 1
            versions._cv.notify_all()

    def worker() -> None:
        while (v := held.next_write()) is not None:
            assert v in (2, 3)
            if held.paused():
                held.serving()

    # t0 before the reader's 0.3 s begins: taken after the threads started, a loaded box let
    # the reader sleep through up to 24 ms of starting the worker before t0 (0.276 s waited)
    t0 = time.monotonic()
    threading.Thread(target=reader_done).start()
    thread = threading.Thread(target=worker)
    thread.start()
    versions.publish({"w": torch.ones(10)}, 2)
    assert time.monotonic() - t0 >= 0.3 and buffer_of(versions).data_ptr() == entry.buffer.data_ptr()
    versions.publish({"w": torch.ones(12)}, 3)  # another shape: a new buffer, and the lease retires
    thread.join(5)
    assert not thread.is_alive() and versions.versions == [3] and versions.num_leases == 0
    assert buffer_of(versions).data_ptr() != entry.buffer.data_ptr()


def test_a_lease_granted_while_a_write_waits_for_readers_is_paused_before_the_write() -> None:
    """A worker's IPC pull is a reader until it answers HOLD; a write that waits for the
    readers must then pause that new lease too, not write under it."""
    versions = DeviceVersions(CPU, timeout_s=5.0)
    versions.publish({"w": torch.zeros(10)}, 1)
    first = lease_on(versions)  # the write goes in place
    entry = versions._held[1]
    entry.readers += 1  # a pull in flight that will answer HOLD
    seen: dict[str, float] = {}

    def follow(held: HeldVersion, name: str) -> None:
        assert held.next_write() == 2
        seen[name] = held.buffer.view(torch.float32)[:10].abs().sum().item()  # just before PAUSED
        assert held.paused()
        held.serving()

    def late_hold() -> None:
        time.sleep(0.2)  # the write is waiting for this reader by now
        trainer_end, worker_end = socket.socketpair()
        versions._add_lease(entry, Lease(trainer_end, versions.timeout_s), "late")
        threading.Thread(
            target=follow, args=(HeldVersion(worker_end, entry.buffer, entry.manifest, 5.0), "late")
        ).start()
        with versions._cv:
            entry.readers -= 1
            versions._cv.notify_all()

    threads = [threading.Thread(target=follow, args=(first, "first")), threading.Thread(target=late_hold)]
    for t in threads:
        t.start()
    versions.publish({"w": torch.ones(10)}, 2)
    for t in threads:
        t.join(5)
    assert seen == {"first": 0.0, "late": 0.0}  # neither read a byte of v2 before it paused
    assert versions.num_leases == 2 and buffer_of(versions).data_ptr() == entry.buffer.data_ptr()


# -------------------------------------------------------------------------------- engine


def share(engine: AsyncEngine, versions: DeviceVersions, version: int) -> HeldVersion:
    """What `WeightReceiver` does once the offer allows a lease: point the engine at the
    buffer, then follow the lease from a thread."""
    held = lease_on(versions)
    views = versions.views(version)
    assert engine.engine.can_share(views)
    engine.submit(lambda: engine.engine.share_weights(views, version, held)).result(timeout=30)
    receiver = WeightReceiver(engine)
    threading.Thread(target=receiver._follow, args=(held, None), daemon=True).start()
    return held


def test_an_engine_reading_the_buffer_in_place_serves_each_version_exactly(
    engine: AsyncEngine, tiny_model: torch.nn.Module
) -> None:
    versions = DeviceVersions(CPU, timeout_s=5.0)
    v1 = version_weights(tiny_model, 1)
    versions.publish(v1, 1)
    share(engine, versions, 1)
    buffer = buffer_of(versions)
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert all(lo <= p.data_ptr() < hi for p in engine.engine.model.parameters())  # no copy of its own
    assert engine.engine.weight_version == 1 and generated(engine) == greedy_tokens(tiny_model, v1)
    v2 = version_weights(tiny_model, 2)
    versions.publish(v2, 2)  # returns once the engine serves v2
    assert engine.engine.weight_version == 2 and buffer_of(versions).data_ptr() == lo
    assert generated(engine) == greedy_tokens(tiny_model, v2)
    assert versions.last_write["pause_s"] < 5.0

    # a version copied in from elsewhere (a TCP pull) lands in memory of the engine's own
    v3 = version_weights(tiny_model, 3)
    engine.submit(lambda: engine.engine.update_weights(v3, 3)).result(timeout=30)
    assert engine.engine.weights_owner is None
    assert not any(lo <= p.data_ptr() < hi for p in engine.engine.model.parameters())
    assert torch.equal(versions.views(2)["model.embed_tokens.weight"], v2["model.embed_tokens.weight"])
    assert generated(engine) == greedy_tokens(tiny_model, v3)
    versions.publish(version_weights(tiny_model, 4), 4)  # the lease said DONE: no wait, no flip
    assert engine.engine.weight_version == 3 and versions.num_leases == 0


def test_the_engine_stops_when_the_trainer_dies_mid_write(engine: AsyncEngine, tiny_model: torch.nn.Module) -> None:
    versions = DeviceVersions(CPU, timeout_s=5.0)
    versions.publish(version_weights(tiny_model, 1), 1)
    share(engine, versions, 1)
    lease = versions._held[1].leases[0]
    assert lease.pause(2) == "paused"  # the trainer announced v2, the engine paused...
    lease.sock.close()  # ...and the trainer died before saying WRITTEN: the weights may be torn
    deadline = time.monotonic() + 10
    while engine.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.error is not None and "went away" in str(engine.error)
    assert engine.engine.weight_version == 1


# ---------------------------------------------------------------------------------- CUDA

SPAWNED_WORKER = """
import asyncio, sys, torch
sys.path.insert(0, sys.argv[4])
from test_engine import spicy_model
from polyrl.config import EngineConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest
from polyrl.protocol.sampling import SamplingParams
from polyrl.transfer.wire import PullSource
from polyrl.worker.weight_sync import WeightReceiver

host, port, token, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5]
engine = AsyncEngine(Engine(spicy_model(model_dir).to(torch.bfloat16).cuda(), EngineConfig(max_num_seqs=4)))
engine.start()


async def main():
    pulled = await WeightReceiver(engine).sync(PullSource(host, port, "local", token), 1, 1, 60.0, "raw", "cuda_ipc")
    print("in_place", pulled.in_place, flush=True)
    for line in sys.stdin:  # the trainer wrote another version: say what the engine serves and generates
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        tokens = []
        async for deltas in engine.generate(EngineRequest("r" + line.strip(), [1, 2, 3, 4], sampling)):
            tokens += [t for d in deltas for t in d.token_ids]
        print(engine.engine.weight_version, *tokens, flush=True)


asyncio.run(main())
"""


@pytest.mark.gpu
def test_a_cuda_worker_reads_the_trainers_buffer_in_place(tmp_path) -> None:
    """A worker process on the trainer's GPU takes v1 over CUDA IPC with a lease; v2 is
    then written into the same buffer, and the worker serves it with no pull."""
    import subprocess
    import sys
    from pathlib import Path

    from polyrl.transfer.publisher import WeightPublisher

    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU")
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(hidden_size=64, intermediate_size=128))
    model = spicy_model(path).to(torch.bfloat16).cuda()
    with WeightPublisher() as pub:
        pub.device = DeviceVersions(torch.device("cuda", 0), timeout_s=60)
        pub.device.publish(version_weights(model, 1), 1, torch.bfloat16)
        ptr = buffer_of(pub.device).data_ptr()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SPAWNED_WORKER,
                *map(str, pub.address),
                pub.grant("local", 1),
                str(Path(__file__).parent),
                str(path),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().split() == ["in_place", "True"]
            assert pub.device.num_leases == 1
            outputs = []
            for version in (2, 3):
                pub.device.publish(version_weights(model, version), version, torch.bfloat16)
                assert buffer_of(pub.device).data_ptr() == ptr  # written in place
                proc.stdin.write(f"{version}\n")
                proc.stdin.flush()
                line = proc.stdout.readline().split()
                assert line[0] == str(version)
                outputs.append(line[1:])
            assert outputs[0] != outputs[1]
        finally:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------------------ trainer


@pytest.mark.parametrize("device_dtype", [torch.bfloat16, torch.float32])
def test_the_trainer_publishes_the_device_copy_in_the_engines_dtype(device_dtype: torch.dtype) -> None:
    """A float32 learner: the copy on its device is in the engines' dtype (what a local
    engine can read in place), the host copy for TCP pulls stays float32 (a CPU worker
    computing in float32 gets exact weights); with one dtype, the host copy is read from
    the device copy."""
    from test_dynamic_sampling import _Model, _NoProcesses
    from test_manager import TOKEN, fast_cfg

    from polyrl.manager.main import ManagerThread
    from polyrl.rollout.manager_link import ManagerLink
    from polyrl.rollout.remote import RemoteRollout
    from polyrl.transfer.manifest import unflatten
    from polyrl.transfer.publisher import WeightPublisher
    from polyrl.transfer.receiver import pull
    from polyrl.transfer.wire import PullSource

    model = _Model(33, 7)
    with ManagerThread(fast_cfg()) as mt, WeightPublisher() as pub:
        pub.device = DeviceVersions(CPU)
        link = ManagerLink(mt.url, TOKEN)
        try:
            rollout = RemoteRollout(
                model=model,
                mode="remote",
                compute_dtype=torch.float32,
                link=link,
                publisher=pub,
                endpoint=None,  # type: ignore[arg-type]  # the manager is never restarted here
                processes=_NoProcesses(),
                device_dtype=device_dtype,
            )
            rollout.publish(None, 1)
            pulled = pull(PullSource(*pub.address, "w", pub.grant("w", 1)), 1, num_streams=1, timeout_s=10.0)
            on_device = {k: t.clone() for k, t in pub.device.views(1).items()}
        finally:
            link.close()
    assert {t.dtype for t in on_device.values()} == {device_dtype}
    assert {e.dtype for e in pulled.manifest.tensors} == {"float32"}
    host = unflatten(pulled.buffer, pulled.manifest)
    for name, p in model.named_parameters():
        assert torch.equal(host[name], p.detach())  # exact float32 over TCP
        assert torch.equal(on_device[name], p.detach().to(device_dtype))
