"""NCCL path: the trainer's GPU broadcasts a version to a worker on another GPU of its host.

Membership is dynamic and the trainer may already run its own torch.distributed job
(FSDP under torchrun), so the default process group is never touched: each worker gets
a 2-rank group of its own, built on demand from a `TCPStore` and
`ProcessGroupNCCL(store, rank, 2, options)` (`dist.new_group` needs the default group
with every rank of it taking part). The publisher is rank 0, the worker rank 1. The pair
lives as long as both sides name the same session, so the communicator is set up once,
not per version; anything wrong with a pair (a timeout, a dead peer, a bad message)
aborts that pair only, and the worker's next pull builds a new one.

How a dead or stalled worker never blocks the trainer:
* each pull is served on its connection's own thread (the publisher's handler), never
  on the training thread;
* the rendezvous runs under the store's timeout and the broadcast under a deadline
  (`_within`); past it the pair is aborted in the background;
* the group is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timeout
  torch's watchdog aborts that group's communicator instead of tearing the process down
  (the default, 3, would take the trainer down with a dead worker); its heartbeat monitor,
  which also ends the process, is off for the pair;
* each side enters NCCL only once the other has shown up on the control socket (the
  offer, then READY): NCCL's communicator setup has no timeout of its own, and a thread
  stuck there despite that is abandoned, not waited for.

With CPU tensors the same code runs gloo: that is how CI tests this path.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field

from polyrl.transfer.manifest import Manifest
from polyrl.transfer.receiver import Pulled
from polyrl.transfer.wire import (
    OP_NCCL,
    READY,
    STATUS_OK,
    STATUS_REFUSED,
    Offer,
    PullSource,
    Request,
    TransferError,
    connect,
    encode_request,
    read_offer,
    read_reply_text,
    recv_exact,
    send_text,
)

log = logging.getLogger("polyrl.transfer")

PAIR_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
"""Read by ProcessGroupNCCL's constructor: set only while a pair group is built."""
POLL_S = 2e-4
"""How often a thread waiting on an NCCL transfer checks it (a 1.2 GB version takes ~3 ms)."""
_env_lock = threading.Lock()


class NcclOffer(Offer):
    """The publisher's reply to an NCCL request: what comes, and the pair to receive it on."""

    backend: Literal["nccl", "gloo"]
    store_port: int = Field(ge=1, le=65535)
    """The pair's TCPStore, on the address the worker reached the publisher at."""
    session: int = Field(ge=0, lt=2**63)
    """Names the pair (and prefixes its store keys); the worker sends it back next time."""
    timeout_s: float = Field(gt=0)


class PairGroup:
    """One side of a worker's 2-rank group (rank 0: the publisher; rank 1: the worker)."""

    def __init__(self, store: dist.Store, session: int, rank: int, backend: str, timeout_s: float) -> None:
        self.store, self.session, self.backend = store, session, backend
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"polyrl-pair-{session}", store)
        if backend == "gloo":  # the constructor waits (up to `timeout`) for both ranks to connect
            self.group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = dist.ProcessGroupGloo(
                prefixed, rank, 2, timeout
            )
        else:  # lazy: the communicator is set up by the first broadcast
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with _env_lock, _environ(PAIR_ENV):
                self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Rank 0 sends `tensor`, rank 1 receives into it; TimeoutError past `timeout_s`."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        deadline = time.monotonic() + timeout_s

        def run() -> None:
            if not tensor.is_cuda:
                self.group.broadcast([tensor], opts).wait(timedelta(seconds=timeout_s))
                return
            with torch.cuda.device(tensor.device):
                work = self.group.broadcast([tensor], opts)
                while not work.is_completed() and time.monotonic() < deadline + 1:
                    time.sleep(POLL_S)
                work.wait()  # raises the transfer's error; the data is on the device now

        _within(run, timeout_s, f"the {self.backend} broadcast")

    def close(self, wait_s: float = 0.0) -> None:
        """Abort in the background (an abort can itself wait on a stuck communicator); the
        thread's arguments keep the store alive until the abort is done. `wait_s`: how
        long to wait for it (at shutdown: a communicator still alive when the interpreter
        exits takes the process down with SIGABRT)."""
        thread = threading.Thread(target=_abort, args=(self.group, self.store), name="polyrl-pair-abort", daemon=True)
        thread.start()
        thread.join(wait_s)


def _abort(group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, store: dist.Store) -> None:
    with suppress(RuntimeError):
        group.abort()


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A pair's TCPStore on `host` only (TCPStore itself would listen on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
        use_libuv=True,  # the store owns (and closes) the socket
    )
    return store, port


# ----------------------------------------------------------------------- publisher side


class _Pair:
    def __init__(self, host: str, timeout_s: float) -> None:
        self.session = secrets.randbits(63)
        self.store, self.port = serve_store(host, timeout_s)
        self.group: PairGroup | None = None
        self.busy = threading.Lock()

    def close(self, wait_s: float = 0.0) -> None:
        if self.group is not None:
            self.group.close(wait_s)


