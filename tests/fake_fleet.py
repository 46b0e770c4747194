"""Dozens of fake rollout engines in ONE process of their own, cheap enough for a 2-core box.

    python tests/fake_fleet.py --manager URL --token T   # prints "fake fleet serving on URL"

A `FakeWorker` (tests/test_manager.py) costs a uvicorn thread and a heartbeat thread each.
Here every engine is a path prefix of one raw ASGI app (`{fleet}/w7/generate`,
`{fleet}/w7/health_generate`) on one event-loop thread, and all memberships are the real
worker's `ManagerSession`s sharing one `ManagerClient` on a second loop thread (on the
engines' loop, busy with hundreds of streams, heartbeats came late enough for the
manager to declare live engines gone). The fleet runs in a process of its own: sharing
the manager's GIL, it made the manager's latency and memory mostly its own.

The test drives it over control routes of the same app (`/_fleet/join`, `/_fleet/churn`,
...; see `FleetProcess` in tests/load_harness.py). An engine's streams read its state at
every token, so killing or draining it is one assignment:

* killed: its streams are cut at their next token, it stops heartbeating without
  leaving, and every later connection to its path is cut (a dead process refuses them;
  both read as WorkerUnreachable);
* drained: it says `draining` in a heartbeat at once, answers new calls with 503, hands
  running samples back (finish "abort"), then leaves, as `polyrl worker` does on SIGTERM.

Tokens depend on (seed, absolute position) only, as the engine's position-keyed sampling
does, so a sample that migrated any number of times must equal `expected_tokens`. The
token function is a bijection of the seed at every position (test_manager's `fake_token`
repeats every 50 seeds), so a sample delivered to the wrong prompt or batch shows too.
No torch here: the process starts in under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import uvicorn

from polyrl.httpapi import checksum
from polyrl.protocol.manager_api import BatchPrompt, Heartbeat, RegisterRequest, RegisterResponse
from polyrl.serving import QuietServer, bind
from polyrl.worker.manager_client import ManagerClient, ManagerSession

log = logging.getLogger("fake_fleet")

CUT = "ASGI callable returned without completing response."
"""uvicorn's log line for a stream cut on purpose (a killed engine)."""


# ----------------------------------------------------------------------------- the "model"


def load_token(seed: int, position: int) -> int:
    """Odd multiplier mod 2**20: distinct seeds (< 2**20) give distinct tokens everywhere."""
    return 3 + (seed * 2654435761 + position * 40503) % 2**20


def load_logprob(seed: int, position: int) -> float:
    return -((seed + position) % 97) / 64  # exact in binary: compared with ==


def expected_tokens(prompt: BatchPrompt, index: int, length: int) -> list[int]:
    start, seed = len(prompt.input_ids), (prompt.seed or 0) + index
    return [load_token(seed, start + t) for t in range(length)]


