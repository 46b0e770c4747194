"""Offline tiny models load through the real HF loaders; tasks and the prompt stream."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polyrl.config import DataConfig, TinyModelConfig
from polyrl.data.source import PromptSource
from polyrl.data.tasks import TASKS, char_match_reward, exact_match_reward, get_task, repeat_match_reward, task_record
from polyrl.models.tiny import save_tiny_model


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tiny_model_is_an_hf_directory(tmp_path, arch):
    out = save_tiny_model(tmp_path / arch, TinyModelConfig(arch=arch, hidden_size=32, intermediate_size=64))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == arch
    assert 10_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    ids = tok("12+3=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 6  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "12+3="
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 6, len(tok))


def test_tiny_model_is_seeded(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "a", TinyModelConfig(hidden_size=32)))
    b = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "b", TinyModelConfig(hidden_size=32)))
    c = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "c", TinyModelConfig(hidden_size=32, seed=1)))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_tiny_model_command_writes_a_chat_template(tmp_path, tiny_model_dir):
    """`polyrl tiny-model --chat-template` (issue 38): the tokenizer then applies a chat
    template in its own alphabet, as a chat client does (Atropos' chat path); without the
    flag it has none."""
    out = tmp_path / "chat"
    command = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "tiny-model",
        "--out",
        str(out),
        "--chat-template",
        "hidden_size=32",
        "intermediate_size=64",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "chat_template.jinja").is_file()  # where transformers, vLLM and SGLang look
    tok = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "user", "content": "abc>"},
        {"role": "assistant", "content": "abc"},
        {"role": "user", "content": "ba>"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos>user: abc>|assistant: abc|user: ba>|assistant: "
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.pad_token_id not in ids and tok.decode(ids) == text  # every character is in the vocabulary
    assert AutoTokenizer.from_pretrained(tiny_model_dir).chat_template is None


def test_bad_tiny_shape():
    with pytest.raises(ValueError, match="divisible"):
        TinyModelConfig(hidden_size=30, num_heads=4)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_and_solvable(name):
    task = get_task(name)
    recs = [task_record(task, seed=3, index=i) for i in range(50)]
    assert recs == [task_record(task, seed=3, index=i) for i in range(50)]
    assert recs != [task_record(task, seed=4, index=i) for i in range(50)]
    fn = exact_match_reward if task.reward.endswith("exact_match_reward") else char_match_reward
    prompts = [r["prompt"] for r in recs]
    answers = [r["answer"] for r in recs]
    assert fn(prompts, answers, answer=answers) == [1.0] * 50
    assert max(fn(prompts, ["zz"] * 50, answer=answers)) < 1.0


def test_rewards_by_hand():
    assert exact_match_reward(["1+2="], [" 3 "], answer=["3"]) == [1.0]
    assert exact_match_reward(["1+2="], ["34"], answer=["3"]) == [0.0]
    # "cba" vs "cbd": 2 of 3 in place; "c" vs "cba": 1 of 3; longer output is penalised too.
    assert char_match_reward(["", "", ""], ["cbd", "c", "cbaxx"], answer=["cba"] * 3) == [2 / 3, 1 / 3, 3 / 5]
    assert char_match_reward([""], [""], answer=[""]) == [0.0]
    # With finish_reason the stop is one more position: "cb$" vs "cba$", "xyz$" vs "cba$".
    stopped = char_match_reward(["", ""], ["cb", "xyz"], answer=["cba", "cba"], finish_reason=["stop", "stop"])
    assert stopped == [2 / 4, 1 / 4]


def test_repeat_match_scores_every_character_against_the_word_repeated():
    # "ab" repeated is "ababa...": "ababx" has 4 of 5 in place, "babab" none, a long run all.
    got = repeat_match_reward(["", "", "", ""], ["ababx", "babab", "ab" * 300, ""], answer=["ab"] * 4)
    assert got == [4 / 5, 0.0, 1.0, 0.0]
    assert repeat_match_reward([""], ["abcab"], answer=["abc"]) == [1.0]
    assert char_match_reward([""], ["cba"], answer=["cba"], finish_reason=["length"]) == [3 / 4]
    assert char_match_reward([""], ["cba"], answer=["cba"], finish_reason=["stop"]) == [1.0]
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")


def test_prompt_source_cursor(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    src = PromptSource(DataConfig(task="digit_sum"), tok, seed=0)
    first = src.take(5)
    assert src.cursor == 5 and [p.index for p in first] == list(range(5))
    assert first[0].prompt_ids == tok(first[0].text).input_ids
    assert "answer" in first[0].columns
    again = PromptSource(DataConfig(task="digit_sum"), tok, seed=0)
    again.cursor = 3
    assert [p.text for p in again.take(2)] == [p.text for p in first[3:]]


def test_prompt_source_dataset_epochs_and_skips(tiny_model_dir, tmp_path):
    import json

    path = tmp_path / "d.jsonl"
    rows = [{"problem": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)] + [{"problem": "9" * 40, "answer": "0"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(task="dataset", path=str(path), max_prompt_tokens=20)
    src = PromptSource(cfg, tok, seed=0)
    assert src.default_reward == "polyrl.data.math:math_reward"
    prompts = src.take(8)  # two epochs of the 4 short rows; the long row is skipped each epoch
    assert src.num_skipped == 2 and src.cursor == 10
    assert sorted(p.text for p in prompts[:4]) == sorted(r["problem"] for r in rows[:4])
    assert sorted(p.text for p in prompts[4:]) == sorted(r["problem"] for r in rows[:4])
    assert all(p.columns["answer"] == str(2 * int(p.text.split("+")[0])) for p in prompts)
    with pytest.raises(ValueError, match="data.path"):
        PromptSource(DataConfig(task="dataset"), tok, seed=0)


def test_prompt_source_gives_up_when_every_prompt_is_too_long(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    src = PromptSource(DataConfig(task="copy", max_prompt_tokens=2), tok, seed=0)
    with pytest.raises(ValueError, match="data.max_prompt_tokens"):
        src.take(1)
