from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from polyrl.config import DataConfig
from polyrl.data.math import extract_gsm8k_answer, load_prompt_dataset, math_reward
from polyrl.data.rewards import RewardPool

GSM8K_ROWS = [
    {"question": "Tom has 8 apples and buys 64 more. How many?", "answer": "8+64=72\n#### 72"},
    {"question": "A car costs 1,000 dollars. Price?", "answer": "It is 1,000.\n#### 1,000"},
]
OPENR1_ROWS = [
    {"problem": "What is 1/2 + 0?", "answer": "\\frac{1}{2}", "solution": "Trivially 1/2."},
    {"problem": "Solve x + 3 = 0.", "answer": "-3", "solution": "x = -3."},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("5*2=10\n#### 10") == "10"
    assert extract_gsm8k_answer("lots\n#### 1,000") == "1000"
    with pytest.raises(ValueError, match="####"):
        extract_gsm8k_answer("no marker")


@pytest.mark.parametrize("fmt", ["auto", "gsm8k"])
def test_gsm8k_jsonl(tmp_path, fmt):
    path = _jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    ds = load_prompt_dataset(DataConfig(path=str(path), format=fmt))
    assert ds["prompt"] == [r["question"] for r in GSM8K_ROWS]
    assert ds["answer"] == ["72", "1000"]
    assert {"question", "solution"} <= set(ds.column_names)


@pytest.mark.parametrize("fmt", ["auto", "openr1"])
def test_openr1_parquet(tmp_path, fmt):
    path = _parquet(tmp_path / "o.parquet", OPENR1_ROWS)
    ds = load_prompt_dataset(DataConfig(path=str(path), format=fmt))
    assert ds["prompt"] == [r["problem"] for r in OPENR1_ROWS]
    assert ds["answer"] == ["\\frac{1}{2}", "-3"]
    assert ds["solution"] == [r["solution"] for r in OPENR1_ROWS]


def test_plain_csv_with_custom_keys_and_numeric_answers(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("q,a,source\nTwo plus two?,4,x\nTen minus one?,9,y\n")
    ds = load_prompt_dataset(DataConfig(path=str(path), prompt_key="q", answer_key="a"))
    assert ds["prompt"] == ["Two plus two?", "Ten minus one?"]
    assert ds["answer"] == ["4", "9"]
    assert ds["source"] == ["x", "y"]


def test_auto_question_without_marker_is_plain(tmp_path):
    rows = [{"prompt": "q?", "answer": "7", "question": "ignored", "extra": 1}]
    ds = load_prompt_dataset(DataConfig(path=str(_jsonl(tmp_path / "x.jsonl", rows))))
    assert ds["prompt"] == ["q?"] and ds["answer"] == ["7"]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "d.txt")))
    path = _jsonl(tmp_path / "o.jsonl", OPENR1_ROWS)
    with pytest.raises(ValueError, match="needs column 'question'.*problem"):
        load_prompt_dataset(DataConfig(path=str(path), format="gsm8k"))
    with pytest.raises(ValueError, match="needs column 'prompt'"):
        load_prompt_dataset(DataConfig(path=str(path), format="plain"))
    (tmp_path / "e.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="no rows"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "e.csv")))
    with pytest.raises(ValueError, match="data.path is required"):
        load_prompt_dataset(DataConfig())


CASES = [
    ("... so the answer is \\boxed{72}", "72", 1.0),
    ("The answer is 1000", extract_gsm8k_answer("#### 1,000"), 1.0),
    ("We get $0.5$.", "\\frac{1}{2}", 1.0),
    ("So x = -3", "-3", 1.0),
    ("The answer is \\boxed{73}", "72", 0.0),
    ("I have no idea", "72", 0.0),
    ("}}}\\frac{{{$$ \\boxed{", "72", 0.0),
    ("", "72", 0.0),
    (None, "72", 0.0),
    ([{"role": "assistant", "content": "\\boxed{72}"}], "72", 1.0),
    ("\\boxed{72}", "", 0.0),
]


def test_math_reward():
    completions = [c for c, _, _ in CASES]
    answers = [a for _, a, _ in CASES]
    assert math_reward([""] * len(CASES), completions, answers) == [s for _, _, s in CASES]


def test_math_reward_in_pool():
    n = 4
    with RewardPool(["polyrl.data.math:math_reward"], timeout_s=30.0) as pool:
        completions = [c for c, _, _ in CASES[:n]]
        scores = pool.score([""] * n, completions, {"answer": [a for _, a, _ in CASES[:n]]})
    assert scores == [1.0] * n


def test_polyrl_keeps_datasets_progress_bars_out_of_its_logs(tmp_path):
    """`datasets` draws a bar per split and per map on stderr; a run's log is no place for
    them. The CLI's logging set-up turns them off for its process and its children."""
    import os
    import subprocess
    import sys

    path = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    code = (
        "import sys; from polyrl.cli import _setup_logging; _setup_logging(False)\n"
        "from polyrl.config import DataConfig; from polyrl.data.math import load_prompt_dataset\n"
        "print(len(load_prompt_dataset(DataConfig(path=sys.argv[1]))))"
    )
    env = {k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")  # nothing cached: every bar would be drawn
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(len(GSM8K_ROWS)), proc.stderr
    assert "examples" not in proc.stderr and "%|" not in proc.stderr, proc.stderr


def test_the_quick_file_check_reads_what_datasets_reads(tmp_path):
    """`polyrl.data.files.peek` (before torch and `datasets` are imported) against the full
    load: the same columns and the same detected format, for every file type."""
    import csv

    from polyrl.data.files import detect_format, peek
    from polyrl.data.math import _detect_format, _read_file

    plain = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}]
    for name, rows in (("gsm8k", GSM8K_ROWS), ("openr1", OPENR1_ROWS), ("plain", plain)):
        files = [_jsonl(tmp_path / f"{name}.jsonl", rows), _parquet(tmp_path / f"{name}.parquet", rows)]
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(rows, indent=1))
        files.append(tmp_path / f"{name}.csv")
        with files[-1].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        for file in files:
            columns, first_rows = peek(file)
            ds = _read_file(str(file))
            assert columns == ds.column_names, file
            assert detect_format(columns, first_rows) == _detect_format(ds) == name, file
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="holds no rows"):
        peek(tmp_path / "empty.json")


