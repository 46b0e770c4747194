"""A run's config checked against this machine before anything heavy or lasting happens.

`polyrl train` calls `preflight` right after `load_config`, before it imports torch,
transformers or `datasets` (4-5 s of imports on 2 cores) and before it creates the run
directory. So a wrong task name, data file, column, reward path, model directory or a
taken port costs a fraction of a second, prints one line, and leaves nothing behind:
the corrected command may reuse the same `--run-dir`. Each check repeats, cheaply, one
the run makes later anyway (which stays the last word, e.g. for a port taken between
this check and the real bind).

`polyrl worker` and `polyrl manager` use the same checks for their own keys (model
directory, token, port) before they load anything.

Nothing heavy is imported here: the standard library, pydantic, uvicorn (0.1 s, through
`polyrl.serving`) and polyrl's light modules, plus whatever the user's reward modules
import. tests/test_config.py asserts that torch, transformers and `datasets` are not.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
from pathlib import Path

from polyrl.config import ConfigError, DataConfig, ManagerConfig, RunConfig
from polyrl.serving import bind, is_loopback


def preflight(cfg: RunConfig) -> None:
    """Raises ConfigError ("config error: <key>: ...", one line) on the first problem found."""
    try:
        check_model_dir(cfg.model.path)
        _check_data(cfg.data)
        _check_rewards(cfg.reward.functions)
        _check_ports(cfg)
        _check_launcher(cfg)
    except (ValueError, OSError) as e:
        raise ConfigError(f"config error: {e}") from None


RAY_MISSING = "fleet.launcher: ray needs Ray: pip install 'polyrl[ray]'"


def _check_launcher(cfg: RunConfig) -> None:
    if cfg.fleet.launcher == "ray" and cfg.rollout.mode != "local" and importlib.util.find_spec("ray") is None:
        raise ValueError(RAY_MISSING)


def check_world_size(cfg: RunConfig, world_size: int) -> None:
    """What a run over several trainer processes (torchrun) cannot do. ConfigError."""
    if world_size > 1 and cfg.rollout.mode == "local":
        raise ConfigError(
            f"config error: rollout.mode: local runs the engine on the trainer's own weights, which are "
            f"sharded over {world_size} ranks here; use remote or hybrid (or one process)"
        )
    if world_size > 1 and cfg.model.lora.enabled:
        raise ConfigError("config error: model.lora: LoRA trains on one process (FSDP with adapters is not supported yet)")


def resolve_token(cfg: ManagerConfig) -> ManagerConfig:
    """The manager's config with its token taken from POLYRL_TOKEN when it has none;
    ConfigError for a non-loopback address without one (the manager serves only loopback
    without a secret)."""
    token = cfg.token or os.environ.get("POLYRL_TOKEN") or None
    if token is None and not is_loopback(cfg.host):
        raise ConfigError(
            f"config error: manager.token: required when listening on {cfg.host} "
            "(set manager.token, --token or POLYRL_TOKEN)"
        )
    return cfg.model_copy(update={"token": token})


def check_model_dir(path: str | None) -> None:
    """A local Hugging Face model directory (polyrl never downloads): ValueError otherwise.
    Without this, transformers reads a missing path as a Hub repo id and says so."""
    if not path:
        return
    model_dir = Path(path)
    if not model_dir.exists():
        raise ValueError(f"model.path: {path} does not exist (a local model directory is expected)")
    if not model_dir.is_dir():
        raise ValueError(f"model.path: {path} is not a directory")
    if not any((model_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ValueError(f"model.path: {path} has no config.json: not a Hugging Face model directory")


def _check_data(cfg: DataConfig) -> None:
    if cfg.source == "atropos":  # the environments bring the prompts
        return
    if cfg.task != "dataset":
        from polyrl.data.tasks import get_task

        get_task(cfg.task)
        return
    from polyrl.data.files import check_columns, data_file, detect_format, peek

    file = data_file(cfg.path)
    head = peek(file)
    if head is not None:
        columns, first_rows = head
        check_columns(columns, detect_format(columns, first_rows) if cfg.format == "auto" else cfg.format, cfg)


def _check_rewards(functions: list[str]) -> None:
    """Import each `module:function` as the reward pool will (its modules are the user's:
    what they import is theirs to pay for)."""
    if not functions:
        return
    from polyrl.data.rewards import load_callable

    for path in functions:
        try:
            load_callable(path)
        except ValueError as e:
            raise ValueError(f"reward.functions: {e}") from None


def _check_ports(cfg: RunConfig) -> None:
    """The manager's port and the weight publisher's, where the run will bind them."""
    if cfg.rollout.mode == "local" or cfg.manager.url:  # no manager, or someone else's
        return
    check_port_free(cfg.manager.host, cfg.manager.port, "manager.port")
    _check_transfer_ports(cfg.manager)


def _check_transfer_ports(cfg: ManagerConfig) -> None:
    transfer = cfg.transfer
    if not transfer.port:
        return
    for group in range(transfer.num_groups):
        host = transfer.group_hosts[group] if transfer.group_hosts else cfg.host
        check_port_free(host, transfer.port + group, "manager.transfer.port")


def check_port_free(host: str, port: int, key: str) -> None:
    """Bind and release `host:port` as the run will; OSError naming `key` when it is taken
    or the address is not this machine's. Port 0 is always free."""
    if port:
        bind_or_refuse(host, port, key).close()


def bind_or_refuse(host: str, port: int, key: str) -> socket.socket:
    """The socket a service will listen on (`polyrl.serving.bind`), bound now; OSError
    naming `key` and saying what to do when the port is taken."""
    try:
        return bind(host, port)
    except OSError as e:
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror or e}"
        raise OSError(f"{key}: {host}:{port} {why} (pick another port, or 0 for any free one)") from None
