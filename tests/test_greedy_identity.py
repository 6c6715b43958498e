"""Token-for-token equality with the base model's own greedy `generate()`."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, VOCAB, random_heads, tiny_model

from mtp import MTPModel, Tree

TREES = ["chain", None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", TREES, ids=["chain", "default-tree", "small-tree"])
def test_random_prompts_match_generate(arch, tree):
    base = tiny_model(arch)
    model = random_heads(base, seed=7)
    g = torch.Generator().manual_seed(hash(arch) % 1000)
    for _ in range(6):
        plen = int(torch.randint(1, 20, (1,), generator=g))
        new = int(torch.randint(1, 48, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (1, plen), generator=g)
        ref = base.generate(ids, max_new_tokens=new, do_sample=False)
        out = model.generate(ids, max_new_tokens=new, tree=tree)
        assert torch.equal(out, ref), (arch, plen, new)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("tree", ["chain", None], ids=["chain", "tree"])
def test_accurate_heads_accept_most_drafts(fitted, arch, tree):
    """With heads fitted to the model's own continuations, most drafts are accepted: τ > 2."""
    model, prompts, seqs = fitted(arch)
    taus = []
    for ids, ref in zip(prompts, seqs, strict=False):
        out = model.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1], tree=tree, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert 1 + sum(out.accepted_lengths) == out.num_new_tokens
        taus.append(out.tau)
    assert min(taus) > 2.0, taus


