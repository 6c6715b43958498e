"""AdaptiveDraft: big trees where heads are right, no drafting where they are not, reproducible sampling."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_heads, tiny_model

from mtp import adaptive, packed
from mtp.adaptive import PRIOR_COST_HALF, AdaptiveDraft
from mtp.proposer import SEQUENTIAL_DEPTH_COST
from mtp.tree import Tree, best_first, build_tree


def _chain_path(tree: Tree) -> list[int]:
    """The rank-0 chain from the root: the accepted path when every head's top-1 is right."""
    accepted = [0]
    while True:
        kids = [c for c in tree.children[accepted[-1]] if tree.ranks[c] == 0]
        if not kids:
            return accepted
        accepted.append(kids[0])


def _step(policy: AdaptiveDraft, hit: bool, seconds: float = 0.01) -> Tree:
    """One simulated verify step: the rank-0 chain accepted (hit) or nothing (miss)."""
    tree = policy.tree()
    policy.update(tree, _chain_path(tree) if hit else [0], seconds)
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

    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: True)  # the curve under which trees are drafted
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

    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: True)  # the curve under which trees are drafted
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


def test_best_first_prefixes_are_the_best_trees_of_every_size():
    acc = [[0.7, 0.2, 0.05], [0.6, 0.2], [0.5, 0.1]]
    order = best_first(11, 3, acc)
    for n in range(1, 13):
        tree = build_tree(n, 3, acc)
        assert tree.paths == Tree([p for p, _ in order[: n - 1]]).paths
        assert abs(tree.expected_length(acc) - 1.0 - sum(prob for _, prob in order[: n - 1])) < 1e-9


def _timed_run(seconds_per_depth: float) -> AdaptiveDraft:
    """A sequential drafter whose top-1 is right about 3 times in 4 at every depth; each step's verify takes 1.0 s
    whatever its size, its drafting `seconds_per_depth` per depth."""
    acc = [[0.75, 0.1]] * 4
    policy = AdaptiveDraft(num_heads=4, max_nodes=8, prior_accuracies=acc, depth_cost=SEQUENTIAL_DEPTH_COST)
    for i in range(80):
        tree = policy.tree()
        path = _chain_path(tree)
        hits = next((k for k in range(1, len(path)) if (3 * i + k) % 4 == 0), len(path))  # first miss
        draft = seconds_per_depth * tree.depth
        policy.update(tree, path[:hits], 1.0 + draft, draft_seconds=draft, draft_depth=tree.depth)
    return policy


def test_a_drafter_whose_depths_cost_gets_a_shallower_tree():
    """Timed: where each depth of drafting measures dear, the policy moves to shallower trees; where it measures
    cheap, it keeps the deepest tree the heads can fill. Drafting is kept out of the verify part."""
    cheap, dear = _timed_run(0.0), _timed_run(0.25)
    assert cheap.current.depth >= 3
    assert 1 <= dear.current.depth <= 2 and len(dear.current) > 1
    assert dear.draft_seconds and all(s == 1.0 for s in dear.seconds.values())


def test_the_depth_cost_prior_shapes_the_first_tree():
    acc = [[0.6, 0.1], [0.5, 0.1], [0.4, 0.1], [0.3, 0.1]]
    flat = AdaptiveDraft(num_heads=4, max_nodes=8, prior_accuracies=acc)
    deep = AdaptiveDraft(num_heads=4, max_nodes=8, prior_accuracies=acc, depth_cost=0.5)
    assert flat.current == build_tree(len(flat.current), 4, acc)  # depth cost 0: the unlimited best tree
    assert deep.current.depth < flat.current.depth


def test_generate_reports_drafting_time_and_depth_to_the_policy(fitted, monkeypatch):
    from mtp.adaptive import AdaptiveDraft as Policy

    model, prompts, _ = fitted("llama")
    calls = []
    real = Policy.update

    def spy(self, tree, accepted, seconds, draft_seconds=None, draft_depth=None):
        calls.append((tree, seconds, draft_seconds, draft_depth))
        return real(self, tree, accepted, seconds, draft_seconds, draft_depth)

    monkeypatch.setattr(Policy, "update", spy)
    model.generate(prompts[2], max_new_tokens=24, prompt_lookup=False)
    drafted = [c for c in calls if len(c[0]) > 1]
    assert drafted
    assert all(0.0 < d <= s and depth == tree.depth for tree, s, d, depth in drafted)


@pytest.mark.parametrize("units", [True, False])
@pytest.mark.parametrize("kernel", [True, False])
def test_half_precision_prior_follows_the_cpu_and_the_runtime(monkeypatch, units, kernel):
    """bf16 on a CPU without bf16 matmul units gets its own untimed cost curve: steep from the model's own
    weights (a tree costs about one forward per node there), nearly flat prepacked (`mtp.packed`), flatter
    through the AVX2 kernel than from fp32 copies."""
    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: units)
    monkeypatch.setattr(packed, "bf16_kernel", lambda: kernel)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    prepacked_curve = adaptive.PRIOR_COST_HALF_KERNEL if kernel else adaptive.PRIOR_COST_HALF_FP32_COPIES
    for prepacked in (False, True):
        curve = adaptive.half_precision_prior(cpu, bf16, prepacked)
        if units:
            assert curve is PRIOR_COST_HALF
        else:
            assert curve is (prepacked_curve if prepacked else adaptive.PRIOR_COST_HALF_EMULATED)
        assert adaptive.half_precision_prior(cpu, torch.float16, prepacked) is PRIOR_COST_HALF
        assert adaptive.half_precision_prior(torch.device("cuda"), bf16, prepacked) is PRIOR_COST_HALF
    assert adaptive.PRIOR_COST_HALF_EMULATED[6] > 3 * PRIOR_COST_HALF[6]
    assert all(adaptive.PRIOR_COST_HALF_KERNEL[k] < adaptive.PRIOR_COST_HALF_FP32_COPIES[k] for k in (4, 6, 8, 16))


def test_half_precision_without_bf16_units_drafts_only_where_it_pays(fitted, monkeypatch):
    """From the model's own bf16 weights on such a CPU a verify costs about a forward per node: the policy
    decodes plain rather than run trees that would be slower; from fp32 copies the accurate heads draft."""
    import copy

    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: False)
    model, prompts, _ = fitted("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    ref = half.base_model.generate(prompts[1], max_new_tokens=48, do_sample=False)
    taus = {}
    for pack in (False, True):
        if pack:
            half.pack_decoding()
        out = half.generate(prompts[1], max_new_tokens=48, prompt_lookup=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        taus[pack] = out.tau
    assert taus[False] < 1.5 < 2.5 < taus[True], taus
