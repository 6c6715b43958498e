"""The EAGLE-3-style recurrent drafter (head_type="eagle"): exactness, draft cache reuse, checkpoints, batching.

Output never depends on the drafter (verification guarantees it), so besides greedy identity with generate()
and the lossless-sampling chi-square test, this file checks the drafter itself: drafts computed with the
proposer's reused cache equal drafts computed from scratch by the training forward (`unroll`), and drafters
fitted on the base's own continuations get most of their drafts accepted (so a broken drafter fails here
even though the output would stay right).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, tiny_model
from test_batching import CHEAP_TREES, run, solo
from test_sampling import NEW, PROMPT, TREE, V, chi2_pvalue, draw, exact_joint

from mtp import MTPModel, Tree, chain
from mtp.batching import BatchDecoder, StepCost
from mtp.config import CONFIG_NAME, HEADS_NAME
from mtp.eagle import EagleDrafter, select_features
from mtp.eagle_proposer import EagleProposer
from mtp.heads import build_heads

# width 3 at the root, 2 below, down to depth 6: several inner nodes per depth
WIDE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 1)]
WIDE += [(0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0)]
DEPTHS = 6
# the fused base layers each test architecture's drafter reads (2-layer models: 0..2, 2 = the final state)
FEATURES = {"llama": (0, 1, 2), "qwen2": None, "mistral": (0, 1, 2), "gpt2": (0, 2)}
OVERRIDES = {"mistral": dict(sliding_window=8)}


def eagle_model(base, num_heads: int = DEPTHS, draft_ids: torch.Tensor | None = None, **kw) -> MTPModel:
    size = None if draft_ids is None else draft_ids.numel()
    model = MTPModel.from_base(base, num_heads=num_heads, head_type="eagle", draft_vocab_size=size, **kw)
    if draft_ids is not None:
        model.heads.set_draft_vocab(draft_ids, base)
    return model


def perturb(model: MTPModel, seed: int, scale: float = 0.05) -> MTPModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def draft_loss(drafter: EagleDrafter, aux: torch.Tensor, ids: torch.Tensor, decay: float = 0.8) -> torch.Tensor:
    """EAGLE-3's training-time-test loss on the draft vocabulary: depth k at t targets x_{t+k+2}; targets
    outside the draft vocabulary are skipped (the drafter cannot name them)."""
    index = torch.full((drafter.vocab_size,), -100, dtype=torch.long)
    index[drafter.draft_ids] = torch.arange(drafter.draft_vocab_size)
    T, total = ids.shape[1], 0.0
    for k, logits in enumerate(drafter.unroll(aux, ids, drafter.num_heads)):
        if T - k - 2 <= 0:
            break
        target = index[ids[:, k + 2 :]]
        total = total + decay**k * F.cross_entropy(logits[:, : T - k - 2].flatten(0, 1), target.flatten())
    return total


def fit(model: MTPModel, seqs: list[torch.Tensor], steps: int, lr: float) -> MTPModel:
    """Fit the drafter on sequences (the base's own outputs); the base's features are computed once."""
    base, drafter = model.base_model, model.heads
    for p in base.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        feats = [
            select_features(base(s, output_hidden_states=True).hidden_states, drafter.feature_layers) for s in seqs
        ]
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        for aux, s in zip(feats, seqs, strict=True):
            draft_loss(drafter, aux, s).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


_FITTED: dict[str, tuple] = {}


def fitted(name: str):
    """(model, prompts, reference sequences): a 6-depth drafter fitted on 4 greedy continuations; cached.

    `name` is an architecture, or "arch:N" for a drafter of N layers (`num_layers`). Mistral and GPT-2 get a
    restricted draft vocabulary (the tokens of the references plus random others, in shuffled order), so the
    draft-index -> token-id mapping is on the path of every test that uses them."""
    if name not in _FITTED:
        arch, _, layers = name.partition(":")
        base = tiny_model(arch, seed=1, **OVERRIDES.get(arch, {}))
        base.generation_config.eos_token_id = None
        g = torch.Generator().manual_seed(123)
        prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (1, 4, 7, 12)]
        seqs = [base.generate(p, max_new_tokens=60, do_sample=False) for p in prompts]
        ids = None
        if arch in ("mistral", "gpt2"):
            used = torch.cat([s[0] for s in seqs]).unique()
            seen = set(used.tolist())
            rest = torch.tensor([t for t in torch.randperm(VOCAB, generator=g).tolist() if t not in seen])
            ids = torch.cat([used, rest[: 200 - used.numel()]])
            ids = ids[torch.randperm(ids.numel(), generator=g)]
        model = eagle_model(base, draft_ids=ids, feature_layers=FEATURES[arch], num_layers=int(layers or 1))
        _FITTED[name] = (fit(model, seqs, steps=20, lr=2e-2), prompts, seqs)
    return _FITTED[name]


# ---- exactness ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "llama:2"])
def test_greedy_output_matches_generate_and_drafts_are_accepted(arch):
    model, prompts, seqs = fitted(arch)
    taus = {"chain": [], "wide": [], "auto": []}
    longest = 0
    for ids, ref in zip(prompts, seqs, strict=True):
        for name, tree in (("chain", "chain"), ("wide", WIDE), ("auto", None)):
            out = model.generate(
                ids, max_new_tokens=ref.shape[1] - ids.shape[1], tree=tree, return_dict_in_generate=True
            )
            assert torch.equal(out.sequences, ref), (arch, name, ids.shape)
            assert 1 + sum(out.accepted_lengths) == out.num_new_tokens
            taus[name].append(out.tau)
            if name != "auto":  # draft-time trees (auto's default here) may go past the trained depths
                longest = max(longest, *out.accepted_lengths)
    print(arch, {k: [round(t, 2) for t in v] for k, v in taus.items()})
    for name, values in taus.items():
        # auto prices each drafted depth as measured, and in these tiny models one drafter step costs a large share
        # of a verify forward: it may choose shallow trees, but it must draft
        assert sum(values) / len(values) > (1.8 if name != "auto" else 1.3), (arch, name, values)
    assert longest == DEPTHS + 1  # every one of the 6 depths drafted an accepted token somewhere
    # held-out prompts, and one that repeats itself (prompt-lookup chains grafted onto the drafter's tree)
    g = torch.Generator().manual_seed(len(arch))
    held_out = [torch.randint(3, VOCAB, (1, 9), generator=g), torch.cat([seqs[2][:, :20], seqs[2][:, :6]], 1)]
    for ids in held_out:
        ref = model.base_model.generate(ids, max_new_tokens=30, do_sample=False)
        for tree, lookup in (("chain", False), (WIDE, True), (None, True)):
            out = model.generate(ids, max_new_tokens=30, tree=tree, prompt_lookup=lookup)
            assert torch.equal(out, ref), (arch, ids.shape, tree, lookup)


# ---- the drafter: cache reuse equals recomputation ------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral", "llama:2"])
def test_rows_drafted_together_grow_the_trees_each_row_grows_alone(name):
    """`propose_dynamic_rows` (the batched engine's drafting: one drafter forward per depth for every row)
    against each row's own `propose_dynamic`, over three rounds: rows of different lengths, a fresh prompt
    longer than the solo catch-up bound beside short ones, budgets of different sizes, depths and widths (so
    rows stop growing at different depths), different acceptance lengths between rounds. Trees, drafts and
    the rows' committed caches must agree (fp32; padding is masked, so only float rounding could differ)."""
    from mtp.dynamic_tree import DynamicTree
    from mtp.eagle_proposer import _SOLO_CATCH_UP

    model, _, seqs = fitted(name)
    base, drafter = model.base_model, model.heads
    starts = [3, 12, _SOLO_CATCH_UP + 8, 1]
    budgets = [DynamicTree(6, 8, 4), DynamicTree(16, 8, 4), DynamicTree(4, 2, 4), DynamicTree(8, 8, 2)]
    with torch.inference_mode():
        feats = [
            select_features(base(s, output_hidden_states=True).hidden_states, drafter.feature_layers)[0] for s in seqs
        ]

        def fresh() -> list[EagleProposer]:
            rows = []
            for s, f, n in zip(seqs, feats, starts, strict=True):
                p = model.make_proposer()
                p.begin(f[:n], s[0, :n])
                rows.append(p)
            return rows

        alone, together = fresh(), fresh()
        pos = list(starts)
        for accepted in ([0, 0, 0, 0], [2, 0, 3, 1], [1, 4, 0, 2]):
            for i, a in enumerate(accepted):  # the base kept the root and `a` drafts: those positions are fed
                if a or pos[i] != starts[i]:
                    for rows in (alone, together):
                        rows[i].observe(feats[i][pos[i] : pos[i] + a + 1], seqs[i][0, pos[i] : pos[i] + a + 1])
                    pos[i] += a + 1
            roots = [int(s[0, n]) for s, n in zip(seqs, pos, strict=True)]
            want = [p.propose_dynamic(r, b) for p, r, b in zip(alone, roots, budgets, strict=True)]
            got = EagleProposer.propose_dynamic_rows(together, roots, budgets)
            for i, ((t1, d1), (t2, d2)) in enumerate(zip(want, got, strict=True)):
                assert t1.paths == t2.paths and d1.tolist() == d2.tolist(), (name, accepted, i)
                assert len(t1) > 1
            for a, b in zip(alone, together, strict=True):
                assert a.committed == b.committed == b.cache.get_seq_length()
                assert a.drafted_depth == b.drafted_depth
                torch.testing.assert_close(a.last_out, b.last_out, rtol=1e-4, atol=1e-5)
                for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
                    torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
    # the rounds above grew trees of different depths in one batch
    assert len({p.drafted_depth for p in together}) > 1


@pytest.mark.parametrize("arch,layers", [("llama", 1), ("gpt2", 1), ("llama", 2)])
def test_proposer_drafts_equal_drafts_from_scratch(arch, layers):
    """Steps with changing trees (wider, deeper and shallower than before), random acceptance lengths, steps
    that draft nothing, a long stretch without drafting (pending features folded through `fc`); every inner
    node's logits against `unroll` on the concatenated path. With 2 layers (perturbed, so the stacked one is
    no identity) the cache holds each layer's keys and the training-time test unrolls both."""
    base = tiny_model(arch, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=g)[:180]  # a shuffled draft vocabulary of 180 of the 256 tokens
    model = eagle_model(base, num_heads=5, draft_ids=ids, feature_layers=(0, 1, 2), num_layers=layers)
    model = perturb(model, seed=3)
    drafter = model.heads
    seq = torch.randint(3, VOCAB, (1, 160), generator=g)
    with torch.no_grad():
        aux = select_features(base(seq, output_hidden_states=True).hidden_states, drafter.feature_layers)[0]
    proposer = model.make_proposer()
    assert isinstance(proposer, EagleProposer) and proposer.feature_layers == (0, 1, 2)
    wide = Tree([p for p in WIDE if len(p) <= 5])
    trees = [wide, chain(5), Tree([]), Tree([(0,), (1,), (0, 0)]), chain(1), wide, Tree([(0,), (0, 0)])]
    n, checked = 1, 0  # a 1-token prompt

    def check(tree: Tree) -> None:
        nonlocal checked
        root = int(seq[0, n])
        draft = proposer.propose(root, tree).tolist()
        if checked == 0:  # proposing again from the same state gives the same drafts (StepCost does this)
            assert proposer.propose(root, tree).tolist() == draft
        for node in range(len(tree)):
            if not tree.children[node]:
                continue
            path, j = [], node
            while j > 0:
                path.append(draft[j])
                j = tree.parents[j]
            tokens = torch.tensor([seq[0, : n + 1].tolist() + path[::-1]])
            m = tree.depths[node]
            ref = drafter.unroll(aux[None, :n], tokens, m + 1)[m][0, n - 1]  # depth m at t = n-1
            torch.testing.assert_close(proposer.draft_logits[node], ref, rtol=1e-4, atol=1e-5)
            top = ids[ref.topk(1 + max(tree.ranks[c] for c in tree.children[node])).indices]
            assert [draft[c] for c in tree.children[node]] == [int(top[tree.ranks[c]]) for c in tree.children[node]]
            checked += 1
        # only committed entries stay cached; a step that drafts nothing feeds nothing
        assert proposer.cache.get_seq_length() == proposer.committed
        assert proposer.length == n and (proposer.committed == n) == (len(tree) > 1)

    with torch.inference_mode():
        proposer.begin(aux[:n], seq[0, :n])
        for step in range(14):
            tree = trees[step % len(trees)]
            check(tree)
            accepted = int(torch.randint(0, tree.depth + 1, (1,), generator=g))  # root + `accepted` nodes
            proposer.observe(aux[n : n + accepted + 1], seq[0, n : n + accepted + 1])
            n += accepted + 1
        for _ in range(12):  # 72 positions without a draft: the pending features get folded into g
            proposer.observe(aux[n : n + 6], seq[0, n : n + 6])
            n += 6
        assert proposer._g and n < seq.shape[1] - 6
        check(wide)
    assert checked > 40


def test_model_forward_feeds_the_fused_features():
    base = tiny_model("qwen2", seed=4)
    model = perturb(eagle_model(base, num_heads=3, draft_ids=torch.arange(40, 140), feature_layers=(1, 2)), seed=4)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
        states = base(ids, output_hidden_states=True).hidden_states
        ref = model.heads.unroll(torch.cat([states[1], states[2]], -1), ids, 3)
    assert out.head_logits.shape == (3, 2, 9, VOCAB)
    torch.testing.assert_close(out.hidden_states, states[-1])
    for k in range(3):
        torch.testing.assert_close(out.head_logits[k][..., 40:140], ref[k])
    assert torch.isneginf(out.head_logits[..., :40]).all() and torch.isneginf(out.head_logits[..., 140:]).all()


# ---- lossless sampling ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked_eagle():
    """test_sampling's sharpened vocab-8 Llama with a drafter fitted on its own samples, whose draft vocabulary
    leaves out the two tokens it writes least often: q is zero there, and the verifier's residual has to
    produce them at exactly their probability."""
    base = tiny_model("llama", seed=8, vocab_size=V)
    base.generation_config.eos_token_id = None
    with torch.no_grad():
        base.lm_head.weight.mul_(15.0)
    torch.manual_seed(8)
    ids = PROMPT.repeat(256, 1)
    seqs = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8)
    excluded = set(torch.bincount(seqs[:, PROMPT.shape[1] :].flatten(), minlength=V).argsort()[:2].tolist())
    keep = torch.tensor([t for t in range(V) if t not in excluded])
    model = eagle_model(base, num_heads=2, draft_ids=keep.flip(0), feature_layers=(0, 1, 2))
    return fit(model, [seqs], steps=60, lr=1e-2), excluded


def test_sampling_matches_generate_distribution(peaked_eagle):
    model, excluded = peaked_eagle
    joint = exact_joint(model.base_model, temperature=1.0)
    assert sum(p for s, p in joint.items() if set(s) & excluded) > 0.1  # the residual path carries real mass
    samples, acc_per_step = draw(model, 1200, seed=2, tree=TREE, temperature=1.0)
    pvalue, tv = chi2_pvalue(samples, joint)
    print(f"EAGLE {TREE}: p-value {pvalue:.3f}, TV {tv:.3f}, accepted drafts/step {acc_per_step:.2f}")
    assert pvalue > 0.001, (pvalue, tv)
    assert acc_per_step > 0.5
    assert all(len(s) == NEW for s in samples)


def test_sampled_drafts_return_per_parent_q_over_the_full_vocabulary(peaked_eagle):
    model, excluded = peaked_eagle
    proposer = model.make_proposer()
    tree = Tree(TREE)
    calls = []

    def probs(logits):
        calls.append(logits)
        return torch.softmax(logits.float() / 0.9, -1)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = model.base_model(PROMPT, output_hidden_states=True)
        proposer.begin(select_features(out.hidden_states, proposer.feature_layers)[0], PROMPT[0])
        draft, q = proposer.propose_sampled(3, tree, probs, g)
        while draft[1] == draft[2]:  # until the two depth-1 siblings (i.i.d. draws) differ
            calls.clear()
            draft, q = proposer.propose_sampled(3, tree, probs, g)
    assert all(x.shape[-1] == V for x in calls)  # `probs` sees full-vocabulary logits, -inf outside
    assert q.shape == (len(tree), V) and draft.shape == (len(tree),)
    for node in range(len(tree)):
        if tree.children[node]:
            assert (q[node].sum() - 1).abs() < 1e-5 and q[node, sorted(excluded)].abs().sum() == 0
            ref = torch.softmax(model.heads.to_full_vocab(proposer.draft_logits[node]).float() / 0.9, -1)
            torch.testing.assert_close(q[node], ref)
        else:
            assert q[node].abs().sum() == 0
    assert not set(draft[1:].tolist()) & excluded
    assert not torch.allclose(q[1], q[2])  # the depth-2 q depends on the drafted depth-1 token
    assert proposer.cache.get_seq_length() == proposer.committed == PROMPT.shape[1]


# ---- checkpoints and the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_save_load_round_trips(tmp_path, layers):
    base = tiny_model("gpt2", seed=11)
    g = torch.Generator().manual_seed(11)
    draft_ids = torch.randperm(VOCAB, generator=g)[:150]
    model = eagle_model(base, num_heads=4, draft_ids=draft_ids, feature_layers=(0, 2), num_layers=layers)
    model = perturb(model, seed=11, scale=0.02)
    full, heads_dir, base_dir = tmp_path / "full", tmp_path / "heads", tmp_path / "base"
    model.save_pretrained(full)
    cfg = json.loads((full / CONFIG_NAME).read_text())
    assert cfg["head_type"] == "eagle" and cfg["num_heads"] == 4
    # one-layer checkpoints keep the config they always had
    expected = {"feature_layers": [0, 2], "draft_vocab_size": 150} | ({"num_layers": 2} if layers == 2 else {})
    assert cfg["head_kwargs"] == expected
    model.base_model.save_pretrained(base_dir)
    model.config.base_model_name_or_path = str(base_dir)
    model.save_pretrained(heads_dir, heads_only=True)
    assert not (heads_dir / "model.safetensors").exists()
    ids = torch.randint(3, VOCAB, (1, 6), generator=g)
    for directory in (full, heads_dir):
        loaded = MTPModel.from_pretrained(directory)
        assert isinstance(loaded.heads, EagleDrafter) and loaded.heads.feature_layers == (0, 2)
        assert loaded.heads.num_layers == layers
        assert torch.equal(loaded.heads.draft_ids, draft_ids)
        sd_a, sd_b = model.heads.state_dict(), loaded.heads.state_dict()
        assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
        for tree in ("chain", WIDE[:9]):
            a = model.generate(ids, max_new_tokens=24, tree=tree, return_dict_in_generate=True)
            b = loaded.generate(ids, max_new_tokens=24, tree=tree, return_dict_in_generate=True)
            assert torch.equal(a.sequences, b.sequences) and a.accepted_lengths == b.accepted_lengths
            assert torch.equal(a.sequences, base.generate(ids, max_new_tokens=24, do_sample=False))
    # the base fingerprint is checked: the drafter on another base is refused
    with pytest.raises(ValueError, match="different base model"):
        MTPModel.from_pretrained(heads_dir, base_model=tiny_model("gpt2", seed=12))
    # a heads file whose draft ids are not distinct token ids is a clear error, not an indexing crash later
    from safetensors.torch import load_file, save_file

    state = load_file(str(full / HEADS_NAME))
    state["draft_ids"][1] = state["draft_ids"][0]
    save_file(state, str(full / HEADS_NAME))
    with pytest.raises(ValueError, match="distinct base token ids"):
        MTPModel.from_pretrained(full)


def test_mtp_generate_command_on_an_eagle_checkpoint(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    from typer.testing import CliRunner

    from mtp.cli import app

    model, _, _ = fitted("llama")
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    model.tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.tokenizer = None
    res = CliRunner().invoke(
        app, ["generate", "-m", str(tmp_path), "-p", "w5 w9 w77", "--max-new-tokens", "20", "--no-chat"]
    )
    assert res.exit_code == 0, res.output
    assert "identical: True" in res.output and "τ=" in res.output


# ---- continuous batching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,tree", [("llama", None), ("llama:2", None), ("llama", "auto-static")])
def test_batch_decoder_rows_match_their_own_generate(name, tree, monkeypatch):
    """Eagle rows in the batched engine (the decoder-only forward, asked for the inner layers' states): rows of
    different lengths joining mid-run, a plain row beside them, a long prompt prefilled in chunks. By default
    greedy rows grow draft-time trees (every speculative step of theirs here); "auto-static" never does."""
    from mtp.eagle_proposer import EagleProposer

    grown = []
    original = EagleProposer.propose_dynamic_rows.__func__

    def spy(cls, proposers, roots, budgets):
        grown.extend(budgets)
        return original(cls, proposers, roots, budgets)

    monkeypatch.setattr(EagleProposer, "propose_dynamic_rows", classmethod(spy))
    model, prompts, _ = fitted(name)
    train = [p[0].tolist() for p in prompts]
    long = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(9)).tolist()
    all_prompts = train + [long, train[2]]
    engine = BatchDecoder(model, guard=False, max_batch_size=4, prefill_chunk=8, cost=CHEAP_TREES, tree=tree)
    assert engine._decoder is not None
    per_row = [{}] * 5 + [dict(speculative=False)]
    max_new = [40, 25, 48, 33, 30, 20]
    outs, finish = run(engine, all_prompts, max_new, join_at=[0, 0, 2, 5, 3, 4], per_row=per_row)
    for p, m, o in zip(all_prompts, max_new, outs, strict=True):
        assert o == solo(model, p, m), p
    taus = [sum(f.accepted_lengths) / len(f.accepted_lengths) for f in (finish[i] for i in range(4))]
    assert min(taus) > 1.8, taus
    assert set(finish[5].accepted_lengths) == {1}
    speculative_steps = sum(len(finish[i].accepted_lengths) for i in range(5))
    if tree is None:  # the cheap curve makes speculation pay: a row's steps grow trees but near its end
        assert len(grown) >= speculative_steps // 2 and all(b.width == 4 for b in grown), (grown, speculative_steps)
    else:
        assert grown == []
    cost = StepCost.measure(model, sizes=(1, 4), context=24)  # drafts with an eagle proposer too
    assert cost.draft_seconds > 0 and 0.0 <= cost.row_share <= 1.0


def test_the_plan_prices_rows_that_draft_together():
    """Four EAGLE rows whose drafting alone costs 0.6 forwards each: one after another (`row_share` 1) the
    batch decodes plain, drafted together (each further row adds 5%) it speculates; a lone row speculates
    either way. Every request decodes exactly what it decodes alone."""
    import dataclasses

    model, prompts, _ = fitted("llama")
    train = [p[0].tolist() for p in prompts]
    alone = StepCost(tokens=(1, 100000), seconds=(1.0, 1.0), draft_seconds=0.6)
    together = dataclasses.replace(alone, row_share=0.05)
    assert alone.together(4) == 1.0 and together.together(1) == 1.0
    assert together.together(4) == pytest.approx(1.15 / 4)
    for cost, speculates in ((alone, False), (together, True)):
        engine = BatchDecoder(model, guard=False, cost=cost, prompt_lookup=False, probe_every=10**9)
        for p in train:
            engine.add(p, 30)
        engine.step()
        assert len(engine.rows) == 4 and (engine._plan() > 1) == speculates, cost
        lone = BatchDecoder(model, guard=False, cost=cost, prompt_lookup=False)
        lone.add(train[0], 30)
        lone.step()
        assert lone._plan() > 1
    outs, _ = run(BatchDecoder(model, guard=False, cost=together, prompt_lookup=False), train, 30)
    assert outs == [solo(model, p, 30) for p in train]


# ---- construction errors ----------------------------------------------------------------------------------


def test_bad_construction_is_a_clear_error(tmp_path):
    base = tiny_model("llama")
    kw = dict(vocab_size=VOCAB, num_heads=3)
    with pytest.raises(ValueError, match="hidden size 32 / vocab 256 cannot run on this base"):
        build_heads("eagle", base_model=base, hidden_size=32, **kw)
    with pytest.raises(ValueError, match="at least one layer"):
        build_heads("eagle", base_model=base, hidden_size=64, num_layers=0, **kw)
    with pytest.raises(ValueError, match="base_model="):
        build_heads("eagle", hidden_size=64, **kw)
    with pytest.raises(ValueError, match=r"feature_layers \(0, 5\) outside 0..2"):
        build_heads("eagle", base_model=base, hidden_size=64, feature_layers=[0, 5], **kw)
    model = MTPModel.from_base(base, num_heads=3, head_type="eagle", draft_vocab_size=10)
    for bad, match in (
        (list(range(9)), "9 ids for a drafter of 10"),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 8], "distinct"),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, VOCAB], "distinct base token ids"),
        ([-1, 1, 2, 3, 4, 5, 6, 7, 8, 9], "distinct base token ids"),
    ):
        with pytest.raises(ValueError, match=match):
            model.heads.set_draft_vocab(bad)
    assert torch.equal(model.heads.draft_ids, torch.arange(10))  # a refused vocabulary changed nothing
    # a model-level draft vocabulary (DraftProjection) does not apply to a drafter with its own
    with pytest.raises(ValueError, match="own 10-token vocabulary"):
        model.set_draft_vocab(torch.arange(50))
    model.set_draft_vocab(None)  # clearing is fine
    with pytest.raises(ValueError, match="input_ids="):
        model.heads(torch.zeros(1, 3, 64 * 3))
    model.save_pretrained(tmp_path, heads_only=True)
    with pytest.raises(ValueError, match="hidden size 64"):
        MTPModel.from_pretrained(tmp_path, base_model=tiny_model("llama", hidden_size=32, num_attention_heads=4))


