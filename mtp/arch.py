"""What we need to know about a base causal LM, read from its HF config and modules.

Architecture differences live here and only here, and they come from config attributes and
transformers' own accessors (`get_output_embeddings`, `get_input_embeddings`), never from class
names: that is what lets one code path serve Llama, Qwen2, Mistral, GPT-2 and whatever comes next.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BaseInfo:
    """The handful of facts about a base model that heads, trees and the decoder depend on."""

    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    vocab_size: int
    max_positions: int | None  # None: no hard limit (rotary); an int: learned positions (GPT-2)
    sliding_window: int | None  # window of the sliding layers, if any
    mixed_layer_types: bool  # some layers sliding, some full
    tied_embeddings: bool
    cache_kwarg: str  # "cache" (transformers >= 5.24) or "past_key_values"
    logits_to_keep: bool  # forward() can skip the lm_head for all but the last position


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _first_attr(config, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def norm_eps(config, default: float = 1e-6) -> float:
    """The epsilon of the config's normalisation layers, whatever the architecture calls it."""
    for name in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"):
        value = getattr(config, name, None)
        if value:
            return float(value)
    return default


def describe(base_model: nn.Module) -> BaseInfo:
    """Read the base model's shape facts; raise a clear error if something essential is missing."""
    config = _text_config(base_model.config)
    lm_head = base_model.get_output_embeddings()
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(
            f"{type(base_model).__name__} has no output embedding (lm_head); MTP heads need a causal LM "
            "loaded with AutoModelForCausalLM."
        )
    vocab_size, lm_hidden = lm_head.weight.shape
    hidden_size = _first_attr(config, ("hidden_size", "n_embd", "d_model")) or lm_hidden
    if hidden_size != lm_hidden:
        raise ValueError(f"config hidden size {hidden_size} does not match lm_head input size {lm_hidden}")

    layer_types = getattr(config, "layer_types", None)
    sliding_window = getattr(config, "sliding_window", None)
    if layer_types:
        has_sliding = any("sliding" in str(t) for t in layer_types)
        mixed = has_sliding and not all("sliding" in str(t) for t in layer_types)
    else:
        # No per-layer types: every layer follows the one window setting (Mistral semantics).
        has_sliding, mixed = sliding_window is not None, False
    # Learned absolute positions have a hard table size; rotary models can run past their nominal length.
    learned_positions = getattr(config, "position_embedding_type", None) == "absolute" or hasattr(config, "n_positions")
    max_positions = _first_attr(config, ("n_positions", "max_position_embeddings")) if learned_positions else None

    embed = base_model.get_input_embeddings()
    tied = embed is not None and embed.weight.data_ptr() == lm_head.weight.data_ptr()
    params = inspect.signature(base_model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    return BaseInfo(
        model_type=str(getattr(config, "model_type", "unknown")),
        architectures=tuple(getattr(base_model.config, "architectures", None) or (type(base_model).__name__,)),
        hidden_size=int(hidden_size),
        vocab_size=int(vocab_size),
        max_positions=max_positions,
        sliding_window=int(sliding_window) if has_sliding and sliding_window else None,
        mixed_layer_types=mixed,
        tied_embeddings=tied,
        cache_kwarg=cache_kwarg,
        logits_to_keep="logits_to_keep" in params,
    )


def model_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def model_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device
