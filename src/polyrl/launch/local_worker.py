"""The trainer's own engine, as an ordinary `polyrl worker` process on the trainer's device.

It registers with the manager as `local` and syncs every version like any worker (from
the trainer's GPU over CUDA IPC when both are on one, else over loopback TCP); the
manager places work on it by the local window's rules: while the other workers sync
(hybrid), when none is left, or for a batch stalled past `manager.local_fallback_s`.
In its own process its engine loop and stream parsing never take the learner's GIL.

Its KV cache is a fixed share of the trainer's device, as before (the engine takes
`engine.kv_cache_memory_fraction` of the memory free when it starts, which is before
the learner allocates its optimizer state).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from polyrl.config import EngineConfig, LoraConfig, TlsConfig
from polyrl.launch.child import Child
from polyrl.launch.fleet import lora_overrides, tls_overrides, worker_command, worker_env
from polyrl.protocol.ids import LOCAL_WORKER_ID

log = logging.getLogger("polyrl.rollout")


class LocalWorker(Child):
    def __init__(
        self,
        model_dir: Path,
        manager_url: str,
        token: str,
        engine: EngineConfig,
        device: torch.device,
        log_dir: Path,
        num_threads: int = 1,
        lora: LoraConfig | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.model_dir, self.manager_url, self.token = model_dir, manager_url, token
        self.lora, self.tls = lora, tls
        self.engine = engine.model_copy(update={"device": device.type})
        self.device, self.log_dir, self.num_threads = device, log_dir, num_threads
        self.num_restarts = 0
        super().__init__()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = worker_command(
            self.model_dir,
            self.manager_url,
            LOCAL_WORKER_ID,
            self.engine,
            [
                "worker.local=true",
                "worker.drain_timeout_s=0",
                *lora_overrides(self.lora),
                *tls_overrides(self.tls),
            ],
        )
        self._spawn(command, self._env(), self.log_dir / "local.log")
        assert self.proc is not None
        log.info(
            "launched the local worker on %s (pid %d, log %s)", self.device, self.proc.pid, self.log_dir / "local.log"
        )

    def _env(self) -> dict[str, str]:
        env = worker_env(self.token, self.num_threads)
        if self.device.type == "cuda":  # the trainer's GPU, as the child numbers it
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        return env

    def restart_if_dead(self) -> bool:
        """Start it again if it died (the manager migrated what it held); True if it did."""
        if self.proc is None or self.alive():
            return False
        log.warning("the local worker exited with code %s; starting it again", self.proc.returncode)
        self.num_restarts += 1
        self.start()
        return True
