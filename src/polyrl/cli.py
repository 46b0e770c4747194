"""`polyrl` command line: `train`, `worker`, `manager`, `tiny-model`, `report`, `status`, `plan`."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from polyrl.config import ConfigError, ManagerRunConfig, RunConfig, WorkerRunConfig, load_config
from polyrl.gc_heap import start_up_imports
from polyrl.lifetime import die_with_parent_from_env
from polyrl.pipes import survive_closed_pipes

if TYPE_CHECKING:
    from polyrl.trainer.distributed import DataParallel

log = logging.getLogger("polyrl")

EXIT_CONFIG = 2


LIBRARY_QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Hugging Face advisories and progress bars (`datasets`' per-map bars leaked into run
logs) are not for operators. Set as environment, not by calling the libraries: they read
it when imported, which stays after the config checks (importing them costs seconds), and
every process the run starts inherits it. A value the user set wins."""


def _setup_logging(verbose: bool) -> None:
    """rich's colours for a terminal; one plain line per event for a file (a launched
    worker's log, `polyrl train > train.log`). Neither breaks a line (`polyrl.console`)."""
    if sys.stdout.isatty():
        from polyrl.console import TerminalHandler

        handler: logging.Handler = TerminalHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stdout)  # where rich's console writes too
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    # Third-party chatter (per-shard progress bars, HTTP client lines) is not for operators.
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, value in LIBRARY_QUIET_ENV.items():
        os.environ.setdefault(name, value)


