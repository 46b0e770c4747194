"""Receiver processes that pull a version's streams in parallel interpreters.

`receiver.pull` on threads contends for one GIL: on a 16-core host the checksummed pull
fell from 84% of the raw-socket ceiling at 1 stream to 56% at 16 (BENCHMARKS.md). A
ReceiverPool keeps a few torch-free processes (`transfer/pull_proc.py`), started once
per worker; a pull gives stream i to process i mod N, each writes straight into a
shared-memory landing buffer (`LandingBuffer`, pinned when the engine is on CUDA) and
checks its chunks as they land. The caller still describes the version, checks the
whole-buffer checksum and decides what to load, as before.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import send_handle

import torch

from polyrl.transfer.pull_proc import Chunks, Job, spare_cores_for_checking
from polyrl.transfer.shm import SharedBuffer
from polyrl.transfer.wire import PartialPull, PullSource, TransferError

log = logging.getLogger("polyrl.transfer")

MIN_POOL_BYTES = 64 * 2**20
"""Smaller versions are pulled on threads: a few ms either way, and tests stay light."""


class LandingBuffer(SharedBuffer):
    """A buffer the pool's processes pull into; `tensor` is what the engine reads."""

    _next_id = 0

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        LandingBuffer._next_id += 1
        self.id = LandingBuffer._next_id
        super().__init__(f"polyrl-landing-{self.id}", nbytes, pin)
        self.sent_to: set[int] = set()
        """Pids of the processes that have it mapped."""


class _Proc:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        entry = f"from polyrl.transfer.pull_proc import main; main({theirs.fileno()}, {os.getpid()})"
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", entry], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def close(self) -> None:
        self.conn.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


GRACE_S = 2.0
"""How long a failed pull waits for its other receiver processes (`ReceiverPool._collect`)."""


class ReceiverPool:
    def __init__(self, num_processes: int, pipelined: bool | None = None) -> None:
        """`pipelined`: each stream hashes on a second thread of its process, or after
        each piece on its receiving thread (False); None: pipelined when the host has a
        core to spare per stream (`pull_proc.spare_cores_for_checking`)."""
        if num_processes < 1:
            raise ValueError("num_processes must be >= 1")
        self.num_processes = num_processes
        self.pipelined = pipelined
        self._procs: list[_Proc | None] = [None] * num_processes
        self._lock = threading.Lock()  # one pull at a time (a worker syncs one version at a time)
        self._buffers: dict[int, LandingBuffer] = {}  # by data_ptr

    def receive(
        self, source: PullSource, requests: list[bytes], chunks: Chunks, into: LandingBuffer, timeout_s: float
    ) -> list[int]:
        """Run the pull's streams (one encoded request each) into `into`: stream i on
        process i mod N. The indices of the chunks received and checked; PartialPull (the
        chunks that did check out) or TransferError on any failure. A process that died is
        replaced at the next pull."""
        pipelined = self.pipelined if self.pipelined is not None else spare_cores_for_checking(len(requests))
        jobs: dict[int, list[bytes]] = {}
        for stream, request in enumerate(requests):
            jobs.setdefault(stream % self.num_processes, []).append(request)
        with self._lock:
            conns: list[Connection] = []
            try:
                for i, mine in jobs.items():
                    job = Job(
                        into.id,
                        False,
                        source.host,
                        source.port,
                        timeout_s,
                        mine,
                        chunks,
                        pipelined,
                        source.tls,
                        source.ca_file,
                    )
                    conns.append(self._send(i, job, into))
            except TransferError:
                self._kill(set(conns))  # their answers must not be read as the next pull's
                raise
            errors, got = self._collect(conns, timeout_s)
        if errors:
            raise PartialPull(errors[0], got)
        return got

    def landing(self, nbytes: int, pin: bool) -> LandingBuffer:
        """A landing buffer this pool knows (so `receiver.pull` lets the processes fill it)."""
        buffer = LandingBuffer(nbytes, pin)
        with self._lock:
            self._buffers[buffer.tensor.data_ptr()] = buffer
        return buffer

    def landing_of(self, tensor: torch.Tensor) -> LandingBuffer | None:
        """The landing buffer `tensor` starts at, if it is one of ours."""
        with self._lock:
            return self._buffers.get(tensor.data_ptr())

    def _send(self, index: int, job: Job, into: LandingBuffer) -> Connection:
        proc = self._procs[index]
        if proc is None or proc.process.poll() is not None:
            proc = self._procs[index] = _Proc()
            for buffer in self._buffers.values():  # a reused pid maps nothing yet
                buffer.sent_to.discard(proc.process.pid)
        new_fd = proc.process.pid not in into.sent_to
        try:
            proc.conn.send(replace(job, new_fd=new_fd))
            if new_fd:
                send_handle(proc.conn, into.fd, proc.process.pid)
                into.sent_to.add(proc.process.pid)
        except OSError as e:
            self._kill({proc.conn})
            raise TransferError(f"receiver process {proc.process.pid} is gone: {e}") from None
        return proc.conn

    def _collect(self, conns: list[Connection], timeout_s: float) -> tuple[list[str], list[int]]:
        """Each process's answer: the errors, and the chunks received and checked. After
        the first error the others get `GRACE_S` more to answer: when the source died,
        their streams fail at once too, and the chunks they did check are kept for the
        next source. One that does not answer in time is killed (replaced at the next
        pull, in ~0.1 s: they import no torch): left running, it could write into the
        landing buffer under the next pull."""
        errors: list[str] = []
        got: list[int] = []
        waiting = set(conns)
        while waiting:
            wait_s = GRACE_S if errors else timeout_s * 2 + 10
            ready = wait(list(waiting), timeout=wait_s)
            if not ready:
                self._kill(waiting)
                return errors + [f"no answer from {len(waiting)} receiver processes in {wait_s:.0f}s"], got
            for conn in ready:
                waiting.discard(conn)  # type: ignore[arg-type]
                try:
                    error, chunks = conn.recv()  # type: ignore[union-attr]
                    got.extend(chunks)
                except (EOFError, OSError):
                    error = "a receiver process died"
                    self._kill({conn})  # type: ignore[arg-type]
                if error is not None:
                    errors.append(error)
        return errors, got

    def _kill(self, conns: set[Connection]) -> None:
        for i, proc in enumerate(self._procs):
            if proc is not None and proc.conn in conns:
                proc.process.kill()
                proc.close()
                self._procs[i] = None

    def release(self, buffer: LandingBuffer) -> None:
        """Close `buffer`, here and in the processes."""
        with self._lock:
            self._buffers.pop(buffer.tensor.data_ptr(), None)
            for proc in self._procs:
                if proc is not None and proc.process.pid in buffer.sent_to:
                    try:
                        proc.conn.send(buffer.id)
                    except OSError:
                        pass
        buffer.close()

    def close(self) -> None:
        """Stop the processes and close every landing buffer."""
        for buffer in list(self._buffers.values()):
            self.release(buffer)
        with self._lock:
            for proc in self._procs:
                if proc is not None:
                    proc.close()
            self._procs = [None] * self.num_processes

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._procs if p is not None]
