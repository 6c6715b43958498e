"""The `mtp` console command, run as a user would run it (subprocess)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import VOCAB, random_heads, tiny_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from mtp.compiled import cpu_compiler
from mtp.packed import bf16_kernel, can_pack, unpackable_reason, upcasts


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """Words w0..w255 are token ids 0..255."""
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")


def _mtp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtp.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_help_lists_subcommands():
    res = _mtp("--help")
    assert res.returncode == 0
    assert "generate" in res.stdout and "info" in res.stdout


def test_generate_and_info_on_a_saved_checkpoint(tmp_path):
    model = random_heads(tiny_model("llama", seed=21), seed=21)
    model.tokenizer = _word_tokenizer()
    model.save_pretrained(tmp_path)
    packs = can_pack(model.base_model)  # on a CPU with oneDNN: decoding runs from prepacked weights by default
    res = _mtp("generate", "-m", str(tmp_path), "-p", "w5 w9 w77", "--max-new-tokens", "20", "--no-chat")
    assert res.returncode == 0, res.stderr
    assert "identical: True" in res.stdout and "τ=" in res.stdout
    assert ("decoding from prepacked weights" in res.stdout) == packs
    assert ("cannot be prepacked here" in res.stdout) == (not packs)
    res = _mtp("generate", "-m", str(tmp_path), "-p", "w5 w9 w77", "--max-new-tokens", "20", "--no-chat", "--no-pack")
    assert res.returncode == 0 and "identical: True" in res.stdout, res.stderr
    assert "prepacked" not in res.stdout
    # bf16: packed in oneDNN's bf16 layout on a CPU with bf16 matmul units; elsewhere for the AVX2 kernel or as
    # fp32 copies (and said which)
    reason = unpackable_reason(copy.deepcopy(model.base_model).to(torch.bfloat16))
    bf16 = ("--dtype", "bfloat16")
    res = _mtp("generate", "-m", str(tmp_path), "-p", "w5 w9", "--max-new-tokens", "8", "--no-chat", *bf16)
    assert res.returncode == 0, res.stderr
    if reason is None:
        assert "decoding from prepacked weights" in res.stdout
        runtime = "bf16 weights through an AVX2 kernel" if bf16_kernel() else "fp32 copies"
        assert (f"{runtime}: this CPU has no bf16 matmul units" in res.stdout) == upcasts(torch.bfloat16)
    else:
        assert f"cannot be prepacked here ({reason})" in res.stdout
    res = _mtp("info", str(tmp_path))
    assert res.returncode == 0 and '"head_type": "medusa"' in res.stdout


@pytest.mark.skipif(cpu_compiler() is None, reason="torch.compile on a CPU needs a C++ compiler: apt install g++")
def test_generate_with_compiled_verify_steps(tmp_path):
    random_heads(tiny_model("llama", seed=21), seed=21).save_pretrained(tmp_path)
    _word_tokenizer().save_pretrained(tmp_path)
    res = _mtp("generate", "-m", str(tmp_path), "-p", "w5 w9 w77", "--max-new-tokens", "20", "--no-chat", "--compile")
    assert res.returncode == 0, res.stderr
    assert "compiled the verify forward" in res.stdout and "identical: True" in res.stdout


def test_compile_without_a_cpu_compiler_is_a_clear_error(tmp_path):
    random_heads(tiny_model("llama", seed=21), seed=21).save_pretrained(tmp_path)
    _word_tokenizer().save_pretrained(tmp_path)
    env = {**os.environ, "PATH": str(tmp_path / "no-bin"), "CXX": ""}  # no g++, c++ or clang++ to be found
    res = _mtp("generate", "-m", str(tmp_path), "-p", "w5 w9", "--no-chat", "--compile", env=env)
    assert res.returncode == 2
    assert "needs a C++ compiler" in res.stderr and "Traceback" not in res.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    res = _mtp("generate", "-m", str(tmp_path / "missing"), "-p", "hi")
    assert res.returncode == 2
    assert "not found" in res.stderr and "Traceback" not in res.stderr
