"""Prompt-lookup drafts grafted onto the heads' tree: one verify pass checks both.

Why: the heads guess what the model would say from its state; prompt lookup (HF `prompt_lookup_num_tokens`,
Saxena 2023) guesses that the text repeats itself, copying what followed the last occurrence of the
current n-gram. They win on different text: lookup on extraction, rewriting, code edits and quoted
context (whole sentences accepted at once), the heads on fresh prose, where lookup finds nothing. In bf16
on a CPU with matrix units a few more tree nodes cost almost nothing (see bench/verify_cost.py), so every
step can carry both proposals and keep whichever the model agrees with.

How: the lookup's continuation c_1..c_m is walked down the heads' tree from the root while a child
already holds the next token (those drafts coincide, nothing is added); the rest hangs below that node
as a chain. Greedy verification walks the combined tree as usual: siblings still hold distinct tokens,
so at most one child matches the model's argmax, and the output stays exactly `generate()`'s.
Greedy only: a deterministic draft inside a sampled tree would need its own rejection rule.

The chain length follows how much of it was accepted lately (an exponential average), between `min_len`
and `max_len`: long when the text is copying, a couple of cheap nodes when it is not.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .tree import Tree

# The rank recorded for lookup nodes: no head draws it, so head statistics (adaptive policy) skip them.
NGRAM_RANK = 1_000


class NgramIndex:
    """The most recent earlier occurrence of every n-gram (n = min_n..max_n) of a growing token list."""

    def __init__(self, tokens: list[int], max_n: int = 3, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follow: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest use
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        for tok in new:
            self.tokens.append(tok)
            end = len(self.tokens) - 1  # n-grams ending just before `tok` are now followed by it
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.follow[tuple(self.tokens[end - n : end])] = end

    def lookup(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the longest n-gram matching the current end, or []."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.follow.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + length]
        return []


class NgramDraft:
    """Per-generation state: the index and the adaptive chain length."""

    def __init__(self, context: list[int], max_len: int = 10, min_len: int = 2, max_n: int = 3, min_n: int = 2):
        self.index = NgramIndex(context, max_n=max_n, min_n=min_n)
        self.max_len, self.min_len = max_len, min_len
        self.recent = float(min_len)  # exponential average of chain tokens accepted per lookup hit
        self.chain: list[int] = []
        self.hits = self.accepted = 0  # lookups that found a continuation; chain tokens accepted in all

    def graft(self, tree: Tree, draft: torch.Tensor, room: int) -> tuple[Tree, torch.Tensor]:
        """The step's tree and drafts with the lookup chain added (unchanged when the lookup finds nothing).

        `room`: the deepest node allowed (max_new_tokens / position limits)."""
        length = min(self.max_len, max(self.min_len, math.ceil(self.recent) + 2), room)
        self.chain = self.index.lookup(length) if length > 0 else []
        if not self.chain:
            return tree, draft
        node, i = 0, 0
        tokens = draft.tolist()
        while i < len(self.chain):
            nxt = next((c for c in tree.children[node] if tokens[c] == self.chain[i]), None)
            if nxt is None:
                break
            node, i = nxt, i + 1
        rest = self.chain[i : i + max(0, room - tree.depths[node])]
        if not rest:
            return tree, draft
        combined, old_pos, new_pos = _grafted(tree, node, len(rest))
        out = draft.new_empty(len(combined))
        out[old_pos] = draft
        out[new_pos] = torch.tensor(rest, dtype=draft.dtype, device=draft.device)
        return combined, out

    def observe(self, emitted: list[int]) -> None:
        """After a step: the tokens it emitted (accepted drafts + bonus)."""
        if self.chain:
            n = 0
            while n < min(len(self.chain), len(emitted) - 1) and self.chain[n] == emitted[n]:
                n += 1
            self.hits += 1
            self.accepted += n
            self.recent = 0.7 * self.recent + 0.3 * n
        self.index.extend(emitted)


@lru_cache(maxsize=1024)
def _grafted(tree: Tree, node: int, length: int) -> tuple[Tree, torch.Tensor, torch.Tensor]:
    """`tree` plus a chain of `length` nodes below `node`; where the old nodes and the new ones land."""
    base = tree.paths[node - 1] if node else ()
    extra = [(*base, *([NGRAM_RANK] * j)) for j in range(1, length + 1)]
    combined = Tree([*tree.paths, *extra])
    where = {p: i + 1 for i, p in enumerate(combined.paths)}
    old_pos = torch.tensor([0] + [where[p] for p in tree.paths], dtype=torch.long)
    new_pos = torch.tensor([where[p] for p in extra], dtype=torch.long)
    return combined, old_pos, new_pos
