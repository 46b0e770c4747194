"""Reading what a pseudo-terminal shows, for tests that run a command as a user's shell does."""

from __future__ import annotations

import os


def read_terminal(fd: int, into: bytearray) -> None:
    """Append what `fd` (a pty's master, or a pipe) gives to `into` until its last writer is
    gone (EIO on a pty, end of file on a pipe)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into += chunk
