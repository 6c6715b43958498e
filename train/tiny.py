"""A tiny random causal LM with a byte-level tokenizer and a chat template, saved as a normal HF checkpoint.

Why: the training pipeline (load from a directory, tokenize, chat-template, train, export, reload) has to be
exercised end to end in CI and in seconds, without a model hub. A byte-level tokenizer needs no training
data and covers any text; the model is random, so what heads learn on it is the structure of the text
visible through the base's hidden states.

    python -m mtp.train.tiny /tmp/tiny-llama      # then: model: /tmp/tiny-llama in a training config
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(extra_tokens: int = 0):
    """256 byte tokens + 5 specials (+ `extra_tokens` filler tokens, to make a deliberately wrong vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in enumerate(_byte_chars())}  # token id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"] + [f"<extra_{i}>" for i in range(extra_tokens)],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tiny_checkpoint(
    directory: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 264,
    hidden_size: int = 64,
    num_layers: int = 2,
    extra_tokens: int = 0,
) -> Path:
    """Write a random `arch` model (llama | qwen2 | gpt2) + byte tokenizer to `directory`."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    tokenizer = byte_tokenizer(extra_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    common = dict(
        vocab_size=vocab_size, bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"]
    )
    torch.manual_seed(seed)
    if arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=4, n_positions=1024, **common)
        )
    else:
        cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
        model = model_cls(
            cfg_cls(
                hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, **common,
            )
        )  # fmt: skip
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(make_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
