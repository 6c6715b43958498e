"""Trees, verification and KV-cache cropping on literal inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mtp.kv_cache import GrowingLayer, keep_accepted, new_cache
from mtp.tree import DEFAULT_ACCURACIES, Tree, best_trees, build_tree, chain
from mtp.verify import verify_greedy

PATHS = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_tree_flattening():
    t = Tree(list(reversed(PATHS)))  # order of the input does not matter
    assert t.paths == tuple(PATHS)
    assert t.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert t.depths == [0, 1, 1, 2, 2, 2, 3]
    assert t.ranks == [0, 0, 1, 0, 1, 0, 0]
    assert t.children[0] == [1, 2] and t.children[1] == [3, 4] and t.children[3] == [6]
    anc = t.ancestors
    assert anc[6].tolist() == [True, True, False, True, False, False, True]
    assert anc[5].tolist() == [True, False, True, False, False, True, False]
    heads, ranks = t.gather_index
    assert heads.tolist() == [0, 0, 1, 1, 1, 2] and ranks.tolist() == [0, 1, 0, 1, 0, 0]


def test_tree_limit_and_chain():
    t = Tree(PATHS)
    assert t.limit(1).paths == ((0,), (1,))
    assert t.limit(0).paths == () and len(t.limit(0)) == 1
    assert t.limit(9) == t
    c = chain(3)
    assert c.paths == ((0,), (0, 0), (0, 0, 0)) and c.parents == [-1, 0, 1, 2]


@pytest.mark.parametrize("bad,msg", [([(0, 1)], "no parent"), ([(-1,)], "negative")])
def test_tree_rejects_bad_paths(bad, msg):
    with pytest.raises(ValueError, match=msg):
        Tree(bad)


def test_build_tree_is_valid_sized_and_best_first():
    for n in (1, 2, 8, 16, 40):
        t = build_tree(n, 4)
        assert len(t) == n and t.depth <= 4
        Tree(t.paths)  # closed under prefixes, or this raises
    # more nodes never lower the expected acceptance length, and beat a chain of the same depth
    lengths = [build_tree(n, 4).expected_length(DEFAULT_ACCURACIES) for n in (2, 5, 10, 20)]
    assert lengths == sorted(lengths)
    assert build_tree(5, 4).expected_length(DEFAULT_ACCURACIES) >= chain(4).expected_length(DEFAULT_ACCURACIES)
    # with a perfect head 1 and useless others, the tree spends nothing beyond depth 1
    acc = [[1.0, 0.0], [0.0, 0.0]]
    assert build_tree(5, 2, acc).paths == ((0,),)


def test_best_trees_reads_every_budget_off_one_search():
    acc = [list(row) for row in DEFAULT_ACCURACIES]
    for limit in (1, 2, 4):
        choices = best_trees([1, 2, 5, 9, 17], limit, acc)
        assert sorted(choices) == [2, 5, 9, 17]  # a one-node budget is no tree to draft
        for n, c in choices.items():
            tree = build_tree(n, limit, acc)
            assert Tree(c.paths).paths == tree.paths and c.size == len(tree) <= n
            assert c.depth == tree.depth <= limit
            assert c.expected == pytest.approx(tree.expected_length(acc))
    # nodes without a chance are never spent: a bigger budget gets the smaller tree that holds them all
    useless_after_one = [[0.9, 0.0], [0.0, 0.0]]
    assert best_trees([4], 2, useless_after_one)[4] == (2, 1, pytest.approx(1.9), ((0,),))


def test_verify_greedy_literal():
    t = Tree(PATHS)
    #        node: 0  1  2  3   4   5   6
    draft = [5, 7, 9, 11, 12, 13, 14]
    # base agrees with 7 after root, with 11 after 7, with 14 after 11, then says 99
    assert verify_greedy(t, draft, [7, 11, 0, 14, 0, 0, 99]) == ([0, 1, 3, 6], 99)
    # second-ranked branch
    assert verify_greedy(t, draft, [9, 0, 13, 0, 0, 42, 0]) == ([0, 2, 5], 42)
    # nothing accepted: the bonus is the base's own token after the root
    assert verify_greedy(t, draft, [3, 0, 0, 0, 0, 0, 0]) == ([0], 3)


def _filled_cache(length: int, cache: DynamicCache | None = None) -> DynamicCache:
    cache = new_cache() if cache is None else cache
    for layer in range(2):
        k = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).repeat(1, 2, 1, 3) + 100 * layer
        cache.update(k, -k, layer)
    return cache


@pytest.mark.parametrize("make", [new_cache, DynamicCache], ids=["growing", "dynamic"])
def test_keep_accepted_tree_path(make):
    cache = _filled_cache(9, make())  # prefix 5 + tree of 4 nodes
    keep_accepted(cache, prefix_len=5, keep=[0, 1, 3])
    assert cache.get_seq_length() == 8
    for i, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [p + 100 * i for p in [0, 1, 2, 3, 4, 5, 6, 8]]
        assert layer.values[0, 1, :, 2].tolist() == [-(p + 100 * i) for p in [0, 1, 2, 3, 4, 5, 6, 8]]


@pytest.mark.parametrize("make", [new_cache, DynamicCache], ids=["growing", "dynamic"])
def test_keep_accepted_chain_is_a_crop(make):
    cache = _filled_cache(9, make())
    keep_accepted(cache, prefix_len=5, keep=[0, 1])
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_growing_layers_follow_dynamic_layers_through_growth_crops_and_tree_keeps():
    """The same appends, crops and tree keeps on both caches, across several buffer growths: equal contents,
    and each layer's keys/values are views of its buffers (written in place, not concatenated)."""
    g = torch.Generator().manual_seed(0)
    grow, ref = new_cache(), DynamicCache()
    for step in range(60):
        n = int(torch.randint(1, 40 if step % 7 == 0 else 9, (1,), generator=g))
        for layer in range(3):
            k = torch.randn(2, 3, n, 4, generator=g)
            v = torch.randn(2, 3, n, 4, generator=g)
            out_k, out_v = grow.update(k, v, layer)
            ref_k, ref_v = ref.update(k, v, layer)
            assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        if n > 2 and step % 3 == 0:  # a tree step: keep a non-contiguous path of the n new nodes
            prefix = grow.get_seq_length() - n
            keep = [0, *sorted(torch.randperm(n - 1, generator=g)[:2].add(1).tolist())]
            keep_accepted(grow, prefix, keep)
            keep_accepted(ref, prefix, keep)
        elif step % 5 == 0:
            drop = int(torch.randint(0, n + 1, (1,), generator=g))
            grow.crop(-drop)
            ref.crop(-drop)
        assert grow.get_seq_length() == ref.get_seq_length()
        for a, b in zip(grow.layers, ref.layers, strict=True):
            assert isinstance(a, GrowingLayer)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert a.keys.untyped_storage().data_ptr() == a._k.untyped_storage().data_ptr()
    assert grow.layers[0]._k.shape[-2] > grow.get_seq_length()  # it grew ahead, by more than it needed


def test_growing_layer_refuses_a_positive_crop_and_resets():
    cache = _filled_cache(9)
    with pytest.raises(ValueError, match="negative"):
        cache.layers[0].crop(3)
    cache.reset()
    assert cache.get_seq_length() == 0
    k = torch.ones(1, 2, 2, 3)
    assert cache.update(k, k, 0)[0].shape == (1, 2, 2, 3)
