"""Draft-time trees (`mtp.dynamic_tree`): the selection, the early stop, the EAGLE drafter's drafts, exactness.

The selection is checked against brute force on a synthetic drafter whose children's probabilities are known;
the EAGLE proposer's draft-time drafts against the training forward (`unroll`) on each node's own path; the
decoder's output against `generate()` (a draft-time tree changes only which drafts are verified).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_eagle import eagle_model, fitted, perturb

from mtp import Tree
from mtp.batching import BatchDecoder
from mtp.dynamic_tree import DraftNodes, DynamicTree, grow
from mtp.eagle import select_features


def synthetic(width: int, seed: int, calls: list | None = None):
    """An `expand` whose children of a node are fixed pseudo-random log-probabilities (a function of the node's
    path), and the path -> path probability of every node any expansion could produce."""

    def child_logps(path: tuple[int, ...]) -> list[float]:
        g = torch.Generator().manual_seed(hash((seed, path)) % (2**31))
        p = torch.softmax(torch.randn(10, generator=g) * 2.0, dim=0).sort(descending=True).values
        return p[:width].log().tolist()

    def expand(k: int, parents: list[int], nodes: DraftNodes):
        if calls is not None:
            calls.append((k, list(parents)))
        logps = [child_logps(nodes.path(u)) for u in parents]
        tokens = [[100 * (k + 1) + r for r in range(width)] for _ in parents]  # token = f(depth, rank)
        return torch.tensor(tokens), torch.tensor(logps)

    return expand, child_logps


def path_logp(path: tuple[int, ...], child_logps) -> float:
    return sum(child_logps(path[:i])[r] for i, r in enumerate(path))


@pytest.mark.parametrize("nodes,depth,width", [(6, 4, 3), (12, 5, 2), (9, 3, 4), (2, 6, 3)])
def test_selection_is_the_best_paths_the_beam_drafted(nodes, depth, width):
    """The tree holds the nodes-1 drafted nodes of highest path probability; the nodes expanded at depth k are
    the `width` best of depth k; tokens sit where the tree's paths say."""
    calls = []
    expand, child_logps = synthetic(width, seed=nodes * depth, calls=calls)
    tree, draft, drafted = grow(7, DynamicTree(nodes, depth, width), expand)
    assert isinstance(tree, Tree) and len(tree) == nodes and draft[0] == 7
    # the beam: at each depth, the parents are the `width` best drafted nodes of the previous depth
    for k, parents in calls[1:]:
        prev = [u for u in range(1, len(drafted)) if drafted.depth[u] == k - 1]
        best = sorted(prev, key=lambda u: -drafted.logp[u])[:width]
        assert sorted(parents) == sorted(best)
    # every drafted node's path probability is the product along its path
    for u in range(1, len(drafted)):
        assert drafted.logp[u] == pytest.approx(path_logp(drafted.path(u), child_logps), abs=1e-5)
    # the selection: no drafted node outside the tree beats one inside
    inside = set(tree.paths)
    lp = {drafted.path(u): drafted.logp[u] for u in range(1, len(drafted))}
    worst_in = min(lp[p] for p in inside)
    assert all(v <= worst_in + 1e-9 for p, v in lp.items() if p not in inside)
    for i, p in enumerate(tree.paths, start=1):
        assert draft[i] == 100 * (len(p) + 1) + p[-1]


def test_exhaustive_width_finds_the_global_best_tree():
    """With a beam as wide as the candidates, the selection equals brute force over every path."""
    width, depth, nodes = 3, 3, 8
    expand, child_logps = synthetic(width, seed=5)
    tree, _, _ = grow(0, DynamicTree(nodes, depth, width=width**depth), expand)
    everything = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    best = sorted(everything, key=lambda p: (-path_logp(p, child_logps), len(p)))[: nodes - 1]
    assert set(tree.paths) == set(best)


def test_drafting_stops_where_nothing_deeper_can_enter():
    """A drafter sure of its first depth and unsure below: depth 2's nodes cannot beat the tree drafted so far,
    so depth 3 is never drafted, and `min_prob` stops it earlier still."""
    calls = []

    def expand(k, parents, nodes):
        calls.append(k)
        row = [0.9, 0.05, 0.03] if k == 1 else [0.02, 0.01, 0.01]
        return torch.tensor([[1, 2, 3]] * len(parents)), torch.tensor([row] * len(parents)).log()

    tree, _, _ = grow(0, DynamicTree(nodes=4, depth=8, width=3), expand)
    assert calls == [1, 2] and tree.paths == ((0,), (1,), (2,))
    calls.clear()
    grow(0, DynamicTree(nodes=20, depth=8, width=3, min_prob=0.05), expand)
    assert calls == [1, 2]  # depth 2's best path (0.9 * 0.02) is under 0.05
    calls.clear()
    tree, draft, _ = grow(5, DynamicTree(nodes=1, depth=8), expand)
    assert calls == [] and len(tree) == 1 and draft == [5]