def _mid_run_position(lengths: list[int]) -> int:
    """Index (among new tokens) of a token that is neither first nor last of a multi-token step."""
    pos = 1  # token 0 comes from the prefill
    for n in lengths:
        if n >= 3:
            return pos + 1
        pos += n
    raise AssertionError(f"no step accepted 3+ tokens: {lengths}")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eos_inside_accepted_run(fitted, arch):
    model, prompts, seqs = fitted(arch)
    ids, ref = prompts[1], seqs[1]
    plen = ids.shape[1]
    full = model.generate(ids, max_new_tokens=ref.shape[1] - plen, tree="chain", return_dict_in_generate=True)
    cut = _mid_run_position(full.accepted_lengths)
    eos = int(ref[0, plen + cut])
    first = next(i for i in range(ref.shape[1] - plen) if int(ref[0, plen + i]) == eos)
    expected = model.base_model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=eos)
    out = model.generate(ids, max_new_tokens=60, eos_token_id=eos, tree="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.sequences.shape[1] == plen + first + 1 and int(out.sequences[0, -1]) == eos


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_max_new_tokens_inside_accepted_run(fitted, arch):
    model, prompts, seqs = fitted(arch)
    ids, ref = prompts[2], seqs[2]
    plen = ids.shape[1]
    full = model.generate(ids, max_new_tokens=ref.shape[1] - plen, tree=None, return_dict_in_generate=True)
    n = _mid_run_position(full.accepted_lengths) + 1  # stop right inside that step
    out = model.generate(ids, max_new_tokens=n, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref[:, : plen + n])
    assert torch.equal(out.sequences, model.base_model.generate(ids, max_new_tokens=n, do_sample=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_prompt_and_tiny_budgets(arch):
    base = tiny_model(arch, seed=3)
    model = random_heads(base, seed=3)
    ids = torch.tensor([[17]])
    for new in (1, 2, 3, 5):
        assert torch.equal(
            model.generate(ids, max_new_tokens=new), base.generate(ids, max_new_tokens=new, do_sample=False)
        )
    assert torch.equal(model.generate(ids, max_new_tokens=0), ids)


def test_default_max_length_and_eos_from_generation_config():
    base = tiny_model("llama", seed=5)
    model = random_heads(base, seed=5)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    # no max_new_tokens: generate() falls back to generation_config.max_length (20 total)
    assert torch.equal(model.generate(ids), base.generate(ids, do_sample=False))
    eos = int(base.generate(ids, max_new_tokens=5, do_sample=False)[0, -2])
    base.generation_config.eos_token_id = [eos, 2]
    assert torch.equal(model.generate(ids, max_new_tokens=30), base.generate(ids, max_new_tokens=30, do_sample=False))


def test_sliding_window_longer_than_window():
    """Mistral-style sliding attention: the tree mask applies the window exactly like HF's mask."""
    base = tiny_model("mistral", seed=2, sliding_window=8)
    model = random_heads(base, seed=2)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    for tree in ("chain", None):
        assert torch.equal(
            model.generate(ids, max_new_tokens=40, tree=tree), base.generate(ids, max_new_tokens=40, do_sample=False)
        )


def test_mixed_sliding_and_full_layers():
    base = tiny_model("qwen2", seed=4, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert model_has_mixed_layers(base)
    model = random_heads(base, seed=4)
    ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model.generate(ids, max_new_tokens=30), base.generate(ids, max_new_tokens=30, do_sample=False))


def model_has_mixed_layers(base) -> bool:
    from mtp.arch import describe

    return describe(base).mixed_layer_types


def test_speculative_off_is_plain_greedy():
    base = tiny_model("qwen2", seed=6)
    model = random_heads(base)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    out = model.generate(ids, max_new_tokens=25, speculative=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, base.generate(ids, max_new_tokens=25, do_sample=False))
    assert set(out.accepted_lengths) == {1} and set(out.draft_tokens) == {0}


def test_streamer_receives_prompt_then_every_token_in_order(fitted):
    model, prompts, seqs = fitted("llama")
    got: list[list[int]] = []

    class Collect:
        ended = False

        def put(self, value):
            got.append(value.reshape(-1).tolist())

        def end(self):
            Collect.ended = True

    ids, ref = prompts[3], seqs[3]
    model.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1], streamer=Collect())
    assert got[0] == ids[0].tolist()
    assert all(len(chunk) == 1 for chunk in got[1:])  # one token per put: smooth streaming
    assert [t for chunk in got[1:] for t in chunk] == ref[0, ids.shape[1] :].tolist()
    assert Collect.ended


def test_bad_inputs_raise_clear_errors():
    base = tiny_model("llama")
    model = MTPModel.from_base(base, num_heads=2)
    ids = torch.randint(3, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="batch size 2"):
        model.generate(ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="padding"):
        model.generate(ids[:1], attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        model.generate(ids[:1, :0], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the 2 heads"):
        model.generate(ids[:1], max_new_tokens=4, tree=[(0,), (0, 0), (0, 0, 0)])
    with pytest.raises(ValueError, match="no parent"):
        model.generate(ids[:1], max_new_tokens=4, tree=[(0, 1)])
    with pytest.raises(ValueError, match="unknown tree"):
        model.generate(ids[:1], max_new_tokens=4, tree="bushy")
    base.generation_config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(ids[:1], max_new_tokens=4)


def test_prompt_beyond_learned_positions_is_refused():
    base = tiny_model("gpt2")
    model = random_heads(base)
    ids = torch.randint(3, VOCAB, (1, 250))
    with pytest.raises(ValueError, match="256 positions"):
        model.generate(ids, max_new_tokens=10)
    # right at the limit it works and stays exact (the tree is cut so positions stay in range)
    out = model.generate(ids, max_new_tokens=6)
    assert torch.equal(out, base.generate(ids, max_new_tokens=6, do_sample=False))


def test_heads_follow_base_dtype_and_forward_shapes():
    base = tiny_model("llama").to(torch.bfloat16)
    model = MTPModel.from_base(base, num_heads=3, num_layers=2)
    assert all(p.dtype == torch.bfloat16 for p in model.heads.parameters())
    out = model(torch.randint(3, VOCAB, (2, 7)))
    assert out.logits.shape == (2, 7, VOCAB)
    assert out.head_logits.shape == (3, 2, 7, VOCAB)
    # zero-initialised residual blocks: every fresh head equals the base head
    assert torch.equal(out.head_logits[0], out.logits)
    assert isinstance(model.default_tree, Tree) and model.default_tree.depth <= 3
