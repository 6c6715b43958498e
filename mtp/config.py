"""The one config that describes an MTP checkpoint: which base it belongs to, which heads, which tree.

Stored as `mtp_config.json` next to the weights. It is validated on construction so that a bad or
foreign file fails at load time with a message naming the field, not deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
CONFIG_NAME = "mtp_config.json"
HEADS_NAME = "mtp_heads.safetensors"


@dataclass
class MTPConfig:
    head_type: str = "medusa"  # registered head class (mtp.heads.HEAD_TYPES)
    num_heads: int = 4  # draft depth the heads can reach
    head_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. num_layers, own_lm_head
    hidden_size: int = 0  # base hidden size the heads were built for
    vocab_size: int = 0  # base vocabulary size
    base_model_type: str = ""  # e.g. "llama"
    base_architectures: list[str] = field(default_factory=list)  # e.g. ["LlamaForCausalLM"]
    base_model_name_or_path: str | None = None  # where to find the base for heads-only checkpoints
    base_checksum: str | None = None  # fingerprint of the base weights (mtp.checkpoint.base_fingerprint)
    tree: list[list[int]] | None = None  # default tree as rank paths; None = built from accuracies
    tree_nodes: int = 16  # size of the default tree (root included) when `tree` is None
    head_accuracies: list[list[float]] | None = None  # measured top-k accuracy per head (from training)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"MTP checkpoint format version {self.format_version} is not supported by this "
                f"version of mtp (expects {FORMAT_VERSION})"
            )
        for name, kind in (("num_heads", int), ("hidden_size", int), ("vocab_size", int), ("tree_nodes", int)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"mtp config field {name!r} must be {kind.__name__}, got {value!r}")
        if self.num_heads < 1:
            raise ValueError(f"mtp config field 'num_heads' must be >= 1, got {self.num_heads}")
        if self.tree_nodes < 1:
            raise ValueError(f"mtp config field 'tree_nodes' must be >= 1, got {self.tree_nodes}")
        if not isinstance(self.head_kwargs, dict):
            raise ValueError(f"mtp config field 'head_kwargs' must be a mapping, got {self.head_kwargs!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MTPConfig:
        if not isinstance(data, dict):
            raise ValueError(f"mtp config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown mtp config field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> MTPConfig:
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}: not an MTP checkpoint directory")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data)
