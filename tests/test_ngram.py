"""Prompt-lookup drafts grafted onto the heads' tree: the index, the graft, and exactness end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, VOCAB, random_heads, tiny_model

from mtp.ngram import NGRAM_RANK, NgramDraft, NgramIndex, carry_rows, lookup_nodes
from mtp.tree import Tree, chain
from mtp.verify import verify_greedy


def test_index_takes_the_longest_then_latest_match():
    idx = NgramIndex([1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3], max_n=3, min_n=2)
    assert idx.lookup(3) == [5, 9, 2]  # (2, 3) last followed by 5 (at 6..7); (9, 2, 3) never seen before
    idx.extend([7])
    assert idx.lookup(4) == []  # (3, 7) and (2, 3, 7) never occurred before
    idx = NgramIndex([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], max_n=3, min_n=2)
    assert idx.lookup(2) == [5, 1]  # (1, 2, 3) occurred twice: the latest wins
    assert NgramIndex([4, 4, 4], max_n=2, min_n=1).lookup(5) == [4]  # overlapping self-continuation
    with pytest.raises(ValueError):
        NgramIndex([], max_n=1, min_n=2)


def test_graft_shares_the_agreeing_prefix_and_hangs_the_rest_below():
    tree = chain(2)  # root -> (0,) -> (0, 0)
    draft = torch.tensor([5, 7, 8])
    ng = NgramDraft([1, 5, 7, 9, 10, 11, 1, 5], max_len=4, node_cost=0.0)  # (1, 5) was followed by 7 9 10 11
    combined, tokens = ng.graft(tree, draft, room=10)
    assert ng.chain == [7, 9, 10, 11]
    assert len(combined) == 3 + 3  # 7 coincides with the head's draft: only 9, 10, 11 are new
    toks = tokens.tolist()
    by_path = {(): toks[0], **{p: toks[i + 1] for i, p in enumerate(combined.paths)}}
    assert by_path[(0,)] == 7 and by_path[(0, 0)] == 8
    assert by_path[(0, NGRAM_RANK)] == 9 and by_path[(0, NGRAM_RANK, NGRAM_RANK, NGRAM_RANK)] == 11
    # the model agrees with the lookup: the walk follows the grafted chain past the heads' depth
    target = [0] * len(combined)
    for node, nxt in [((), 7), ((0,), 9), ((0, NGRAM_RANK), 10), ((0, NGRAM_RANK, NGRAM_RANK), 11)]:
        target[0 if not node else combined.paths.index(node) + 1] = nxt
    last = combined.paths.index((0, NGRAM_RANK, NGRAM_RANK, NGRAM_RANK)) + 1
    target[last] = 42
    accepted, bonus = verify_greedy(combined, toks, target)
    assert [toks[i] for i in accepted[1:]] == [7, 9, 10, 11] and bonus == 42
    ng.observe([7, 9, 10, 11, 42])
    assert ng.accepted == 4 and ng.accuracy > 0.5
    # room caps the depth of every grafted node; no continuation -> the tree is untouched
    combined, _ = NgramDraft([1, 5, 7, 9, 10, 11, 1, 5], max_len=4, node_cost=0.0).graft(tree, draft, room=2)
    assert combined.depth == 2 and len(combined) == 4
    assert NgramDraft([1, 2, 3], max_len=4).graft(tree, draft, room=10)[0] is tree


def test_chain_length_follows_the_lookup_accuracy_and_node_cost():
    ng = NgramDraft([1, 2, 3, 1, 2], max_len=10, node_cost=0.2)  # (1, 2) was followed by 3
    assert ng.length() == 2  # prior a = 0.5: 0.5 and 0.25 beat 0.2, 0.125 does not
    tree, draft = chain(1), torch.tensor([0, 4])
    for i in range(12):  # after (1, 2) the model says something new each time: the lookup is always wrong
        ng.graft(tree, draft, room=10)
        ng.observe([100 + i, 1, 2])
    assert ng.accuracy < 0.2 and ng.length() == 0 and ng.graft(tree, draft, room=10)[0] is tree
    for _ in range(12):  # now it repeats itself; not grafted, but still compared with what the model said
        ng.graft(tree, draft, room=10)
        ng.observe([3, 1, 2])
    assert ng.accuracy > 0.6 and ng.length() >= 3
    cheap = NgramDraft([1, 2, 3, 1, 2], max_len=10, node_cost=0.02)
    assert cheap.length() == 5  # bf16-cheap nodes: 0.5**5 = 0.031 > 0.02


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_drafts_are_accepted_and_output_stays_exact(arch):
    """Random heads rarely hit; tiny random models repeat themselves, so the lookup must lift τ."""
    base = tiny_model(arch)
    model = random_heads(base, num_heads=3)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    ref = base.generate(ids, max_new_tokens=80, do_sample=False)
    taus = {}
    for lookup in (False, True):
        for tree in ("chain", "default", None):
            out = model.generate(ids, max_new_tokens=80, tree=tree, prompt_lookup=lookup, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), (lookup, tree)
            taus[lookup, tree] = out.tau
    for tree in ("chain", "default", None):
        assert taus[True, tree] > taus[False, tree] + 0.15, taus
    # max_new_tokens and EOS inside a grafted chain end exactly where generate() ends
    new = ref[0, 12:].tolist()
    for n in (1, 2, 3, 7, 30):
        out = model.generate(ids, max_new_tokens=n, prompt_lookup=True)
        assert torch.equal(out, base.generate(ids, max_new_tokens=n, do_sample=False))
    eos = new[40]
    want = base.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=eos)
    assert torch.equal(model.generate(ids, max_new_tokens=80, eos_token_id=eos, prompt_lookup=True), want)


def test_sampling_with_lookup_is_seeded_and_keeps_the_chain_apart():
    """Sampling grafts the lookup too (its exactness: tests/test_sampling.py); a seed still fixes the output."""
    model = random_heads(tiny_model("llama"), num_heads=3)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))

    def run() -> torch.Tensor:
        return model.generate(ids, max_new_tokens=30, do_sample=True, prompt_lookup=True, tree="default",
                              generator=torch.Generator().manual_seed(7))  # fmt: skip

    assert torch.equal(run(), run())
    tree = Tree([(0,), (1,), (0, 0)])
    draft = torch.tensor([3, 9, 4, 1])  # the head draft at (0,) equals the lookup's first token
    merged, _ = NgramDraft([9, 3, 9, 1, 2, 9, 3], max_len=3, node_cost=0.0).graft(tree, draft, room=5)
    apart, tokens = NgramDraft([9, 3, 9, 1, 2, 9, 3], max_len=3, node_cost=0.0).graft(tree, draft, room=5, merge=False)
    assert len(merged) < len(apart) == len(tree) + 3
    assert lookup_nodes(apart) == {i for i, p in enumerate(apart.paths, 1) if p[0] == NGRAM_RANK}
    assert [tokens[i] for i in sorted(lookup_nodes(apart))] == [9, 1, 2]
    q = torch.rand(len(tree), 5)
    moved = carry_rows(q, tree, apart)
    for i, p in enumerate(tree.paths, 1):
        assert torch.equal(moved[apart.paths.index(p) + 1], q[i])
    assert torch.equal(moved[0], q[0]) and float(moved[sorted(lookup_nodes(apart))].abs().sum()) == 0


def test_grafted_trees_are_valid_trees():
    tree = Tree([(0,), (1,), (0, 0)])
    draft = torch.tensor([3, 4, 5, 6])
    combined, tokens = NgramDraft([9, 3, 1, 2, 9, 3], max_len=3, node_cost=0.0).graft(tree, draft, room=5)
    assert len(combined) == len(tree) + 3 and tokens[0] == 3
    for node in range(1, len(combined)):  # siblings hold distinct tokens: verification stays unambiguous
        sibs = [int(tokens[c]) for c in combined.children[combined.parents[node]]]
        assert len(sibs) == len(set(sibs))
