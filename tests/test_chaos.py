"""Fault injection, the fast subset of `benchmarks/chaos.py`: every fault kind once, on
real `polyrl worker` processes behind misbehaving proxies, with zero samples lost; the
fault proxy itself; and regression tests for what the chaos runs found:

* a worker killed during its readiness check was only dropped at readiness_timeout_s
  (30-60 s) when the check went through a relay: now at heartbeat_timeout_s;
* a failing worker was the least loaded one, so every retried sample went straight back
  to it and a broken link burnt the samples' retry budget: failures now back off;
* bytes damaged between manager and worker could fail a batch as `invalid_request`, or
  change tokens silently: requests and incremental streams now carry checksums, and a
  refused request is tried once more elsewhere.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from test_manager import FakeWorker, batch, check_exact, fast_cfg, wait_active

from chaos_harness.harness import ChaosFleet, chaos_manager_config
from chaos_harness.proxy import FaultProxy
from chaos_harness.restarts import manager_restart, trainer_restart
from chaos_harness.roles import local_worker_killed, manager_killed
from chaos_harness.scenarios import SCENARIOS, Context, FaultRow, Scale
from polyrl.config import TinyModelConfig
from polyrl.httpapi import CHECKSUM_HEADER, ChecksumGuard, checksum
from polyrl.manager.main import ManagerThread
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.manager_api import BatchError

SCALE = Scale(num_prompts=6, n=2, max_new_tokens=300, injections=1, num_workers=2)


# ------------------------------------------------------------------------------ the proxy


class _Echo(socketserver.ThreadingTCPServer):
    daemon_threads = allow_reuse_address = True


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_proxy() -> Iterator[FaultProxy]:
    server = _Echo(("127.0.0.1", 0), _EchoHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy(*server.server_address, seed=1) as proxy:
        yield proxy
    server.shutdown()
    server.server_close()


def _round_trip(port: int, payload: bytes, timeout_s: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _round_trip_or_reset(port: int, payload: bytes) -> bytes:
    try:
        return _round_trip(port, payload)
    except OSError:  # reset, or not connected any more
        return b""


def test_proxy_passes_delays_corrupts_cuts_and_refuses(echo_proxy: FaultProxy) -> None:
    payload = bytes(range(256)) * 64
    assert _round_trip(echo_proxy.port, payload) == payload

    echo_proxy.set(delay_s=0.2, direction="to_client")
    t0 = time.monotonic()
    assert _round_trip(echo_proxy.port, b"x") == b"x"
    assert time.monotonic() - t0 >= 0.2

    echo_proxy.set(delay_s=0.0, corrupt_rate=1.0)
    damaged = _round_trip(echo_proxy.port, payload)
    assert len(damaged) == len(payload) and damaged != payload and echo_proxy.stats.corrupted_chunks >= 1

    echo_proxy.heal()
    echo_proxy.set(cut_after_bytes=1000)
    assert len(_round_trip_or_reset(echo_proxy.port, payload)) < len(payload)
    assert echo_proxy.stats.cut >= 1

    echo_proxy.heal()
    echo_proxy.set(refuse=True)
    assert _round_trip_or_reset(echo_proxy.port, b"hello") == b""
    assert echo_proxy.stats.refused == 1
    echo_proxy.heal()
    assert _round_trip(echo_proxy.port, b"back") == b"back"


# ------------------------------------------------------------------- checksums on the link


def test_checksum_guard_refuses_a_damaged_body_and_passes_a_whole_one() -> None:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, object]:
        return {"got": await request.json()}

    app.add_middleware(ChecksumGuard)
    client = TestClient(app)
    body = json.dumps({"input_ids": [1, 2, 3]}).encode()
    ok = client.post("/echo", content=body, headers={CHECKSUM_HEADER: checksum(body)})
    assert ok.status_code == 200 and ok.json() == {"got": {"input_ids": [1, 2, 3]}}
    damaged = body.replace(b"2", b"7")  # still valid JSON: would change a prompt silently
    refused = client.post("/echo", content=damaged, headers={CHECKSUM_HEADER: checksum(body)})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "corrupt_request"
    assert client.post("/echo", content=damaged).status_code == 200  # no header: SGLang clients as before


def test_a_refused_request_is_tried_once_more_then_fails_the_batch() -> None:
    with ManagerThread(fast_cfg()) as mt:
        with FakeWorker(mt.url, "refuser", mode="refuse") as refuser:
            wait_active(mt, "refuser")
            with pytest.raises(BatchError) as err:
                list(mt.generate(batch(1, 1, 4)))
            assert err.value.kind == "invalid_request" and "token id out of range" in str(err.value)
            assert len(refuser.calls) == 2


def test_a_failing_worker_backs_off_instead_of_eating_the_retry_budget() -> None:
    """Before: the broken worker, always the least loaded, took every retry at once and the
    batch failed with retry_budget although a healthy worker was there."""
    with ManagerThread(fast_cfg(retry_budget=2)) as mt:
        with FakeWorker(mt.url, "broken", mode="error") as broken, FakeWorker(mt.url, "ok", token_delay_s=0.01):
            wait_active(mt, "broken", "ok")
            request = batch(8, 1, 30)
            groups = list(mt.generate(request))
            check_exact(request, groups)
            assert 1 <= len(broken.calls) < len(request.prompts)  # tried, then left alone while it backs off
            record = mt.call(lambda: mt.manager.registry.get("broken"))
            assert record.consecutive_failures >= 1 and record.busy_until > 0


# ------------------------------------------------------------------ every fault, real workers


@pytest.fixture(scope="module")
def chaos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("chaos_model"), TinyModelConfig(max_position_embeddings=2048))


@pytest.fixture(scope="module")
def chaos(chaos_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Context]:
    from transformers import AutoModelForCausalLM

    base = {k: p.detach().clone() for k, p in AutoModelForCausalLM.from_pretrained(str(chaos_model)).named_parameters()}

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {k: v + 1e-3 * version for k, v in base.items()}

    with ChaosFleet(chaos_model, tmp_path_factory.mktemp("chaos_logs"), chaos_manager_config()) as fleet:
        yield Context(fleet, SCALE, weights)


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=pytest.mark.slow) if "readiness" in f else f for f in SCENARIOS]
)  # the readiness fault waits out a heartbeat timeout: 9-10 s
def test_fault_loses_nothing(chaos: Context, fault: str) -> None:
    row = FaultRow(fault)
    SCENARIOS[fault](chaos, row)
    assert row.ok, row.summary()
    assert row.injected == SCALE.injections and row.samples >= SCALE.num_prompts * SCALE.n
    heartbeat_timeout_s = chaos.fleet.cfg.heartbeat_timeout_s
    if "readiness" in fault:  # the regression: detected by silence, not by the readiness timeout
        assert max(row.recovery_s) < heartbeat_timeout_s + 3 < chaos.fleet.cfg.readiness_timeout_s
    if "SIGSTOP" in fault:
        assert heartbeat_timeout_s - 0.5 < max(row.recovery_s) < heartbeat_timeout_s + 3
    if fault in ("kill -9 while generating", "all workers killed, new ones join", "connections cut after 4 KiB"):
        assert row.migrated > 0  # the fault really hit samples in flight


@pytest.mark.slow
def test_standalone_manager_restart_workers_come_back(chaos_model: Path, tmp_path: Path) -> None:
    row = manager_restart(chaos_model, tmp_path, SCALE)
    assert row.ok, row.summary()
    assert max(row.recovery_s) < 5


RESUBMITTED = re.compile(r"resubmitting (\d+) of (\d+) prompts after losing the manager")
"""The trainer's warning when a batch's stream broke with the manager (`rollout/remote.py`)."""


@pytest.mark.slow
def test_trainers_manager_process_killed_mid_step_nothing_lost(chaos_model: Path, tmp_path: Path) -> None:
    """Killed while workers hold samples: the trainer starts its manager again, tells it the
    publisher and the version, and resubmits the prompts whose groups had not arrived;
    every step complete, each logged once."""
    row = manager_killed(chaos_model, tmp_path, SCALE)
    assert row.ok, row.summary()
    assert row.samples > 0 and row.lost == 0
    log = (tmp_path / "trainer.log").read_text(errors="replace")
    resubmitted = [(int(n), int(m)) for n, m in RESUBMITTED.findall(log)]
    assert "rollout manager" in log and "starting it again" in log, log[-2000:]  # exited, or unreachable first
    assert sum(n for n, _ in resubmitted) > 0 and all(n <= m for n, m in resubmitted), resubmitted  # work was in flight


@pytest.mark.slow
def test_local_worker_killed_mid_window_nothing_lost(chaos_model: Path, tmp_path: Path) -> None:
    """Its samples move to the workers with the tokens it streamed (it is started again).
    The scenario is a `polyrl train` process, which keeps no token ids: what the data
    shows is that samples migrated, and that the learner's log-probs of every sample's
    ids, the migrated ones included, are the engines' (a continuation generated after
    other tokens than the sample's breaks them). That a migrated sample's seed gives the
    uninterrupted tokens is checked against a reference generation by `test_e2e.py`'s
    `test_hybrid_window_hands_local_samples_to_a_worker_token_exact`."""
    row = local_worker_killed(chaos_model, tmp_path, SCALE)
    assert row.ok, row.summary()
    assert row.samples > 0 and row.lost == 0
    assert row.migrated > 0, row.summary()  # the kill hit samples with tokens, which went on elsewhere
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["rollout/logprob_diff"] for r in rows) < 1e-4, [r["rollout/logprob_diff"] for r in rows]


@pytest.mark.slow
def test_trainer_killed_and_resumed_workers_resync(chaos_model: Path, tmp_path: Path) -> None:
    row = trainer_restart(chaos_model, tmp_path, SCALE)
    assert row.ok, row.summary()
    assert row.samples > 0 and row.lost == 0
