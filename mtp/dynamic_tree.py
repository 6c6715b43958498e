"""Draft-time trees (EAGLE-2's dynamic trees): the drafter's own confidence decides the tree's shape.

Why: a static tree spends its nodes the same way at every step, e.g. a chain of four plus two siblings,
whether the drafter is sure of the next six tokens (a code block it is copying) or unsure of the next one
(the start of a sentence). A drafter whose probabilities are calibrated (trained on the base's own soft
targets) knows which case it is in: the probability that a path of drafts is accepted is close to the
product of the drafter's probabilities along it (EAGLE-2, Li et al. 2024). So each step grows the tree
where that product is high and verifies the best `nodes - 1` paths of what it drafted:

1. expand: at depth k, the `width` drafted nodes of depth k with the highest path probability each get
   their top-`width` children from the drafter (one drafter step for all of them together);
2. select: of every node drafted, the `nodes - 1` with the highest path probability form the tree. A child's
   path probability never exceeds its parent's, so the selection is always a tree (ties go to the
   shallower node).

Depth is decided on the way: once no node of the newest depth can enter the selection (its path probability
is below the `nodes - 1`-th best drafted so far) or the best one falls under `min_prob`, deeper drafting is
pointless and stops, so a step pays for as many drafter steps as its drafts are worth.

Only the drafts change: the tree is verified like any other (`mtp.verify`), so greedy output stays the base
model's own. It is for greedy decoding: lossless sampling needs siblings drawn i.i.d. from the drafter's q,
which top-`width` children are not (sampling keeps the static trees).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .tree import Tree

# The default shape of `MTPModel.generate`'s draft-time trees (for drafters that grow them): drafting stops
# itself where deeper nodes could not enter the tree (mean 3-5 depths drafted at 6-32 nodes on SmolLM2), so
# the depth limit only bounds the worst case; 4 children of the 4 best nodes per depth measured level with
# 3 at 6 nodes and ahead of 2 (development prompts, fp32).
DYNAMIC_DEPTH = 8
DYNAMIC_WIDTH = 4


@dataclass(frozen=True)
class DynamicTree:
    """The budget of a draft-time tree: at most `nodes` verified (root included), `depth` deep, `width`
    nodes expanded per depth with `width` children each; `min_prob`: no deeper drafting once the best path
    probability of a depth falls below it."""

    nodes: int
    depth: int
    width: int = 4
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.depth < 0 or self.width < 1:
            raise ValueError(f"a dynamic tree needs nodes >= 1, depth >= 0 and width >= 1, got {self}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"min_prob must lie in [0, 1), got {self.min_prob}")

    def limit(self, max_depth: int) -> DynamicTree:
        """The same budget no deeper than `max_depth` (near max_new_tokens or the position limit)."""
        return self if max_depth >= self.depth else replace(self, depth=max(0, max_depth))


class DraftNodes:
    """The nodes drafted so far, in drafting order (node 0: the root). What `expand` reads: `parent`, `token`,
    `depth` and `path` (its ranks from the root) of any node id."""

    def __init__(self, root: int):
        self.parent, self.token, self.depth, self.rank = [-1], [root], [0], [0]
        self.logp = [0.0]

    def __len__(self) -> int:
        return len(self.token)

    def add(self, parent: int, token: int, rank: int, logp: float) -> int:
        self.parent.append(parent)
        self.token.append(token)
        self.depth.append(self.depth[parent] + 1)
        self.rank.append(rank)
        self.logp.append(logp)
        return len(self.token) - 1

    def path(self, node: int) -> tuple[int, ...]:
        ranks = []
        while node > 0:
            ranks.append(self.rank[node])
            node = self.parent[node]
        return tuple(reversed(ranks))


# expand(depth k, parents: node ids of depth k-1) -> (tokens (R, w), log-probabilities (R, w)), each row sorted
# from the most probable child down: the drafter's top-w children of every parent.
Expand = Callable[[int, list[int], DraftNodes], tuple[torch.Tensor, torch.Tensor]]


class Growth:
    """One draft-time tree grown depth by depth (see the module docstring): `parents` are the nodes whose
    children the drafter drafts next (at depth `depth`), `add` takes those children, and the growth is `done`
    once no deeper drafting can pay. Stepwise, so a batched engine can grow many rows' trees in lockstep, one
    drafter forward per depth for all of them (`grow` is the loop for one tree)."""

    def __init__(self, root: int, budget: DynamicTree):
        self.nodes, self.budget = DraftNodes(root), budget
        self.keep = budget.nodes - 1
        self.floor = math.log(budget.min_prob) if budget.min_prob > 0 else -math.inf
        self.depth = 1
        self.parents: list[int] = [0] if self.keep > 0 and budget.depth > 0 else []

    @property
    def done(self) -> bool:
        return not self.parents

    def add(self, tokens: torch.Tensor, logps: torch.Tensor) -> None:
        """tokens, logps: (len(parents), w) the drafter's top-w children of every parent, most probable first."""
        nodes = self.nodes
        fresh = []
        for parent, row_t, row_p in zip(self.parents, tokens.tolist(), logps.float().tolist(), strict=True):
            base = nodes.logp[parent]
            for rank, (tok, lp) in enumerate(zip(row_t, row_p, strict=True)):
                fresh.append(nodes.add(parent, int(tok), rank, base + lp))
        fresh.sort(key=lambda u: -nodes.logp[u])
        parents = fresh[: self.budget.width]
        k, self.depth = self.depth, self.depth + 1
        if k == self.budget.depth or not parents or nodes.logp[parents[0]] < self.floor:
            parents = []
        elif len(nodes) - 1 >= self.keep:
            cut = sorted(nodes.logp[1:], reverse=True)[self.keep - 1]
            if nodes.logp[parents[0]] <= cut:  # nothing deeper can enter the selection
                parents = []
        self.parents = parents

    def result(self) -> tuple[Tree, list[int], DraftNodes]:
        """The selected tree, its draft tokens in the tree's node order (node 0 = the root), every node drafted."""
        nodes = self.nodes
        chosen = sorted(range(1, len(nodes)), key=lambda u: (-nodes.logp[u], nodes.depth[u], u))[: self.keep]
        paths = {nodes.path(u): u for u in chosen}
        tree = Tree(list(paths))
        draft = [nodes.token[0]] + [nodes.token[paths[p]] for p in tree.paths]
        return tree, draft, nodes


def grow(root: int, budget: DynamicTree, expand: Expand) -> tuple[Tree, list[int], DraftNodes]:
    """Grow and select a tree (see the module docstring). Returns the tree, its draft tokens in the tree's node
    order (node 0 = `root`), and every node drafted (for callers that keep statistics)."""
    growth = Growth(root, budget)
    while not growth.done:
        growth.add(*expand(growth.depth, growth.parents, growth.nodes))
    return growth.result()