class NcclSender:
    """The publisher's pairs, one per worker id (dropped when it fails or the worker comes
    back without its session, e.g. restarted)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()

    def serve(self, sock: socket.socket, req: Request, buffer: torch.Tensor, manifest: Manifest) -> None:
        """Broadcast `buffer` to the worker behind `sock` (its token already checked).
        Failures are logged and end this pair only."""
        pair = self._pair_for(req.worker_id, req.base, sock.getsockname()[0])
        if not pair.busy.acquire(blocking=False):
            send_text(sock, STATUS_REFUSED, b"a transfer to this worker is already running")
            return
        try:
            backend = "nccl" if buffer.is_cuda else "gloo"
            offer = NcclOffer(
                manifest=manifest, backend=backend, store_port=pair.port, session=pair.session, timeout_s=self.timeout_s
            )
            send_text(sock, STATUS_OK, offer.model_dump_json().encode())
            if pair.group is None:
                pair.group = PairGroup(pair.store, pair.session, 0, backend, self.timeout_s)
            if recv_exact(sock, 1, time.monotonic() + self.timeout_s) != READY:
                raise TransferError("the worker did not get ready")
            pair.group.broadcast(buffer, self.timeout_s)
        except (OSError, RuntimeError) as e:  # TransferError, TimeoutError, torch's DistError
            self._drop(req.worker_id, pair)
            log.warning(
                "nccl transfer of v%d to %s failed (%s: %s); its pair is dropped",
                req.version,
                req.worker_id,
                type(e).__name__,
                e,
            )
            with suppress(OSError):
                send_text(sock, STATUS_REFUSED, f"nccl transfer failed: {e}".encode()[:4096])
            return
        finally:
            pair.busy.release()
        # The pair is free before the worker hears the version is in: its next pull may come
        # at once (it did, on a loaded box, and found the pair still busy). A worker that
        # does not hear this fails the pull and makes a new pair.
        with suppress(OSError):
            send_text(sock, STATUS_OK, b"")

    def _pair_for(self, worker_id: str, session: int, host: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get(worker_id)
            if pair is not None and pair.session == session:
                return pair
            if pair is not None:
                pair.close()
            pair = self._pairs[worker_id] = _Pair(host, self.timeout_s)
            return pair

    def _drop(self, worker_id: str, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(worker_id) is pair:
                del self._pairs[worker_id]
        pair.close()

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close(wait_s=5.0)


# -------------------------------------------------------------------------- worker side


class NcclReceiver:
    """The worker's side: its pair with one publisher, kept across versions, and the
    device buffer versions land in (reused while it is large enough)."""

    def __init__(self) -> None:
        self._group: PairGroup | None = None
        self._publisher: tuple[str, int] | None = None
        self._buffer: torch.Tensor | None = None

    def pull(self, source: PullSource, version: int, device: torch.device, timeout_s: float = 30.0) -> Pulled:
        """Receive `version` into a buffer on `device`; TransferError on any failure (the
        pair is then dropped; the next pull makes a new one)."""
        t0 = time.perf_counter()
        same = self._group is not None and self._publisher == (source.host, source.port)
        session = self._group.session if same and self._group is not None else -1
        with connect(source.host, source.port, timeout_s) as sock:
            sock.sendall(encode_request(OP_NCCL, version, source.worker_id, source.token, base=session))
            offer = read_offer(sock, NcclOffer, version, "nccl")
            if (offer.backend == "nccl") != (device.type == "cuda"):
                raise TransferError(f"the publisher offers {offer.backend}, this worker is on {device}")
            try:
                if offer.session != session or self._group is None:
                    self.close()
                    store = dist.TCPStore(
                        source.host, offer.store_port, is_master=False, timeout=timedelta(seconds=timeout_s)
                    )
                    self._group = PairGroup(store, offer.session, 1, offer.backend, timeout_s)
                    self._publisher = (source.host, source.port)
                buffer = self._landing(offer.manifest.total_bytes, device)
                sock.sendall(READY)
                self._group.broadcast(buffer, timeout_s)
                status, text = read_reply_text(sock)
                if status != STATUS_OK:
                    raise TransferError(f"publisher: {text.decode(errors='replace')}")
            except (OSError, RuntimeError) as e:
                self.close()
                raise TransferError(f"nccl pull of v{version} failed: {type(e).__name__}: {e}") from None
        total = offer.manifest.total_bytes
        return Pulled(buffer, offer.manifest, time.perf_counter() - t0, "nccl", total)

    def _landing(self, total: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.device != device or self._buffer.numel() < total:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(total, dtype=torch.uint8, device=device)
        return self._buffer[:total]

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._publisher = None, None


def _within(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Run `fn` on a thread of its own and wait at most `timeout_s` for it: an NCCL call
    can block its thread with no timeout (communicator setup with a peer that vanished),
    and the caller must return regardless."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # handed to the caller
            outcome.append(e)

    thread = threading.Thread(target=run, name="polyrl-nccl", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"{what} did not finish within {timeout_s:.1f}s")
    if outcome[0] is not None:
        raise outcome[0]


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
