"""Lossless speculative sampling: statistical tests against generate()'s exact distribution.

The reference distribution is not recomputed by our code: it is read off `base_model.generate(
do_sample=True, output_scores=True)`, i.e. the warped scores transformers itself samples from, for
every prefix of the first three new tokens. Our samples must fit it (chi-square), and a deliberately
broken verifier must be rejected by the same test, which shows the test has power.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model
from scipy.stats import chisquare

import mtp.decoding
from mtp import MTPModel, Tree
from mtp.sampling import SamplingParams, verify_sampled
from mtp.train.losses import medusa_loss

V = 8  # vocabulary small enough to enumerate every 3-token continuation
NEW = 3
PROMPT = torch.tensor([[3, 5, 1]])
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


@pytest.fixture(scope="module")
def peaked_model():
    base = tiny_model("llama", seed=8, vocab_size=V)
    base.generation_config.eos_token_id = None
    with torch.no_grad():  # sharpen the random model so p is far from uniform
        base.lm_head.weight.mul_(15.0)
    # Fit the heads on the model's own samples, so that most drafts get accepted.
    torch.manual_seed(8)
    ids = PROMPT.repeat(256, 1)
    seqs = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8)
    model = MTPModel.from_base(base, num_heads=2)
    opt = torch.optim.Adam(model.heads.parameters(), lr=3e-2)
    for _ in range(150):
        loss, _ = medusa_loss(model(seqs).head_logits, seqs)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def exact_joint(base, prompt: torch.Tensor = PROMPT, **kw) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) from the scores generate() samples from."""

    def next_probs(prefix: list[int]) -> torch.Tensor:
        ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long)], 1) if prefix else prompt
        # explicit mask: token 0 is the pad id, and generate() would otherwise mask it out of the prompt
        out = base.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=1,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
        return torch.softmax(out.scores[0][0].float(), -1)

    joint: dict[tuple[int, ...], float] = {}
    p1 = next_probs([])
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = next_probs([a])
        for b in range(V):
            if p2[b] == 0:
                continue
            p3 = next_probs([a, b])
            for c in range(V):
                if p3[c] > 0:
                    joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def chi2_pvalue(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Chi-square goodness of fit (bins with expected < 5 pooled) and total-variation distance."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    keys = set(joint) | set(counts)
    big = [k for k in keys if joint.get(k, 0.0) * n >= 5]
    small = [k for k in keys if k not in big]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)]
    exp = [joint.get(k, 0.0) * n for k in big] + [sum(joint.get(k, 0.0) for k in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        assert sum(obs) == n, "samples outside the support of p"
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]  # float rounding of p: make the sums agree exactly
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - joint.get(k, 0.0)) for k in keys)
    return float(chisquare(obs, exp).pvalue), tv


def draw(model, n: int, seed: int, prompt: torch.Tensor = PROMPT, **kw) -> tuple[list[tuple[int, ...]], float]:
    g = torch.Generator().manual_seed(seed)
    samples, accepted, steps = [], 0, 0
    for _ in range(n):
        out = model.generate(
            prompt, max_new_tokens=NEW, do_sample=True, generator=g, return_dict_in_generate=True, **kw
        )
        samples.append(tuple(out.sequences[0, -NEW:].tolist()))
        accepted += sum(a - 1 for a in out.accepted_lengths)
        steps += len(out.accepted_lengths)
    return samples, accepted / max(1, steps)


CASES = [
    ("chain", dict(temperature=1.0)),
    ("tree", dict(temperature=1.0)),
    ("chain", dict(temperature=0.7, top_p=0.9)),
    ("tree", dict(temperature=0.7, top_p=0.9)),
]


@pytest.mark.parametrize("tree,kw", CASES, ids=["chain-t1", "tree-t1", "chain-t0.7-p0.9", "tree-t0.7-p0.9"])
def test_speculative_sampling_matches_generate_distribution(peaked_model, tree, kw):
    joint = exact_joint(peaked_model.base_model, **kw)
    samples, acc_per_step = draw(peaked_model, 1500, seed=1, tree=TREE if tree == "tree" else "chain", **kw)
    pvalue, tv = chi2_pvalue(samples, joint)
    print(f"{tree} {kw}: p-value {pvalue:.3f}, TV {tv:.3f}, accepted drafts/step {acc_per_step:.2f}")
    assert pvalue > 0.001, (pvalue, tv)
    assert acc_per_step > 0.5  # the rejection path AND the acceptance path are both exercised


def test_sampling_with_prompt_lookup_matches_generate_distribution(peaked_model, monkeypatch):
    """Lookup chains verified as point-mass drafts keep the distribution exact; they do get accepted."""
    seen = {"lookup_steps": 0, "lookup_accepted": 0}
    real = mtp.decoding.verify_sampled

    def spy(tree, draft, target_probs, draft_probs, generator, fixed=frozenset()):
        accepted, bonus = real(tree, draft, target_probs, draft_probs, generator, fixed=fixed)
        seen["lookup_steps"] += bool(fixed)
        seen["lookup_accepted"] += sum(node in fixed for node in accepted)
        return accepted, bonus

    monkeypatch.setattr(mtp.decoding, "verify_sampled", spy)
    # the prompt, the model's own greedy continuation, the prompt again: the lookup proposes that continuation
    seen_ids = PROMPT.clone()
    greedy = peaked_model.base_model.generate(seen_ids, attention_mask=torch.ones_like(seen_ids), max_new_tokens=6)
    prompt = torch.cat([greedy, PROMPT], 1)
    joint = exact_joint(peaked_model.base_model, prompt, temperature=1.0)
    samples, _ = draw(peaked_model, 1500, seed=3, prompt=prompt, tree=TREE, temperature=1.0, prompt_lookup=True)
    pvalue, tv = chi2_pvalue(samples, joint)
    print(f"lookup: p-value {pvalue:.3f}, TV {tv:.3f}, {seen}")
    assert pvalue > 0.001, (pvalue, tv)
    assert seen["lookup_steps"] > 500 and seen["lookup_accepted"] > 100


