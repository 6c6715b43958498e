"""Checkpoint I/O: heads as safetensors + `mtp_config.json`, base as a normal HF checkpoint.

Two layouts, one loader:
  full        dir/ = the base's own `save_pretrained` files + mtp_heads.safetensors + mtp_config.json
  heads-only  dir/ = mtp_heads.safetensors + mtp_config.json, whose `base_model_name_or_path` points
              at the base (or the caller passes `base_model=` to `from_pretrained`)
Nothing is ever unpickled: heads are safetensors, the base goes through transformers' loader.

Heads are only meaningful on the exact base they were trained on, so the heads file carries a small
probe of the base weights (`base_probe`) and loading compares it with the base actually given.
The comparison tolerates a change of precision (fp32 checkpoint loaded in bf16) but not another base.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import HEADS_NAME

PROBE_KEY = "base_probe"
DRAFT_VOCAB_KEY = "draft_vocab"  # optional: token ids the heads draft from (mtp.draft_vocab)
_PROBE_PER_TENSOR = 16


def base_probe(base_model: nn.Module) -> torch.Tensor:
    """A few evenly spaced values from every base parameter (float32), in name order."""
    values = []
    for _, p in sorted(base_model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        # float64: float32 positions collide past 2**24 elements (a 49k x 576 embedding has 28M)
        idx = torch.linspace(0, flat.numel() - 1, min(_PROBE_PER_TENSOR, flat.numel()), dtype=torch.float64).long()
        values.append(flat[idx.to(flat.device)].float().cpu())
    return torch.cat(values) if values else torch.zeros(0)


def base_fingerprint(probe: torch.Tensor) -> str:
    """Precision-independent checksum: the probe rounded to bf16, hashed."""
    rounded = probe.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return "sha256:" + hashlib.sha256(rounded).hexdigest()[:32]


def probes_match(saved: torch.Tensor, actual: torch.Tensor) -> bool:
    if saved.shape != actual.shape:
        return False
    # bf16 keeps ~3 significant digits; different bases differ at nearly every probed value.
    close = torch.isclose(saved, actual, rtol=2e-2, atol=1e-3)
    return bool(close.float().mean() > 0.99)


def save_heads(heads: nn.Module, directory: Path, probe: torch.Tensor, draft_vocab: torch.Tensor | None = None) -> Path:
    tensors = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    tensors[PROBE_KEY] = probe.contiguous()
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = draft_vocab.detach().to(torch.long).contiguous().cpu()
    path = directory / HEADS_NAME
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def load_heads_state(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """(head tensors, base probe or None, draft vocabulary or None)."""
    path = directory / HEADS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {HEADS_NAME} in {directory}: the MTP checkpoint is incomplete")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
    probe = state.pop(PROBE_KEY, None)
    draft_vocab = state.pop(DRAFT_VOCAB_KEY, None)
    return state, probe, draft_vocab


def check_heads_state(heads: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Name the first missing/unexpected/mis-shaped tensor instead of a bare load_state_dict error."""
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"heads in {source} do not match the configured head layout: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"head tensor {name!r} in {source} has shape {tuple(state[name].shape)}, but this base "
                f"model needs {tuple(tensor.shape)} (heads built for a different hidden/vocab size?)"
            )


def apply_heads_state(
    heads: nn.Module, base_model: nn.Module, state: dict[str, torch.Tensor], probe: torch.Tensor | None, source: Path
) -> None:
    """Load `state` (from `load_heads_state(source)`) into `heads` after checking its layout and base.

    Shared by inference loading and training warm starts: heads on another base would draft noise (or
    start training from noise) without any error, so a recorded base fingerprint must match.
    """
    check_heads_state(heads, state, source)
    if probe is not None and not probes_match(probe, base_probe(base_model)):
        raise ValueError(
            f"the heads in {source} were trained on a different base model (weights checksum "
            f"{base_fingerprint(probe)}, this base {base_fingerprint(base_probe(base_model))}); "
            "load them on the base they were trained for"
        )
    heads.load_state_dict(state)
