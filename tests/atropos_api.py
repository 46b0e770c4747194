"""The real Atropos API server (`atroposlib.cli.run_api`) as a test subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AtroposAPI:
    """`run-api` on 127.0.0.1:`port`; stop() kills it (all its state is in memory), start()
    brings up a fresh one on the same port."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> AtroposAPI:
        cmd = [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"run-api exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"run-api did not serve within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def get(self, path: str) -> dict:
        return httpx.get(self.url + path, timeout=5.0).json()

    def post(self, path: str, body: dict) -> dict:
        response = httpx.post(self.url + path, json=body, timeout=5.0)
        response.raise_for_status()
        return response.json()
