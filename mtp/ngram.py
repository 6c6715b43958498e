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
Sampling: the chain always hangs from the root as its own branch (`merge=False`; whether a sampled head
draft happens to equal the lookup token must not decide where the lookup sits), and its nodes are verified
as point-mass drafts (`mtp.sampling.verify_sampled`'s `fixed`), which keeps the output distribution exact.

The chain length follows how often the lookup was right lately and what a tree node costs (`NgramDraft`):
long while the text copies itself, nothing when it does not, back when it starts copying again.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .tree import Tree

# What one more verified tree node costs, in decode steps (bench/verify_cost.py, SmolLM2 on a 2-core CPU:
# in fp32 a 4-token forward costs 1.64 steps, ~0.2 per extra node; in bf16 a 16-token one costs 1.27).
NODE_COST_FULL, NODE_COST_HALF = 0.2, 0.02
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
    """Per-generation state: the index, and how far the lookup has been right lately.

    Every step the lookup's continuation is compared with what the model then emitted (whether or not it
    was grafted: the emitted tokens are the model's own choices either way), which estimates a, the chance
    that the next lookup token is right given the ones before it were. The j-th chain token pays when
    a**j, the chance it gets accepted, exceeds what one more tree node costs (`node_cost`, in decode
    steps: ~0.2 in fp32 on a CPU, ~0.02 in bf16 with matrix units): so the chain is long while the text
    copies itself and disappears when it does not, and comes back when the shadow comparisons say so.
    """

    def __init__(
        self, context: list[int], max_len: int = 10, node_cost: float = 0.02, max_n: int = 3, min_n: int = 2,
        forget: float = 0.95,
    ):  # fmt: skip
        self.index = NgramIndex(context, max_n=max_n, min_n=min_n)
        self.max_len, self.node_cost, self.forget = max_len, node_cost, forget
        self.right, self.wrong = 1.0, 1.0  # decayed counts of lookup tokens confirmed / refuted (prior a = 0.5)
        self.chain: list[int] = []  # this step's lookup continuation (grafted or not)
        self.grafted = 0  # how many of its tokens went into the tree
        self.hits = self.accepted = 0  # steps that grafted a chain; chain tokens the model confirmed

    @property
    def accuracy(self) -> float:
        return self.right / (self.right + self.wrong)

    def length(self) -> int:
        """Chain tokens worth verifying: those whose acceptance chance a**j beats a node's cost."""
        a, n = self.accuracy, 0
        while n < self.max_len and a ** (n + 1) > self.node_cost:
            n += 1
        return n

    def graft(self, tree: Tree, draft: torch.Tensor, room: int, merge: bool = True) -> tuple[Tree, torch.Tensor]:
        """The step's tree and drafts with the lookup chain added (unchanged when there is nothing to add).

        `room`: the deepest node allowed (max_new_tokens / position limits). `merge`: share the nodes whose
        head draft already equals the lookup token (greedy); False hangs the whole chain from the root."""
        self.chain, self.grafted = self.index.lookup(self.max_len), 0
        chain = self.chain[: min(self.length(), room)]
        if not chain:
            return tree, draft
        node, i = 0, 0
        tokens = draft.tolist()
        while merge and i < len(chain):
            nxt = next((c for c in tree.children[node] if tokens[c] == chain[i]), None)
            if nxt is None:
                break
            node, i = nxt, i + 1
        rest = chain[i:]  # node is at depth i and the chain was cut to room: no node goes deeper than room
        self.grafted = len(chain)
        if not rest:
            return tree, draft
        combined, old_pos, new_pos = _grafted(tree, node, len(rest))
        out = draft.new_empty(len(combined))
        out[old_pos] = draft
        out[new_pos] = torch.tensor(rest, dtype=draft.dtype, device=draft.device)
        return combined, out

    def observe(self, emitted: list[int]) -> None:
        """After a step: the tokens it emitted (accepted drafts + bonus), all of them the model's own."""
        if self.chain:
            comparable = min(len(self.chain), len(emitted))
            n = 0
            while n < comparable and self.chain[n] == emitted[n]:
                n += 1
            self.right = self.forget * self.right + n
            self.wrong = self.forget * self.wrong + (n < comparable)
            if self.grafted:
                self.hits += 1
                self.accepted += min(n, self.grafted)
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


def lookup_nodes(tree: Tree) -> frozenset[int]:
    """The nodes a graft added (their drafts came from the lookup, not from a head)."""
    return frozenset(i for i, r in enumerate(tree.ranks) if r == NGRAM_RANK)


def carry_rows(q: torch.Tensor, before: Tree, after: Tree) -> torch.Tensor:
    """Per-parent draft distributions (one row per node of `before`) moved to the node ids of `after`.

    The rows of added nodes stay zero: a lookup node's only children are lookup nodes, whose q is not read.
    Per-depth layouts (fewer rows than nodes) do not depend on node ids and come back unchanged.
    """
    if before is after or q.shape[0] != len(before):
        return q
    where = {p: i + 1 for i, p in enumerate(after.paths)}
    rows = torch.tensor([0] + [where[p] for p in before.paths], dtype=torch.long, device=q.device)
    out = q.new_zeros(len(after), *q.shape[1:])
    out[rows] = q
    return out
