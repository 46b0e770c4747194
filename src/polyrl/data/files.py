"""A prompt file's type, columns and first rows, read without `datasets`.

`polyrl train` checks `data.path` before it imports torch or `datasets` and before it
writes the run directory (`polyrl.preflight`): importing `datasets` alone takes seconds,
and a wrong column should cost the user well under that. So the format rules live here,
on plain column names and a few rows, and `polyrl.data.math` applies the same rules to
the loaded dataset.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from polyrl.config import DataConfig

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""File suffix -> the `datasets` builder that reads it."""
SNIFF_ROWS = 8
"""Rows looked at to tell GSM8K's `#### N` answers from other question/answer files."""
_PEEK_BYTES = 1 << 20


def data_file(path: str | None) -> Path:
    """`path` as an existing file of a supported type; ValueError/FileNotFoundError naming `data.path`."""
    if not path:
        raise ValueError("data.path is required when data.task = 'dataset'")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path: file not found: {file}")
    if file.suffix.lower() not in BUILDERS:
        raise ValueError(
            f"data.path: unsupported file type {file.suffix!r} for {file} "
            f"(expected one of {', '.join(sorted(BUILDERS))})"
        )
    return file


def detect_format(columns: list[str], first_rows: list[dict[str, Any]]) -> str:
    """GSM8K if question/answer with '####' answers; OpenR1 if problem/answer; else plain."""
    cols = set(columns)
    if {"question", "answer"} <= cols:
        if all(isinstance(row.get("answer"), str) and "####" in row["answer"] for row in first_rows[:SNIFF_ROWS]):
            return "gsm8k"
    if {"problem", "answer"} <= cols:
        return "openr1"
    return "plain"


def required_columns(fmt: str, cfg: DataConfig) -> list[str]:
    if fmt == "gsm8k":
        return ["question", "answer"]
    if fmt == "openr1":
        return ["problem", "answer"]
    return [cfg.prompt_key, cfg.answer_key]


def check_columns(columns: list[str], fmt: str, cfg: DataConfig) -> None:
    """ValueError naming the first column format `fmt` needs that the file lacks."""
    for col in required_columns(fmt, cfg):
        if col not in columns:
            hint = " (set data.prompt_key / data.answer_key, or data.format)" if fmt == "plain" else ""
            how = (
                f"data.format='auto' reads the file as {fmt!r}, which"
                if cfg.format == "auto"
                else f"data.format={fmt!r}"
            )
            raise ValueError(f"{how} needs column {col!r}, but the file has only {columns}{hint}")
    key = cfg.max_new_tokens_key
    if key is not None and key not in columns:
        raise ValueError(f"data.max_new_tokens_key={key!r}: the file has no such column, only {columns}")


def peek(file: Path) -> tuple[list[str], list[dict[str, Any]]] | None:
    """The file's column names and first rows, from its start only (a parquet file's
    footer); None when that cannot tell (e.g. one pretty-printed JSON object), in which
    case the full load checks. ValueError when the file is empty or unreadable."""
    kind = BUILDERS[file.suffix.lower()]
    try:
        if kind == "parquet":
            return _peek_parquet(file)
        if kind == "csv":
            return _peek_csv(file)
        return _peek_json(file)
    except (OSError, UnicodeDecodeError, csv.Error, json.JSONDecodeError) as e:
        raise ValueError(f"data.path: {file} cannot be read as {kind}: {e}") from None


def _peek_parquet(file: Path) -> tuple[list[str], list[dict[str, Any]]]:
    import pyarrow.parquet as pq  # ~0.2 s; `datasets` needs it anyway

    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:  # pyarrow's own error types (ArrowInvalid) for a file that is not parquet
        raise OSError(str(e)) from None
    columns = parquet.schema_arrow.names
    batch = next(parquet.iter_batches(batch_size=SNIFF_ROWS), None)
    return columns, _non_empty(file, batch.to_pylist() if batch is not None else [])


def _peek_csv(file: Path) -> tuple[list[str], list[dict[str, Any]]]:
    with file.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [row for _, row in zip(range(SNIFF_ROWS), reader, strict=False)]
        return list(reader.fieldnames or []), _non_empty(file, rows)


def _peek_json(file: Path) -> tuple[list[str], list[dict[str, Any]]] | None:
    """JSON lines, or one JSON array of objects (the two layouts `datasets` reads without
    a `field`); the first rows of either are decoded from the file's first MiB. Every line
    of that MiB is checked: a bad one is named here, by number, not after the imports."""
    with file.open() as f:
        head = f.read(_PEEK_BYTES)
    is_cut = len(head) == _PEEK_BYTES
    text = head.lstrip()
    decoder = json.JSONDecoder()
    rows: list[Any] = []
    if text.startswith("["):
        pos = 1
        while len(rows) < SNIFF_ROWS:
            pos = _skip(text, pos, " \t\r\n,")
            if pos >= len(text) or text[pos] == "]":
                break
            try:
                row, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                if not is_cut or not rows:
                    raise
                break  # cut at the peek limit: the rows so far will do
            rows.append(row)
    elif _opens_one_object(text):  # pretty-printed (`datasets`' `field` layout)
        if is_cut:
            return None  # the full load decides
        try:
            json.loads(head)
        except json.JSONDecodeError as e:
            raise ValueError(_bad_line(file, e.lineno, e)) from None
        return None
    else:
        lines = head.split("\n")
        if is_cut:
            lines = lines[:-1]  # the last one may be cut at the peek limit
        rows = list(json_lines(file, lines))
        if not rows and is_cut:
            return None  # one long line: not worth reading further here
        rows = rows[:SNIFF_ROWS]
    if not all(isinstance(row, dict) for row in rows):
        return None
    columns = list(dict.fromkeys(key for row in rows for key in row))  # `datasets` takes their union
    return columns, _non_empty(file, rows)


def json_lines(file: Path, lines: Iterable[str]) -> Iterator[Any]:
    """The values of JSON `lines` (blank ones skipped); ValueError naming `file` and the
    number of the first line that is not JSON."""
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(_bad_line(file, number, e)) from None


def check_json_lines(file: Path) -> None:
    """ValueError naming the first line of a JSON-lines `file` that is not JSON. The full
    load's own error (pyarrow's, through `datasets`) names neither the file nor the line;
    a file that opens an array or one pretty-printed object is not checked here."""
    with file.open() as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("[") or _opens_one_object(first):
        return
    with file.open() as f:
        for _ in json_lines(file, f):
            pass


def _opens_one_object(text: str) -> bool:
    """The first line opens an object that it does not close: not JSON lines."""
    first = text.lstrip().split("\n", 1)[0]
    if not first.startswith("{"):
        return False
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return True
    return False


def _bad_line(file: Path, number: int, error: json.JSONDecodeError) -> str:
    return f"data.path: {file} line {number} is not JSON: {error.msg} (column {error.colno})"


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _non_empty(file: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not rows:
        raise ValueError(f"data.path: {file} holds no rows")
    return rows
