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

Several rows at once (`EagleProposer.propose_dynamic_rows`, the batched engine's drafting): each of those D
forwards is a small matmul over a few entries, so a row's drafting costs about the same for 1 entry as for
20, and B rows drafting one after another pay B x D forwards, which with a few users cost more than the
batched verify forward itself. Drafted together, the rows' committed caches are stacked into one padded
batch (`_RowBatch`), their pending entries fed in one forward (then appended to each row's own cache), and
their draft-time trees grown in lockstep (`mtp.dynamic_tree.Growth`): one forward per depth for every row
still growing, each row's entries masked to its own committed entries and ancestors, padding to nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .dynamic_tree import DraftNodes, DynamicTree, Growth, grow
from .kv_cache import new_cache
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


# A row with more positions than this to feed (a prompt just prefilled) catches up alone before a batched
# drafting round, instead of padding every row's catch-up to its length.
_SOLO_CATCH_UP = 32


class _RowBatch:
    """Several proposers' drafter caches as one padded batch, for one drafting round (`propose_dynamic_rows`).

    Slots 0..L-1 hold each row's committed entries (left-aligned, L the longest); every later forward appends
    its entries after them. `visible` (B, slots) marks the committed slots of each row; a speculative entry
    sees those and its own ancestors' entries. The rows' own caches receive only the committed entries of the
    catch-up feed: the speculative ones live and die with this batch."""

    def __init__(self, proposers: Sequence[EagleProposer]):
        self.proposers = proposers
        dr = proposers[0].drafter
        self.dtype, self.device = dr.fc.weight.dtype, dr.fc.weight.device
        self.drafter = dr
        self.length = max(p.committed for p in proposers)
        self.cache = new_cache()
        lengths = torch.tensor([p.committed for p in proposers], device=self.device)
        self.visible = torch.arange(self.length, device=self.device)[None] < lengths[:, None]
        self.slot: list[dict[int, int]] = [{} for _ in proposers]  # per row: node -> slot of its entry
        if self.length == 0:
            return
        for layer in range(len(next(p for p in proposers if p.committed).cache.layers)):
            ref = next(p for p in proposers if p.committed).cache.layers[layer].keys
            keys, values = [], []
            for p in proposers:
                pad = self.length - p.committed
                if p.committed:
                    lay = p.cache.layers[layer]
                    keys.append(torch.nn.functional.pad(lay.keys, (0, 0, 0, pad)))
                    values.append(torch.nn.functional.pad(lay.values, (0, 0, 0, pad)))
                else:
                    keys.append(ref.new_zeros(1, ref.shape[1], pad, ref.shape[3]))
                    values.append(keys[-1])
            self.cache.update(torch.cat(keys), torch.cat(values), layer)

    def catch_up(self, roots: Sequence[int]) -> None:
        """Feed every row's pending entries (`EagleProposer._commit`, padded to the longest): they join each
        row's own cache, and their last output drafts the root's children."""
        counts = [len(p._tokens) for p in self.proposers]
        P = max(counts)
        if P == 0:
            return
        B, d = len(self.proposers), self.drafter.hidden_size
        hidden = torch.zeros(B, P, d, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(B, P, dtype=torch.long, device=self.device)
        positions = torch.empty(B, P, dtype=torch.long, device=self.device)
        for i, (p, root, n) in enumerate(zip(self.proposers, roots, counts, strict=True)):
            positions[i] = torch.arange(p.committed, p.committed + P)
            if n:
                p._fold()
                hidden[i, :n] = torch.cat(p._g) if len(p._g) > 1 else p._g[0]
                tokens[i, :n] = torch.tensor(p._tokens[1:] + [root])
        fresh = torch.arange(P, device=self.device)[None] < torch.tensor(counts, device=self.device)[:, None]
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril_()
        sees = torch.cat([self.visible[:, None].expand(B, P, self.length), causal[None] & fresh[:, None]], dim=-1)
        out = self.drafter.step(hidden, tokens, positions, self._mask(sees), self.cache)
        L = self.length
        for i, (p, n) in enumerate(zip(self.proposers, counts, strict=True)):
            if not n:
                continue
            for layer, lay in enumerate(self.cache.layers):
                p.cache.update(lay.keys[i : i + 1, :, L : L + n], lay.values[i : i + 1, :, L : L + n], layer)
            p.last_out = out[i, n - 1]
            p.committed += n
            p._g, p._tokens = [], []
        self.visible = torch.cat([self.visible, fresh], dim=1)
        self.length += P

    def speculative_step(
        self, inputs: dict[int, torch.Tensor], parents: dict[int, list[int]], nodes: dict[int, DraftNodes], depth: int
    ) -> torch.Tensor:
        """Entries for the depth-(depth-1) `parents` of the rows still growing (row i: their parents' outputs
        `inputs[i]`), at position n_i - 1 + (depth - 1); returns the outputs (B, S, d), row i's first
        len(parents[i]) real."""
        B, S, d = len(self.proposers), max(len(us) for us in parents.values()), self.drafter.hidden_size
        hidden = torch.zeros(B, S, d, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(B, S, dtype=torch.long, device=self.device)
        positions = torch.zeros(B, S, dtype=torch.long, device=self.device)
        sees = torch.zeros(B, S, self.length + S, dtype=torch.bool)
        sees[:, :, : self.length] = self.visible[:, None].cpu()
        sees[:, torch.arange(S), self.length + torch.arange(S)] = True  # padding entries see themselves only
        for i, us in parents.items():
            hidden[i, : len(us)] = inputs[i]
            tokens[i, : len(us)] = torch.tensor([nodes[i].token[u] for u in us])
            positions[i] = self.proposers[i].committed + depth - 2
            slot = self.slot[i]
            slot.update((u, self.length + r) for r, u in enumerate(us))
            for r, u in enumerate(us):
                while u > 0:  # itself and its ancestors (every ancestor was expanded, so has an entry)
                    sees[i, r, slot[u]] = True
                    u = nodes[i].parent[u]
        out = self.drafter.step(hidden, tokens, positions, self._mask(sees.to(self.device)), self.cache)
        self.visible = torch.cat([self.visible, self.visible.new_zeros(B, S)], dim=1)
        self.length += S
        return out

    def _mask(self, sees: torch.Tensor) -> torch.Tensor:
        """(B, S, K) bool -> (B, 1, S, K) additive."""
        mask = torch.zeros(sees.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~sees, torch.finfo(self.dtype).min)[:, None]


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
        self.drafter = drafter
        self.feature_layers = tuple(drafter.feature_layers)
        self.cache = new_cache()
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

    @classmethod
    def propose_dynamic_rows(
        cls, proposers: Sequence[EagleProposer], roots: Sequence[int], budgets: Sequence[DynamicTree]
    ) -> list[tuple[Tree, torch.Tensor]]:
        """Draft-time trees for several rows with one drafter forward per depth for all of them (see
        "Several rows at once" in the module docstring); the same trees as each row's `propose_dynamic` up to
        the float rounding of a padded batch."""
        if len(proposers) == 1:
            return [proposers[0].propose_dynamic(roots[0], budgets[0])]
        dr = proposers[0].drafter
        if any(p.drafter is not dr for p in proposers):
            raise ValueError("propose_dynamic_rows: every row's proposer must share one drafter")
        for p, root in zip(proposers, roots, strict=True):
            if len(p._tokens) > _SOLO_CATCH_UP:  # a fresh prompt: fed alone rather than padding every row to it
                p._commit(root)
        batch = _RowBatch(proposers)
        batch.catch_up(roots)
        growths = [Growth(root, budget) for root, budget in zip(roots, budgets, strict=True)]
        width = max(b.width for b in budgets)
        outs = [p.last_out[None] for p in proposers]  # per row: outputs of the previous depth's entries
        row_of: list[dict[int, int]] = [{0: 0} for _ in proposers]  # per row: node -> its row in `outs`
        while True:
            active = [i for i, g in enumerate(growths) if not g.done]
            if not active:
                break
            if growths[active[0]].depth > 1:
                parents = {i: growths[i].parents for i in active}
                out = batch.speculative_step(
                    {i: outs[i][[row_of[i][growths[i].nodes.parent[u]] for u in us]] for i, us in parents.items()},
                    parents, {i: growths[i].nodes for i in active}, growths[active[0]].depth,
                )  # fmt: skip
                for i, us in parents.items():
                    outs[i], row_of[i] = out[i, : len(us)], {u: r for r, u in enumerate(us)}
            top = dr.logits(torch.cat([outs[i] for i in active])).float().log_softmax(dim=-1).topk(width, dim=-1)
            tokens, logps = dr.draft_ids[top.indices], top.values
            at = 0
            for i in active:
                r, w = outs[i].shape[0], budgets[i].width
                growths[i].add(tokens[at : at + r, :w], logps[at : at + r, :w])
                at += r
        results = []
        for p, g in zip(proposers, growths, strict=True):
            tree, draft, nodes = g.result()
            p.drafted_depth = max(nodes.depth)
            results.append((tree, torch.tensor(draft, dtype=torch.long, device=dr.fc.weight.device)))
        return results

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
