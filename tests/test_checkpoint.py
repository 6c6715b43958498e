"""Save / load round trips and the errors a user meets with a wrong or damaged checkpoint."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from conftest import VOCAB, random_heads, tiny_model

from mtp import MTPModel
from mtp.config import CONFIG_NAME, HEADS_NAME


@pytest.fixture
def model():
    return random_heads(tiny_model("qwen2", seed=11), seed=11)


def _same_output(a: MTPModel, b: MTPModel) -> None:
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ra = a.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    rb = b.generate(ids, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(ra.sequences, rb.sequences)
    assert ra.accepted_lengths == rb.accepted_lengths  # same drafts too, not only the same text


def test_full_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / HEADS_NAME).is_file()
    assert not list(tmp_path.glob("*.bin"))
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["head_type"] == "medusa" and cfg["num_heads"] == 4 and cfg["format_version"] == 1
    assert cfg["base_architectures"] == ["Qwen2ForCausalLM"] and cfg["base_checksum"].startswith("sha256:")
    loaded = MTPModel.from_pretrained(tmp_path)
    _same_output(model, loaded)


def test_heads_only_round_trip(model, tmp_path):
    base_dir, heads_dir = tmp_path / "base", tmp_path / "heads"
    model.base_model.save_pretrained(base_dir)
    model.config.base_model_name_or_path = str(base_dir)
    model.save_pretrained(heads_dir, heads_only=True)
    assert not (heads_dir / "model.safetensors").exists()
    _same_output(model, MTPModel.from_pretrained(heads_dir))  # base found through the pointer
    _same_output(model, MTPModel.from_pretrained(heads_dir, base_model=model.base_model))


def test_bf16_load_of_fp32_checkpoint_is_accepted(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = MTPModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert next(loaded.heads.parameters()).dtype == torch.bfloat16


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        MTPModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not an MTP checkpoint"):
        MTPModel.from_pretrained(tmp_path)


def test_other_format_version(model, tmp_path):
    model.save_pretrained(tmp_path, heads_only=True)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    cfg["format_version"] = 99
    (tmp_path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="format version 99"):
        MTPModel.from_pretrained(tmp_path, base_model=model.base_model)


def test_bad_config_field(model, tmp_path):
    model.save_pretrained(tmp_path, heads_only=True)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    cfg["num_heads"] = "four"
    (tmp_path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_heads"):
        MTPModel.from_pretrained(tmp_path, base_model=model.base_model)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MTPModel.from_pretrained(tmp_path, base_model=model.base_model)


def test_hidden_size_mismatch(model, tmp_path):
    model.save_pretrained(tmp_path, heads_only=True)
    other = tiny_model("llama", hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden size 64"):
        MTPModel.from_pretrained(tmp_path, base_model=other)


def test_heads_on_a_different_base_are_refused(model, tmp_path):
    model.save_pretrained(tmp_path, heads_only=True)
    same_shape_other_weights = tiny_model("qwen2", seed=12)
    with pytest.raises(ValueError, match="different base model"):
        MTPModel.from_pretrained(tmp_path, base_model=same_shape_other_weights)


def test_truncated_heads_file(model, tmp_path):
    model.save_pretrained(tmp_path, heads_only=True)
    path = tmp_path / HEADS_NAME
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors"):
        MTPModel.from_pretrained(tmp_path, base_model=model.base_model)


def test_heads_only_without_base_pointer(model, tmp_path):
    model.config.base_model_name_or_path = None
    model.save_pretrained(tmp_path, heads_only=True)
    with pytest.raises(ValueError, match="pass base_model="):
        MTPModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_saved_weights_follow_the_umask(model, tmp_path, umask, mode):
    """safetensors writes 0600 whatever the umask: a checkpoint exported by one user and served by another
    would fail on its weights alone. Every weights file gets the mode of any other new file, never wider."""
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "full")
        model.save_pretrained(tmp_path / "heads", heads_only=True)
    finally:
        os.umask(old)
    weights = sorted(tmp_path.rglob("*.safetensors"))
    assert {p.name for p in weights} == {"model.safetensors", HEADS_NAME}
    assert {p: stat.S_IMODE(p.stat().st_mode) for p in weights} == {p: mode for p in weights}
    config = tmp_path / "heads" / CONFIG_NAME
    assert stat.S_IMODE(config.stat().st_mode) == mode  # the same mode as the JSON beside it
