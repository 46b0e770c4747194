"""Tiny causal LMs and a character tokenizer, built offline and saved as ordinary HF dirs.

Nothing here is needed to *load* a model: every other module goes through
`from_pretrained(local_dir)`, so a downloaded Qwen3-0.6B directory works unchanged. This
module only makes a directory of that same shape without a model hub.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from polyrl.config import TinyModelConfig

log = logging.getLogger(__name__)

# One alphabet serves every synthetic task, so one tokenizer serves them all.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=|>?:, "
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template written in the alphabet (no newline token), for chat endpoints and
clients that apply templates themselves (atroposlib's ManagedServer). Opt-in
(`model.tiny.chat_template`, `polyrl tiny-model --chat-template`, `add_chat_template`):
with a template, `data.apply_chat_template`'s automatic mode would wrap the synthetic
tasks' prompts in it."""

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "qwen3": Qwen3Config,
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3_moe": Qwen3MoeConfig,
}


def build_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A one-token-per-character tokenizer that prepends <bos> to every encoded text."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Split every character into its own pre-token; Fuse joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD)


def build_model_config(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    moe = (
        {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": True,
        }
        if cfg.arch == "qwen3_moe"
        else {}
    )
    return _CONFIG_CLASSES[cfg.arch](
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_model(out_dir: str | Path, cfg: TinyModelConfig = TinyModelConfig()) -> Path:
    """Build a randomly initialised tiny model + tokenizer and save them as an HF directory."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    if cfg.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE  # saved as chat_template.jinja, where transformers looks
    model_cfg = build_model_config(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(model_cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    log.info("built tiny %s model (%d parameters) in %s", cfg.arch, num_params, out)
    return out


def add_chat_template(model_dir: str | Path) -> Path:
    """Give a saved tiny model's tokenizer the `CHAT_TEMPLATE` (for chat serving offline)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    return Path(model_dir)
