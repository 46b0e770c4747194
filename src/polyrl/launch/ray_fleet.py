"""Rollout workers on a Ray cluster (`fleet.launcher = "ray"`).

Each worker is a Ray actor, `WorkerHost`, that runs `polyrl worker` as a child process
on its node: the same program a person starts by hand, joining the manager with its URL
and token, so the membership protocol does not change. The actor reserves the worker's
Ray resources (`fleet.ray_num_cpus`, `ray_num_gpus`, `ray_resources`), which is how Ray
places it (spot nodes by a custom resource, GPUs by count), and it is restartable: when
its node is lost (a preemption, `ray stop`, a crash), Ray creates it again on a node with
room, and the new incarnation starts a fresh worker under a new id. The samples the lost
worker held were already migrated by the manager, token for token: nothing here is on
the data path, and the trainer talks to the cluster only to launch, list and retire.

The child dies with its actor (PR_SET_PDEATHSIG, SIGKILL): an actor killed with its node
or by `fleet.kill_interval_s` must not leave a worker heartbeating. A worker that exits on
its own after a healthy start takes its actor down with it, so Ray restarts that one too;
one that exits within `HEALTHY_AFTER_S` of starting (a bad flag, a missing model) is not
restarted in a loop: the fleet logs the end of its log and lets it go.

Ray is an optional extra (`pip install 'polyrl[ray]'`), imported only here.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from polyrl.config import ConfigError, EngineConfig, FleetConfig, LoraConfig, TlsConfig
from polyrl.launch.fleet import Fleet, lora_overrides, tls_overrides, worker_command, worker_env
from polyrl.lifetime import HURRY, parent_death_env
from polyrl.preflight import RAY_MISSING
from polyrl.serving import is_loopback

log = logging.getLogger("polyrl.fleet")

HEALTHY_AFTER_S = 60.0
"""A worker that ran this long before exiting on its own is restarted by Ray; one that
failed sooner is a configuration problem, and restarting it would only loop."""
INFO_WAIT_S = 2.0
"""How long listing the fleet waits for the actors' answers (a pending or restarting
actor keeps its last known id)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(f"config error: {RAY_MISSING}") from None
    return ray


class WorkerHost:
    """A Ray actor that owns one `polyrl worker` on its node (see the module docstring)."""

    def __init__(self, slot: str, command: list[str], env: dict[str, str], prices: dict[str, float]) -> None:
        import ray

        context = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray marks the property's internals deprecated
            warnings.simplefilter("ignore")
            restarted = bool(context.was_current_actor_reconstructed)
        self.worker_id = f"{slot}.{secrets.token_hex(2)}" if restarted else slot
        node_id = context.get_node_id()
        ip = ray.util.get_node_ip_address()
        self.node = f"{socket.gethostname()}/{node_id[:8]}"
        self.instance_type = os.environ.get("POLYRL_INSTANCE_TYPE") or os.environ.get("RAY_NODE_TYPE_NAME") or None
        node_keys = [f"worker.host={ip}", f"worker.node={self.node}"]
        if self.instance_type is not None:
            node_keys.append(f"worker.instance_type={self.instance_type}")
            if self.instance_type in prices:  # after the fleet's default price: the last one counts
                node_keys.append(f"worker.usd_per_hour={prices[self.instance_type]}")
        # this node's interpreter, not the trainer's path to its own
        self.command = [sys.executable, *command[1:4], "--worker-id", self.worker_id, *command[4:], *node_keys]
        self.log_path = Path(tempfile.gettempdir()) / "polyrl-workers" / f"{self.worker_id}.log"
        self.env = os.environ | env  # this node's environment, with the token and thread counts
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.retiring = False
        started = threading.Event()
        # the child's PDEATHSIG fires when the thread that started it ends: this one waits for it
        threading.Thread(target=self._run, args=(started,), name="polyrl-worker-child", daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env | parent_death_env(signal.SIGKILL),  # dies with this actor
                start_new_session=True,
            )
            started.set()
            self.exit_code = self.proc.wait()
        if not self.retiring and time.monotonic() - began >= HEALTHY_AFTER_S:
            os._exit(1)  # a lost worker: Ray starts this actor (and a new worker) again

    def info(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "node": self.node, "exit_code": self.exit_code}

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def retire(self, timeout_s: float) -> int | None:
        """SIGTERM (the spot notice: drain and hand back), SIGKILL after `timeout_s`."""
        self.retiring = True
        if self.proc is None or self.proc.poll() is not None:
            return self.exit_code
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class RayWorker:
    handle: Any
    worker_id: str
    """The current incarnation's id (the slot's name, then `slot.xxxx` after each restart)."""


