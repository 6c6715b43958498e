"""AdaptiveDraft: big trees where heads are right, no drafting where they are not, reproducible sampling."""

from __future__ import annotations

import torch
from conftest import VOCAB, random_heads, tiny_model

from mtp.adaptive import PRIOR_COST_HALF, AdaptiveDraft
from mtp.tree import Tree


def _step(policy: AdaptiveDraft, hit: bool, seconds: float = 0.01) -> Tree:
    """One simulated verify step: every node accepted (hit) or none (miss)."""
    tree = policy.tree()
    accepted = list(range(len(tree))) if hit and len(tree) > 1 else [0]
    if hit and len(tree) > 1:  # the accepted path is the rank-0 chain
        accepted = [0]
        while True:
            kids = [c for c in tree.children[accepted[-1]] if tree.ranks[c] == 0]
            if not kids:
                break
            accepted.append(kids[0])
    policy.update(tree, accepted, seconds)
    return tree


def test_accurate_heads_get_big_trees_and_missing_heads_stop_drafting():
    policy = AdaptiveDraft(num_heads=4, max_nodes=32, prior_cost=PRIOR_COST_HALF, timed=False)
    for _ in range(40):
        _step(policy, hit=True)
    assert policy.current.depth == 4 and len(policy.current) >= 5  # the full rank-0 chain at least
    for _ in range(400):
        _step(policy, hit=False)
    assert len(policy.current) == 1  # plain decoding: drafts cost more than they bring
    # ... but it keeps probing with a small tree, so it can recover when the text gets predictable
    sizes = [len(policy.tree()) for _ in range(policy.probe_every)]
    assert max(sizes) > 1 and sizes.count(1) == policy.probe_every - 1


def test_costly_big_trees_are_avoided_when_timings_say_so():
    """Timed mode: a size that measures slow loses to a smaller one with the same expected length."""
    acc = [[0.6, 0.3, 0.2], [0.5, 0.3, 0.2]]
    policy = AdaptiveDraft(num_heads=2, max_nodes=16, prior_accuracies=acc, prior_cost=PRIOR_COST_HALF, every=4)
    assert len(policy.current) > 3
    for _ in range(3 * policy.probe_every):  # plain steps (probes) take 0.01 s, every tree 1 s
        tree = policy.tree()
        policy.update(tree, [0], 1.0 if len(tree) > 1 else 0.01)
    assert len(policy.current) == 1


def test_seeded_sampling_with_the_adaptive_tree_is_reproducible():
    base = tiny_model("llama", seed=3)
    model = random_heads(base, seed=3, scale=0.3)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    outs = [
        model.generate(
            ids, max_new_tokens=30, do_sample=True, temperature=0.9, generator=torch.Generator().manual_seed(7)
        )
        for _ in range(3)
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_half_precision_greedy_does_not_read_the_clock(fitted, monkeypatch):
    """In bf16 the tree a step uses decides how the verify forward rounds, so a policy steered by wall-clock
    timings would give different (near-tie) greedy output on a busy machine than on a quiet one. Half
    precision steers by the prior cost curve alone: same prompt, same tokens and the same steps, whatever
    the clock says. (fp32 output is exact either way, so there the timings stay in charge.)"""
    import copy
    import random

    from mtp import decoding

    model, prompts, _ = fitted("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    real = decoding.time.perf_counter
    runs = []
    for seed in (0, 1, 2):
        jitter = random.Random(seed)
        monkeypatch.setattr(decoding.time, "perf_counter", lambda j=jitter: real() + j.uniform(0, 5))
        out = half.generate(prompts[1], max_new_tokens=48, return_dict_in_generate=True)
        runs.append((out.sequences.tolist(), out.accepted_lengths))
    assert all(r == runs[0] for r in runs[1:])
    assert sum(runs[0][1]) / len(runs[0][1]) > 1.5  # the heads draft (a policy stuck at plain steps passes trivially)


def test_a_pinned_shape_is_only_switched_on_or_off():
    """`shapes` fixes a size's tree: hits on the rank-0 chain would otherwise deepen it (as in the first
    test), misses still switch drafting off, and hits switch the very same tree back on."""
    pinned = Tree([(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)])
    full = len(pinned)
    policy = AdaptiveDraft(
        num_heads=4, max_nodes=full, prior_cost=PRIOR_COST_HALF, timed=False, ladder=(1, full), shapes={full: pinned}
    )
    free = AdaptiveDraft(num_heads=4, max_nodes=full, prior_cost=PRIOR_COST_HALF, timed=False, ladder=(1, full))
    for _ in range(40):
        _step(policy, hit=True)
        _step(free, hit=True)
    assert policy.current == pinned
    assert free.current != pinned and free.current.depth == 4  # unpinned, the same hits reshape it
    for _ in range(400):
        _step(policy, hit=False)
    assert len(policy.current) == 1
    for _ in range(40 * policy.probe_every):
        _step(policy, hit=True)
        if len(policy.current) > 1:
            break
    assert policy.current == pinned


def test_half_precision_default_drafts_the_default_tree_or_nothing(fitted, monkeypatch):
    import copy

    from mtp import decoding

    model, prompts, _ = fitted("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    seen: list[Tree] = []
    real = decoding.TreeScorer.score

    def spy(self, draft, tree):
        seen.append(tree)
        return real(self, draft, tree)

    monkeypatch.setattr(decoding.TreeScorer, "score", spy)
    half.generate(prompts[1], max_new_tokens=48, prompt_lookup=False)
    default = half.default_tree
    assert len(seen) > 3
    # every step verifies the default tree (cut only where max_new_tokens leaves less room) or no draft
    assert all(len(t) == 1 or t == default or set(t.paths) <= set(default.paths) for t in seen)
    assert sum(t == default for t in seen) >= len(seen) // 2
