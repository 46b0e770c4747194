"""The processes of a remote or hybrid run, and who keeps them alive.

A `polyrl train` with a manager runs each role in a process of its own (README, "What
runs where"): the manager (`manager_process.py`, or a standalone one at `manager.url`),
the publisher's data plane (threads of the trainer's process), the trainer's own engine
(the `local` worker, `local_worker.py`) and the launched workers (`fleet.py`,
`ray_fleet.py`). `Supervisor` starts them, brings the manager and the local worker back
when they die, and stops them. The rollout source (`rollout/remote.py`) only asks it to,
through the two calls of `polyrl.rollout.remote.Processes`: it is the one that notices a
lost manager (a control call or a batch fails) and that publishes (when a dead local
worker is started again).

If the manager's process dies, it is started again on the same port; the rollout tells
it the publisher and the last version published and resubmits the prompts whose groups
had not arrived (same seeds): nothing is lost, and workers register again by themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from polyrl.config import ManagerConfig, RunConfig
from polyrl.launch.fleet import Fleet
from polyrl.launch.local_worker import LocalWorker
from polyrl.launch.manager_process import ManagerProcess
from polyrl.protocol.manager_api import PublisherEndpoint
from polyrl.rollout.manager_link import ManagerLink
from polyrl.tls import reachable_host
from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.publisher import WeightPublisher

log = logging.getLogger("polyrl.rollout")


def window_policy(cfg: RunConfig, device: torch.device) -> ManagerConfig:
    """The manager's config with the hybrid window's mode (see `manager/window.py`) and,
    for fully asynchronous training, workers that keep their running samples across
    versions (`manager.swap_policy`, unless set)."""
    r = cfg.rollout
    mode = r.local_window(on_cuda=device.type == "cuda")
    update: dict[str, object] = {"local_window": mode, "local_window_max_s": r.hybrid_max_window_s}
    if r.fully_async and cfg.manager.swap_policy is None:
        update["swap_policy"] = "continue"
    return cfg.manager.model_copy(update=update)


class Supervisor:
    """Starts the publisher, the manager (unless standalone), the trainer's link to it and
    the local worker, then the launched fleet (`launch`); restarts the manager and the
    local worker when asked; `close` stops them all, last started first.

    The manager's socket is bound here, before anything else starts, so its URL is known
    to the workers at once (the fleet may be launched before `wait_for_manager`)."""

    def __init__(self, *, cfg: RunConfig, run_dir: Path, token: str, init_path: Path, device: torch.device) -> None:
        """`cfg`'s engine settings are those of the workers the run starts (the local one
        included); `device` is the trainer's, where the local worker runs. OSError if the
        manager's address is taken."""
        self.fleet: Fleet | None = None
        """The launched workers (`fleet.num_workers`), once `launch` started them."""
        self._stack = ExitStack()
        try:
            self._start(cfg, run_dir, token, init_path, device)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, cfg: RunConfig, run_dir: Path, token: str, init_path: Path, device: torch.device) -> None:
        mcfg, transfer = window_policy(cfg, device), cfg.manager.transfer
        tls = (mcfg.tls.cert_file, mcfg.tls.key_file) if transfer.tls else None
        self.publisher = WeightPublisher(
            mcfg.host,
            transfer.port,
            num_groups=transfer.num_groups,
            group_hosts=transfer.group_hosts,
            send_mode=transfer.send_mode,
            tls=tls,  # type: ignore[arg-type]
            max_send_gbps=transfer.max_send_gbps,
        ).start()
        self._stack.callback(self.publisher.stop)
        # workers on this host pull over NCCL / CUDA IPC (not with TLS: those sockets go to another process)
        if transfer.gpu_paths and not transfer.tls and device.type == "cuda":
            self.publisher.device = DeviceVersions(device, single_copy=transfer.single_copy)
        # each group's own bind address, else where other machines reach this one
        reachable = transfer.advertise_host or reachable_host(mcfg.host, mcfg.advertise_host)
        advertise = None if transfer.group_hosts else reachable
        on_device = self.publisher.device.identity if self.publisher.device is not None else None
        self.endpoint = PublisherEndpoint(
            groups=[(advertise or host, port) for host, port in self.publisher.addresses],
            key=self.publisher.key.hex(),
            device_host_id=on_device.host_id if on_device else None,
            device_gpu_uuid=on_device.gpu_uuid if on_device else None,
            tls=transfer.tls,
        )
        """What the manager is told of the publisher: at the start and after every restart."""
        self.manager: ManagerProcess | None = None
        if mcfg.url:
            self.url = self.public_url = mcfg.url
            log.info("using the rollout manager at %s", self.url)
        else:
            self.manager = ManagerProcess(mcfg, token, run_dir)  # binds its port now: the URL is known
            self.url = self.manager.url
            self.public_url = self.manager.public_url
            self.manager.spawn()
            self._stack.callback(self.manager.stop)
        self.link = ManagerLink(self.url, token, ca_file=cfg.manager.tls.ca_file)
        """The trainer's client of the manager, closed before the manager stops."""
        self._stack.callback(self.link.close)
        self.local = LocalWorker(
            init_path,
            self.url,
            token,
            cfg.engine,
            device,
            run_dir / "workers",
            cfg.fleet.worker_threads,
            cfg.model.lora,
            cfg.manager.tls,
        )
        self.local.start()  # it registers once the manager serves, as every worker does
        self._stack.callback(self.local.stop)

    def on_close(self, callback: Callable[[], object]) -> None:
        """`callback` runs in `close` after the launched fleet has stopped and before the
        local worker, the link and the manager do (the rollout: a batch that fails from
        then on is no lost manager)."""
        self._stack.callback(callback)

    def launch(self, fleet: Fleet) -> list[str]:
        """Start `fleet`'s workers (they register once the manager serves); returns their
        ids. In `close` the local worker gets its SIGTERM first, so that it drains while
        the fleet does."""
        self.fleet = fleet
        self._stack.callback(fleet.stop)
        self._stack.callback(self.local.terminate)
        return fleet.start()

    def wait_for_manager(self) -> None:
        """Wait until a manager started here serves (a standalone one is not waited for)."""
        if self.manager is not None:
            self.manager.wait_ready()

    def revive_manager(self, why: str) -> bool:
        """Start the manager again on its port and wait until it serves: True. A standalone
        manager is not ours to start: False at once (it restarts on its own schedule)."""
        if self.manager is None:
            log.warning("lost the rollout manager at %s (%s); waiting for it to come back", self.url, why)
            return False
        self.manager.restart()
        return True

    def revive_local_worker(self) -> None:
        """Start the local worker again if it died (the manager migrated what it held)."""
        self.local.restart_if_dead()

    def close(self) -> None:
        """The fleet, then the local worker, the link, the manager and the publisher stop."""
        self._stack.close()
