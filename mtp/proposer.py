"""Proposers: turn the heads' guesses into draft tokens at every node of a tree.

The contract mirrors transformers' `CandidateGenerator`: the decoder tells the proposer what was
accepted (`begin` after the prefill, `observe` after each verify step, both with the base model's
hidden states at those positions) and asks for drafts (`propose`). A proposer that needs no hidden
states (n-gram lookup, say) would simply ignore them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .dynamic_tree import DynamicTree
from .kv_cache import new_cache
from .tree import Tree

# One depth of a drafter that runs a module per depth (one layer, its projection onto the draft vocabulary,
# top-k), in decode steps of the base: ~0.05 for SmolLM2 in fp32 packed on AVX2, 0.08-0.09 in bf16 on AVX512-BF16
# (bench/profile.py --tree, the propose phase per depth).
SEQUENTIAL_DEPTH_COST = 0.06


class Proposer:
    """Base class: subclasses draft one token per tree node.

    `feature_layers`: which of the base's hidden states `begin`/`observe` receive. None (the default, all
    heads on the last hidden state): the final hidden state, the input of the lm_head, (.., d). A tuple
    of layer indices: the inputs of those decoder layers, concatenated, (.., len * d) (`hidden_states[i]`
    of transformers' `output_hidden_states`; `mtp.eagle.select_features`), for drafters that fuse low,
    middle and high features (EAGLE-3). The decoders read it to hand over the right features; the
    verification never depends on it.
    """

    feature_layers: tuple[int, ...] | None = None
    # What drafting one more depth costs, in decode steps (a prior for `mtp.adaptive`, which then measures it):
    # 0 for drafters that produce every depth in one pass, more for those that run a module per depth.
    depth_cost: float = 0.0
    # Whether `propose_dynamic` grows draft-time trees (`mtp.dynamic_tree`); greedy decoding then uses it.
    dynamic_trees: bool = False
    drafted_depth: int = 0  # after `propose_dynamic`: the depths drafted (its tree may keep fewer)

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """After the prefill. hidden: (T, d) final hidden states of the prompt (`feature_layers`); tokens: (T,)."""
        raise NotImplementedError

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a verify step. hidden: (n, d) at the root + accepted nodes; tokens: (n,) their ids."""
        raise NotImplementedError

    def propose(self, root: int, tree: Tree) -> torch.Tensor:
        """Draft tokens for every node, (N,) long, node 0 = `root` (the token the base just chose)."""
        raise NotImplementedError

    def propose_dynamic(self, root: int, budget: DynamicTree) -> tuple[Tree, torch.Tensor]:
        """A tree grown at draft time within `budget` and its drafts (N,), node 0 = `root` (`dynamic_trees`)."""
        raise NotImplementedError

    @classmethod
    def propose_dynamic_rows(
        cls, proposers: Sequence[Proposer], roots: Sequence[int], budgets: Sequence[DynamicTree]
    ) -> list[tuple[Tree, torch.Tensor]]:
        """`propose_dynamic` for several sequences at once (a batched engine's rows, proposers of this class
        over one drafter): row i's tree and drafts. Here one row after another; a drafter that can run its
        depths for every row in one forward overrides it, since with a few users each row's own sequential
        drafter steps cost more than the batched verify forward they feed."""
        return [p.propose_dynamic(r, b) for p, r, b in zip(proposers, roots, budgets, strict=True)]

    def propose_sampled(
        self, root: int, tree: Tree, probs: Callable[[torch.Tensor], torch.Tensor], generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts for lossless speculative sampling.

        `probs` maps logits to the warped draft distribution q. Returns (N,) tokens and q, either
        (D, V) per depth (q of depth d+1 at row d: drafters whose q ignores the path, Medusa) or (N, V)
        per parent (q of the children of node i at row i: sequential drafters, whose q depends on the
        path). The siblings of every node are i.i.d. draws from that q.
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


# ---- sequential MTP modules (DeepSeek-V3 style) ----------------------------------------------------
#
# Positions: the base has final hidden states h_0..h_{n-1}; x_0..x_{n-1} are in its cache and x_n is the
# root (the token it just chose). Module k (1-based) at position t reads h^{k-1}_t and x_{t+k}, so with
# x_n known it can be *committed* at t <= n-k: module k's KV cache (its own DynamicCache) and the
# outputs h^k that module k+1 still needs are kept across steps, and each step only feeds the new
# positions ("pending": c_k .. n-k, where c_k is the module's cache length).
#
# Drafting a tree: a node u at depth m stands for the tokens x_{n+1..n+m} of its path. Module k needs an
# entry for u at position n-k+m (token d_u = x_{n+m}, input h^{k-1} from module k-1's entry for u's
# parent, or module k-1's committed state at n-k+1 when the parent is the root). Module k's entries
# for depth-(k-1) nodes sit at position n-1 and draft their children (depth k); its entries for
# shallower nodes are the context those need. All of module k's pending and speculative entries go
# through ONE forward with a mask: pending rows are causal over the cache, a speculative row sees the
# cache, the pending rows and its own ancestors. Then the speculative entries are cropped off again.
# This reproduces exactly what the parallel (training) forward computes on the sequence
# x_0..x_n, d_1..d_m, i.e. drafts equal drafts computed from scratch (tests/test_mtp_modules.py).


@dataclass(frozen=True)
class _DepthPlan:
    """What module k computes on a given tree (static per tree and short-context cut)."""

    spec: list[int]  # nodes with a speculative entry in module k (ascending = causal order)
    spec_depth: list[int]  # their depths m (entry position n - k + m)
    spec_src: list[int]  # input row: 0 = module k-1's committed state at n-k+1, r+1 = its spec row r
    spec_anc: torch.Tensor  # (S, S) bool: ancestor-or-self among the spec nodes
    parents: list[int]  # nodes at depth k-1 with children: their children are drafted at depth k
    parent_rows: list[int]  # their rows among `spec` (k >= 2)
    children: list[int]  # nodes at depth k
    child_parent: list[int]  # index into `parents` of each child's parent
    child_rank: list[int]  # rank of each child among its parent's candidates


@lru_cache(maxsize=256)
def _mtp_plan(tree: Tree, n: int) -> tuple[_DepthPlan, ...]:
    """Per-depth plans. `n` (capped at the tree depth) drops entries that would sit before position 0."""
    height = list(tree.depths)  # deepest depth in each node's subtree
    for node in range(len(tree) - 1, 0, -1):
        parent = tree.parents[node]
        height[parent] = max(height[parent], height[node])
    plans: list[_DepthPlan] = []
    prev_rows: dict[int, int] = {}
    for k in range(1, tree.depth + 1):
        spec = [
            u for u in range(1, len(tree)) if tree.depths[u] <= k - 1 and height[u] >= k and n - k + tree.depths[u] >= 0
        ]
        rows = {u: i for i, u in enumerate(spec)}
        src = [0 if tree.depths[u] == 1 else prev_rows[tree.parents[u]] + 1 for u in spec]
        idx = torch.tensor(spec, dtype=torch.long)
        anc = tree.ancestors[idx][:, idx] if spec else torch.zeros(0, 0, dtype=torch.bool)
        parents = [u for u in range(len(tree)) if tree.depths[u] == k - 1 and tree.children[u]]
        where = {u: i for i, u in enumerate(parents)}
        children = [c for u in parents for c in tree.children[u]]
        plans.append(
            _DepthPlan(
                spec=spec,
                spec_depth=[tree.depths[u] for u in spec],
                spec_src=src,
                spec_anc=anc,
                parents=parents,
                parent_rows=[rows[u] for u in parents] if k > 1 else [],
                children=children,
                child_parent=[where[tree.parents[c]] for c in children],
                child_rank=[tree.ranks[c] for c in children],
            )
        )
        prev_rows = rows
    return tuple(plans)


class MTPProposer(Proposer):
    """Drafts with sequential MTP modules (`mtp.mtp_modules.MTPModules`), reusing their KV caches.

    State between steps: the committed tokens, for every depth j the states h^j the next module has
    not consumed yet (j = 0: the base's hidden states), and each module's cache of committed positions.
    Nothing is computed in `begin`/`observe`; `propose` feeds the pending positions and drafts in one
    forward per module.
    """

    depth_cost = SEQUENTIAL_DEPTH_COST

    def __init__(self, modules: nn.Module, lm_head: nn.Module):
        self.modules, self.lm_head = modules, lm_head
        K = modules.num_heads
        self.caches = [new_cache() for _ in range(K)]
        self.committed = [0] * K  # module k+1 has positions [0, committed[k]) in its cache
        self.tokens: list[int] = []
        self.outs: list[torch.Tensor | None] = [None] * (K + 1)  # h^j for positions [starts[j], ...)
        self.starts = [0] * (K + 1)
        self.draft_logits: dict[int, torch.Tensor] = {}  # last step: parent node -> logits of its children

    # ---- bookkeeping --------------------------------------------------------------------------

    def _append(self, j: int, rows: torch.Tensor) -> None:
        self.outs[j] = rows if self.outs[j] is None else torch.cat([self.outs[j], rows])

    def _rows(self, j: int, lo: int, hi: int) -> torch.Tensor:
        """h^j at positions [lo, hi)."""
        return self.outs[j][lo - self.starts[j] : hi - self.starts[j]]

    def _trim(self, j: int, keep_from: int) -> None:
        drop = keep_from - self.starts[j]
        if drop > 0:
            self.outs[j] = self.outs[j][drop:]
            self.starts[j] = keep_from

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens = [int(t) for t in tokens.tolist()]
        self.outs[0], self.starts[0] = hidden, 0

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.tokens += [int(t) for t in tokens.tolist()]
        self._append(0, hidden)

    # ---- drafting -----------------------------------------------------------------------------

    def _draft(
        self, root: int, tree: Tree, choose: Callable[[int, torch.Tensor, _DepthPlan], torch.Tensor]
    ) -> torch.Tensor:
        """Run modules 1..D; `choose(k, logits (R, V), plan)` returns the depth-k tokens (C,)."""
        mods = self.modules
        device = mods.depths[0].proj.weight.device
        dtype = mods.depths[0].proj.weight.dtype
        neg = torch.finfo(dtype).min
        n = len(self.tokens)
        ctx = self.tokens + [root]
        draft = torch.empty(len(tree), dtype=torch.long, device=device)
        draft[0] = root
        self.draft_logits = {}
        spec_prev: torch.Tensor | None = None
        for k, plan in enumerate(_mtp_plan(tree, min(n, tree.depth)), start=1):
            i = k - 1
            c, hi = self.committed[i], n - k
            P, S = max(0, hi - c + 1), len(plan.spec)
            out = None
            if P + S > 0:
                hid, tok, pos = [], [], []
                if P:
                    hid.append(self._rows(i, c, hi + 1))
                    tok.append(torch.tensor(ctx[c + k : hi + k + 1], device=device))
                    pos.append(torch.arange(c, hi + 1, device=device))
                if S:
                    # row 0: module k-1's committed state at n-k+1 (only read when a depth-1 node needs it)
                    first = self._rows(i, n - k + 1, n - k + 2) if 0 in plan.spec_src else None
                    parts = [t for t in (first, spec_prev) if t is not None]
                    src = torch.cat(parts) if len(parts) > 1 else parts[0]
                    idx = torch.tensor(plan.spec_src, device=device) - (0 if first is not None else 1)
                    hid.append(src[idx])
                    tok.append(draft[torch.tensor(plan.spec, device=device)])
                    pos.append(torch.tensor(plan.spec_depth, device=device) + (n - k))
                mask = torch.full((P + S, c + P + S), neg, dtype=dtype, device=device)
                mask[:, :c] = 0
                mask[:P, c : c + P].triu_(1)  # pending rows: causal among themselves (diagonal and below: 0)
                mask[P:, c : c + P] = 0
                if S:
                    mask[P:, c + P :] = torch.where(plan.spec_anc.to(device), 0.0, neg).to(dtype)
                out = mods.run_depth(
                    i,
                    torch.cat(hid)[None],
                    torch.cat(tok)[None],
                    torch.cat(pos)[None],
                    mask[None, None],
                    self.caches[i],
                )[0]
                if S:
                    self.caches[i].crop(-S)  # speculative entries never stay in the module's cache
                if P:
                    if self.outs[k] is None or self.outs[k].shape[0] == 0:
                        self.starts[k] = c
                    self._append(k, out[:P])
                    self.committed[i] = hi + 1
                    self._trim(i, hi + 1)
            spec_out = out[P:] if out is not None else None
            if k == 1:
                feats = self._rows(1, n - 1, n)  # module 1 at the last position, reading the root
            else:
                feats = spec_out[torch.tensor(plan.parent_rows, device=device)]
            logits = self.lm_head(mods.features(i, feats))  # (R, V)
            self.draft_logits.update(zip(plan.parents, logits, strict=True))
            draft[torch.tensor(plan.children, device=device)] = choose(k, logits, plan).to(device)
            spec_prev = spec_out
        return draft

    def propose(self, root: int, tree: Tree) -> torch.Tensor:
        if len(tree) == 1:
            return torch.tensor([root], dtype=torch.long, device=self.modules.depths[0].proj.weight.device)

        def top(k: int, logits: torch.Tensor, plan: _DepthPlan) -> torch.Tensor:
            ranks = torch.tensor(plan.child_rank, device=logits.device)
            best = logits.topk(int(ranks.max()) + 1, dim=-1).indices  # (R, r)
            return best[torch.tensor(plan.child_parent, device=logits.device), ranks]

        return self._draft(root, tree, top)

    def propose_sampled(
        self, root: int, tree: Tree, probs: Callable[[torch.Tensor], torch.Tensor], generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(tree) == 1:
            return self.propose(root, tree), torch.zeros(0)
        q_all: torch.Tensor | None = None

        def sample(k: int, logits: torch.Tensor, plan: _DepthPlan) -> torch.Tensor:
            nonlocal q_all
            q = probs(logits)  # (R, V) float32: q of the children of each parent, given its path
            if q_all is None:
                q_all = q.new_zeros(len(tree), q.shape[-1])
            q_all[torch.tensor(plan.parents, device=q.device)] = q
            width = max(plan.child_rank) + 1
            # The children of a parent are i.i.d. draws from its q; the r-th child takes draw r.
            draws = torch.multinomial(q.cpu(), width, replacement=True, generator=generator)  # (R, width)
            return draws[torch.tensor(plan.child_parent), torch.tensor(plan.child_rank)]

        draft = self._draft(root, tree, sample)
        return draft, q_all
