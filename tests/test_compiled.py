"""Decoding through a compiled verify forward (`MTPModel.compile_decoding`): the same tokens as `generate()`."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_decodes_like_generate, fit_heads, tiny_model
from torch._dynamo.utils import counters

from mtp import MTPModel
from mtp.compiled import cpu_compiler

pytestmark = [
    # torch's compiler calls a deprecated torch.jit helper of its own while it builds graphs
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
    pytest.mark.skipif(cpu_compiler() is None, reason="torch.compile on a CPU needs a C++ compiler: apt install g++"),
]


def _counting(model: MTPModel) -> list[int]:
    """Record the number of tree nodes of every call to the compiled forward."""
    calls: list[int] = []
    inner = model._verify_forward

    def forward(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return inner(*args, **kwargs)

    model._verify_forward = forward
    return calls


def test_compiled_decoding_matches_generate_and_needs_no_graph_after_warm_up():
    torch._dynamo.reset()
    base = tiny_model("llama", seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (3, 9)]
    model, seqs = fit_heads(base, prompts, num_new=40, steps=200)
    assert not model.compiled
    model.compile_decoding()
    assert model.compiled
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the warm-up built them
    calls = _counting(model)

    assert_decodes_like_generate(model, prompts, seqs, g)  # prompts of 3 and 9 tokens: τ checked on both

    assert calls and 1 in calls and max(calls) > 2  # verify steps of every size ran compiled
    assert counters["stats"]["unique_graphs"] == graphs  # no request waited for a compile


def test_a_missing_cpu_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr("mtp.compiled.shutil.which", lambda name: None)
    model = MTPModel.from_base(tiny_model("llama"), num_heads=2)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        model.compile_decoding()
    assert not model.compiled
