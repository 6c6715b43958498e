"""Drafting with the EAGLE-3-style recurrent drafter (`mtp.eagle.EagleDrafter`), reusing its KV cache.

Positions: the base has processed x_0..x_{n-1} and gave the fused features aux_0..aux_{n-1} (the inputs
of the drafter's `feature_layers`); x_n is the root (the token the base just chose). The drafter's entry
at position t reads g_t = fc(aux_t) and the token one ahead, x_{t+1}, and guesses x_{t+2}. With x_n known,
every entry t <= n-1 is *committed*: it never changes again, so its keys/values stay in the drafter's own
DynamicCache across steps and each step feeds only the new ("pending") entries t = c..n-1, where c is the
cache length. The output o_{n-1} of the last committed entry guesses x_{n+1}: the root's children.

Drafting a tree: a node u at depth m >= 1 stands for the tokens x_{n+1..n+m} of its path. If u has
children, it gets one entry at position n-1+m that reads its parent's output (o_{n-1} when the parent is
the root) and its own token d_u = x_{n+m}; that entry's output drafts u's children and is the hidden
input of their entries. Its attention sees the committed entries and the entries of its own ancestors:
exactly the chain EAGLE-3's training-time test unrolls (`EagleDrafter.unroll`: the depth-m entry for
t = n-1 sees the real-feature entries <= n-1 and its own chain), so drafts equal drafts computed from
scratch on the concatenated path (tests/test_eagle.py). All nodes of one depth go through ONE `step`
(the mask keeps the branches apart); the pending entries go through one more before them. At the end
the speculative entries are cropped off the cache again.

Only nodes with children get an entry (a leaf's output would draft nothing), so a tree of depth D costs
D forwards of the drafter (its one layer, or each of its `num_layers`): the pending entries, then the inner
nodes of depth 1, .., D-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .dynamic_tree import DraftNodes, DynamicTree, grow
from .proposer import SEQUENTIAL_DEPTH_COST, Proposer
from .tree import Tree


@dataclass(frozen=True)
class _EaglePlan:
    """What one tree needs at each depth (static per tree; the index tensors live on `device`)."""

    # depth m = 1..D-1: the nodes of depth m with children, i.e. the entries of the m-th speculative step
    entries: tuple[torch.Tensor, ...]  # (S_m,) node ids; entry order = cache order after the committed part
    entry_src: tuple[torch.Tensor, ...]  # (S_m,) row of each entry's parent among the previous step's outputs
    entry_mask: tuple[torch.Tensor, ...]  # (S_m, S_1 + .. + S_m) bool: the speculative entries each one sees
    # depth k = 1..D: the drafting of the nodes of depth k from their parents' outputs
    parents: tuple[list[int], ...]  # nodes of depth k-1 with children (rows of the step's output)
    children: tuple[torch.Tensor, ...]  # (C_k,) nodes of depth k
    child_parent: tuple[torch.Tensor, ...]  # (C_k,) index into `parents[k]` of each child's parent
    child_rank: tuple[torch.Tensor, ...]  # (C_k,) rank of each child among its parent's candidates
    max_rank: tuple[int, ...]  # per depth k: the highest rank drafted


@lru_cache(maxsize=256)
def _eagle_plan(tree: Tree, device: str) -> _EaglePlan:
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    inner = [[u for u in range(len(tree)) if tree.depths[u] == m and tree.children[u]] for m in range(tree.depth)]
    entries, entry_src, entry_mask = [], [], []
    seen: list[int] = []  # speculative entries in cache order
    for m in range(1, tree.depth):
        nodes = inner[m]
        prev = {u: i for i, u in enumerate(inner[m - 1])}  # depth 1: the root, row 0 (o_{n-1})
        seen += nodes
        entries.append(t(nodes))
        entry_src.append(t([prev[tree.parents[u]] for u in nodes]))
        entry_mask.append(tree.ancestors[torch.tensor(nodes)][:, torch.tensor(seen)].to(device))
    parents, children, child_parent, child_rank, max_rank = [], [], [], [], []
    for k in range(1, tree.depth + 1):
        where = {u: i for i, u in enumerate(inner[k - 1])}
        kids = [c for u in inner[k - 1] for c in tree.children[u]]
        parents.append(inner[k - 1])
        children.append(t(kids))
        child_parent.append(t([where[tree.parents[c]] for c in kids]))
        child_rank.append(t([tree.ranks[c] for c in kids]))
        max_rank.append(max(tree.ranks[c] for c in kids))
    return _EaglePlan(
        tuple(entries),
        tuple(entry_src),
        tuple(entry_mask),
        tuple(parents),
        tuple(children),
        tuple(child_parent),
        tuple(child_rank),
        tuple(max_rank),
    )


# Pending fused features (n*d per position) are folded into g = fc(aux) (d per position) once this many wait:
# a long stretch without drafting (the adaptive policy at size 1, plain steps of a loaded batch, speculative=False)
# then holds d floats per position, as the other proposers do, instead of three times that.
_FOLD_ROWS = 64


class EagleProposer(Proposer):
    """Drafts with an `EagleDrafter` (see the module docstring for positions and masks).

    State between steps: the drafter's cache of committed entries (length `committed`), the output of
    the last committed entry, and the features and tokens of the positions not fed yet. `begin`/`observe`
    run no drafter layer (at most the `fc` fold above): a step that drafts nothing costs no drafter
    forward, and the next `propose` feeds everything pending in one.
    """

    depth_cost = SEQUENTIAL_DEPTH_COST
    dynamic_trees = True

    def __init__(self, drafter: nn.Module):
        from transformers import DynamicCache

        self.drafter = drafter
        self.feature_layers = tuple(drafter.feature_layers)
        self.cache = DynamicCache()
        self.committed = 0  # entries 0..committed-1 are in the cache
        self.last_out: torch.Tensor | None = None  # (d,) output of entry committed-1: drafts x_{n+1}
        self._g: list[torch.Tensor] = []  # g = fc(aux) of the first pending positions, in chunks
        self._aux: list[torch.Tensor] = []  # fused features of the pending positions after those, in chunks
        self._aux_rows = 0
        self._tokens: list[int] = []  # x_committed..x_{n-1}
        self.draft_logits: dict[int, torch.Tensor] = {}  # last step: parent node -> draft-vocab logits (Dv,)

    @property
    def length(self) -> int:
        """n: positions the base has processed (and this proposer observed)."""
        return self.committed + len(self._tokens)

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """hidden: (T, n*d) the prompt's fused features (`select_features(..., feature_layers)`)."""
        self._g, self._aux, self._aux_rows = [], [hidden], hidden.shape[0]
        self._tokens = [int(x) for x in tokens.tolist()]

    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self._aux.append(hidden)
        self._aux_rows += hidden.shape[0]
        self._tokens += [int(x) for x in tokens.tolist()]
        if self._aux_rows >= _FOLD_ROWS:
            self._fold()

    def _fold(self) -> None:
        """Pending fused features -> g (`combine`), kept until the next `propose` feeds them."""
        if self._aux:
            aux = torch.cat(self._aux) if len(self._aux) > 1 else self._aux[0]
            self._g.append(self.drafter.combine(aux.to(self.drafter.fc.weight.device)))
            self._aux, self._aux_rows = [], 0

    # ---- drafting -----------------------------------------------------------------------------

    def _commit(self, root: int) -> None:
        """Feed the pending entries t = c..n-1 (token x_{t+1}; x_n = root) causally after the cache."""
        P = len(self._tokens)
        if P == 0:
            return
        dr = self.drafter
        dtype, device = dr.fc.weight.dtype, dr.fc.weight.device
        c = self.committed
        self._fold()
        g = torch.cat(self._g) if len(self._g) > 1 else self._g[0]
        tokens = torch.tensor(self._tokens[1:] + [root], dtype=torch.long, device=device)
        positions = torch.arange(c, c + P, device=device)
        mask = torch.zeros(P, c + P, dtype=dtype, device=device)
        mask[:, c:] = torch.full((P, P), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
        out = dr.step(g[None], tokens[None], positions[None], mask[None, None], self.cache)
        self.last_out = out[0, -1]
        self.committed = c + P
        self._g, self._tokens = [], []

    def _speculative_step(self, inputs: torch.Tensor, tokens: torch.Tensor, sees: torch.Tensor, position: int):
        """One drafter step over S speculative entries at `position`, each reading its parent's output (`inputs`,
        (S, d)) and its own token (S,); each sees the committed cache and the speculative entries `sees` marks
        ((S, entries so far) bool, in cache order, itself included). Returns their outputs (S, d)."""
        dr = self.drafter
        dtype, device = dr.fc.weight.dtype, dr.fc.weight.device
        n, S = self.committed, tokens.numel()
        mask = torch.zeros(S, n + sees.shape[1], dtype=dtype, device=device)
        mask[:, n:].masked_fill_(~sees, torch.finfo(dtype).min)
        positions = torch.full((1, S), position, dtype=torch.long, device=device)
        return dr.step(inputs[None], tokens[None], positions, mask[None, None], self.cache)[0]

    def _drop_speculative(self) -> None:
        """Crop the speculative entries: only committed ones stay in the cache between steps."""
        extra = self.cache.get_seq_length() - self.committed
        if extra > 0:
            self.cache.crop(-extra)

    def _draft(self, root: int, tree: Tree, choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Depth by depth; `choose(k, logits (R, Dv))` returns the depth-k tokens (base ids) in plan order."""
        dr = self.drafter
        device = dr.fc.weight.device
        self._commit(root)
        n = self.committed
        plan = _eagle_plan(tree, str(device))
        draft = torch.empty(len(tree), dtype=torch.long, device=device)
        draft[0] = root
        self.draft_logits = {}
        outs = self.last_out[None]  # outputs of the previous depth's entries (depth 0: the root's, o_{n-1})
        try:
            for k in range(1, tree.depth + 1):
                if k > 1:
                    m = k - 1  # entries of the depth-m nodes with children, at position n-1+m
                    inputs, tokens = outs[plan.entry_src[m - 1]], draft[plan.entries[m - 1]]
                    outs = self._speculative_step(inputs, tokens, plan.entry_mask[m - 1], n - 1 + m)
                logits = dr.logits(outs)  # (R, Dv): the children of each parent of depth k-1
                self.draft_logits.update(zip(plan.parents[k - 1], logits, strict=True))
                draft[plan.children[k - 1]] = choose(k, logits).to(device)
        finally:
            self._drop_speculative()
        return draft

    def propose(self, root: int, tree: Tree) -> torch.Tensor:
        if len(tree) == 1:
            return torch.tensor([root], dtype=torch.long, device=self.drafter.fc.weight.device)
        plan = _eagle_plan(tree, str(self.drafter.fc.weight.device))
        ids = self.drafter.draft_ids

        def top(k: int, logits: torch.Tensor) -> torch.Tensor:
            # ranks over the draft vocabulary, mapped to base token ids
            best = ids[logits.topk(plan.max_rank[k - 1] + 1, dim=-1).indices]  # (R, r)
            return best[plan.child_parent[k - 1], plan.child_rank[k - 1]]

        return self._draft(root, tree, top)

    def propose_dynamic(self, root: int, budget: DynamicTree) -> tuple[Tree, torch.Tensor]:
        """A draft-time tree (`mtp.dynamic_tree`): the same entries and masks as `_draft`, but which nodes of a
        depth get an entry, and so children, is decided by their path probability as drafting goes."""
        dr = self.drafter
        device = dr.fc.weight.device
        self._commit(root)
        n = self.committed
        entry: dict[int, int] = {}  # node -> index of its entry among the speculative ones (cache order)
        outs, row = self.last_out[None], {0: 0}  # outputs of the previous depth's entries, node -> row

        def expand(k: int, parents: list[int], nodes: DraftNodes) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal outs, row
            if k > 1:  # entries for the depth-(k-1) parents, at position n-1+(k-1)
                first = len(entry)
                entry.update((u, first + i) for i, u in enumerate(parents))
                sees = torch.zeros(len(parents), len(entry), dtype=torch.bool)
                for i, u in enumerate(parents):
                    while u > 0:  # itself and its ancestors (every ancestor was expanded, so has an entry)
                        sees[i, entry[u]] = True
                        u = nodes.parent[u]
                src = torch.tensor([row[nodes.parent[u]] for u in parents], device=device)
                tokens = torch.tensor([nodes.token[u] for u in parents], dtype=torch.long, device=device)
                outs = self._speculative_step(outs[src], tokens, sees.to(device), n + k - 2)
                row = {u: i for i, u in enumerate(parents)}
            top = dr.logits(outs).float().log_softmax(dim=-1).topk(budget.width, dim=-1)
            return dr.draft_ids[top.indices], top.values

        try:
            tree, draft, nodes = grow(root, budget, expand)
            self.drafted_depth = max(nodes.depth)
        finally:
            self._drop_speculative()
        return tree, torch.tensor(draft, dtype=torch.long, device=device)

    def propose_sampled(
        self, root: int, tree: Tree, probs: Callable[[torch.Tensor], torch.Tensor], generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q per parent, (N, V) over the FULL base vocabulary: `probs` sees `to_full_vocab(logits)` (-inf, so
        zero mass, outside the draft vocabulary), so its warpers act on exactly the q the tokens are drawn
        from and the verifier's rejection sampling stays lossless."""
        if len(tree) == 1:
            return self.propose(root, tree), torch.zeros(0)
        plan = _eagle_plan(tree, str(self.drafter.fc.weight.device))
        q_all: torch.Tensor | None = None

        def sample(k: int, logits: torch.Tensor) -> torch.Tensor:
            nonlocal q_all
            q = probs(self.drafter.to_full_vocab(logits))  # (R, V) float32: q of each parent's children
            if q_all is None:
                q_all = q.new_zeros(len(tree), q.shape[-1])
            q_all[torch.tensor(plan.parents[k - 1], device=q.device)] = q
            # The children of a parent are i.i.d. draws from its q; the r-th child takes draw r.
            draws = torch.multinomial(q.cpu(), plan.max_rank[k - 1] + 1, replacement=True, generator=generator)
            return draws[plan.child_parent[k - 1].cpu(), plan.child_rank[k - 1].cpu()]

        draft = self._draft(root, tree, sample)
        return draft, q_all
