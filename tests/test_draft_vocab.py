"""Draft vocabulary: cheaper drafting from frequent tokens, output unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model

from mtp import MTPModel
from mtp.draft_vocab import DraftProjection, coverage, frequent_tokens


def _run(model, prompts, seqs, tree):
    """Heads' drafts only (prompt_lookup=False): the lookup copies context tokens, whatever the draft vocab."""
    lengths = []
    for ids, ref in zip(prompts, seqs, strict=True):
        out = model.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1], tree=tree, prompt_lookup=False,
                             return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, ref)
        lengths.append(out.accepted_lengths)
    return lengths


def test_projection_is_exact_on_the_subset_and_minus_inf_elsewhere():
    lm_head = torch.nn.Linear(16, 50, bias=True)
    ids = torch.tensor([3, 7, 11, 40])
    proj = DraftProjection(lm_head, ids)
    x = torch.randn(2, 5, 16)
    full = lm_head(x)
    out = proj(x)
    assert out.shape == full.shape
    torch.testing.assert_close(out[..., ids], full[..., ids])
    rest = torch.ones(50, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[..., rest]).all()


def test_frequent_tokens_and_coverage():
    seqs = [[1, 1, 1, 2, 2, 3], [1, 2, 4]]
    ids = frequent_tokens(seqs, size=2, vocab_size=10, always=[9])
    assert ids.tolist() == [1, 9]  # EOS-like `always` ids first, then by frequency
    assert coverage(seqs, frequent_tokens(seqs, 2, 10)) == pytest.approx(7 / 9)
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_tokens(seqs, size=0, vocab_size=10)


@pytest.mark.parametrize("tree", ["chain", None], ids=["chain", "tree"])
def test_covering_draft_vocab_keeps_every_accepted_draft(fitted, tree):
    """Every token the model writes is in the set, so no accepted draft is lost."""
    model, prompts, seqs = fitted("llama")
    full = _run(model, prompts, seqs, tree)
    used = torch.unique(torch.cat([s[0] for s in seqs]))
    model.set_draft_vocab(used)
    try:
        assert model.draft_vocab.numel() < VOCAB // 2  # a real restriction
        restricted = _run(model, prompts, seqs, tree)
    finally:
        model.set_draft_vocab(None)

    # A draft that was right stays top ranked in a subset holding it (and a wrong one may give way to
    # the right one), so the restriction costs no acceptance here.
    def tau(runs):
        return sum(sum(x) for x in runs) / sum(map(len, runs))

    assert tau(restricted) >= 0.95 * tau(full) and tau(restricted) > 2.0, (tau(restricted), tau(full))


def test_draft_vocab_without_the_models_tokens_accepts_nothing_and_changes_nothing(fitted):
    model, prompts, seqs = fitted("llama")
    used = set(torch.cat([s[0] for s in seqs]).tolist())
    model.set_draft_vocab(torch.tensor([t for t in range(VOCAB) if t not in used]))
    try:
        lengths = _run(model, prompts, seqs, None)
    finally:
        model.set_draft_vocab(None)
    assert all(n == 1 for run in lengths for n in run)


def test_draft_vocab_round_trips_and_bad_ids_are_refused(tmp_path, fitted):
    model, prompts, seqs = fitted("qwen2")
    ids = torch.unique(torch.cat([s[0] for s in seqs]))
    model.set_draft_vocab(ids)
    try:
        model.save_pretrained(tmp_path / "ckpt", heads_only=True)
    finally:
        model.set_draft_vocab(None)
    loaded = MTPModel.from_pretrained(tmp_path / "ckpt", base_model=model.base_model)
    assert torch.equal(loaded.draft_vocab, ids)
    _run(loaded, prompts, seqs, "chain")
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        loaded.set_draft_vocab(torch.tensor([0, VOCAB]))


def test_mtp_modules_draft_from_the_subset():
    base = tiny_model("llama", seed=2)
    model = MTPModel.from_base(base, head_type="mtp", num_heads=2)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    model.set_draft_vocab(torch.arange(0, VOCAB, 3))
    out = model.generate(ids, max_new_tokens=20, tree=None)
    assert torch.equal(out, ref)
    proposer = model.make_proposer()
    assert isinstance(proposer.lm_head, DraftProjection)
