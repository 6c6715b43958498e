"""Static token trees: which head candidates get verified together in one forward pass.

A tree is given as *paths of ranks*, Medusa style. The path ``(0, 2)`` is the node "top-1 token of
head 1, then the top-3 token of head 2 after it". Node 0 is the root: the last token the base model
itself chose (certain, not yet in the KV cache). Nodes are stored breadth first, so a parent always
comes before its children and the flattened order is also a valid causal order.

Everything the decoder needs per step is precomputed here once per tree (and once per depth limit):
parents, depths (= position offsets), per-node (head, rank) for gathering drafted tokens, and the
ancestor mask that becomes the tree attention mask.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from functools import cached_property, lru_cache
from typing import NamedTuple

import torch

Path = tuple[int, ...]

# Top-k acceptance rates of a reasonably trained Medusa head (head 1 .. 5, rank 1 .. 8), rounded from
# the Medusa paper's figures; used only to shape the default tree until measured accuracies exist.
DEFAULT_ACCURACIES: tuple[tuple[float, ...], ...] = (
    (0.60, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01),
    (0.40, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01),
    (0.30, 0.08, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01),
    (0.25, 0.07, 0.04, 0.02, 0.02, 0.01, 0.01, 0.01),
    (0.20, 0.06, 0.03, 0.02, 0.01, 0.01, 0.01, 0.01),
)


class Tree:
    """A validated, flattened token tree (root included as node 0)."""

    def __init__(self, paths: Sequence[Sequence[int]]):
        clean = sorted({tuple(int(r) for r in p) for p in paths if len(p) > 0}, key=lambda p: (len(p), p))
        known = set(clean)
        for p in clean:
            if any(r < 0 for r in p):
                raise ValueError(f"tree path {p} has a negative rank")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree")
        self.paths: tuple[Path, ...] = tuple(clean)
        index = {p: i + 1 for i, p in enumerate(clean)}  # node id of each path; 0 is the root
        self.parents: list[int] = [-1] + [index.get(p[:-1], 0) for p in clean]
        self.depths: list[int] = [0] + [len(p) for p in clean]
        self.ranks: list[int] = [0] + [p[-1] for p in clean]
        self.children: list[list[int]] = [[] for _ in range(len(self))]
        for node, parent in enumerate(self.parents[1:], start=1):
            self.children[parent].append(node)

    def __len__(self) -> int:
        return len(self.paths) + 1

    def __repr__(self) -> str:
        return f"Tree(nodes={len(self)}, depth={self.depth})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def max_rank(self) -> int:
        return max(self.ranks)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """(N, N) bool: row i is True at i and at every ancestor of i."""
        n = len(self)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = self.parents[j]
        return anc

    @cached_property
    def depth_tensor(self) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.long)

    @cached_property
    def gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(head index, rank) of every non-root node, to gather drafted tokens from a (D, R) top-k table."""
        heads = torch.tensor(self.depths[1:], dtype=torch.long) - 1
        ranks = torch.tensor(self.ranks[1:], dtype=torch.long)
        return heads, ranks

    def limit(self, max_depth: int) -> Tree:
        """The same tree cut at `max_depth` (near max_new_tokens or the position limit)."""
        return _limited(self, max(0, max_depth))

    def expected_length(self, accuracies: Sequence[Sequence[float]]) -> float:
        """Expected tokens per step (bonus included) if rank r of head d is right with prob acc[d][r]."""
        return 1.0 + sum(_path_prob(p, accuracies) for p in self.paths)


@lru_cache(maxsize=256)
def _limited(tree: Tree, max_depth: int) -> Tree:
    if max_depth >= tree.depth:
        return tree
    return Tree([p for p in tree.paths if len(p) <= max_depth])


def _path_prob(path: Path, accuracies: Sequence[Sequence[float]]) -> float:
    prob = 1.0
    for depth, rank in enumerate(path):
        row = accuracies[depth] if depth < len(accuracies) else ()
        prob *= row[rank] if rank < len(row) else 0.0
    return prob


