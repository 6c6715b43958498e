"""DeepSeek-style sequential MTP modules (head_type="mtp"): exactness, draft cache reuse, checkpoints.

Correctness of the output never depends on the drafter (verification guarantees it), so besides the
usual identity / distribution tests this file checks the drafter itself: drafts computed with the
modules' reused KV caches equal drafts computed from scratch by the parallel (training) forward.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_sampling import NEW, PROMPT, TREE, V, chi2_pvalue, draw, exact_joint

from mtp import MTPModel, Tree, chain
from mtp.config import CONFIG_NAME
from mtp.heads import build_heads
from mtp.mtp_modules import MTPModules
from mtp.proposer import MTPProposer
from mtp.train.losses import medusa_loss

SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]


def mtp_model(base, num_heads: int = 3, seed: int = 0, scale: float = 0.05) -> MTPModel:
    """MTP modules (initialised from the base's last layer), perturbed so drafts are often wrong."""
    model = MTPModel.from_base(base, num_heads=num_heads, head_type="mtp")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def fit(model: MTPModel, seqs: torch.Tensor | list[torch.Tensor], steps: int, lr: float) -> MTPModel:
    for p in model.base_model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.heads.parameters(), lr=lr)
    for _ in range(steps):
        for s in seqs if isinstance(seqs, list) else [seqs]:
            loss, _ = medusa_loss(model(s).head_logits, s)
            loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


# ---- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
@pytest.mark.parametrize("tree", ["chain", SMALL_TREE], ids=["chain", "tree"])
def test_greedy_output_matches_generate(arch, tree):
    base = tiny_model(arch)
    model = mtp_model(base, seed=7)
    g = torch.Generator().manual_seed(len(arch))
    for plen, new in ((1, 30), (int(torch.randint(2, 16, (1,), generator=g)), 40)):
        ids = torch.randint(3, VOCAB, (1, plen), generator=g)
        ref = base.generate(ids, max_new_tokens=new, do_sample=False)
        out = model.generate(ids, max_new_tokens=new, tree=tree, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (arch, plen)
        assert 1 + sum(out.accepted_lengths) == out.num_new_tokens


def test_accurate_modules_accept_most_drafts():
    """Modules fitted on the base's own continuations: τ > 2 for chain and tree, output unchanged."""
    base = tiny_model("llama", seed=1)
    base.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (1, 4, 7, 12)]
    seqs = [base.generate(p, max_new_tokens=60, do_sample=False) for p in prompts]
    model = fit(MTPModel.from_base(base, num_heads=3, head_type="mtp"), seqs, steps=60, lr=3e-3)
    for tree in ("chain", "default", None):
        taus = []
        for ids, ref in zip(prompts, seqs, strict=True):
            out = model.generate(
                ids, max_new_tokens=ref.shape[1] - ids.shape[1], tree=tree, return_dict_in_generate=True
            )
            assert torch.equal(out.sequences, ref)
            taus.append(out.tau)
        print(f"fitted MTP modules, {tree or 'auto'}: tau {[round(t, 2) for t in taus]}")
        # The adaptive policy (None) prices each drafted depth as measured; in a model this small one module costs
        # a large share of a verify forward, so it may pick shallow trees: it must still draft, not stay plain.
        assert min(taus) > (2.0 if tree else 1.3), taus


@pytest.fixture(scope="module")
def peaked_mtp():
    """test_sampling's sharpened vocab-8 Llama, with MTP modules fitted on its own samples."""
    base = tiny_model("llama", seed=8, vocab_size=V)
    base.generation_config.eos_token_id = None
    with torch.no_grad():
        base.lm_head.weight.mul_(15.0)
    torch.manual_seed(8)
    ids = PROMPT.repeat(256, 1)
    seqs = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=8)
    return fit(MTPModel.from_base(base, num_heads=2, head_type="mtp"), seqs, steps=60, lr=1e-2)


@pytest.mark.parametrize("tree", ["chain", TREE], ids=["chain", "tree"])
def test_sampling_matches_generate_distribution(peaked_mtp, tree):
    """Lossless: q depends on the drafted path (per-parent q), and the samples still follow p exactly."""
    joint = exact_joint(peaked_mtp.base_model, temperature=1.0)
    samples, acc_per_step = draw(peaked_mtp, 1200, seed=2, tree=tree, temperature=1.0)
    pvalue, tv = chi2_pvalue(samples, joint)
    print(f"MTP {tree}: p-value {pvalue:.3f}, TV {tv:.3f}, accepted drafts/step {acc_per_step:.2f}")
    assert pvalue > 0.001, (pvalue, tv)
    assert acc_per_step > 0.5
    assert all(len(s) == NEW for s in samples)


