"""Grouped-query attention under a mask without repeated KV heads (`mtp.attention`): transformers' bits."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mtp import attention
from mtp.attention import GROUPED_SDPA, grouped_sdpa_forward, use_grouped_sdpa


class _Attn(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _tree_mask(q: int, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (1, 1, q, kv) mask: the prefix visible, the q new rows as a random tree (each sees its parent's
    rows)."""
    g = torch.Generator().manual_seed(q)
    sees = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        parent = int(torch.randint(0, i, (1,), generator=g))
        sees[i] |= sees[parent]
    mask = torch.zeros(q, kv, dtype=dtype)
    mask[:, kv - q :].masked_fill_(~sees, torch.finfo(dtype).min)
    return mask[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [2, 7, 16])
def test_grouped_heads_under_a_mask_give_transformers_sdpa_bits(dtype, q):
    g = torch.Generator().manual_seed(0)
    kv = 150 + q
    query = torch.randn(1, 9, q, 64, generator=g).to(dtype)
    key = torch.randn(1, 3, 300, 64, generator=g).to(dtype)[:, :, :kv]  # a view of a larger buffer, as cached
    value = torch.randn(1, 3, 300, 64, generator=g).to(dtype)[:, :, :kv]
    mask = _tree_mask(q, kv, dtype)
    ours, _ = grouped_sdpa_forward(_Attn(3), query, key, value, mask, scaling=0.125)
    ref, _ = sdpa_attention_forward(_Attn(3), query, key, value, mask, scaling=0.125)
    assert ours.shape == ref.shape == (1, q, 9, 64)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    "case",
    ["one query row", "no mask", "no grouped heads", "position bias", "attention sinks"],
)
def test_what_the_fast_path_does_not_cover_goes_to_transformers(case, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
    q = 1 if case == "one query row" else 4
    groups = 1 if case == "no grouped heads" else 3
    query = torch.randn(1, 3 * groups, q, 8)
    key = value = torch.randn(1, 3, 10, 8)
    mask = None if case == "no mask" else _tree_mask(q, 10, torch.float32)
    kwargs = {
        "position bias": {"position_bias": torch.zeros(1, 1, q, 10)},
        "attention sinks": {"s_aux": torch.zeros(9)},
    }
    grouped_sdpa_forward(_Attn(groups), query, key, value, mask, **kwargs.get(case, {}))
    assert calls == [1]


def test_packed_decoding_switches_its_own_copy_and_runs_tree_steps_on_the_fast_path():
    from mtp import MTPModel

    base = tiny_model("llama", seed=2)  # 4 query heads over 2 KV heads
    model = MTPModel.from_base(base, num_heads=2).pack_decoding()
    assert model.decoding_base.config._attn_implementation == GROUPED_SDPA
    assert base.config._attn_implementation == "sdpa"  # generate(), the reference, is untouched
    rows = []
    fast = attention.grouped_sdpa_forward

    def counted(module, query, *args, **kwargs):
        rows.append(query.shape[2])
        return fast(module, query, *args, **kwargs)

    attention.AttentionInterface.register(GROUPED_SDPA, counted)
    try:
        ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(1))
        model.generate(ids, max_new_tokens=12, tree=[(0,), (1,), (0, 0)], speculative=True)
    finally:
        attention.AttentionInterface.register(GROUPED_SDPA, fast)
    assert 4 in rows  # the 4-node verify steps ran through it


def test_only_sdpa_models_switch():
    eager = tiny_model("llama", attn_implementation="eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"
    sdpa = copy.deepcopy(tiny_model("qwen2"))
    assert use_grouped_sdpa(sdpa) and sdpa.config._attn_implementation == GROUPED_SDPA