def test_batch_trees_bench_levels_decode_every_prompt_exactly():
    """bench/batch_trees.py's level runner: every mode decodes each prompt as generate() alone; τ counts verify
    steps (plain decoding: exactly 1), concurrency 1 and 3 alike."""
    from mtp.bench.batch_trees import MODES, run_level

    model, prompts, seqs = fitted("llama")
    ids = [p[0].tolist() for p in prompts]
    refs = [s[0, p.shape[1] :].tolist() for p, s in zip(prompts, seqs, strict=True)]
    max_new = min(len(r) for r in refs)
    for c in (1, 3):
        for mode in MODES:
            r = run_level(model, ids, max_new, c, mode, CHEAP_TREES)
            assert r["answers"] == [ref[:max_new] for ref in refs], (c, mode)
            assert r["tokens"] == max_new * len(ids)
            assert r["tau"] == 1.0 if mode == "plain" else r["tau"] > 1.8, (c, mode, r["tau"])


def test_batch_profile_times_the_engine_phases_and_restores_them():
    """bench/batch_profile.py: its timers see drafting (rows together, or one after another with `/alone`),
    the batched forward and verification of an EAGLE batch, the answers stay exact, and every patched
    method is itself again afterwards."""
    import contextlib
    from collections import defaultdict

    from mtp.batching import BatchDecoder as Engine
    from mtp.bench.batch_profile import rows_drafting_alone, timed_engine_phases
    from mtp.bench.batch_trees import run_level

    model, prompts, seqs = fitted("llama")
    ids = [p[0].tolist() for p in prompts]
    refs = [s[0, p.shape[1] : p.shape[1] + 20].tolist() for p, s in zip(prompts, seqs, strict=True)]
    before = (dict(vars(Engine)), dict(vars(EagleProposer)))
    solo_calls = {}
    for alone in (False, True):
        totals, counts = defaultdict(float), defaultdict(int)
        with rows_drafting_alone() if alone else contextlib.nullcontext():
            with timed_engine_phases(totals, counts):
                r = run_level(model, ids, 20, 4, "dynamic", CHEAP_TREES)
        assert r["answers"] == refs
        assert {"step (total)", "drafting", "batched forward", "verify", "KV commit"} <= set(totals), totals
        assert totals["step (total)"] >= totals["batched forward"] + totals["drafting"] > 0
        solo_calls[alone] = counts["drafting: catch-up feed"]
    # together, the rows' catch-up feeds are one batched feed per step; alone, one per row
    assert solo_calls[True] > 2 * solo_calls[False] > 0
    assert (dict(vars(Engine)), dict(vars(EagleProposer))) == before


