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
import json
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
        _check_tokens(cfg)
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
        raise ConfigError(
            "config error: model.lora: LoRA trains on one process (FSDP with adapters is not supported yet)"
        )


def resolve_token(cfg: ManagerConfig) -> ManagerConfig:
    """The manager's config with its tokens read (`shared_token`, and `read_token_file`);
    ConfigError for a non-loopback address without a token (the manager serves only
    loopback without a secret), or for a token file without one."""
    read_token = cfg.read_token
    try:
        token = shared_token(cfg.token, cfg.token_file, "manager.token_file")
        if not read_token and cfg.read_token_file:
            read_token = read_token_file(cfg.read_token_file, "manager.read_token_file")
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    if token is None and not is_loopback(cfg.host):
        raise ConfigError(
            f"config error: manager.token: required when listening on {cfg.host} "
            "(set manager.token_file, --token-file, POLYRL_TOKEN or POLYRL_TOKEN_FILE)"
        )
    return cfg.model_copy(update={"token": token, "read_token": read_token or None})


def shared_token(token: str | None, token_file: str | None, file_key: str) -> str | None:
    """A service's token: as given, else the one in `token_file`, else $POLYRL_TOKEN, else
    the one in the file $POLYRL_TOKEN_FILE names; None when none is set. ValueError naming
    the key for a token file without a token."""
    if token:
        return token
    if token_file:
        return read_token_file(token_file, file_key)
    if os.environ.get("POLYRL_TOKEN"):
        return os.environ["POLYRL_TOKEN"]
    if os.environ.get("POLYRL_TOKEN_FILE"):
        return read_token_file(os.environ["POLYRL_TOKEN_FILE"], "POLYRL_TOKEN_FILE")
    return None


def read_token_file(path: str, key: str) -> str:
    """The token that the file `path` holds: its text, without the line end, or the "token"
    of a JSON object (a run's manager.json). ValueError naming `key` if it holds none (the
    message never quotes the file: it may hold a secret)."""
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if text.startswith("{"):
        try:
            text = str(json.loads(text).get("token") or "")
        except (ValueError, AttributeError):
            text = ""
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"{key}: {path} holds no token (expected the token alone, or a run's manager.json)")
    return text


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
    if cfg.source == "agent":  # records as they are, for the episode function
        from polyrl.data.files import data_file
        from polyrl.data.rewards import load_callable

        data_file(cfg.path)
        load_callable(cfg.agent or "", "data.agent")
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


def _check_tokens(cfg: RunConfig) -> None:
    """The manager's token files hold a token (the run reads them again when it starts it)."""
    if cfg.rollout.mode == "local":
        return
    shared_token(cfg.manager.token, cfg.manager.token_file, "manager.token_file")
    if cfg.manager.read_token_file and not cfg.manager.read_token:
        read_token_file(cfg.manager.read_token_file, "manager.read_token_file")


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
