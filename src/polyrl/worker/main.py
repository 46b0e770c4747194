"""`polyrl worker`: one engine behind the HTTP API, a member of a manager's fleet.

Lifecycle: load the engine, bind the port, serve, print one ready line, register with
the manager and heartbeat. SIGTERM (a spot-instance notice), SIGINT or POST /shutdown
starts the drain: new /generate calls get 503 and the heartbeat says `draining`;
in-flight requests get `worker.drain_timeout_s` to finish, then are aborted so their
clients receive the partial tokens with finish_reason "abort" (the hand-back the
manager migrates); then leave, stop serving, exit 0. A second signal skips the wait.

uvicorn's own signal handling is switched off (`polyrl.serving.QuietServer`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Any

import torch

from polyrl.config import LoraConfig, WorkerRunConfig
from polyrl.engine.async_engine import AsyncEngine
from polyrl.engine.engine import Engine
from polyrl.engine.lora import AdapterMerger, expected_spec
from polyrl.preflight import shared_token
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import Heartbeat, RegisterRequest, RegisterResponse
from polyrl.serving import QuietServer, bind, server_config, wait_started
from polyrl.tls import base_url, reachable_host
from polyrl.transfer.relay import Relay
from polyrl.worker.manager_client import ManagerRejected, ManagerSession, ManagerUnreachable, worker_client
from polyrl.worker.server import create_app
from polyrl.worker.state import WorkerState

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
"""After the drain, how long the handlers get to send the (partial) results out."""


def run_worker(cfg: WorkerRunConfig, sock: socket.socket | None = None) -> int:
    """Serve until a signal or POST /shutdown, drain, leave; returns the exit code.
    `sock`: the listening address, bound already (the CLI binds it before loading anything,
    so that a taken port fails at once)."""
    assert cfg.model.path, "the CLI checks that a model path is given"
    sock = sock or bind(cfg.worker.host, cfg.worker.port)
    engine = AsyncEngine(Engine.from_pretrained(cfg.model.path, cfg.engine))
    if cfg.model.lora.enabled:  # refuse adapters of another rank or targets from the first one on
        expect_adapters(engine.engine, cfg.model.lora)
    tokenizer = _load_tokenizer(cfg.model.path)
    engine.start()
    try:
        return asyncio.run(_serve(cfg, engine, tokenizer, sock))
    finally:
        engine.shutdown()
        sock.close()


def expect_adapters(engine: Engine, lora: LoraConfig) -> None:
    model = engine.model
    spec = expected_spec(model, lora.rank, lora.alpha, lora.target_modules)
    engine.adapters = AdapterMerger(model, spec.base_model, expected=spec)
    log.info("accepting LoRA adapters of rank %d on %s", spec.rank, ",".join(spec.target_modules))


def _load_tokenizer(path: str) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s): text input is refused, output text is empty", path, e)
        return None


async def _serve(cfg: WorkerRunConfig, engine: AsyncEngine, tokenizer: Any | None, sock: socket.socket) -> int:
    host, port = cfg.worker.host, sock.getsockname()[1]
    relay = None
    if cfg.worker.relay_port is not None and not cfg.worker.local:
        tls = cfg.worker.tls
        relay = Relay(host, cfg.worker.relay_port, tls_cert_file=tls.cert_file, tls_key_file=tls.key_file)
    state = WorkerState(
        engine,
        model_path=str(cfg.model.path),
        worker_id=LOCAL_WORKER_ID if cfg.worker.local else cfg.worker.worker_id or f"{socket.gethostname()}-{port}",
        tokenizer=tokenizer,
        block_size=cfg.engine.block_size,
        max_num_seqs=cfg.engine.max_num_seqs,
        token=shared_token(cfg.worker.token, cfg.worker.token_file, "worker.token_file"),
        stream_interval_s=cfg.worker.stream_interval_s,
        ca_file=cfg.worker.tls.ca_file,
        relay=relay,
    )
    server = QuietServer(server_config(create_app(state), cfg.worker.http, cfg.worker.tls, int(FLUSH_TIMEOUT_S)))
    _install_signal_handlers(state)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_started(server, serving)
    print(f"polyrl worker {state.worker_id} serving on {base_url(host, port, cfg.worker.tls.enabled)}", flush=True)
    session = _manager_session(cfg, state, port) if cfg.worker.manager_url else None
    membership = asyncio.create_task(session.run()) if session else None
    exit_code = await _wait_for_end(state, serving, membership)
    await _drain(state, cfg.worker.drain_timeout_s, session)
    await _stop_membership(membership, session, exit_code)
    server.should_exit = True
    await serving
    if relay is not None:
        relay.close()
    log.info("worker %s stopped", state.worker_id)
    return exit_code


def _install_signal_handlers(state: WorkerState) -> None:
    def on_signal(sig: signal.Signals) -> None:
        if state.shutdown_requested.is_set():
            log.warning("%s again: aborting in-flight requests now", sig.name)
            state.engine.abort_all()
            return
        state.request_shutdown(sig.name)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def _manager_session(cfg: WorkerRunConfig, state: WorkerState, port: int) -> ManagerSession:
    w = cfg.worker
    assert w.manager_url is not None
    advertise = w.advertise_url or base_url(reachable_host(w.host), port, w.tls.enabled)
    client = worker_client(w)

    def registration() -> RegisterRequest:
        return RegisterRequest(
            worker_id=state.worker_id,
            url=advertise,
            model_path=state.model_path,
            weight_version=state.weight_version,
            max_num_seqs=state.max_num_seqs,
            max_model_len=state.engine.engine.max_model_len,
            capabilities=["incremental_stream", "batched_generate"],
            usd_per_hour=cfg.worker.usd_per_hour,
            device=device_name(state.engine.engine.device),
            node=w.node or socket.gethostname(),
            instance_type=w.instance_type or os.environ.get("POLYRL_INSTANCE_TYPE") or None,
            pid=os.getpid(),
            log_path=log_file(),
            relay_port=state.relay.address[1] if state.relay is not None else None,
            local=cfg.worker.local,
        )

    def on_registered(reply: RegisterResponse) -> None:
        state.worker_id = reply.worker_id

    return ManagerSession(
        client,
        registration,
        lambda: _heartbeat(state),
        w.heartbeat_interval_s,
        on_registered=on_registered,
        give_up_after_s=w.manager_timeout_s,
    )


def log_file() -> str | None:
    """The file this process logs to (stderr), when it is one: a launched worker's
    RUN_DIR/workers/<id>.log, or wherever a worker started by hand was redirected. Linux
    only (/proc); None elsewhere, or on a terminal or a pipe."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if os.path.isfile(path) else None


