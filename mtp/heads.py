"""Draft heads that sit on the base model's last hidden state.

A head type is a small `nn.Module` registered under a name (`@register_head("medusa")`); the
checkpoint records that name and `build_heads` rebuilds the right class on load. Heads never
re-implement the base model: they read its final hidden state and project through a vocabulary
matrix (the base `lm_head`, shared by default, or a copy of their own).

The interface every head type offers (what `MTPModel`, the trainer and the decoder call):
  forward(hidden, lm_head, num_heads=None, input_ids=None) -> (K, ..., V) logits
  head_hidden(hidden, num_heads=None, input_ids=None)      -> (K, ..., d) lm_head inputs
  config_kwargs()             what `build_heads` needs to rebuild it (stored in the checkpoint)
  make_proposer(base_model)   the drafter `generate()` uses
A head class that uses parts of the base (embeddings, blocks: `mtp.mtp_modules.MTPModules`) sets
`needs_base = True` and receives `base_model=` from `build_heads`; it must not save those parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HEAD_TYPES: dict[str, type[nn.Module]] = {}


def register_head(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        cls.head_type = name
        HEAD_TYPES[name] = cls
        return cls

    return wrap


def build_heads(head_type: str, base_model: nn.Module | None = None, **kwargs: Any) -> nn.Module:
    """Instantiate a registered head type; `base_model` goes only to classes that declare `needs_base`."""
    if head_type not in HEAD_TYPES:
        raise ValueError(f"unknown head_type {head_type!r}; known: {sorted(HEAD_TYPES)}")
    cls = HEAD_TYPES[head_type]
    if getattr(cls, "needs_base", False):
        if base_model is None:
            raise ValueError(f"{head_type!r} heads are built on a base model: pass base_model=")
        kwargs["base_model"] = base_model
    return cls(**kwargs)


class ResBlock(nn.Module):
    """h + SiLU(W h + b), with W and b at zero so a fresh head reproduces the base head exactly."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@register_head("medusa")
class MedusaHeads(nn.Module):
    """K Medusa heads: head k (0-based) guesses the token k+2 places after the last hidden state.

    The base `lm_head` guesses token t+1 from h_t; head k guesses token t+k+2 from the same h_t.
    With `own_lm_head=False` (default) every head projects through the base `lm_head`, which keeps a
    checkpoint small (a 49152x576 projection is 28M parameters, the size of a small model) and lets
    all heads share one (K, d) @ (d, V) matmul when drafting.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        own_lm_head: bool = False,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, own_lm_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_head
            else None
        )

    def config_kwargs(self) -> dict[str, Any]:
        """What `build_heads` needs to rebuild this module (stored in the checkpoint config)."""
        return {"num_layers": self.num_layers, "own_lm_head": self.own_lm_head}

    def init_from_base(self, lm_head: nn.Module) -> None:
        """Copy the base projection into the heads' own projections (when they have them)."""
        if self.lm_heads is not None:
            with torch.no_grad():
                for proj in self.lm_heads:
                    proj.weight.copy_(lm_head.weight)

    def make_proposer(self, base_model: nn.Module, lm_head: nn.Module | None = None):
        """`lm_head`: the drafting projection (default: the base's; a DraftProjection restricts it)."""
        from .proposer import MedusaProposer

        return MedusaProposer(self, lm_head if lm_head is not None else base_model.get_output_embeddings())

    def head_hidden(
        self, hidden: torch.Tensor, num_heads: int | None = None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-head features: (..., d) -> (K, ..., d). `input_ids` is ignored (see `forward`)."""
        k = self.num_heads if num_heads is None else num_heads
        return torch.stack([self.blocks[i](hidden) for i in range(k)])

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        num_heads: int | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head logits: (..., d) -> (K, ..., V). `lm_head` is the base projection (shared mode).

        `input_ids` is accepted for interface parity with token-reading heads and ignored: Medusa heads
        read the hidden state only.
        """
        feats = self.head_hidden(hidden, num_heads)  # (K, ..., d)
        if self.lm_heads is None:
            return lm_head(feats)
        return torch.stack([self.lm_heads[i](feats[i]) for i in range(feats.shape[0])])


from . import draft_model as _draft_model  # noqa: E402,F401  (registers head type "draft_lm")
from . import eagle as _eagle  # noqa: E402,F401  (registers head type "eagle")
from . import mtp_modules as _mtp_modules  # noqa: E402,F401  (registers head type "mtp")