class RayFleet(Fleet):
    """`fleet.num_workers` workers kept alive on a Ray cluster."""

    def __init__(
        self,
        cfg: FleetConfig,
        engine: EngineConfig,
        model_path: str,
        manager_url: str,
        token: str,
        lora: LoraConfig | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        super().__init__(cfg)
        ray = sys.modules.get("ray")  # not imported yet: `connect` may set Ray's environment first
        self._owns_connection = ray is None or not ray.is_initialized()
        if self._owns_connection:
            ray = connect(cfg.ray_address)
        self._ray = ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info("Ray cluster: %d nodes, %s", len(nodes), _resources(ray.cluster_resources()))
        elsewhere = {n["NodeManagerAddress"] for n in nodes} - {ray.util.get_node_ip_address()}
        if elsewhere and is_loopback(urlsplit(manager_url).hostname or ""):
            log.warning(
                "the Ray cluster has nodes on other machines (%s), but the manager is at %s, which they "
                "cannot reach: set manager.host=0.0.0.0 (and manager.advertise_host)",
                ", ".join(sorted(elsewhere)),
                manager_url,
            )
        if not elsewhere and (exposed := exposed_ray_listeners()):
            log.warning(
                "the Ray cluster runs on this machine alone, but listens beyond loopback: %s; for loopback "
                "only, see README, 'Ray on one machine'",
                ", ".join(exposed),
            )
        self.command = worker_command(
            Path(model_path),
            manager_url,
            None,
            engine,
            [
                f"worker.usd_per_hour={cfg.usd_per_hour}",
                f"worker.drain_timeout_s={cfg.drain_timeout_s}",
                *lora_overrides(lora),
                *tls_overrides(tls),
            ],
        )
        self.env = worker_env(token, cfg.worker_threads, base={})
        self.logs = f"{tempfile.gettempdir()}/polyrl-workers/ on each worker's node"
        self.workers: list[RayWorker]
        self._actor = ray.remote(WorkerHost).options(
            num_cpus=cfg.ray_num_cpus,
            num_gpus=cfg.ray_num_gpus,
            resources=cfg.ray_resources or None,
            max_restarts=cfg.ray_max_restarts,
            max_task_retries=-1,
            max_concurrency=4,
            scheduling_strategy="SPREAD",
        )

    def launch(self) -> str:
        slot = self._new_id("ray")
        handle = self._actor.remote(slot, self.command, self.env, self.cfg.ray_usd_per_hour)
        with self._lock:
            self.workers.append(RayWorker(handle, slot))
            self.events.launched += 1
        log.info("launched worker %s on Ray (placed once a node has %s)", slot, self._wants())
        return slot

    def _wants(self) -> str:
        return _resources(self._bundle())

    def _bundle(self) -> dict[str, float]:
        """What one worker reserves, as Ray names resources."""
        wants = {"CPU": self.cfg.ray_num_cpus, "GPU": self.cfg.ray_num_gpus, **self.cfg.ray_resources}
        return {k: float(v) for k, v in wants.items() if v}

    def request(self, total: int) -> None:
        """Ray's `request_resources`: the cluster autoscaler adds nodes until `total`
        workers' bundles fit (each request replaces the one before, so a smaller one lets
        it retire idle nodes)."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[self._bundle()] * total)
        log.info("asked Ray's autoscaler for room for %d workers (%s each)", total, self._wants())

    def alive(self) -> list[RayWorker]:
        """The actors not dead for good, with their current ids (asked from each; Ray
        answers for a restarted actor once its new incarnation runs)."""
        ray = self._ray
        with self._lock:
            workers = list(self.workers)
        refs = {w.handle.info.remote(): w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=INFO_WAIT_S) if refs else ([], [])
        for ref in ready:
            worker = refs[ref]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:  # out of restarts (calls to a restarting one wait)
                self._forget(worker, "its actor died for good")
                continue
            if info["worker_id"] != worker.worker_id:
                log.warning(
                    "worker %s is back as %s on %s (Ray restarted it)",
                    worker.worker_id,
                    info["worker_id"],
                    info["node"],
                )
                worker.worker_id = info["worker_id"]
            if info["exit_code"] is not None:  # failed early: not restarted (see HEALTHY_AFTER_S)
                tail = ray.get(worker.handle.log_tail.remote(), timeout=10)
                self._forget(worker, f"it exited with code {info['exit_code']} soon after starting:\n{tail}")
                ray.kill(worker.handle, no_restart=True)
        with self._lock:
            return list(self.workers)

    def _forget(self, worker: RayWorker, why: str) -> None:
        with self._lock:
            if worker in self.workers:
                self.workers.remove(worker)
                log.warning("worker %s left the fleet: %s", worker.worker_id, why)

    def _retire(self, worker: RayWorker) -> None:
        threading.Thread(target=self._see_out, args=(worker,), daemon=True).start()

    def _see_out(self, worker: RayWorker) -> None:
        """Retire through the actor (SIGTERM, SIGKILL past the drain allowance), then end
        the actor for good."""
        ray = self._ray
        drain_s = self.cfg.drain_timeout_s
        try:
            if not HURRY.is_set():  # a second Ctrl-C: no draining
                ray.get(worker.handle.retire.remote(drain_s + 15), timeout=drain_s + 30)
        except (ray.exceptions.RayError, TimeoutError) as e:  # GetTimeoutError is a TimeoutError
            log.warning("worker %s did not retire cleanly (%s): killing it", worker.worker_id, type(e).__name__)
        ray.kill(worker.handle, no_restart=True)

    def kill(self, worker: RayWorker) -> None:
        """kill -9 of the worker's actor (its child goes with it); Ray starts it again, as
        the autoscaler would replace a preempted spot node."""
        self._ray.kill(worker.handle, no_restart=False)
        with self._lock:
            self.events.killed += 1
        log.warning("killed worker %s (its Ray actor, SIGKILL); Ray will start it again", worker.worker_id)

    def _stop_workers(self, workers: list[RayWorker]) -> None:
        threads = [threading.Thread(target=self._see_out, args=(w,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=self.cfg.drain_timeout_s + 35)
        if self._owns_connection:
            self._ray.shutdown()


SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's single-machine mode (its default on Windows and macOS): the node's address is
127.0.0.1 and every Ray server listens there. Ray's other ways fall short: it turns
`ray.init(_node_ip_address="127.0.0.1")` and `ray start --node-ip-address=127.0.0.1` into
the machine's own address, and its gRPC servers then listen on all interfaces (`::`). Ray
reads the variable when it is imported, in this process and in each process of the
cluster (they inherit it)."""


def connect(address: str | None) -> Any:
    """Import ray and join the cluster at `address`; without one, the one `ray.init()` finds
    (RAY_ADDRESS, else the cluster whose address the last `ray start` on this machine left
    in Ray's temp directory), else start a local cluster in Ray's single-machine mode, on
    loopback only. Returns the ray module."""
    starts_one = address is None and not os.environ.get("RAY_ADDRESS") and not _ray_start_left_a_cluster()
    if starts_one and "ray" not in sys.modules:  # imported already: too late, exposed_ray_listeners tells
        for name, value in SINGLE_MACHINE.items():
            os.environ.setdefault(name, value)
    ray = import_ray()
    if starts_one:
        ray.init(address="local", namespace="polyrl", log_to_driver=False)
        log.info("started a local Ray cluster (node %s)", ray.util.get_node_ip_address())
    else:
        ray.init(address=address, namespace="polyrl", log_to_driver=False)
    return ray


def _ray_start_left_a_cluster() -> bool:
    """Ray's temp directory holds the address of the cluster `ray start` started last (Ray's
    own rule, `ray.init`'s docstring); $RAY_TMPDIR, else $TMPDIR, else /tmp holds that one."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(temp, "ray", "ray_current_cluster").exists()


def ray_listeners() -> list[tuple[str, int, str]]:
    """Where Ray's processes on this machine listen: (address, port, process name), sorted."""
    import psutil

    try:
        connections = psutil.net_connections(kind="inet")  # another user's sockets come without a pid
    except psutil.AccessDenied:  # macOS without root: nothing to tell
        return []
    found = set()
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        try:
            process = psutil.Process(conn.pid)
            name, cmdline = process.name(), process.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        if _is_ray_process(name, cmdline):
            found.add((conn.laddr.ip, conn.laddr.port, name))
    return sorted(found)


def _is_ray_process(name: str, cmdline: list[str]) -> bool:
    """Ray's binaries, its Python services (`.../ray/dashboard/agent.py`, `-m
    ray.util.client.server`) and its workers (`ray::IDLE`, `ray::WorkerHost`)."""
    return name in ("gcs_server", "raylet") or any("/ray/" in p or p.startswith(("ray::", "ray.")) for p in cmdline)


def exposed_ray_listeners() -> list[str]:
    """`ray_listeners` beyond loopback, as "ADDRESS:PORT (process)"."""
    return [
        f"{f'[{address}]' if ':' in address else address}:{port} ({name})"
        for address, port, name in ray_listeners()
        if not is_loopback(address)
    ]


def _resources(resources: dict[str, float]) -> str:
    """CPU=2, GPU=8, spot=8: what places workers (not Ray's per-node and memory entries)."""
    internal = ("node:", "memory", "object_store")
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if not k.startswith(internal))