def chain(num_heads: int) -> Tree:
    """Top-1 of each head, one after another."""
    return Tree([(0,) * d for d in range(1, num_heads + 1)])


def build_tree(num_nodes: int, num_heads: int, accuracies: Sequence[Sequence[float]] | None = None) -> Tree:
    """The tree of `num_nodes` nodes (root included) with the largest expected acceptance length.

    A node is accepted only if its whole path is right, so its value is the product of the
    per-depth rank accuracies along the path; children never beat their parent, so taking the best
    nodes one by one from a frontier (best-first search) always yields a valid tree and is optimal
    for this independence model (the same construction Medusa uses for its sparse trees).
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    return Tree([path for path, _ in best_first(num_nodes - 1, num_heads, accuracies)])


def best_first(
    count: int, num_heads: int, accuracies: Sequence[Sequence[float]] | None = None
) -> list[tuple[Path, float]]:
    """The first `count` nodes of `build_tree`'s best-first order, each with its acceptance probability.

    Every prefix of the list is the best tree of that size (`build_tree(k + 1, ...)` is the first k paths), so a
    caller comparing many sizes at one depth limit (`mtp.adaptive`) searches once, for the largest. Fewer than
    `count` come back when no further node has a chance of being accepted.
    """
    acc = [list(row) for row in (accuracies or DEFAULT_ACCURACIES)][:num_heads]
    frontier: list[tuple[float, Path]] = [(-_path_prob((r,), acc), (r,)) for r in range(len(acc[0]))] if acc else []
    heapq.heapify(frontier)
    chosen: list[tuple[Path, float]] = []
    while frontier and len(chosen) < count:
        neg_prob, path = heapq.heappop(frontier)
        if -neg_prob <= 0.0:
            break
        chosen.append((path, -neg_prob))
        if len(path) < len(acc):
            for r in range(len(acc[len(path)])):
                child = (*path, r)
                heapq.heappush(frontier, (-_path_prob(child, acc), child))
    return chosen


class TreeChoice(NamedTuple):
    """One candidate tree: its size (root included), depth, expected acceptance length and paths."""

    size: int
    depth: int
    expected: float
    paths: tuple[Path, ...]


def best_trees(
    budgets: Sequence[int], depth_limit: int, accuracies: Sequence[Sequence[float]] | None = None
) -> dict[int, TreeChoice]:
    """The best tree of at most ``n`` nodes (root included) for every ``n`` in ``budgets``, at one depth limit.

    Why one search: every prefix of `best_first`'s order is the best tree of its size, so a policy that
    weighs many sizes (and prices each by its depth, since a sequential drafter pays per drafted depth)
    searches once for the largest and reads every smaller tree off it. A budget larger than the nodes with
    any chance of acceptance gets the smaller tree that has them all (its ``size`` says so).
    """
    budgets = [n for n in budgets if n > 1]
    if not budgets:
        return {}
    order = best_first(max(budgets) - 1, depth_limit, accuracies)
    expected, depth = [1.0], [0]
    for path, prob in order:
        expected.append(expected[-1] + prob)
        depth.append(max(depth[-1], len(path)))
    out: dict[int, TreeChoice] = {}
    for n in budgets:
        k = min(n - 1, len(order))
        out[n] = TreeChoice(k + 1, depth[k], expected[k], tuple(path for path, _ in order[:k]))
    return out


def resolve_tree(spec: object, num_heads: int, default: Tree) -> Tree:
    """Turn the user's `tree=` argument into a Tree: None (model default), "chain", a Tree, or paths."""
    if spec is None or spec == "default":
        tree = default
    elif isinstance(spec, Tree):
        tree = spec
    elif spec == "chain":
        tree = chain(num_heads)
    elif isinstance(spec, str):
        raise ValueError(f"unknown tree {spec!r}: use None, 'chain', a Tree, or a list of rank paths")
    elif isinstance(spec, int):
        tree = build_tree(spec, num_heads)
    else:
        tree = Tree(spec)  # type: ignore[arg-type]
    if tree.depth > num_heads:
        raise ValueError(f"tree depth {tree.depth} exceeds the {num_heads} heads this model has")
    return tree