def test_broken_verifier_is_detected(peaked_model, monkeypatch):
    """Accept-always (drafts taken as they come) must fail the very same test."""

    def accept_all(tree, draft, target_probs, draft_probs, generator, fixed=frozenset()):
        node, accepted = 0, [0]
        while tree.children[node]:
            node = tree.children[node][0]
            accepted.append(node)
        return accepted, int(torch.multinomial(target_probs[node], 1, generator=generator))

    monkeypatch.setattr(mtp.decoding, "verify_sampled", accept_all)
    joint = exact_joint(peaked_model.base_model, temperature=1.0)
    samples, _ = draw(peaked_model, 1500, seed=1, tree="chain", temperature=1.0)
    pvalue, tv = chi2_pvalue(samples, joint)
    print(f"broken verifier: p-value {pvalue:.2e}, TV {tv:.3f}")
    assert pvalue < 1e-6


def test_verify_sampled_alone_is_exact_on_synthetic_distributions():
    """The pure function, many draws: the emitted first token follows p for any q and any sibling count."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = torch.tensor([0.1, 0.1, 0.4, 0.0, 0.2, 0.2])
    tree = Tree([(0,), (1,), (2,)])  # three i.i.d. candidates under the root
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        draft = [0] + torch.multinomial(q, 3, replacement=True, generator=g).tolist()
        accepted, bonus = verify_sampled(tree, draft, torch.stack([p, p, p, p]), q[None], g)
        counts[draft[accepted[1]] if len(accepted) > 1 else bonus] += 1
    keep = p > 0
    assert counts[~keep].sum() == 0
    expected = (p[keep] / p[keep].sum() * counts.sum()).tolist()
    assert chisquare(counts[keep].tolist(), expected).pvalue > 0.001


def test_point_mass_candidates_keep_verify_sampled_exact():
    """A deterministic (lookup) child beside sampled ones, and below it: every emitted token still follows p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    p2 = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.4, 0.0, 0.2, 0.2])
    tree = Tree([(0,), (1,), (1000,), (1000, 1000)])  # two sampled candidates, then a 2-token lookup chain
    fixed = frozenset({3, 4})
    first, second = torch.zeros(6), torch.zeros(6, 6)
    n = 20000
    for _ in range(n):
        draft = [0] + torch.multinomial(q, 2, replacement=True, generator=g).tolist() + [0, 1]
        rows = torch.stack([p, p2, p2, p2, p2])  # p after the root, p2 after any first token
        accepted, bonus = verify_sampled(tree, draft, rows, q[None], g, fixed=fixed)
        tokens = [draft[i] for i in accepted[1:]] + [bonus]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[0], tokens[1]] += 1
    keep = p > 0
    assert first[~keep].sum() == 0
    assert chisquare(first[keep].tolist(), (p[keep] * n).tolist()).pvalue > 0.001
    chain_rows = second[0]  # after the lookup's first token (0) was accepted, its second (1) competes with p2
    assert chain_rows.sum() > 1000 and chain_rows[5] == 0
    expected = (p2[:5].double() / p2[:5].double().sum() * chain_rows.sum().double()).tolist()
    assert chisquare(chain_rows[:5].tolist(), expected).pvalue > 0.001


def test_seed_reproduces_and_tiny_temperature_is_greedy(peaked_model):
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8)
    a = peaked_model.generate(PROMPT, generator=torch.Generator().manual_seed(5), **kw)
    b = peaked_model.generate(PROMPT, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a, b)
    greedy = peaked_model.base_model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    for tree in ("chain", TREE):
        cold = peaked_model.generate(
            PROMPT,
            max_new_tokens=12,
            do_sample=True,
            temperature=1e-6,
            tree=tree,
            generator=torch.Generator().manual_seed(1),
        )
        assert torch.equal(cold, greedy)


def test_typical_acceptance_is_opt_in_and_runs(peaked_model):
    out = peaked_model.generate(
        PROMPT,
        max_new_tokens=10,
        do_sample=True,
        acceptance="typical",
        generator=torch.Generator().manual_seed(0),
        return_dict_in_generate=True,
    )
    assert out.num_new_tokens == 10
    with pytest.raises(ValueError, match="acceptance"):
        peaked_model.generate(PROMPT, max_new_tokens=4, do_sample=True, acceptance="fast")
    with pytest.raises(ValueError, match="only applies to sampling"):
        peaked_model.generate(PROMPT, max_new_tokens=4, acceptance="typical")


def test_sampling_params_follow_generate_defaults(peaked_model):
    params = SamplingParams.resolve(peaked_model.base_model.generation_config)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 50, 1.0)
    assert [type(w).__name__ for w in SamplingParams(0.7, 50, 0.9).warpers()] == [
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
    ]
    with pytest.raises(ValueError, match="temperature"):
        peaked_model.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=0.0)


def test_enumeration_covers_the_support():
    assert len(list(itertools.product(range(V), repeat=NEW))) == V**NEW
