"""Proposers: turn the heads' guesses into draft tokens at every node of a tree.

The contract mirrors transformers' `CandidateGenerator`: the decoder tells the proposer what was
accepted (`begin` after the prefill, `observe` after each verify step, both with the base model's
hidden states at those positions) and asks for drafts (`propose`). A proposer that needs no hidden
states (n-gram lookup, say) would simply ignore them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .tree import Tree


class Proposer:
    """Base class: subclasses draft one token per tree node."""

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """After the prefill. hidden: (T, d) final hidden states of the prompt; tokens: (T,)."""
        raise NotImplementedError

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a verify step. hidden: (n, d) at the root + accepted nodes; tokens: (n,) their ids."""
        raise NotImplementedError

    def propose(self, root: int, tree: Tree) -> torch.Tensor:
        """Draft tokens for every node, (N,) long, node 0 = `root` (the token the base just chose)."""
        raise NotImplementedError

    def propose_sampled(
        self, root: int, tree: Tree, probs: Callable[[torch.Tensor], torch.Tensor], generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts for lossless speculative sampling.

        `probs` maps logits to the warped draft distribution q. Returns (N,) tokens and (D, V) q per
        depth; the siblings of every node are i.i.d. draws from q of their depth.
        """
        raise NotImplementedError


class MedusaProposer(Proposer):
    """Node (d, r) of the tree gets the rank-r token of head d, all read off the last hidden state."""

    def __init__(self, heads: nn.Module, lm_head: nn.Module):
        self.heads, self.lm_head = heads, lm_head
        self.last_hidden: torch.Tensor | None = None  # (d,)

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.last_hidden = hidden[-1]

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.last_hidden = hidden[-1]

    def head_logits(self, num_heads: int) -> torch.Tensor:
        """(D, V) logits of the first `num_heads` heads at the last accepted position."""
        return self.heads(self.last_hidden, self.lm_head, num_heads=num_heads)

    def propose(self, root: int, tree: Tree) -> torch.Tensor:
        root_t = torch.tensor([root], dtype=torch.long, device=self.last_hidden.device)
        if len(tree) == 1:
            return root_t
        logits = self.head_logits(tree.depth)  # (D, V)
        top = logits.topk(tree.max_rank + 1, dim=-1).indices  # (D, R)
        heads, ranks = tree.gather_index
        return torch.cat([root_t, top[heads.to(top.device), ranks.to(top.device)]])

    def propose_sampled(
        self, root: int, tree: Tree, probs: Callable[[torch.Tensor], torch.Tensor], generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        root_t = torch.tensor([root], dtype=torch.long, device=self.last_hidden.device)
        if len(tree) == 1:
            return root_t, torch.zeros(0)
        q = probs(self.head_logits(tree.depth))  # (D, V) float32
        # Node (d, r) takes the r-th of R i.i.d. draws from q_d (Medusa heads' q ignores the path).
        draws = torch.multinomial(q.cpu(), tree.max_rank + 1, replacement=True, generator=generator)  # (D, R)
        heads, ranks = tree.gather_index
        return torch.cat([root_t, draws[heads, ranks].to(root_t.device)]), q
