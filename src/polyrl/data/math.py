"""Math prompt datasets (GSM8K, OpenR1-Math, plain files) and a math-verify reward.

Every loader returns a `datasets.Dataset` with string columns "prompt" and "answer" (plus the
file's other columns), so the rest of the pipeline never needs to know the source format.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import datasets

from polyrl.config import DataConfig
from polyrl.data.files import (
    BUILDERS,
    SNIFF_ROWS,
    check_columns,
    check_json_lines,
    data_file,
    detect_format,
    required_columns,
)

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_gsm8k_answer(solution: str) -> str:
    """The final answer after GSM8K's "####" marker, thousands separators removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' final answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


# ---- loading -----------------------------------------------------------------------------


def _read_file(path: str | None) -> datasets.Dataset:
    """Read a local file through `datasets` so large files are memory-mapped, not loaded.
    Any failure is one ValueError naming the file (and for JSON lines, the bad line), so
    `datasets`' log is held back while it reads: it printed the error twice before ours."""
    file = data_file(path)
    builder = BUILDERS[file.suffix.lower()]
    try:
        with _quiet(logging.getLogger("datasets")):
            return datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as e:
        if builder == "json":
            check_json_lines(file)  # past the first MiB that `polyrl.preflight` checked
        # An empty file surfaces as 'Instruction "train" corresponds to no data!'.
        why = "holds no rows" if "no data" in str(e) else f"cannot be read as {builder}: {_root_cause(e)}"
        raise ValueError(f"data.path: {file} {why}") from e


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _root_cause(error: BaseException) -> str:
    """The innermost cause: `datasets` wraps the reader's error in "An error occurred while
    generating the dataset", which says nothing."""
    while error.__cause__ is not None:
        error = error.__cause__
    return " ".join(str(error).split())


def _detect_format(ds: datasets.Dataset) -> str:
    first_rows = ds.select(range(min(len(ds), SNIFF_ROWS))).to_list()
    return detect_format(ds.column_names, first_rows)


def _as_text(value: Any) -> str:
    return "" if value is None else str(value)


def _gsm8k_row(row: dict[str, Any]) -> dict[str, str]:
    out = {"prompt": _as_text(row["question"]), "answer": extract_gsm8k_answer(row["answer"])}
    if "solution" not in row:
        out["solution"] = row["answer"]  # keep the worked rationale for inspection
    return out


def _convert(ds: datasets.Dataset, fmt: str, cfg: DataConfig) -> datasets.Dataset:
    """Map one known format onto the prompt/answer schema."""
    check_columns(ds.column_names, fmt, cfg)
    if fmt == "gsm8k":
        return ds.map(_gsm8k_row)
    keys = required_columns(fmt, cfg)
    return ds.map(lambda row: {"prompt": _as_text(row[keys[0]]), "answer": _as_text(row[keys[1]])})


def _cast_to_str(ds: datasets.Dataset) -> datasets.Dataset:
    """A file of all-numeric answers is read as int64; the schema promises strings."""
    for col in ("prompt", "answer"):
        if ds.features[col] != datasets.Value("string"):
            ds = ds.cast_column(col, datasets.Value("string"))
    return ds


def load_prompt_dataset(cfg: DataConfig) -> datasets.Dataset:
    """Load `cfg.path` and return it with string columns "prompt" and "answer"."""
    ds = _read_file(cfg.path)
    if len(ds) == 0:
        raise ValueError(f"data.path: {cfg.path} holds no rows")
    fmt = _detect_format(ds) if cfg.format == "auto" else cfg.format
    return _cast_to_str(_convert(ds, fmt, cfg))


def read_rows(path: str | None) -> datasets.Dataset:
    """`path`'s records as they are (agent items): no prompt or answer column needed."""
    ds = _read_file(path)
    if len(ds) == 0:
        raise ValueError(f"data.path: {path} holds no rows")
    return ds


# ---- reward ------------------------------------------------------------------------------


def _completion_text(completion: Any) -> str | None:
    """Plain text, or the last message's content for TRL's conversational format."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def _gold_latex(gold: str) -> str:
    """Bare gold answers ("72", "\\frac{1}{2}") are boxed so math-verify reads them as LaTeX;
    ones already in math mode are kept; "1,000" loses its separators first."""
    gold = gold.strip()
    if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
        return gold
    if _NUMBER.fullmatch(gold):
        gold = gold.replace(",", "")
    return "\\boxed{" + gold + "}"


def _timeouts() -> dict[str, dict[str, int | None]]:
    """math-verify's timeouts use signal.alarm, which only works on the main thread."""
    main = threading.current_thread() is threading.main_thread()
    return {
        "parse": {"parsing_timeout": 5 if main else None},
        "verify": {"timeout_seconds": 5 if main else None},
    }


def _score_one(gold: Any, completion: Any, cache: dict[str, list]) -> float:
    from math_verify import parse, verify  # heavy (sympy): import only where rewards run

    text = _completion_text(completion)
    if text is None or gold is None or not str(gold).strip():
        return 0.0
    t = _timeouts()
    key = str(gold)
    if key not in cache:
        cache[key] = parse(_gold_latex(key), **t["parse"])
    if not cache[key]:
        return 0.0
    pred = parse(text, **t["parse"])
    return 1.0 if pred and verify(cache[key], pred, **t["verify"]) else 0.0


def math_reward(prompts: list[str], completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1.0 when the completion's final answer equals the gold `answer`, else 0.0 (never raises)."""
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    cache: dict[str, list] = {}  # GRPO groups repeat the same gold answer n times
    scores = []
    for gold, completion in zip(answer, completions):
        try:
            scores.append(_score_one(gold, completion, cache))
        except (Exception, TimeoutException):  # noqa: BLE001 - a parser bug must not stop training
            scores.append(0.0)
    return scores + [0.0] * (len(completions) - len(scores))
