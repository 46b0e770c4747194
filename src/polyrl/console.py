"""What polyrl writes for people to read: rich where it helps, and never a line broken for them.

A terminal wraps a long line by itself, and a copy of it is still one line; a line that
rich breaks is pasted in pieces. A pipe or a file has no width at all: rich's 80 columns
there cut every header of `polyrl status`'s table (`wor…`, `sta…`) and split errors
mid-sentence. So nothing here breaks a line: a terminal gets colours, a pipe plain text.
"""

from __future__ import annotations

import logging
import time
from typing import TextIO

from rich import get_console
from rich.console import Console
from rich.highlighter import ReprHighlighter
from rich.text import Text

UNWRAPPED = 1 << 16
"""Columns of a console that is not a terminal: wide enough that nothing is wrapped."""


def console_on(stream: TextIO) -> Console:
    """rich's console on `stream`: the terminal's width for a terminal (a table fits it),
    else as wide as the text, unwrapped."""
    if stream.isatty():
        return Console(file=stream)
    return Console(file=stream, width=UNWRAPPED, soft_wrap=True)


class TerminalHandler(logging.Handler):
    """Log lines for a terminal: time, level and message in rich's colours, one line per
    event. rich's RichHandler folds each message into the columns right of its time and
    level: the trainer's "add a worker" command came out in three pieces on a 120-column
    terminal. Printed through rich's console, so a progress bar stays below the lines."""

    def __init__(self) -> None:
        super().__init__()
        self.highlighter = ReprHighlighter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            when = time.strftime("[%x %X]", time.localtime(record.created))
            level = record.levelname
            message = self.highlighter(Text(self.format(record)))
            line = Text.assemble(
                (when, "log.time"), " ", (level.ljust(8), f"logging.level.{level.lower()}"), " ", message
            )
            get_console().print(line, soft_wrap=True)
        except Exception:  # logging's rule: a failed emit reports itself and never raises
            self.handleError(record)