def device_name(device: torch.device) -> str:
    """'cuda:0 NVIDIA H100 80GB HBM3' or 'cpu': what the operator page shows."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} {torch.cuda.get_device_name(index)}"


def _heartbeat(state: WorkerState) -> Heartbeat:
    stats = state.engine.stats()
    return Heartbeat(
        state=state.lifecycle,
        weight_version=stats.weight_version,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        gen_throughput=stats.gen_throughput,
    )


async def _wait_for_end(state: WorkerState, serving: asyncio.Task[None], membership: asyncio.Task[None] | None) -> int:
    """Wait for a shutdown request (exit 0), a manager refusal or the server dying (exit 1)."""
    requested = asyncio.create_task(state.shutdown_requested.wait())
    tasks = {requested, serving} | ({membership} if membership else set())
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    requested.cancel()
    if membership is not None and membership.done() and not membership.cancelled():
        error = membership.exception()
        known = isinstance(error, (ManagerRejected, ManagerUnreachable))
        log.error("%s; stopping", error if known else repr(error))
        state.request_shutdown("manager unreachable" if isinstance(error, ManagerUnreachable) else "manager refused")
        return 1
    if serving.done():
        log.error("the HTTP server stopped unexpectedly: %r", serving.exception())
        state.request_shutdown("server stopped")
        return 1
    return 0


async def _drain(state: WorkerState, timeout_s: float, session: ManagerSession | None) -> None:
    """Let in-flight requests finish for `timeout_s`, then abort (hand back) the rest."""
    if session is not None:
        session.wake()  # tell the manager `draining` now, not at the next beat
    stats = state.engine.stats()
    log.info(
        "draining (%s): %d running, %d waiting, up to %.1fs",
        state.shutdown_reason,
        stats.num_running,
        stats.num_waiting,
        timeout_s,
    )
    if not await state.engine.wait_idle(timeout_s):
        num_aborted = state.engine.abort_all()
        log.info("drain deadline: aborted %d requests; their partial results go back to the clients", num_aborted)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FLUSH_TIMEOUT_S
    while state.num_open_generates > 0 and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def _stop_membership(
    membership: asyncio.Task[None] | None, session: ManagerSession | None, exit_code: int
) -> None:
    if membership is None or session is None:
        return
    membership.cancel()
    await asyncio.wait({membership}, timeout=FLUSH_TIMEOUT_S)  # its failure, if any, is logged
    if exit_code == 0:  # a refused worker has nothing to leave
        await session.leave("shutdown")
    await session.client.aclose()
