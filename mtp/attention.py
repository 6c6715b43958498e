"""Grouped-query attention under an explicit mask, without copying the KV cache per head.

transformers' `sdpa` attention hands torch's kernel the grouped key/value heads directly only when there
is no mask; with one (every tree verify step) it first repeats each KV head for its query heads
(`repeat_kv`), a copy of the layer's whole cache per forward (SmolLM2: 9 query heads over 3 KV heads).
Together with the in-place caches of `mtp.kv_cache`, avoiding it takes a 6-node bf16 verify of SmolLM2 with 400
cached tokens from 35.4 to 32.4 ms (bench/latest/amx/forward_ab.py). torch's own `enable_gqa` takes the mask
too and gives the same bits (`tests/test_attention.py`), so decoding registers `GROUPED_SDPA` and switches its own
copy of the base to it (`use_grouped_sdpa`). Anything the fast path does not cover (one query row, a
position bias, soft-capping, attention sinks, no grouped heads) goes to transformers' `sdpa` unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GROUPED_SDPA = "mtp_grouped_sdpa"

# keyword arguments that change what sdpa computes: their presence sends a call to transformers' own path
_SPECIAL = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


def grouped_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, q, D) query -> (B, q, H, D) output."""
    groups = getattr(module, "num_key_value_groups", 1)
    fast = (
        groups > 1
        and isinstance(attention_mask, torch.Tensor)
        and query.shape[2] > 1
        and all(kwargs.get(name) is None or kwargs.get(name) is False for name in _SPECIAL)
    )
    if not fast:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch `model` (a decoding copy with a config of its own) from `sdpa` to `GROUPED_SDPA`.

    Only `sdpa` models switch: eager, flash or flex attention compute differently and stay as they are.
    Returns whether it switched. Never call it on the user's model: its `generate()` is the reference.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    config._attn_implementation = GROUPED_SDPA
    return True
