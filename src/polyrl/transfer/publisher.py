"""The trainer's side of the weight data plane: publish versions, let another process serve them.

`publish` copies the weights once into a shared-memory slot (a memfd: no name in
/dev/shm to leak, no /dev/shm size limit) and announces it to the publisher process
(`transfer/serve.py`), which checksums it and serves every pull from its own
interpreter: serving no longer competes with the learner for the GIL. A slot is written
again only once that process says no pull reads it, so with `keep_versions=2` three
slots take turns and a publish allocates nothing after the third.

This side creates the listening sockets and hands them down, so when the publisher
process dies it is restarted on the same ports and the versions still held are
announced again; pulls in flight fail with TransferError and the manager retries them.
Requests for a GPU path (NCCL, CUDA IPC) come back here, token checked, with their
socket, and are served from `device` (the versions on the trainer's GPU).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import torch

from polyrl.transfer.device import DeviceVersions
from polyrl.transfer.manifest import flatten, layout
from polyrl.transfer.pacing import gbps_to_bytes
from polyrl.transfer.serve import (
    STATS_BYTES,
    Forget,
    GpuConn,
    Publish,
    Published,
    Ready,
    Released,
    ServeConfig,
    word_bytes,
)
from polyrl.transfer.shm import SharedBuffer
from polyrl.transfer.wire import (
    GPU_OPS,
    STATUS_REFUSED,
    Request,
    TransferInfo,
    combined_checksum,
    send_text,
    transfer_token,
)

__all__ = ["WeightPublisher", "word_bytes"]

log = logging.getLogger("polyrl.transfer")

DEFAULT_CHUNK_BYTES = 8 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0
"""A connection's whole request must arrive within this long (a receiver sends it at once):
the socket's per-read timeout alone let a client dripping one byte at a time hold its
connection and thread forever."""
START_TIMEOUT_S = 120.0
"""For the publisher process to come up (it imports torch: seconds on a loaded host)."""
SEND_MODE = "sendfile"
"""How the publisher process sends chunks: `sendfile` from the memfd, or `sendall` from
its mapping. On the 16-core GPU host (Intel, Linux 6.18, xxhash 4.1), three runs of
`benchmarks/transfer.py --send-mode sendall sendfile` with the pulls and the ceiling
taking turns put sendfile ahead in 18 of 20 pairs at 8 and 16 streams (by up to 17
points of the ceiling; 1-2 behind in the other two) and level or ahead at 1 and 4
streams: the copy into the socket is work the publisher no longer does, and on a real
NIC CPU and memory bandwidth the trainer's host keeps for the learner. On the 2-core
dev machine (AMD) sendfile over loopback is the slower one (2.9 against 1.4 GB/s for
256 MiB to a receiver process): there, and with TLS (which always sends from this
process), sendall. `manager.transfer.send_mode` picks."""


class _Slot(SharedBuffer):
    """One version's worth of shared memory, mapped here; the process maps it too."""

    def __init__(self, slot_id: int, nbytes: int, pin: bool) -> None:
        super().__init__(f"polyrl-weights-{slot_id}", nbytes, pin)
        self.id = slot_id
        self.sent_to = -1
        """The generation of the publisher process that has its fd (-1: none)."""


