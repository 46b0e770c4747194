"""Output that outlives its reader.

`polyrl train ... 2>&1 | tee train.log` in a terminal, then Ctrl-C: the terminal sends
SIGINT to the whole job, so `tee` dies of it while the trainer handles it (finish the
step, save, exit 130) and goes on writing into a pipe that nobody reads. Python ignores
SIGPIPE, so each write raises BrokenPipeError (EPIPE); rich's console answers one with
SystemExit(1), which cut the save short and left no checkpoint. The output can go nowhere
by then, but the work must not stop: stdout and stderr become streams that, on EPIPE,
send what follows to /dev/null, and return as if written.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO


class SurvivingStream:
    """A text stream whose writes never raise BrokenPipeError: the first one points its file
    descriptor at /dev/null (the pipe's reader is gone for good) and drops the text."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop_output()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop_output()

    def _drop_output(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        with contextlib.suppress(OSError):
            self._stream.flush()  # what the pipe refused goes to /dev/null, so the buffer is empty

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def survive_closed_pipes() -> None:
    """Make sys.stdout and sys.stderr `SurvivingStream`s. Before logging is set up: its
    handlers keep the stream they were given."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream))
