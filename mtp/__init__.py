"""Self-speculative decoding with multi-token prediction heads, exact to the base model's output."""

from .config import MTPConfig
from .decoding import GenerateOutput
from .heads import HEAD_TYPES, MedusaHeads, register_head
from .model import MTPModel, MTPOutput
from .tree import Tree, build_tree, chain

__all__ = [
    "HEAD_TYPES",
    "GenerateOutput",
    "MTPConfig",
    "MTPModel",
    "MTPOutput",
    "MedusaHeads",
    "Tree",
    "build_tree",
    "chain",
    "register_head",
]
__version__ = "0.1.0"