def test_bad_budgets_are_clear_errors():
    for bad in (dict(nodes=0, depth=3), dict(nodes=4, depth=-1), dict(nodes=4, depth=3, width=0)):
        with pytest.raises(ValueError, match="dynamic tree"):
            DynamicTree(**bad)
    with pytest.raises(ValueError, match="min_prob"):
        DynamicTree(4, 3, min_prob=1.0)
    assert DynamicTree(8, 6, 3).limit(2) == DynamicTree(8, 2, 3)


# ---- the EAGLE drafter ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_eagle_draft_time_drafts_equal_drafts_from_scratch(layers):
    """Every node of a draft-time tree holds the rank-r token of the drafter's logits on its parent's own path,
    computed from scratch by `unroll`; its path probability is the product of those softmaxes; only committed
    entries stay cached between steps."""
    base = tiny_model("llama", seed=2)
    g = torch.Generator().manual_seed(4)
    ids = torch.randperm(VOCAB, generator=g)[:180]
    model = perturb(eagle_model(base, num_heads=5, draft_ids=ids, feature_layers=(0, 1, 2), num_layers=layers), 3)
    drafter = model.heads
    seq = torch.randint(3, VOCAB, (1, 120), generator=g)
    with torch.no_grad():
        aux = select_features(base(seq, output_hidden_states=True).hidden_states, drafter.feature_layers)[0]
    proposer = model.make_proposer()
    assert proposer.dynamic_trees
    budgets = [DynamicTree(10, 5, 3), DynamicTree(4, 5, 2), DynamicTree(16, 4, 4), DynamicTree(1, 5)]
    n, checked = 3, 0
    with torch.inference_mode():
        proposer.begin(aux[:n], seq[0, :n])
        for step in range(8):
            budget = budgets[step % len(budgets)]
            root = int(seq[0, n])
            tree, draft = proposer.propose_dynamic(root, budget)
            draft = draft.tolist()
            assert len(tree) <= budget.nodes and tree.depth <= budget.depth and draft[0] == root
            assert proposer.drafted_depth >= tree.depth
            for node in range(1, len(tree)):
                path, j = [], tree.parents[node]
                while j > 0:
                    path.append(draft[j])
                    j = tree.parents[j]
                tokens = torch.tensor([seq[0, : n + 1].tolist() + path[::-1]])
                m = tree.depths[node] - 1  # the parent's depth
                ref = drafter.unroll(aux[None, :n], tokens, m + 1)[m][0, n - 1].float()
                order = ref.argsort(descending=True)
                assert draft[node] == int(ids[order[tree.ranks[node]]]), (step, node)
                checked += 1
            assert proposer.cache.get_seq_length() == proposer.committed
            accepted = int(torch.randint(0, 3, (1,), generator=g))
            proposer.observe(aux[n : n + accepted + 1], seq[0, n : n + accepted + 1])
            n += accepted + 1
    assert checked > 40


# ---- exactness -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama:2"])
def test_greedy_output_with_draft_time_trees_matches_generate(arch):
    """Fixed budgets (deep and narrow, wide, one node), against the references of `test_eagle`'s fitted drafters,
    with and without prompt lookup; the drafts are mostly accepted (a broken selection would fail here)."""
    model, prompts, seqs = fitted(arch)
    taus = []
    for ids, ref in zip(prompts, seqs, strict=True):
        max_new = ref.shape[1] - ids.shape[1]
        for budget, lookup in ((DynamicTree(8, 8, 2), False), (DynamicTree(16, 6, 4), True), (DynamicTree(1, 4), True)):
            out = model.generate(
                ids, max_new_tokens=max_new, tree=budget, prompt_lookup=lookup, return_dict_in_generate=True
            )
            assert torch.equal(out.sequences, ref), (arch, budget, lookup)
            assert 1 + sum(out.accepted_lengths) == out.num_new_tokens
            if budget.nodes > 1 and not lookup:
                taus.append(out.tau)
    assert sum(taus) / len(taus) > 2.5, taus
    # the default policy grows draft-time trees; "auto-static" keeps static shapes: both exact
    for ids, ref in zip(prompts, seqs, strict=True):
        for tree in (None, "auto-static"):
            out = model.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1], tree=tree)
            assert torch.equal(out, ref), (arch, tree)


def test_draft_time_trees_are_refused_where_they_cannot_be_exact():
    model, prompts, _ = fitted("llama")
    with pytest.raises(ValueError, match="greedy"):
        model.generate(prompts[0], max_new_tokens=5, do_sample=True, tree=DynamicTree(6, 4))
    with pytest.raises(ValueError, match="plans each step's size itself"):
        BatchDecoder(model, tree=DynamicTree(6, 4))
    medusa = tiny_model("llama", seed=1)
    from mtp import MTPModel

    heads = MTPModel.from_base(medusa, num_heads=3)
    with pytest.raises(ValueError, match="static trees only"):
        heads.generate(prompts[0], max_new_tokens=5, tree=DynamicTree(6, 3))
    assert math.isfinite(heads.generate(prompts[0], max_new_tokens=5).float().sum())
