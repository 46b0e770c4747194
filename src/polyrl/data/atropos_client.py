"""The trainer's side of the Atropos API: register, then poll `/batch` until a batch comes.

The API keeps all its state in memory, so a restart (or `/reset_data`) forgets the
trainer. The client notices (an "error" status from `/batch`, or a server error) and
registers again with the steps done so far as `starting_step`. While the API does not
answer at all, the client retries with capped back-off for `unreachable_timeout_s`,
then fails with one line that names the URL.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError

from polyrl.config import AtroposConfig
from polyrl.data.atropos import BatchReply, Registration
from polyrl.tls import http_client

log = logging.getLogger("polyrl.atropos")


class AtroposError(RuntimeError):
    """The Atropos API cannot serve this run; `str()` is one line."""


class AtroposUnreachable(AtroposError):
    pass


class AtroposClient:
    def __init__(self, cfg: AtroposConfig, registration: Registration) -> None:
        assert cfg.url is not None
        self.cfg, self.registration = cfg, registration
        self.url = cfg.url.rstrip("/")
        self.http = http_client(None, base_url=self.url, timeout=cfg.timeout_s)  # the system's trust store
        self.num_registrations = 0

    def close(self) -> None:
        self.http.close()

    def register(self, steps_done: int) -> None:
        """`POST /register`, retried while the API is unreachable."""
        self.registration = self.registration.model_copy(update={"starting_step": steps_done})
        try:
            self._call("POST", "/register", json=self.registration.model_dump())
        except _ServerError as e:
            raise AtroposError(f"Atropos API at {self.url}: {e} (see the API's log)") from None
        self.num_registrations += 1
        log.info(
            "registered with the Atropos API at %s (batch_size=%d, starting_step=%d)",
            self.url,
            self.registration.batch_size,
            steps_done,
        )

    def next_batch(self, steps_done: int) -> list[dict[str, Any]]:
        """The next batch's groups, unparsed: polls with back-off until the environments
        have queued a batch."""
        wait_s, t0 = self.cfg.poll_interval_s, time.monotonic()
        just_registered = False
        while True:
            try:
                reply = BatchReply.model_validate(self._call("GET", "/batch").json())
            except ValidationError as e:
                raise AtroposError(f"Atropos API at {self.url}: a malformed batch: {_first_error(e)}") from None
            except _ServerError as e:
                if just_registered:  # registering did not help: not a lost state
                    raise AtroposError(f"Atropos API at {self.url}: {e} (see the API's log)") from None
                log.warning("Atropos API at %s: %s; registering again (a reset API has lost its state)", self.url, e)
                self.register(steps_done)
                just_registered = True
                continue
            if reply.is_unregistered:
                if just_registered:
                    raise AtroposError(
                        f"Atropos API at {self.url} ignores this trainer's registration (it took scored data before "
                        f"any trainer registered, which leaves it half set up): call its /reset_data or restart it"
                    )
                log.warning("Atropos API at %s does not know this trainer (restarted?): registering again", self.url)
                self.register(steps_done)
                just_registered = True
                continue
            just_registered = False
            if reply.batch is not None:
                return reply.batch
            if self.cfg.batch_timeout_s and time.monotonic() - t0 > self.cfg.batch_timeout_s:
                raise AtroposError(
                    f"Atropos API at {self.url}: no batch within data.atropos.batch_timeout_s="
                    f"{self.cfg.batch_timeout_s:g}s (are the environments running and registered?)"
                )
            time.sleep(wait_s)
            wait_s = min(wait_s * 2, self.cfg.max_poll_interval_s)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One request, retried with capped back-off while the API is unreachable or
        times out; a 4xx fails at once, a 5xx raises _ServerError for the caller."""
        deadline = time.monotonic() + self.cfg.unreachable_timeout_s
        wait_s, warned = self.cfg.poll_interval_s, False
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as e:  # refused, reset, timed out
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:  # (the last wait ends at the deadline: the message's time is true)
                    raise AtroposUnreachable(
                        f"Atropos API at {self.url} unreachable for {self.cfg.unreachable_timeout_s:g}s "
                        f"(data.atropos.unreachable_timeout_s): {reason}"
                    ) from None
                if not warned:
                    log.warning(
                        "Atropos API at %s unreachable (%s): retrying for up to %.0fs",
                        self.url,
                        reason,
                        self.cfg.unreachable_timeout_s,
                    )
                    warned = True
                time.sleep(min(wait_s, remaining_s))
                wait_s = min(wait_s * 2, self.cfg.max_poll_interval_s)
                continue
            if warned:
                log.info("Atropos API at %s answers again", self.url)
            if response.status_code >= 500:
                raise _ServerError(f"{method} {path} -> HTTP {response.status_code}")
            if response.status_code >= 400:
                raise AtroposError(
                    f"Atropos API at {self.url}: {method} {path} -> HTTP {response.status_code}: {response.text[:200]}"
                )
            return response


class _ServerError(Exception):
    pass


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