def test_a_bad_json_line_past_the_quick_check_is_named_once(tmp_path, capfd, caplog):
    """A bad line after the first MiB, which `polyrl.preflight` reads: the full load names
    the file and the line, and `datasets`' own report of the failure (an error line, then
    its copy through the run's logging) stays out."""
    from polyrl.data.files import _PEEK_BYTES

    row = json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
    num_good = _PEEK_BYTES // len(row) + 100
    path = tmp_path / "big.jsonl"
    path.write_text(row * num_good + "not json\n" + row)
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(DataConfig(task="dataset", path=str(path)))
    assert str(err.value) == f"data.path: {path} line {num_good + 1} is not JSON: Expecting value (column 1)"
    out, errors = capfd.readouterr()
    assert "JSON" not in out + errors, out + errors
    assert not [r for r in caplog.records if r.name.startswith("datasets")], caplog.records


def test_each_prompt_can_carry_its_own_generation_budget(tmp_path, tiny_model_dir):
    """`data.max_new_tokens_key` names a column that becomes each prompt's budget (a
    long-tail workload); it does not reach the rewards, and a bad value is one clear error."""
    from transformers import AutoTokenizer

    from polyrl.config import ConfigError
    from polyrl.data.source import PromptSource
    from polyrl.preflight import _check_data

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": f"p{i}", "answer": str(i), "budget": b} for i, b in enumerate([3, 40, 7])]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(task="dataset", path=str(path), format="plain", max_new_tokens_key="budget")
    prompts = PromptSource(cfg, tok, seed=0).take(3)
    assert sorted((p.text, p.max_new_tokens) for p in prompts) == [("p0", 3), ("p1", 40), ("p2", 7)]
    assert all("budget" not in p.columns and "answer" in p.columns for p in prompts)
    assert [p.budget(10) for p in sorted(prompts, key=lambda p: p.text)] == [3, 10, 7]
    assert (
        PromptSource(cfg.model_copy(update={"max_new_tokens_key": None}), tok, seed=0).take(1)[0].max_new_tokens is None
    )

    with pytest.raises(ValueError, match="data.max_new_tokens_key='length': the file has no such column"):
        _check_data(cfg.model_copy(update={"max_new_tokens_key": "length"}))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "a", "budget": 0}])
    with pytest.raises(ConfigError, match="prompt 0 has budget=0, not a positive integer"):
        PromptSource(cfg.model_copy(update={"path": str(bad)}), tok, seed=0).take(1)
    with pytest.raises(ValueError, match="data.max_new_tokens_key needs data.task = 'dataset'"):
        DataConfig(max_new_tokens_key="budget")