class WeightPublisher:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        key: bytes | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_versions: int = 2,
        io_timeout_s: float = 30.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        num_groups: int = 1,
        group_hosts: Sequence[str] = (),
        send_mode: str = SEND_MODE,
        tls: tuple[str, str] | None = None,
        max_send_gbps: float | None = None,
    ) -> None:
        """`num_groups` listeners serve the same versions (the seeds' sender groups): group
        g binds `group_hosts[g]` (one per network interface) or `host`, on `port + g` when
        `port` is set, else on any free port; the manager spreads workers over them.
        `tls`: (certificate file, key file): every pull is encrypted (`transfer/wire.py`).
        `max_send_gbps`: the cap on all pulls together (`transfer/pacing.py`); None: none."""
        if chunk_bytes < 4096 or keep_versions < 1 or num_groups < 1:
            raise ValueError("chunk_bytes must be >= 4096, keep_versions and num_groups >= 1")
        if send_mode not in ("sendall", "sendfile"):
            raise ValueError(f"send_mode {send_mode!r}: sendall or sendfile")
        if group_hosts and len(group_hosts) != num_groups:
            raise ValueError(f"{len(group_hosts)} group_hosts for {num_groups} groups")
        self.key = key if key is not None else os.urandom(32)
        self.tls = tls is not None
        """Receivers must speak TLS (the manager tells them so)."""
        self.chunk_bytes, self.keep_versions = chunk_bytes, keep_versions
        self._listeners = _listen([group_hosts[g] if group_hosts else host for g in range(num_groups)], port)
        self.addresses: list[tuple[str, int]] = [s.getsockname()[:2] for s in self._listeners]
        """Where each group listens."""
        self.address = self.addresses[0]
        self.device: DeviceVersions | None = None
        """Versions held on the trainer's GPU for same-host workers (NCCL, CUDA IPC): set it
        and `device.publish` each version there too (`transfer/device.py`)."""
        self._stats_fd = os.memfd_create("polyrl-publisher-stats")
        os.ftruncate(self._stats_fd, STATS_BYTES)
        self._stats = mmap.mmap(self._stats_fd, STATS_BYTES)
        self._config = dict(
            key=self.key,
            chunk_bytes=chunk_bytes,
            keep_versions=keep_versions,
            io_timeout_s=io_timeout_s,
            handshake_timeout_s=handshake_timeout_s,
            send_mode=send_mode,
            tls_cert_file=tls[0] if tls else None,
            tls_key_file=tls[1] if tls else None,
            max_send_bytes_per_s=gbps_to_bytes(max_send_gbps),
        )
        self._slots: dict[int, _Slot] = {}
        self._held: dict[int, int] = {}  # version -> slot id, as announced
        self._manifests: dict[int, str] = {}  # version -> its manifest (to announce it again)
        self._next_slot = 0
        self._free: set[int] = set()  # slots no pull reads
        self._acks: dict[int, list[int] | None] = {}  # version -> its chunk checksums, once servable
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()  # the channel, the generation and what each slot was sent
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._generation = 0
        self._stopping = False
        self._failed: BaseException | None = None
        self.restarts = 0
        """How often the publisher process was restarted after dying."""
        self.last_recovery_s: float | None = None
        """From noticing the last death until the new process listens (the held versions
        are announced to it right after, in milliseconds)."""
        self._supervisor = threading.Thread(target=self._supervise, name="polyrl-publisher", daemon=True)

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> WeightPublisher:
        self._supervisor.start()
        with self._cv:
            if not self._cv.wait_for(lambda: self._generation > 0 or self._failed is not None, START_TIMEOUT_S):
                self._failed = TimeoutError(f"the publisher process did not start within {START_TIMEOUT_S:.0f}s")
        if self._failed is not None:
            self.stop()
            raise RuntimeError(f"weight publisher failed to start: {self._failed}") from self._failed
        log.info(
            "weight publisher serving on %s (process %d)", ", ".join(f"{h}:{p}" for h, p in self.addresses), self.pid
        )
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        with self._send_lock:
            conn, process = self._conn, self._process
            if conn is not None:  # EOF for both: the process exits, the relay thread returns
                with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as channel:
                    channel.shutdown(socket.SHUT_RDWR)  # a close alone would not wake the relay's recv
                conn.close()
        if process is not None:
            _reap(process)
        if self._supervisor.is_alive():
            self._supervisor.join(10)
        for listener in self._listeners:
            listener.close()
        with self._cv:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
            self._held.clear()
            self._manifests.clear()
        if not self._stats.closed:
            self._stats.close()
            os.close(self._stats_fd)
        if self.device is not None:
            self.device.close()

    def __enter__(self) -> WeightPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The publisher process's pid (it changes when the process is restarted)."""
        process = self._process
        return process.pid if process is not None else None

    @property
    def bytes_sent(self) -> int:
        """Bytes of versions served so far, over every restart."""
        return 0 if self._stats.closed else struct.unpack_from("Q", self._stats)[0]

    # ------------------------------------------------------------------------ publishing

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, timeout_s: float = 120.0) -> TransferInfo:
        """Snapshot `state_dict` as `version` and return once it is servable; the oldest
        versions beyond `keep_versions` are dropped (a pull already reading one finishes;
        new pulls of it are refused)."""
        if not self._supervisor.is_alive():
            raise RuntimeError("the weight publisher is not running: start() it first")
        manifest = layout(state_dict, version)
        slot = self._take_slot(manifest.total_bytes, any(t.is_cuda for t in state_dict.values()))
        out = slot.tensor[: manifest.total_bytes]
        pinned = slot.pinned and out.is_pinned()  # as flatten sees registered memory: then it takes the slot
        buffer, _ = flatten(state_dict, version, pin_memory=pinned, out=out)
        if buffer.data_ptr() != out.data_ptr():  # never expected: flatten made its own buffer
            out.copy_(buffer)
        text = manifest.model_dump_json()
        with self._cv:
            self._held[version], self._manifests[version], self._acks[version] = slot.id, text, None
            self._free.discard(slot.id)  # a restart while we wrote it counted it free
            for old in sorted(self._held)[: -self.keep_versions]:
                del self._held[old], self._manifests[old]  # its slot is free once the process says no pull reads it
        self._announce(version, slot, text)
        sums = self._wait_servable(version, timeout_s)
        log.debug("weights v%d published: %.1f MB in %d chunks", version, manifest.total_bytes / 1e6, len(sums))
        return TransferInfo(
            manifest=manifest,
            chunk_bytes=self.chunk_bytes,
            chunk_checksums=sums,
            buffer_checksum=combined_checksum(sums),
        )

    def grant(self, worker_id: str, version: int) -> str:
        """The secret that lets `worker_id` pull `version` (hand it out over an
        authenticated channel, e.g. the manager's API)."""
        return transfer_token(self.key, worker_id, version)

    @property
    def versions(self) -> list[int]:
        with self._cv:
            return sorted(self._held)

    def _take_slot(self, nbytes: int, pin: bool) -> _Slot:
        """A free slot of this size (pinning a new one cost 1.3 s per 1.2 GB on an H200
        host, the copy into it 0.02 s: BENCHMARKS.md), else a new one; free slots of
        another size are closed."""
        with self._cv:
            self._free -= set(self._held.values())
            fits = [i for i in self._free if self._slots[i].nbytes == max(nbytes, 1) and self._slots[i].pinned >= pin]
            others = [self._slots.pop(i) for i in self._free if i not in fits]
            self._free -= {s.id for s in others} | set(fits[:1])
            slot = self._slots[fits[0]] if fits else None
            self._next_slot += 1
            slot_id = self._next_slot
        for other in others:
            self._forget(other)
        if slot is None:  # allocated (and pinned: slow) without holding up the relay
            slot = _Slot(slot_id, nbytes, pin)
            with self._cv:
                self._slots[slot.id] = slot
        return slot

    def _forget(self, slot: _Slot) -> None:
        with self._send_lock:
            if slot.sent_to == self._generation and self._conn is not None:
                _send_quietly(self._conn, Forget(slot.id))
        slot.close()

    def _announce(self, version: int, slot: _Slot, manifest_json: str) -> None:
        """Tell the process; if it is dead, its successor gets every held version anyway."""
        with self._send_lock:
            if self._conn is None:
                return
            new_fd = slot.sent_to != self._generation
            if _send_quietly(self._conn, Publish(version, slot.id, manifest_json, new_fd)) and new_fd:
                try:
                    send_handle(self._conn, slot.fd, self._process.pid)  # type: ignore[union-attr]
                    slot.sent_to = self._generation
                except OSError:
                    pass

    def _wait_servable(self, version: int, timeout_s: float) -> list[int]:
        with self._cv:
            done = self._cv.wait_for(lambda: self._acks.get(version) is not None or self._stopping, timeout_s)
            sums = self._acks.pop(version, None)
        if not done or sums is None:
            raise RuntimeError(f"the publisher process did not take v{version} within {timeout_s:.0f}s")
        return sums

    # ------------------------------------------------------------------------ the process

    def _supervise(self) -> None:
        """Start the publisher process, relay what it says, restart it when it dies."""
        died_at: float | None = None
        backoff_s = 0.5
        while not self._stopping:
            try:
                conn, process = self._spawn()
            except Exception as e:  # noqa: BLE001 (reported to start(); on a restart, tried again)
                if died_at is None:
                    with self._cv:
                        self._failed = e
                        self._cv.notify_all()
                    return
                log.error("weight publisher process failed to restart (%s): trying again in %.1fs", e, backoff_s)
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 10.0)
                continue
            backoff_s = 0.5
            self._install(conn, process)
            if died_at is not None:
                self.restarts += 1
                self.last_recovery_s = time.monotonic() - died_at
                log.warning(
                    "weight publisher process restarted as %d in %.2fs; serving %s again",
                    process.pid,
                    self.last_recovery_s,
                    self.versions,
                )
            self._relay(conn)
            code = _reap(process)
            if not self._stopping:
                died_at = time.monotonic()
                log.warning(
                    "weight publisher process %d died (exit code %s): restarting it on the same ports",
                    process.pid,
                    code,
                )

    def _spawn(self) -> tuple[Connection, subprocess.Popen[bytes]]:
        """A fresh interpreter (not a fork of the trainer's) that imports only serve.py's needs."""
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno(), self._stats_fd, *(s.fileno() for s in self._listeners)]
        entry = f"from polyrl.transfer.serve import main; main({theirs.fileno()}, {os.getpid()})"
        command = [sys.executable, "-c", entry]
        try:
            # a session of its own: a terminal's Ctrl-C is the trainer's (polyrl/lifetime.py)
            process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        level = logging.getLogger("polyrl.transfer").getEffectiveLevel()
        conn.send(ServeConfig(**self._config, listener_fds=fds[2:], stats_fd=self._stats_fd, log_level=level))
        if not conn.poll(START_TIMEOUT_S):
            process.kill()
            raise TimeoutError(f"no word from the publisher process within {START_TIMEOUT_S:.0f}s")
        ready = conn.recv()
        assert isinstance(ready, Ready), ready
        return conn, process

    def _install(self, conn: Connection, process: subprocess.Popen[bytes]) -> None:
        """The new process reads no slot yet; it gets every held version again."""
        with self._send_lock:
            self._conn, self._process = conn, process
            self._generation += 1
        with self._cv:
            self._free = set(self._slots) - set(self._held.values())
            held = [(v, self._slots[i], self._manifests[v]) for v, i in sorted(self._held.items())]
            self._cv.notify_all()
        threading.Thread(target=self._reannounce, args=(held,), name="polyrl-publisher-announce", daemon=True).start()

    def _reannounce(self, held: list[tuple[int, _Slot, str]]) -> None:
        """In its own thread: the relay must go on reading while these are sent."""
        for version, slot, manifest in held:
            self._announce(version, slot, manifest)

    def _relay(self, conn: Connection) -> None:
        """What the process says, until it goes away."""
        while True:
            try:
                msg = conn.recv()
                fd = recv_handle(conn) if isinstance(msg, GpuConn) else None
            except (EOFError, OSError):
                return
            if isinstance(msg, Published):
                with self._cv:
                    if msg.version in self._acks:
                        self._acks[msg.version] = msg.chunk_checksums
                    self._cv.notify_all()
            elif isinstance(msg, Released):
                with self._cv:
                    if msg.slot in self._slots and msg.slot not in self._held.values():
                        self._free.add(msg.slot)
            elif isinstance(msg, GpuConn) and fd is not None:
                threading.Thread(
                    target=self._serve_device,
                    args=(socket.socket(fileno=fd), msg.request),
                    name="polyrl-publisher-gpu",
                    daemon=True,
                ).start()

    def _serve_device(self, sock: socket.socket, req: Request) -> None:
        """A GPU-path request whose token the publisher process checked."""
        with sock:
            try:
                if self.device is None:
                    send_text(sock, STATUS_REFUSED, f"no versions on a GPU here for {GPU_OPS[req.op]}".encode())
                else:
                    self.device.serve(sock, req)
            except (OSError, ValueError, RuntimeError) as e:  # a receiver that died or stalled
                log.debug("%s transfer to %r ended: %s: %s", GPU_OPS[req.op], req.worker_id, type(e).__name__, e)


def _listen(hosts: list[str], port: int) -> list[socket.socket]:
    listeners: list[socket.socket] = []
    try:
        for g, host in enumerate(hosts):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listeners.append(socket.create_server((host, port + g if port else 0), family=family, backlog=128))
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def _send_quietly(conn: Connection, message: object) -> bool:
    """False when the process is gone (the supervisor restarts it and announces again)."""
    try:
        conn.send(message)
        return True
    except OSError:
        return False


def _reap(process: subprocess.Popen[bytes]) -> int | None:
    try:
        return process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(10)