def _default_run_dir(task: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{task}"


def cmd_train(args: argparse.Namespace) -> int:
    """One process, or every rank under `torchrun --nproc_per_node N -m polyrl.cli train ...`:
    rank 0 runs everything below; the others follow it (README, "Training on several GPUs").

    Rank 0 checks the config, its files, modules and ports (`polyrl.preflight`) before
    torch is imported and before the run directory exists: a config error takes a fraction
    of a second and leaves nothing to clean up."""
    is_main = os.environ.get("RANK", "0") == "0"
    cfg, run_dir = train_config(args) if is_main else (None, None)
    with start_up_imports():
        from polyrl.trainer.distributed import data_parallel
        from polyrl.trainer.loop import follow

    with data_parallel() as dp:
        if not dp.is_main:
            follow(dp)
            return 0
        assert cfg is not None and run_dir is not None
        return _train_main(cfg, run_dir, bool(args.resume), dp)


def train_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The run's config and directory, checked against this machine; writes nothing.
    Raises ConfigError."""
    from polyrl.preflight import check_world_size, preflight

    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ConfigError("config error: --resume reads RUN_DIR/config.toml; do not pass --config too")
        if not (run_dir / "config.toml").exists():
            raise ConfigError(f"config error: --resume: {run_dir}/config.toml not found")
        cfg = load_config(run_dir / "config.toml", args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(cfg.data.task)
        if any((run_dir / name).exists() for name in ("checkpoints", "metrics.jsonl", "init_model")):
            raise ConfigError(f"config error: --run-dir {run_dir} already holds a run; use --resume {run_dir}")
    check_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    preflight(cfg)
    return cfg, run_dir


def _train_main(cfg: RunConfig, run_dir: Path, resume: bool, dp: DataParallel) -> int:
    from polyrl.data.atropos_client import AtroposError
    from polyrl.data.rewards import RewardPoolError
    from polyrl.trainer.loop import train

    log.info("run directory: %s", run_dir)
    before = set(os.listdir(run_dir)) if run_dir.is_dir() else None
    try:
        train(cfg, run_dir, resume=resume, dp=dp)
    except ConfigError:
        if not resume:
            _discard_unstarted_run(run_dir, before)
        raise
    except (AtroposError, RewardPoolError) as e:  # the API is gone, reward workers keep dying: one line, how to go on
        log.error("%s; continue with: polyrl train --resume %s", e, run_dir)
        return 1
    except KeyboardInterrupt:
        signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # stopped already: a late Ctrl-C must not turn exit 130 into a traceback
        log.warning("stopped; continue with: polyrl train --resume %s", run_dir)
        return 130
    return 0


def _discard_unstarted_run(run_dir: Path, before: set[str] | None) -> None:
    """A config error that only loading could find (a tokenizer without a chat template, a
    model too short for the prompts): remove what the start wrote (all of `run_dir` if it
    did not exist, else the entries not in `before`), so the corrected command may use the
    same --run-dir. A run that logged a step is never touched."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        return
    if before is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in run_dir.iterdir():
        if path.name in before:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    with start_up_imports():
        from polyrl.models.tiny import save_tiny_model

    overrides = [*args.overrides, *(["chat_template=true"] if args.chat_template else [])]
    cfg = load_config(None, [f"model.tiny.{o}" for o in overrides]).model.tiny
    save_tiny_model(args.out, cfg)
    print(args.out)
    return 0


_WORKER_FLAGS = {
    "model": "model.path",
    "manager": "worker.manager_url",
    "token": "worker.token",
    "token_file": "worker.token_file",
    "host": "worker.host",
    "port": "worker.port",
    "worker_id": "worker.worker_id",
}


_MANAGER_FLAGS = {
    "host": "manager.host",
    "port": "manager.port",
    "token": "manager.token",
    "token_file": "manager.token_file",
}


def _flag_overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Flags as dotted overrides. They go last, so they win over the file and the other
    overrides; values go in as TOML literals (JSON strings are valid TOML strings), so a
    path or token is never re-read as a number."""
    return [
        f"{key}={json.dumps(getattr(args, name))}" for name, key in flags.items() if getattr(args, name) is not None
    ]


def worker_config(args: argparse.Namespace) -> WorkerRunConfig:
    """The worker's config: defaults < --config file < dotted overrides < flags."""
    cfg = load_config(args.config, [*args.overrides, *_flag_overrides(args, _WORKER_FLAGS)], schema=WorkerRunConfig)
    if not cfg.model.path:
        raise ConfigError(
            "config error: model.path: the worker needs a model directory: pass --model PATH "
            "(for a tiny offline one: polyrl tiny-model --out DIR)"
        )
    from polyrl.preflight import check_model_dir, shared_token

    try:
        check_model_dir(cfg.model.path)
        token = shared_token(cfg.worker.token, cfg.worker.token_file, "worker.token_file")
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    return cfg.model_copy(update={"worker": cfg.worker.model_copy(update={"token": token})})


def cmd_worker(args: argparse.Namespace) -> int:
    cfg = worker_config(args)
    sock = _listen_socket(cfg.worker.host, cfg.worker.port, "worker.port")  # before seconds of imports
    if cfg.worker.manager_url:  # the manager too: a wrong token or URL is told before the engine loads
        from polyrl.worker.manager_client import check_manager

        if (code := check_manager(cfg.worker)) is not None:
            return code
    with start_up_imports():
        from polyrl.worker.main import run_worker

    return run_worker(cfg, sock)


def manager_config(args: argparse.Namespace) -> ManagerRunConfig:
    from polyrl.preflight import resolve_token

    overrides = [*args.overrides, *_flag_overrides(args, _MANAGER_FLAGS)]
    cfg = load_config(args.config, overrides, schema=ManagerRunConfig)
    resolve_token(cfg.manager)  # refuses a non-loopback address without a token
    return cfg


def cmd_manager(args: argparse.Namespace) -> int:
    cfg = manager_config(args).manager
    listen_fd = args.listen_fd
    if listen_fd is None:  # bound here, before seconds of imports: a taken port is one quick line
        listen_fd = _listen_socket(cfg.host, cfg.port, "manager.port").detach()
    from polyrl.manager.main import run_manager

    return run_manager(cfg, args.ready_file, listen_fd)


def _listen_socket(host: str, port: int, key: str) -> socket.socket:
    from polyrl.preflight import bind_or_refuse

    try:
        return bind_or_refuse(host, port, key)
    except OSError as e:
        raise ConfigError(f"config error: {e}") from None


def cmd_report(args: argparse.Namespace) -> int:
    from polyrl.report import ReportError, report

    run_dirs = [Path(d) for d in args.run_dirs]
    out = Path(args.out) if args.out else run_dirs[0] / "report"
    try:
        paths = report(run_dirs, out)
    except ReportError as e:
        print(f"polyrl report: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{len(paths) - 1} plots and {paths[-1]}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from polyrl.preflight import shared_token
    from polyrl.status import status

    try:
        token = shared_token(args.token, args.token_file, "--token-file")
    except ValueError as e:
        raise ConfigError(f"polyrl status: {e}") from None
    return status(args.url, token, args.watch, args.interval, ca_file=args.ca_file)


TOKEN_FILE_HELP = (
    "a file holding the token, or a run's manager.json; unlike --token, ps does not show it "
    "({key}; default: $POLYRL_TOKEN_FILE)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run GRPO training (default: manager + 2 local rollout workers)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--run-dir", help="output directory (default: runs/<time>-<task>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-6 rollout.n=8"
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("tiny-model", help="build a tiny random model + tokenizer as an HF directory")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--chat-template", action="store_true", help="give the tokenizer a chat template (chat_template=true)"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="model.tiny keys, e.g. arch=llama hidden_size=64")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("worker", help="serve one engine over HTTP (SGLang-compatible) as a rollout worker")
    p.add_argument("--config", help="TOML config file (sections model, engine, worker)")
    p.add_argument("--model", metavar="PATH", help="local HF model directory (model.path)")
    p.add_argument("--manager", metavar="URL", help="rollout manager to register with (worker.manager_url)")
    p.add_argument("--token", help="shared secret for the manager (worker.token; default: $POLYRL_TOKEN)")
    p.add_argument("--token-file", metavar="FILE", help=TOKEN_FILE_HELP.format(key="worker.token_file"))
    p.add_argument("--host", help="address to listen on (worker.host)")
    p.add_argument("--port", type=int, help="port to listen on, 0 = any free one (worker.port)")
    p.add_argument("--worker-id", help="id to register under (worker.worker_id; default: <hostname>-<port>)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. engine.max_num_seqs=64")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("manager", help="run the rollout manager standalone (workers register with it)")
    p.add_argument("--config", help="TOML config file (section manager)")
    p.add_argument("--host", help="address to listen on (manager.host)")
    p.add_argument("--port", type=int, help="port to listen on, 0 = any free one (manager.port; default 5000)")
    p.add_argument("--token", help="shared secret (manager.token; default: $POLYRL_TOKEN)")
    p.add_argument("--token-file", metavar="FILE", help=TOKEN_FILE_HELP.format(key="manager.token_file"))
    p.add_argument("--ready-file", help="write the URL there once serving (for a parent process)")
    p.add_argument("--listen-fd", type=int, help="serve on this inherited, bound socket (for a parent process)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. manager.retry_budget=3")
    p.set_defaults(func=cmd_manager)

    p = sub.add_parser("report", help="plots of one or more runs (metrics.jsonl) as PNGs and one HTML file")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, drawn on the same axes")
    p.add_argument("--out", metavar="DIR", help="where to write them (default: RUN_DIR/report of the first run)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("status", help="the fleet of a running manager as a table")
    p.add_argument("url", metavar="URL", help="the manager, e.g. http://127.0.0.1:5000")
    p.add_argument("--token", help="the manager's token or read token (default: $POLYRL_TOKEN)")
    p.add_argument("--token-file", metavar="FILE", help=TOKEN_FILE_HELP.format(key="e.g. RUN_DIR/manager.json"))
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    p.add_argument("--ca-file", help="PEM CA bundle to verify an https manager against (default: the system's)")
    p.set_defaults(func=cmd_status)

    from polyrl.plan.command import add_parser as add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent_from_env()  # a child of polyrl train: go when it goes (`polyrl.lifetime`)
    args = build_parser().parse_args(argv)
    if args.command == "train":  # a Ctrl-C that kills `| tee` must not cost the save
        survive_closed_pipes()
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return EXIT_CONFIG


def exit_now(code: int) -> NoReturn:
    """Leave the process without the interpreter's teardown.

    A process that imported torch and transformers and built a model takes about a second
    to tear its interpreter down (every module and object finalised, 0.8-1.0 s measured on
    an idle 2-core box; the trainer, the manager and three workers exit together at the end
    of a run). Everything with an effect outside the process is still done: other
    non-daemon threads are joined and the atexit handlers run (logging's flush,
    multiprocessing's finalizers and resource tracker); what is skipped only frees memory."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def entry() -> NoReturn:
    """The `polyrl` command (`main` is the same, returning, for calls in-process)."""
    code = main()
    exit_now(int(code or 0))


if __name__ == "__main__":
    entry()