def test_sampled_drafts_return_per_parent_q(peaked_mtp):
    proposer = peaked_mtp.make_proposer()
    tree = Tree(TREE)
    with torch.no_grad():
        out = peaked_mtp.base_model(PROMPT, output_hidden_states=True)
        proposer.begin(out.hidden_states[-1][0], PROMPT[0])
        draft, q = proposer.propose_sampled(
            3, tree, lambda x: torch.softmax(x.float(), -1), torch.Generator().manual_seed(0)
        )
    assert q.shape == (len(tree), V) and draft.shape == (len(tree),)
    for node in range(len(tree)):
        assert (q[node].sum() - 1).abs() < 1e-5 if tree.children[node] else q[node].abs().sum() == 0
    assert not torch.allclose(q[1], q[2])  # the depth-2 q differs with the drafted depth-1 token


# ---- the drafter: cache reuse equals recomputation ----------------------------------------------


def scratch_logits(heads: MTPModules, lm_head, hidden: torch.Tensor, tokens: list[int], depth: int) -> torch.Tensor:
    """Module `depth+1` at the last hidden position, by the parallel forward over the whole sequence."""
    ids = torch.tensor(tokens)[None]
    feats = heads.head_hidden(hidden[None], num_heads=depth + 1, input_ids=ids)
    return lm_head(feats[depth, 0, hidden.shape[0] - 1])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_cached_drafts_equal_drafts_from_scratch(arch):
    """Steps with changing trees (deeper and shallower than before) and random acceptance lengths."""
    base = tiny_model(arch, seed=2)
    model = mtp_model(base, num_heads=3, seed=3)
    lm_head = base.get_output_embeddings()
    seq = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = base(seq, output_hidden_states=True).hidden_states[-1][0]  # what the decoder observes
    proposer = model.make_proposer()
    assert isinstance(proposer, MTPProposer)
    trees = [chain(3), Tree(SMALL_TREE), chain(1), Tree([(0,), (0, 0)]), Tree(SMALL_TREE), chain(3)]
    g = torch.Generator().manual_seed(5)
    n = 2  # a 2-token prompt: modules 2 and 3 start with positions before the sequence start
    checked = 0
    with torch.inference_mode():
        proposer.begin(hidden[:n], seq[0, :n])
        for step in range(12):
            tree = trees[step % len(trees)]
            root = int(seq[0, n])
            draft = proposer.propose(root, tree).tolist()
            for node in range(len(tree)):
                if not tree.children[node]:
                    continue
                path, j = [], node
                while j > 0:
                    path.append(draft[j])
                    j = tree.parents[j]
                tokens = seq[0, : n + 1].tolist() + path[::-1]
                ref = scratch_logits(model.heads, lm_head, hidden[:n], tokens, tree.depths[node])
                torch.testing.assert_close(proposer.draft_logits[node], ref, rtol=1e-4, atol=1e-5)
                top = ref.topk(1 + max(tree.ranks[c] for c in tree.children[node])).indices
                assert [draft[c] for c in tree.children[node]] == [int(top[tree.ranks[c]]) for c in tree.children[node]]
                checked += 1
            accepted = int(torch.randint(0, tree.depth + 1, (1,), generator=g))  # root + `accepted` nodes
            proposer.observe(hidden[n : n + accepted + 1], seq[0, n : n + accepted + 1])
            n += accepted + 1
    assert checked > 20
    # only committed positions stay cached: module k covers the positions whose token k ahead is known
    assert [c.get_seq_length() for c in proposer.caches] == proposer.committed


# ---- construction, training forward, checkpoints -------------------------------------------------


def test_modules_share_base_parts_and_follow_dtype():
    base = tiny_model("llama").to(torch.bfloat16)
    model = MTPModel.from_base(base, num_heads=2, head_type="mtp")
    heads = model.heads
    assert all(p.dtype == torch.bfloat16 for p in heads.parameters())
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    assert not base_ptrs & {p.data_ptr() for p in heads.parameters()}  # nothing of the base is owned
    assert all(k.startswith("depths.") for k in heads.state_dict())
    # the block is the base's own layer class, initialised from its last layer
    last = base.model.layers[-1]
    assert type(heads.depths[0].blocks[0]) is type(last)
    assert torch.equal(heads.depths[1].blocks[0].mlp.up_proj.weight, last.mlp.up_proj.weight)
    out = model(torch.randint(3, VOCAB, (2, 7)))
    assert out.head_logits.shape == (2, 2, 7, VOCAB)
    heads.float()  # what the trainer does (fp32 master weights): the base stays untouched
    assert next(base.parameters()).dtype == torch.bfloat16


def test_training_forward_is_per_sequence_and_causal():
    base = tiny_model("qwen2")
    model = mtp_model(base, num_heads=3)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both = model(ids).head_logits
        one = model(ids[1:]).head_logits
        prefix = model(ids[1:, :7]).head_logits
    torch.testing.assert_close(both[:, 1], one[:, 0], rtol=1e-4, atol=1e-5)
    # module k at position t only sees tokens up to t+k: a shorter sequence gives the same values there
    for k in range(3):
        torch.testing.assert_close(prefix[k, 0, : 7 - k - 1], one[k, 0, : 7 - k - 1], rtol=1e-4, atol=1e-5)


