"""The rollout manager's own cost: added latency and maximum request rate, next to
SGLang's router (`sglang-router` on PyPI) routing the same fake engines in the same run.

Fake engines answer /generate at once (one SSE chunk of `--tokens` tokens, then
[DONE]), so what is measured is the routing layer plus HTTP, not generation. Each
component is a separate process: N fake engines, `polyrl manager`, the router, and this
client.

    python benchmarks/manager.py                    # needs: pip install -e '.[bench]'
    python benchmarks/manager.py --requests 2000 --json out.json

Rows:
* latency: one request at a time, p50/p99 of the client-side time to the last byte;
  `direct` goes straight to one fake engine (the floor);
* rate (concurrent): `--concurrency` clients each sending single requests;
* rate (one batch): the manager's native use, one batch of `--requests` prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# ------------------------------------------------------------------------------- fake engine


def serve_fake(port: int, tokens: int) -> None:
    """A fake SGLang engine: every /generate answers at once (streamed: one chunk)."""
    app = FastAPI()
    ids = list(range(3, 3 + tokens))
    logprobs = [[-0.5, t, None] for t in ids]

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        n = body.get("sampling_params", {}).get("n", 1)
        chunks = []
        for j in range(n):
            meta = {
                "id": body.get("rid", "x"),
                "finish_reason": {"type": "length"},
                "prompt_tokens": 3,
                "completion_tokens": tokens,
                "weight_version": 0,
                "output_token_weight_versions": [0] * tokens,
                "output_token_logprobs": logprobs,
            }
            chunk = {"text": "", "output_ids": ids, "index": j, "meta_info": meta}
            chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        if not body.get("stream"):
            return [json.loads(c[6:]) for c in chunks] if n > 1 else json.loads(chunks[0][6:])

        async def events() -> Any:
            yield b"".join(chunks) + b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> dict[str, Any]:
        return {}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"num_running_reqs": 0, "num_queued_reqs": 0}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "fake", "is_generation": True}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# ----------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def generate_body(i: int, stream: bool = True) -> dict[str, Any]:
    return {
        "input_ids": [5, 6, 7],
        "stream": stream,
        "return_logprob": True,
        "rid": f"r{i}-{time.monotonic_ns()}",
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
    }


def batch_body(num: int, offset: int = 0) -> dict[str, Any]:
    prompts = [{"id": f"p{offset + i}", "input_ids": [5, 6, 7]} for i in range(num)]
    return {"prompts": prompts, "n": 1, "sampling": {"max_new_tokens": 16}}


async def one_router(client: httpx.AsyncClient, url: str, i: int) -> None:
    async with client.stream("POST", f"{url}/generate", json=generate_body(i)) as r:
        r.raise_for_status()
        async for _ in r.aiter_bytes():
            pass


async def one_plain(client: httpx.AsyncClient, url: str, i: int) -> None:
    """A non-streaming /generate (the router answers it with one JSON body)."""
    (await client.post(f"{url}/generate", json=generate_body(i, stream=False))).raise_for_status()


async def one_manager(client: httpx.AsyncClient, url: str, i: int) -> None:
    async with client.stream("POST", f"{url}/v1/batches", json=batch_body(1, i), headers=AUTH) as r:
        r.raise_for_status()
        lines = [line async for line in r.aiter_lines() if line]
    if not lines or json.loads(lines[-1]).get("type") != "end":
        raise RuntimeError(f"batch failed: {lines[-1:]}")


async def latency(fn: Any, url: str, num: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(20):  # warm-up: connections, caches
            await fn(client, url, i)
        times = []
        for i in range(num):
            t0 = time.perf_counter()
            await fn(client, url, i)
            times.append(time.perf_counter() - t0)
    return times


async def rate(fn: Any, url: str, num: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(fn(client, url, i) for i in range(concurrency)))  # warm-up
        next_i = iter(range(num))

        async def loop() -> None:
            for i in next_i:
                await fn(client, url, i)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return num / (time.perf_counter() - t0)


async def batch_rate(url: str, num: int) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/batches", json=batch_body(num), headers=AUTH) as r:
            r.raise_for_status()
            lines = [line async for line in r.aiter_lines() if line]
        elapsed = time.perf_counter() - t0
    if json.loads(lines[-1]).get("type") != "end" or len(lines) != num + 1:
        raise RuntimeError(f"batch failed: {lines[-1][:300]}")
    return num / elapsed


async def keep_registered(manager_url: str, fakes: list[str], stop: asyncio.Event) -> None:
    """Register the fake engines as workers and heartbeat for them."""
    async with httpx.AsyncClient(base_url=manager_url, headers=AUTH, timeout=10) as c:
        for i, url in enumerate(fakes):
            reg = {
                "worker_id": f"fake{i}",
                "url": url,
                "model_path": "fake",
                "weight_version": 0,
                "max_num_seqs": 4096,
                "max_model_len": 4096,
            }
            (await c.post("/v1/workers/register", json=reg)).raise_for_status()
        while not stop.is_set():
            for i in range(len(fakes)):
                beat = {
                    "state": "active",
                    "weight_version": 0,
                    "num_running": 0,
                    "num_waiting": 0,
                    "gen_throughput": 0.0,
                }
                await c.post(f"/v1/workers/fake{i}/heartbeat", json=beat)
            await asyncio.sleep(1.0)


# -------------------------------------------------------------------------------------- main


def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2, help="fake engines")
    p.add_argument("--tokens", type=int, default=16, help="tokens per fake answer")
    p.add_argument("--latency-requests", type=int, default=300)
    p.add_argument("--requests", type=int, default=2000, help="requests per rate measurement")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", help="write the numbers here")
    p.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.tokens)
        return

    procs: list[subprocess.Popen[bytes]] = []
    try:
        fakes = []
        for _ in range(args.engines):
            port = free_port()
            procs.append(start([sys.executable, __file__, "--serve-fake", str(port), "--tokens", str(args.tokens)]))
            fakes.append(f"http://127.0.0.1:{port}")
        for url in fakes:
            wait_http(f"{url}/health")

        manager_port = free_port()
        polyrl = [
            sys.executable,
            "-m",
            "polyrl.cli",
            "manager",
            "--port",
            str(manager_port),
            "--token",
            TOKEN,
            "manager.max_inflight_per_worker=4096",
        ]
        procs.append(start(polyrl))
        manager_url = f"http://127.0.0.1:{manager_port}"
        wait_http(f"{manager_url}/health")

        router_url = None
        if shutil.which("sglang-router") or _has_module("sglang_router"):
            router_port = free_port()
            procs.append(
                start(
                    [
                        sys.executable,
                        "-m",
                        "sglang_router.launch_router",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(router_port),
                        "--policy",
                        "round_robin",
                        "--log-level",
                        "error",
                        "--worker-urls",
                        *fakes,
                    ]
                )
            )
            router_url = f"http://127.0.0.1:{router_port}"
            wait_http(f"{router_url}/health", timeout_s=120)
        else:
            print("sglang-router is not installed (pip install -e '.[bench]'): its rows are skipped", file=sys.stderr)

        results = asyncio.run(measure(args, fakes, manager_url, router_url))
    finally:
        for proc in procs:
            with _suppress():
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            with _suppress():
                proc.wait(timeout=10)
    report(args, results)


async def measure(
    args: argparse.Namespace, fakes: list[str], manager_url: str, router_url: str | None
) -> dict[str, Any]:
    stop = asyncio.Event()
    registered = asyncio.create_task(keep_registered(manager_url, fakes, stop))
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = (await c.get(f"{manager_url}/v1/workers", headers=AUTH)).json()["workers"]
            if sum(w["state"] == "active" for w in workers) == len(fakes):
                break
            await asyncio.sleep(0.1)
    out: dict[str, Any] = {"latency_s": {}, "rate_concurrent": {}, "rate_batch": {}}
    try:
        n = args.latency_requests
        paths = [("direct", one_router, fakes[0]), ("polyrl manager", one_manager, manager_url)]
        if router_url:
            paths += [("sglang-router", one_router, router_url), ("sglang-router, no stream", one_plain, router_url)]
        for name, fn, url in paths:
            out["latency_s"][name] = await latency(fn, url, n)
        for name, fn, url in paths:
            out["rate_concurrent"][name] = await rate(fn, url, args.requests, args.concurrency)
        out["rate_batch"]["polyrl manager"] = await batch_rate(manager_url, args.requests)
    finally:
        stop.set()
        registered.cancel()
    return out


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    lat = results["latency_s"]
    floor = statistics.median(lat["direct"])
    rows = []
    print(f"\n{args.engines} fake engines, {args.tokens} tokens per answer; {os.cpu_count()} CPUs")
    print(
        f"{'path':<26} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13} {'req/s (c=' + str(args.concurrency) + ')':>14}"
    )
    for name, times in lat.items():
        p50, p99 = percentile(times, 0.5) * 1e3, percentile(times, 0.99) * 1e3
        rps = results["rate_concurrent"].get(name, float("nan"))
        added = p50 - floor * 1e3
        print(f"{name:<26} {p50:>8.2f} {p99:>8.2f} {added:>13.2f} {rps:>14.0f}")
        rows.append({"path": name, "p50_ms": p50, "p99_ms": p99, "added_p50_ms": added, "rps_concurrent": rps})
    batch = results["rate_batch"]["polyrl manager"]
    print(f"polyrl manager, one batch of {args.requests} prompts: {batch:.0f} requests/s")
    if args.json:
        payload = {
            "engines": args.engines,
            "tokens": args.tokens,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "rows": rows,
            "manager_batch_rps": batch,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


if __name__ == "__main__":
    main()