def sse_event(payload: Any, with_checksum: bool) -> bytes:
    """As `polyrl.worker.protocol.sse_event` writes it (not imported: it pulls in torch)."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    head = b": xxh3 " + checksum(data).encode() + b"\n" if with_checksum else b""
    return head + b"data: " + data + b"\n\n"


def _chunk(
    rid: str, seed: int, index: int, start: int, sent: int, total: int, finish: Any, incremental: bool
) -> dict[str, Any]:
    """Sample `index` with `total` tokens, `sent` of them already streamed: all of them
    (SGLang's cumulative snapshot), or only the new ones (polyrl's incremental chunk)."""
    positions = range(start + (sent if incremental else 0), start + total)
    tokens = [load_token(seed, p) for p in positions]
    return {
        "text": "",
        "output_ids": tokens,
        "index": index,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": start,
            "completion_tokens": total,
            "weight_version": 0,
            "output_token_weight_versions": [0] * len(tokens),
            "output_token_logprobs": [
                [load_logprob(seed, p), tok, None] for p, tok in zip(positions, tokens, strict=True)
            ],
        },
    }


# ------------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class Churn:
    """How the fleet changes while a round of load runs."""

    interval_s: float = 0.1
    max_events: int = 60
    """Per round: a slow box then sees no more churn, and so no more work, than a fast one."""
    min_alive: int = 8
    max_alive: int = 40


@dataclass(eq=False)
class FakeEngine:
    worker_id: str
    incremental: bool
    """Speaks polyrl's incremental chunks (else SGLang's cumulative snapshots): both parsers run."""
    state: Literal["active", "draining", "dead"] = "active"
    num_running: int = 0
    num_registrations: int = 0
    session: ManagerSession | None = None
    membership: asyncio.Task[None] | None = None


@dataclass
class FleetStats:
    num_joined: int = 0
    num_killed: int = 0
    num_drained: int = 0
    num_registrations: int = 0
    num_reregistrations: int = 0
    """After a 404 on a heartbeat: the manager declared a live engine gone (beats too late)."""
    num_leaves_delivered: int = 0
    num_calls: int = 0
    num_cut_streams: int = 0
    num_handbacks: int = 0
    errors: list[str] = field(default_factory=list)


class FakeFleet:
    """Fake engines `{url}/w{k}` behind one server, their memberships and the churn driver."""

    def __init__(self, manager_url: str, token: str, *, max_num_seqs: int, token_delay_s: float, seed: int) -> None:
        self.manager_url, self.token = manager_url, token
        self.max_num_seqs, self.token_delay_s = max_num_seqs, token_delay_s
        self.rng = random.Random(seed)
        self.engines: dict[str, FakeEngine] = {}
        self.stats = FleetStats()
        self._ids = itertools.count()
        self.members = asyncio.new_event_loop()
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.client: ManagerClient | None = None
        self._churn: asyncio.Task[None] | None = None
        self._churn_stop = asyncio.Event()
        self._control: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "join": self._join_many,
            "churn": self._start_churn,
            "churn/stop": self._stop_churn,
            "alive": self._alive,
            "stats": self._stats,
            "probe": self._add_probe,
        }

    def serve(self) -> None:
        """Serve until the process is killed (or its parent goes away)."""
        threading.Thread(target=self.members.run_forever, name="fleet-members", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._open_client(), self.members).result(10)
        config = uvicorn.Config(self, log_config=None, log_level="warning", access_log=False, lifespan="off")
        server = QuietServer(config)

        async def main() -> None:
            serving = asyncio.create_task(server.serve(sockets=[self.sock]))
            while not server.started:
                await asyncio.sleep(0.01)
            print(f"fake fleet serving on {self.url}", flush=True)
            parent = os.getppid()
            while not serving.done() and os.getppid() == parent:  # an orphan stops
                await asyncio.sleep(0.5)

        asyncio.run(main())

    async def _open_client(self) -> None:
        self.client = ManagerClient(self.manager_url, self.token, timeout_s=10)

    # ------------------------------------------------------------------------ control routes
    # They run on the membership loop: sessions and the churn live there.

    async def _join_many(self, body: dict[str, Any]) -> list[str]:
        return [self._join() for _ in range(body["count"])]

    async def _alive(self, body: dict[str, Any]) -> list[str]:
        """Engines that serve and mean to stay (not draining, not dead)."""
        return sorted(e.worker_id for e in self.engines.values() if e.state == "active")

    async def _stats(self, body: dict[str, Any]) -> dict[str, Any]:
        return asdict(self.stats)

    async def _add_probe(self, body: dict[str, Any]) -> str:
        """An engine that serves like the others but is never churned; its membership is
        the caller's (the latency probe). Returns its URL."""
        self.engines[body["worker_id"]] = FakeEngine(body["worker_id"], incremental=True)
        return f"{self.url}/{body['worker_id']}"

    async def _start_churn(self, body: dict[str, Any]) -> None:
        assert self._churn is None, "churn already running"
        self._churn_stop.clear()
        self._churn = asyncio.ensure_future(self._churn_loop(Churn(**body)))

    async def _stop_churn(self, body: dict[str, Any]) -> None:
        self._churn_stop.set()
        if self._churn is not None:
            await self._churn
            self._churn = None

    async def _churn_loop(self, churn: Churn) -> None:
        """About every `interval_s` one event, a join, a kill or a drain (of an engine with
        streams running, if any), keeping the number of active engines within
        [min_alive, max_alive]."""
        drains: set[asyncio.Task[None]] = set()
        for _ in range(churn.max_events):
            await asyncio.sleep(churn.interval_s * self.rng.uniform(0.5, 1.5))
            if self._churn_stop.is_set():
                break
            active = [e for e in self.engines.values() if e.state == "active" and e.session is not None]
            busy = [e for e in active if e.num_running > 0] or active  # the point: cut streams mid-sample
            r = self.rng.random()
            if len(active) <= churn.min_alive or (len(active) < churn.max_alive and r < 0.4):
                self._join()
            elif r < 0.7:
                self._kill(self.rng.choice(busy))
            else:
                task = asyncio.ensure_future(self._drain(self.rng.choice(busy)))
                drains.add(task)
                task.add_done_callback(drains.discard)
        await asyncio.gather(*drains)

    # ---------------------------------------------------------------------------- membership

    def _join(self) -> str:
        worker_id = f"w{next(self._ids)}"
        engine = FakeEngine(worker_id, incremental=self.rng.random() < 0.5)
        registration = RegisterRequest(
            worker_id=worker_id,
            url=f"{self.url}/{worker_id}",
            model_path="fake",
            weight_version=0,
            max_num_seqs=self.max_num_seqs,
            max_model_len=4096,
            capabilities=["incremental_stream", "batched_generate"] if engine.incremental else [],
        )

        def beat() -> Heartbeat:
            state = "draining" if engine.state == "draining" else "active"
            return Heartbeat(
                state=state, weight_version=0, num_running=engine.num_running, num_waiting=0, gen_throughput=0.0
            )

        def registered(_: RegisterResponse) -> None:
            self.stats.num_registrations += 1
            self.stats.num_reregistrations += engine.num_registrations > 0
            engine.num_registrations += 1

        assert self.client is not None
        engine.session = ManagerSession(
            self.client, lambda: registration, beat, interval_s=0.5, on_registered=registered
        )
        engine.membership = asyncio.ensure_future(engine.session.run())
        engine.membership.add_done_callback(self._membership_done)
        self.engines[worker_id] = engine
        self.stats.num_joined += 1
        return worker_id

    def _membership_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.stats.errors.append(f"membership failed: {task.exception()!r}")

    def _kill(self, engine: FakeEngine) -> None:
        engine.state = "dead"
        del self.engines[engine.worker_id]  # its path now cuts every connection
        if engine.membership is not None:
            engine.membership.cancel()
        self.stats.num_killed += 1

    async def _drain(self, engine: FakeEngine) -> None:
        engine.state = "draining"
        assert engine.session is not None and engine.membership is not None
        engine.session.wake()  # tell the manager now, not at the next beat
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while engine.num_running > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        engine.membership.cancel()
        await asyncio.wait({engine.membership})
        delivered = await engine.session.leave("drained")  # not `+= await`: drains run concurrently
        self.stats.num_leaves_delivered += delivered
        self.engines.pop(engine.worker_id, None)
        self.stats.num_drained += 1

    # ----------------------------------------------------------------------------- the app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        path = scope["path"]
        if path.startswith("/_fleet/"):
            body = await _read_body(receive)
            future = asyncio.run_coroutine_threadsafe(self._control[path[8:]](body or {}), self.members)
            await _send_json(send, 200, await asyncio.wrap_future(future))
            return
        _, worker_id, action = (path.split("/", 2) + ["", ""])[:3]
        engine = self.engines.get(worker_id)
        if engine is None or engine.state == "dead":
            # a dead process: headers, then nothing; uvicorn closes the connection
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return
        if action == "health_generate":
            await _send_json(send, 200, {})
        elif action == "generate":
            body = await _read_body(receive)
            if body is not None:
                await self._generate(engine, body, receive, send)
        else:
            await _send_json(send, 404, {"error": {"message": f"no route {path}"}})

    async def _generate(self, engine: FakeEngine, body: dict[str, Any], receive: Any, send: Any) -> None:
        """One call, or several (SGLang's batched form, as polyrl workers take it: samples
        numbered across the prompts), streamed a token per `token_delay_s`."""
        self.stats.num_calls += 1
        if engine.state == "draining":
            await _send_json(send, 503, {"error": {"message": "worker is draining", "type": "draining"}})
            return
        batched = bool(body["input_ids"]) and isinstance(body["input_ids"][0], list)
        inputs = body["input_ids"] if batched else [body["input_ids"]]
        rids = body["rid"] if batched else [body["rid"]]
        params = body["sampling_params"] if batched else [body["sampling_params"]]
        prompts, offset = [], 0  # (rid, n, seed, budget, prompt length, index of its first sample)
        for ids, rid, sp in zip(inputs, rids, params, strict=True):
            prompts.append((rid, sp["n"], sp["sampling_seed"], sp["max_new_tokens"], len(ids), offset))
            offset += sp["n"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        disconnected = asyncio.ensure_future(receive())  # resolves when the manager hangs up
        engine.num_running += offset
        try:
            for t in range(1, max(p[3] for p in prompts) + 1):
                await asyncio.sleep(self.token_delay_s)
                if engine.state == "dead":
                    self.stats.num_cut_streams += 1
                    return  # response incomplete: uvicorn cuts the connection
                if disconnected.done():
                    return
                handback = engine.state == "draining"
                events = []
                for rid, n, seed, budget, start, first in prompts:
                    if t > budget:
                        continue  # finished at an earlier token
                    finish = {"type": "abort"} if handback else ({"type": "length"} if t == budget else None)
                    total = t - 1 if handback else t  # a hand-back brings no new token
                    events += [
                        sse_event(
                            _chunk(rid, seed + j, first + j, start, t - 1, total, finish, engine.incremental),
                            with_checksum=engine.incremental,
                        )  # as `polyrl worker` does
                        for j in range(n)
                    ]
                await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
                if handback:
                    self.stats.num_handbacks += len(prompts)
                    break
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            engine.num_running -= offset
            disconnected.cancel()


async def _read_body(receive: Any) -> Any:
    """The request's JSON (None if empty), or None when the client hung up before sending it all."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return json.loads(body) if body else None


async def _send_json(send: Any, status: int, payload: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


class _QuietCuts(logging.Filter):
    """Drop uvicorn's error line for the streams cut on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != CUT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manager", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--token-delay-s", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="fake fleet: %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.error").addFilter(_QuietCuts())
    fleet = FakeFleet(
        args.manager, args.token, max_num_seqs=args.max_num_seqs, token_delay_s=args.token_delay_s, seed=args.seed
    )
    fleet.serve()


if __name__ == "__main__":
    main()