def test_the_server_decodes_concurrent_requests_with_an_eagle_drafter(tmp_path):
    """`mtp serve` on an EAGLE checkpoint: the batched engine grows each greedy request's draft-time tree with
    the other requests' (`propose_dynamic_rows`). Six concurrent requests each get the text of the base's own
    greedy generate(), and the server verified accepted drafts.

    The plan prices trees with a `--step-cost` curve in which drafting is cheap: a curve measured on the test
    machine can price a tiny model's drafting above what it brings (CI once decoded every step plain), and
    this test is about serving the drafts, not about when they pay."""
    import concurrent.futures
    import copy

    import openai
    from test_serve_support import Server, word_tokenizer, words

    from mtp.batching import StepCost

    model, prompts, seqs = fitted("llama")
    served = copy.deepcopy(model)
    served.tokenizer = word_tokenizer()
    served.base_model.generation_config.eos_token_id = None
    served.save_pretrained(tmp_path)
    ids = [p[0].tolist() for p in prompts] + [seqs[2][0, :20].tolist(), seqs[3][0, :9].tolist()]
    want = [served.tokenizer.decode(solo(model, p, 30)) for p in ids]
    cost = tmp_path / "step-cost.json"
    StepCost(tokens=(1, 256), seconds=(1e-3, 1.2e-3), draft_seconds=1e-5, depth_seconds=1e-5, row_share=0.2).save(cost)
    server = Server(tmp_path, "--served-model-name", "tiny", "--speculation", "on", "--step-cost", str(cost))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def call(p: list[int]) -> str:
            return (
                client.completions.create(model="tiny", prompt=words(p), max_tokens=30, temperature=0).choices[0].text
            )

        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            got = list(pool.map(call, ids))
        metrics = server.metrics()
    finally:
        server.stop()
    assert got == want
    assert metrics['mtp:batch_size_bucket{le="1"}'] < metrics["mtp:batch_size_count"]  # decoded together
    drafts, accepted = metrics["mtp:spec_decode_num_drafts_total"], metrics["mtp:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 1 + accepted / drafts > 1.3  # untrained drafts give ~1.0
