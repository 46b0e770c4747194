"""A cap on how fast a sender sends, all its connections together (`manager.transfer.max_send_gbps`).

A trainer's network link is rarely its own: checkpoints, the dataset and other jobs use
it too, and a version pulled by every worker at once would take all of it. A sender
sends in pieces of at most `PACE_BYTES`, and each piece first books its bytes on one
virtual clock: it may start once the bytes booked before it have had their time at the
capped rate. Over any stretch the bytes sent stay within the rate plus one piece; no
byte is delayed when the link is idle and under the cap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

PACE_BYTES = 256 * 1024
"""The most one booking covers: what the link may get in one burst, so a chunk of 8 MiB
does not go at the link's full speed."""


class SendPacer:
    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a send rate must be > 0 bytes/s, not {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        """When the link, at the capped rate, is done with the bytes booked so far."""
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Book `nbytes` and sleep until they may be sent; returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
        wait = start - now
        if wait > 0:
            time.sleep(wait)
        return max(wait, 0.0)


def paced(pacer: SendPacer | None, start: int, end: int) -> Iterator[tuple[int, int]]:
    """[start, end) in the pieces to send, each booked first; one piece without a pacer."""
    if pacer is None:
        yield start, end
        return
    for piece in range(start, end, PACE_BYTES):
        piece_end = min(piece + PACE_BYTES, end)
        pacer.take(piece_end - piece)
        yield piece, piece_end


def gbps_to_bytes(gbps: float | None) -> float | None:
    """Gbit/s (network units, 10**9 bits) to bytes/s; None stays None (no cap)."""
    return None if gbps is None else gbps * 1e9 / 8
