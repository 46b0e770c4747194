"""The worker's side of membership: register with the manager, heartbeat, leave; and
before any of it, before even the engine's imports, see that the manager answers and
takes the token (`check_manager`), so that a wrong token or URL costs a second, not the
time it takes to load a model.

Only transient failures are retried (connection errors, timeouts, 5xx, 429), with capped
exponential backoff; a refusal (401/403/422 and other 4xx) raises `ManagerRejected`, which
stops the worker with a clear message, since retrying a wrong token or a protocol
mismatch forever would hide the mistake. A 404 on heartbeat means the manager restarted
and forgot us: register again.

An outage is logged when it starts, every `RETRY_LOG_INTERVAL_S` while it lasts (a
worker given a wrong manager URL must not look hung) and once when it ends, not on every
beat. With `give_up_after_s` (`worker.manager_timeout_s`) an outage that long raises
`ManagerUnreachable`, which stops the worker; without it the worker retries forever, so
that a restarting manager finds its fleet again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import httpx
from pydantic import BaseModel, ValidationError

from polyrl.config import ConfigError, WorkerConfig
from polyrl.preflight import shared_token
from polyrl.protocol.manager_api import Heartbeat, LeaveRequest, RegisterRequest, RegisterResponse
from polyrl.tls import async_http_client, certificate_error

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = {408, 429}
RETRY_LOG_INTERVAL_S = 15.0
"""While the manager is unreachable, one line this often says so."""


class ManagerRejected(RuntimeError):
    """The manager refused this worker (bad token, protocol mismatch): retrying cannot help."""


class ManagerUnreachable(RuntimeError):
    """The manager stayed unreachable for longer than the worker was told to wait."""


class ManagerClient:
    """HTTP calls to the manager, each under `timeout_s`, with the bearer token.

    `transport` lets tests swap the network (httpx.MockTransport)."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float,
        ca_file: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = async_http_client(
            ca_file, base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    async def get(self, path: str) -> httpx.Response:
        return await self._http.get(path)

    async def post(self, path: str, message: BaseModel, timeout_s: float | None = None) -> httpx.Response:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        return await self._http.post(path, json=message.model_dump(mode="json"), timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()


def _is_transient(response: httpx.Response) -> bool:
    return response.status_code >= 500 or response.status_code in _RETRYABLE_STATUS


def _rejected(url: str, action: str, response: httpx.Response) -> ManagerRejected:
    """One line: the manager's own message from its error body, not the JSON."""
    code = response.status_code
    hint = {
        401: "; check worker.token / POLYRL_TOKEN",
        403: "; check worker.token / POLYRL_TOKEN",
        404: "; is worker.manager_url a polyrl manager?",
    }.get(code, "")
    return ManagerRejected(f"the manager at {url} refused {action}: {_error_message(response)} (HTTP {code}){hint}")


def _error_message(response: httpx.Response) -> str:
    """`{"error": {"message": ...}}` (`polyrl.httpapi`), else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(response.text.split())[:200] or response.reason_phrase


class ManagerContact:
    """Calls to the manager that wait out its outages: transient failures are retried with
    capped exponential backoff, and logged as the module says; with `give_up_after_s`
    (None or 0: never), ManagerUnreachable ends an outage that long."""

    def __init__(
        self, client: ManagerClient, max_backoff_s: float = 10.0, give_up_after_s: float | None = None
    ) -> None:
        self.client, self.max_backoff_s = client, max_backoff_s
        self.give_up_after_s = give_up_after_s or None
        self._outage_since: float | None = None
        self._outage_logged_at = 0.0

    async def check(self) -> None:
        """Wait until the manager answers, and see that it would take our registration
        (token, address). `polyrl worker` asks before it loads its engine (seconds; minutes
        for a large model), so that a wrong token or URL is told at once, not after
        "serving on". Raises ManagerRejected."""
        response = await self._answer(lambda: self.client.get("/v1/workers/register"))
        if response.is_error:
            raise _rejected(self.client.base_url, "the worker", response)
        self._outage_ended()

    async def _answer(self, call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """`call()`'s first answer that is not a transient failure."""
        delay_s = min(0.5, self.max_backoff_s)
        while True:
            try:
                response = await call()
                if not _is_transient(response):
                    return response
                self._outage_started(f"HTTP {response.status_code}")
            except httpx.TransportError as e:
                if certificate_error(e) is not None:
                    raise ManagerRejected(
                        f"{self.client.base_url}: {certificate_error(e)} (check worker.tls.ca_file)"
                    ) from None
                self._outage_started(_describe(e))
            await asyncio.sleep(min(delay_s, self._time_left_s()))  # the last try comes at the deadline
            delay_s = min(delay_s * 2, self.max_backoff_s)

    def _outage_started(self, why: str) -> None:
        """Record a failed call; log it if the outage is new or was last logged long ago.
        Raises ManagerUnreachable once the outage outlasts `give_up_after_s`."""
        now = time.monotonic()
        url = self.client.base_url
        if self._outage_since is None:
            self._outage_since = self._outage_logged_at = now
            patience = (
                f"giving up after {self.give_up_after_s:g}s"
                if self.give_up_after_s
                else "forever; worker.manager_timeout_s sets a limit"
            )
            log.warning("cannot reach the manager at %s: %s; retrying (%s)", url, why, patience)
        elif now - self._outage_logged_at >= RETRY_LOG_INTERVAL_S:
            self._outage_logged_at = now
            log.warning(
                "still cannot reach the manager at %s after %.0fs: %s; retrying", url, now - self._outage_since, why
            )
        if self._time_left_s() <= 0:
            raise ManagerUnreachable(
                f"gave up: the manager at {url} was unreachable for {now - self._outage_since:.0f}s "
                f"(worker.manager_timeout_s={self.give_up_after_s:g}): {why}"
            )

    def _time_left_s(self) -> float:
        """Until this outage's give-up deadline (inf without a deadline or an outage)."""
        if self.give_up_after_s is None or self._outage_since is None:
            return math.inf
        return self._outage_since + self.give_up_after_s - time.monotonic()

    def _outage_ended(self) -> None:
        if self._outage_since is not None:
            log.info("manager %s reachable again", self.client.base_url)
        self._outage_since = None


class ManagerSession(ManagerContact):
    """Keeps one worker registered for as long as `run()` runs."""

    def __init__(
        self,
        client: ManagerClient,
        registration: Callable[[], RegisterRequest],
        heartbeat: Callable[[], Heartbeat],
        interval_s: float,
        max_backoff_s: float = 10.0,
        on_registered: Callable[[RegisterResponse], None] | None = None,
        give_up_after_s: float | None = None,
    ) -> None:
        """`give_up_after_s`: raise ManagerUnreachable after an outage this long (None or
        0: retry forever)."""
        super().__init__(client, max_backoff_s, give_up_after_s)
        self.registration, self.heartbeat = registration, heartbeat
        self.interval_s = interval_s
        self.on_registered = on_registered
        self.worker_id: str | None = None
        self._wake = asyncio.Event()

    async def run(self) -> None:
        """Register, then heartbeat until cancelled. Raises ManagerRejected."""
        await self.register()
        while True:
            await self._sleep()
            await self.beat_once()

    async def _sleep(self) -> None:
        """One heartbeat interval, cut short by `wake()`. Not `asyncio.wait_for`: on
        Python 3.11 it swallows a cancellation that coincides with the wake-up, and the
        worker would then never stop heartbeating."""
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({woken}, timeout=self.interval_s)
        finally:
            woken.cancel()
        self._wake.clear()

    def wake(self) -> None:
        """Heartbeat now (e.g. on entering `draining`, so the manager stops routing to us)."""
        self._wake.set()

    async def register(self) -> RegisterResponse:
        """Register, retrying transient failures with capped exponential backoff."""
        response = await self._answer(lambda: self.client.post("/v1/workers/register", self.registration()))
        return self._registered(response)

    def _registered(self, response: httpx.Response) -> RegisterResponse:
        if response.status_code != 200:
            raise _rejected(self.client.base_url, "the registration", response)
        try:
            reply = RegisterResponse.model_validate_json(response.content)
        except ValidationError as e:
            raise ManagerRejected(f"manager sent an unreadable registration reply: {e}") from None
        self.worker_id = reply.worker_id
        if reply.heartbeat_interval_s is not None:
            self.interval_s = reply.heartbeat_interval_s
        self._outage_ended()
        log.info(
            "registered with %s as %s (heartbeat every %.1fs)", self.client.base_url, reply.worker_id, self.interval_s
        )
        if self.on_registered is not None:
            self.on_registered(reply)
        return reply

    async def beat_once(self) -> None:
        """One heartbeat; a transient failure is only recorded, the next beat retries."""
        assert self.worker_id is not None, "heartbeat before registration"
        try:
            response = await self.client.post(f"/v1/workers/{self.worker_id}/heartbeat", self.heartbeat())
        except httpx.TransportError as e:
            self._outage_started(_describe(e))
            return
        if response.status_code == 404:
            log.warning("manager does not know worker %s (restarted?); registering again", self.worker_id)
            await self.register()
        elif _is_transient(response):
            self._outage_started(f"HTTP {response.status_code}")
        elif response.is_error:
            raise _rejected(self.client.base_url, "a heartbeat", response)
        else:
            self._outage_ended()

    async def leave(self, reason: str, timeout_s: float = 2.0) -> bool:
        """Best effort: the manager also notices a worker that stops heartbeating."""
        if self.worker_id is None:
            return False
        try:
            response = await self.client.post(
                f"/v1/workers/{self.worker_id}/leave", LeaveRequest(reason=reason), timeout_s=timeout_s
            )
        except httpx.HTTPError as e:
            log.warning("leave not delivered to %s: %s: %s", self.client.base_url, type(e).__name__, e)
            return False
        log.info("left %s (%s): HTTP %d", self.client.base_url, reason, response.status_code)
        return not response.is_error


def _describe(error: httpx.TransportError) -> str:
    """'ConnectError: [Errno 111] Connection refused'; httpx's timeouts have no text."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def worker_client(w: WorkerConfig) -> ManagerClient:
    """The client of `w.manager_url`, with the worker's token (`preflight.shared_token`)."""
    assert w.manager_url is not None
    token = shared_token(w.token, w.token_file, "worker.token_file")
    return ManagerClient(w.manager_url, token, w.manager_request_timeout_s, w.tls.ca_file)


def check_manager(w: WorkerConfig) -> int | None:
    """`ManagerContact.check` for `polyrl worker`, before its imports and its engine: None
    once the manager took the token; else the exit code: 1 when it stayed unreachable past
    worker.manager_timeout_s (logged), 130 for a Ctrl-C while waiting. ConfigError (one
    line) when it refuses the worker."""

    async def check() -> None:
        client = worker_client(w)
        try:
            await ManagerContact(client, give_up_after_s=w.manager_timeout_s).check()
        finally:
            await client.aclose()

    try:
        asyncio.run(check())
    except ManagerRejected as e:
        raise ConfigError(f"config error: {e}") from None
    except ManagerUnreachable as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    return None
