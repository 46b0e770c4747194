"""`polyrl status URL --token-file F`: the operator page's fleet summary in the terminal.

Reads `GET /v1/fleet` once (or every `--interval` seconds with `--watch`) and prints
the counters and one row per worker as a rich table: for a terminal over ssh, a cron
job's log, or a cluster without a browser.
"""

from __future__ import annotations

import sys
import time

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from polyrl.console import console_on
from polyrl.manager.fleet import FleetStatus
from polyrl.tls import http_client

STATE_STYLE = {
    "registering": "magenta",
    "standby": "dim",
    "syncing": "yellow",
    "active": "green",
    "draining": "dark_orange",
    "gone": "red",
}
COLUMNS = (
    "worker",
    "state",
    "version",
    "node",
    "instance",
    "device",
    "tokens/s",
    "$/h",
    "uptime",
    "in flight",
    "failures",
)
NUMERIC = {"version", "tokens/s", "$/h", "in flight", "failures"}


class StatusError(Exception):
    """The manager could not be read; the message says why, for the operator."""


def fetch(url: str, token: str | None, timeout_s: float = 10.0, ca_file: str | None = None) -> FleetStatus:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with http_client(ca_file, headers=headers, timeout=timeout_s) as client:
            response = client.get(f"{url.rstrip('/')}/v1/fleet")
    except httpx.HTTPError as e:
        raise StatusError(f"cannot reach the manager at {url}: {type(e).__name__}: {e}") from None
    if response.status_code == 401 and not token:
        raise StatusError(
            f"no token given, and {url} wants one: pass --token-file RUN_DIR/manager.json "
            "(polyrl train writes its manager's token there), or set POLYRL_TOKEN"
        )
    if response.status_code == 401:
        raise StatusError(
            f"{url} refused the token (pass --token-file, or set POLYRL_TOKEN; RUN_DIR/manager.json has it)"
        )
    if response.status_code != 200:
        raise StatusError(f"{url}/v1/fleet answered HTTP {response.status_code}: {response.text[:200]}")
    return FleetStatus.model_validate_json(response.content)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _summary(fleet: FleetStatus, url: str) -> Text:
    serving = [w for w in fleet.workers if w.state in ("active", "draining")]
    tokens_per_s = sum(w.tokens_per_s for w in serving)
    prices = [w.usd_per_hour for w in serving if w.usd_per_hour is not None]
    usd = f"${sum(prices):,.2f}/h" if prices else "$-/h"
    per_usd = f"{tokens_per_s * 3600 / sum(prices):,.0f}" if prices and sum(prices) > 0 else "-"
    lost_style = "red" if fleet.num_lost_samples else ""
    return Text.assemble(
        (url, "bold"),
        f"  step/version v{fleet.latest_weight_version}  batches {fleet.num_open_batches}",
        f"  samples in flight {fleet.num_inflight_samples} (waiting {fleet.num_waiting_samples})",
        f"  migrated {fleet.num_migrations}  lost ",
        (str(fleet.num_lost_samples), lost_style),
        f"\n{tokens_per_s:,.0f} tokens/s  {usd}  {per_usd} tokens/$  {fleet.num_generated_tokens:,} tokens generated",
    )


def render(fleet: FleetStatus, url: str) -> Group:
    count = len(fleet.workers)
    table = Table(title=f"{count} worker{'' if count == 1 else 's'}", title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column in NUMERIC else "left")
    for w in fleet.workers:
        price = "-" if w.usd_per_hour is None else f"{w.usd_per_hour:.2f}"
        table.add_row(
            w.worker_id + (" (local)" if w.is_local else ""),
            Text(w.state, STATE_STYLE[w.state]),
            f"v{w.weight_version}",
            w.node or w.host,
            w.instance_type or "-",
            w.device or "-",
            f"{w.tokens_per_s:,.0f}",
            price,
            _duration(w.uptime_s),
            str(w.num_inflight),
            str(w.num_failures),
        )
    return Group(_summary(fleet, url), table)


def status(
    url: str,
    token: str | None,
    watch: bool = False,
    interval_s: float = 2.0,
    console: Console | None = None,
    ca_file: str | None = None,
) -> int:
    """Print the fleet once (or until interrupted, with `watch`); 1 if it cannot be read.
    Errors go to stderr, unless `console` is given. Off a terminal nothing is wrapped
    (`polyrl.console`), and `watch` prints one table per refresh: rich's live display
    would show only the last, once stopped."""
    out = console or console_on(sys.stdout)
    try:
        if watch and out.is_terminal:
            with Live(render(fetch(url, token, ca_file=ca_file), url), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(render(fetch(url, token, ca_file=ca_file), url), refresh=True)
        while True:
            out.print(render(fetch(url, token, ca_file=ca_file), url))
            if not watch:
                return 0
            time.sleep(interval_s)
    except StatusError as e:
        (console or console_on(sys.stderr)).print(Text(str(e), style="red"))
        return 1
    except KeyboardInterrupt:
        return 0
