"""Which processes a run starts: none for a colocated rollout (`rollout.mode = local`);
else the manager, the publisher and the local worker (`Supervisor`), the launched
workers (`fleet.num_workers`, here or on Ray) and the rollout source that reads them."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import PreTrainedModel

from polyrl.config import ConfigError, EngineConfig, RunConfig
from polyrl.engine.engine import weights_dtype
from polyrl.launch.fleet import Fleet, WorkerFleet
from polyrl.launch.supervisor import Supervisor
from polyrl.preflight import shared_token
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.rollout.local import LocalRollout
from polyrl.rollout.remote import RemoteRollout
from polyrl.rollout.source import Rollout

log = logging.getLogger(__name__)


def start_rollout(
    cfg: RunConfig,
    run_dir: Path,
    model: PreTrainedModel,
    compute_dtype: torch.dtype,
    init_path: Path,
    cleanup: ExitStack,
) -> tuple[Rollout, Fleet | None]:
    """The rollout and, remote or hybrid, the launched workers; `cleanup` stops them."""
    if cfg.rollout.mode == "local":
        return LocalRollout.colocated(model, cfg.engine, compute_dtype), None
    return start_remote(cfg, run_dir, model, compute_dtype, init_path, cleanup)


def start_remote(
    cfg: RunConfig,
    run_dir: Path,
    model: PreTrainedModel,
    compute_dtype: torch.dtype,
    init_path: Path,
    cleanup: ExitStack,
) -> tuple[RemoteRollout, Fleet | None]:
    """The manager, publisher and local worker processes, then the launched workers (if
    any). The manager always has a token (a random one unless given), so that workers
    from anywhere can be added later; it goes to RUN_DIR/manager.json (owner-only), not
    to the log."""
    try:
        token = shared_token(cfg.manager.token, cfg.manager.token_file, "manager.token_file") or secrets.token_hex(16)
    except ValueError as e:  # the file went away since the preflight
        raise ConfigError(f"config error: {e}") from None
    cfg = cfg.model_copy(update={"engine": started_engines(cfg)})
    try:
        processes = Supervisor(cfg=cfg, run_dir=run_dir, token=token, init_path=init_path, device=model.device)
    except OSError as e:  # the port is taken, the address is not ours
        raise ConfigError(
            f"config error: manager: cannot listen on {cfg.manager.host}:{cfg.manager.port}: {e}"
        ) from None
    cleanup.callback(processes.close)
    rollout = RemoteRollout(
        model=model,
        mode=cfg.rollout.mode,
        compute_dtype=compute_dtype,
        link=processes.link,
        publisher=processes.publisher,
        endpoint=processes.endpoint,
        processes=processes,
        device_dtype=weights_dtype(cfg.engine, model.device.type),
    )
    processes.on_close(rollout.close)
    info = run_dir / "manager.json"
    ca_file = {"ca_file": cfg.manager.tls.ca_file} if cfg.manager.tls.ca_file else {}
    write_owner_only(info, json.dumps({"url": processes.url, "token": token} | ca_file))
    extra = f" worker.tls.ca_file={cfg.manager.tls.ca_file}" if cfg.manager.tls.ca_file else ""
    if cfg.engine.dtype == "float64":  # as the run's own workers (rollout.deterministic)
        extra += " engine.dtype=float64"
    log.info(
        "rollout manager on %s; add a worker: polyrl worker --model %s --manager %s --token-file %s%s",
        processes.url,
        init_path,
        processes.public_url,
        info,
        extra,
    )
    log.info(
        "operator page: %s/?token=<token in %s> (terminal: polyrl status %s --token-file %s)",
        processes.url,
        info,
        processes.url,
        info,
    )
    # launched while the manager starts: they register once it serves
    ids = processes.launch(launcher(cfg, init_path, processes, token, run_dir)) if cfg.fleet.num_workers else []
    processes.wait_for_manager()
    rollout.connect()
    wait_for_workers(rollout, processes, ids, cfg.fleet.min_workers, cfg.fleet.ready_timeout_s)
    return rollout, processes.fleet


def launcher(cfg: RunConfig, init_path: Path, processes: Supervisor, token: str, run_dir: Path) -> Fleet:
    """The fleet that launches `fleet.num_workers` workers: subprocesses here, or Ray actors
    on a cluster (which reach the manager at its advertised address)."""
    if cfg.fleet.launcher == "ray":
        from polyrl.launch.ray_fleet import RayFleet

        model_path = cfg.fleet.ray_model_path or str(init_path)
        return RayFleet(cfg.fleet, cfg.engine, model_path, processes.public_url, token, cfg.model.lora, cfg.manager.tls)
    return WorkerFleet(
        cfg.fleet, cfg.engine, init_path, processes.url, token, run_dir / "workers", cfg.model.lora, cfg.manager.tls
    )


def started_engines(cfg: RunConfig) -> EngineConfig:
    """The engine settings of the workers the run starts (the local one included). A
    deterministic run's CPU engines compute in float64 unless `engine.dtype` says
    otherwise: float32 log-probs change in their last bits with the batch a sample shared
    (see `engine/sampler.py`, LOGIT_GRID). Workers started by hand need `engine.dtype=float64`."""
    engine = cfg.engine
    on_cpu = engine.device == "cpu" or (engine.device == "auto" and not torch.cuda.is_available())
    if cfg.rollout.deterministic and engine.dtype == "auto" and on_cpu:
        log.info("rollout.deterministic: the run's CPU engines compute in float64")
        return engine.model_copy(update={"dtype": "float64"})
    return engine


def wait_for_workers(
    rollout: RemoteRollout, processes: Supervisor, ids: list[str], min_active: int, timeout_s: float
) -> None:
    """Wait until the local worker and the launched workers `ids` are active, and at
    least `min_active` workers in all (a worker's start-up is mostly imports and model
    loading); a launched worker that dies or is late, or a fleet short of `min_active`,
    is left behind with a warning."""
    deadline = time.monotonic() + timeout_s
    fleet, local = processes.fleet, processes.local
    if min_active:
        log.info("waiting up to %.0fs for %d active rollout workers (fleet.min_workers)", timeout_s, min_active)

    def active() -> set[str]:
        return {w.worker_id for w in rollout.fleet().workers if w.state == "active"}

    while time.monotonic() < deadline:
        now, launched = active(), {w.worker_id for w in fleet.alive()} if fleet is not None else set()
        local_up = LOCAL_WORKER_ID in now or not local.alive()
        if local_up and len(now - {LOCAL_WORKER_ID}) >= min_active and all(i in now or i not in launched for i in ids):
            break
        time.sleep(0.2)
    now = active()
    if LOCAL_WORKER_ID not in now:
        log.warning("the local worker is not active after %.0fs (see %s)", timeout_s, local.log_dir / "local.log")
    now.discard(LOCAL_WORKER_ID)
    missing = [i for i in ids if i not in now]
    if missing and fleet is not None:  # launched ids come with their fleet
        log.warning(
            "workers %s died or were not ready within %.0fs (see %s): training goes on without them",
            missing,
            timeout_s,
            fleet.logs,
        )
    if len(now) < min_active:
        log.warning(
            "%d of fleet.min_workers=%d workers active after %.0fs: training starts with them",
            len(now),
            min_active,
            timeout_s,
        )
    log.info("%d rollout workers ready", len(now))


def write_owner_only(path: Path, text: str) -> None:
    """Write `path` whole or not at all, readable by its owner only from the first byte: a
    worker or a test polling for a run's manager.json must not read it half-written (it
    would see no token), and the token must never sit in a file others can read."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: the mode is this call's, not a leftover's
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)