def test_trainer_objective_trains_only_the_modules():
    from mtp.train.config import LossSection
    from mtp.train.objective import MTPTrainModule

    base = tiny_model("llama")
    model = MTPModel.from_base(base, num_heads=2, head_type="mtp")
    for p in base.parameters():
        p.requires_grad_(False)
    module = MTPTrainModule(base, model.heads, LossSection())
    ids = torch.randint(3, VOCAB, (2, 12))
    out = module(ids)
    out.loss.backward()
    assert torch.isfinite(out.head_ce).all() and out.head_ce.shape == (2,)
    assert all(p.grad is not None for p in model.heads.parameters())
    assert all(p.grad is None for p in base.parameters())


def _same_drafts(a: MTPModel, b: MTPModel) -> None:
    """The reloaded model has the very same weights and decodes the very same tokens.

    Its draft logits agree to float rounding, not bit for bit: transformers (>= 5.25) leaves loaded
    safetensors weights at 8-byte- instead of 64-byte-aligned addresses, and the CPU GEMM takes another
    reduction order for unaligned operands (a 64-byte-aligned copy of the same weight gives the original
    bits back). So the promise checked here is: identical weights, identical greedy tokens and drafts.
    """
    for name, sd_a, sd_b in (
        ("base", a.base_model.state_dict(), b.base_model.state_dict()),
        ("heads", a.heads.state_dict(), b.heads.state_dict()),
    ):
        assert sd_a.keys() == sd_b.keys(), name
        assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a), f"{name} weights changed in the round trip"
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    for tree in ("chain", SMALL_TREE):
        ra = a.generate(ids, max_new_tokens=24, tree=tree, return_dict_in_generate=True)
        rb = b.generate(ids, max_new_tokens=24, tree=tree, return_dict_in_generate=True)
        assert torch.equal(ra.sequences, rb.sequences)
        assert ra.accepted_lengths == rb.accepted_lengths
    pa, pb = a.make_proposer(), b.make_proposer()
    with torch.inference_mode():
        hidden = a.base_model(ids, output_hidden_states=True).hidden_states[-1][0]
        for p in (pa, pb):
            p.begin(hidden, ids[0])
        assert torch.equal(pa.propose(9, Tree(SMALL_TREE)), pb.propose(9, Tree(SMALL_TREE)))
    for node, logits in pa.draft_logits.items():
        torch.testing.assert_close(logits, pb.draft_logits[node], rtol=1e-5, atol=1e-6)


def test_save_load_round_trips(tmp_path):
    model = mtp_model(tiny_model("gpt2", seed=11), num_heads=3, seed=11)
    full, heads_dir, base_dir = tmp_path / "full", tmp_path / "heads", tmp_path / "base"
    model.save_pretrained(full)
    cfg = json.loads((full / CONFIG_NAME).read_text())
    assert cfg["head_type"] == "mtp" and cfg["num_heads"] == 3 and cfg["head_kwargs"] == {"num_layers": 1}
    loaded = MTPModel.from_pretrained(full)
    assert isinstance(loaded.heads, MTPModules)
    _same_drafts(model, loaded)

    model.base_model.save_pretrained(base_dir)
    model.config.base_model_name_or_path = str(base_dir)
    model.save_pretrained(heads_dir, heads_only=True)
    assert not (heads_dir / "model.safetensors").exists()
    _same_drafts(model, MTPModel.from_pretrained(heads_dir))
    again = tmp_path / "again"  # reload -> save -> reload keeps the very same tensors
    MTPModel.from_pretrained(heads_dir).save_pretrained(again, heads_only=True)
    sd_a, sd_b = model.heads.state_dict(), MTPModel.from_pretrained(again).heads.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def test_hidden_size_mismatch_is_a_clear_error(tmp_path):
    base = tiny_model("llama")
    with pytest.raises(ValueError, match="hidden size 32 cannot run on this base"):
        build_heads("mtp", base_model=base, hidden_size=32, vocab_size=VOCAB, num_heads=2)
    with pytest.raises(ValueError, match="base_model="):
        build_heads("mtp", hidden_size=64, vocab_size=VOCAB, num_heads=2)
    with pytest.raises(ValueError, match="own_lm_head"):
        MTPModel.from_base(base, num_heads=2, head_type="mtp", own_lm_head=True)
    model = MTPModel.from_base(base, num_heads=2, head_type="mtp")
    model.save_pretrained(tmp_path, heads_only=True)
    other = tiny_model("llama", hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden size 64"):
        MTPModel.from_pretrained(tmp_path, base_model=other)
