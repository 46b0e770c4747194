"""The operator page (`GET /`) and who may read the fleet.

Reading the fleet (the page, `/v1/fleet`, `/v1/workers`, `/metrics`) shows worker URLs
and load, so it needs a token too: the manager's own, or `manager.read_token`, which
reads but cannot act (hand it to dashboards and Prometheus). A browser cannot send a
header when it opens a URL, so the page also takes `?token=`; its script then sends the
token as a bearer header. A manager with no token at all (loopback-only set-ups) stays
open, as its mutating endpoints are.
"""

from __future__ import annotations

import hmac
from functools import cache
from importlib.resources import files

from fastapi import Request
from fastapi.responses import HTMLResponse

from polyrl.config import ManagerConfig
from polyrl.httpapi import ApiError

# no external assets and nothing framed elsewhere: the page is one inline file
HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'",
}

LOGIN_HEADERS = HEADERS | {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'"}
LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>polyrl fleet: token</title></head>
<body style="font:15px system-ui,sans-serif;margin:40px">
<h1 style="font-size:18px">polyrl fleet</h1>
{notice}<p>This page needs the manager's token (<code>manager.token</code>, or <code>manager.read_token</code>;
the main job writes it to <code>RUN_DIR/manager.json</code>).</p>
<form method="get" action=""><input name="token" type="password" size="40" autofocus> <button>open</button></form>
</body></html>"""
REFUSED = """<p id="refused" role="alert" style="color:#b3261e;font-weight:600">The manager refused that token:
it is neither <code>manager.token</code> nor <code>manager.read_token</code>.</p>
"""
"""Shown above the form when a token was given and is wrong: the same blank form again
would look as if the link had lost it."""


@cache
def page_html() -> str:
    return (files("polyrl.manager") / "static" / "operator.html").read_text(encoding="utf-8")


def bearer(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


class Readers:
    """Which tokens may read the fleet."""

    def __init__(self, cfg: ManagerConfig) -> None:
        self.tokens = [t.encode() for t in (cfg.token, cfg.read_token) if t]

    def allows(self, given: str | None) -> bool:
        if not self.tokens:
            return True
        if given is None:
            return False
        # every token compared, in constant time each: how many matched tells nothing
        return sum(hmac.compare_digest(given.encode(), t) for t in self.tokens) > 0

    def check(self, request: Request) -> None:
        """The dependency of the read endpoints: 401 unless a reader's bearer token."""
        if not self.allows(bearer(request)):
            raise ApiError(401, "missing or wrong bearer token (manager.token or manager.read_token)", "unauthorized")

    def page(self, request: Request) -> HTMLResponse:
        """The page for a reader (bearer header or `?token=`), else a 401: a form asking
        for the token to a browser, the API's error body to anything else."""
        given = bearer(request) or request.query_params.get("token")
        if not self.allows(given):
            if "text/html" not in request.headers.get("accept", ""):
                raise ApiError(401, "missing or wrong token (bearer header or ?token=)", "unauthorized")
            return HTMLResponse(LOGIN.format(notice=REFUSED if given else ""), status_code=401, headers=LOGIN_HEADERS)
        return HTMLResponse(page_html(), headers=HEADERS)
