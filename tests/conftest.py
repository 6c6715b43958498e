"""Tiny random-config models of several architectures, and heads fitted to be accurate.

Random models are deterministic given the seed; fitted heads are cached per architecture for the
whole session because fitting takes a few seconds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mtp import MTPModel
from mtp.train.losses import medusa_loss

torch.set_num_threads(1)  # tiny models: a second thread only adds sync overhead

VOCAB = 256
ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt2":
        cfg = GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, n_positions=256), **common, **overrides})
        model = GPT2LMHeadModel(cfg)
    else:
        llama_like = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
        cls = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
        }[arch]
        model = cls[1](cls[0](**{**llama_like, **common, **overrides}))
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_heads(base, num_heads: int = 4, seed: int = 0, scale: float = 0.5) -> MTPModel:
    """Heads with random weights: drafts that are sometimes right, mostly wrong."""
    model = MTPModel.from_base(base, num_heads=num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def fit_heads(
    base, prompts: list[torch.Tensor], num_new: int = 60, steps: int = 300, num_heads: int = 4
) -> tuple[MTPModel, list[torch.Tensor]]:
    """Fit heads on the base model's own greedy continuations of `prompts` (self-distillation).

    Returns the model and the reference sequences (prompt + greedy continuation) it was fitted on.
    """
    torch.manual_seed(0)
    base.generation_config.eos_token_id = None
    seqs = [base.generate(p, max_new_tokens=num_new, do_sample=False) for p in prompts]
    model = MTPModel.from_base(base, num_heads=num_heads)
    for p in base.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.heads.parameters(), lr=1e-2)
    for _ in range(steps):
        for s in seqs:
            loss, _ = medusa_loss(model(s).head_logits, s)
            loss.backward()
        opt.step()
        opt.zero_grad()
    return model, seqs


def same_or_near_tie(base, ref: torch.Tensor, got: torch.Tensor, prompt_len: int) -> bool:
    """Whether half-precision `got` is `ref` (the base's own greedy `generate()`) token for token; where it parts,
    it must do so at a near-tie: the base's top-2 logit margin there within two bf16 ulps of its top logit."""
    from mtp.bench.run import first_difference, top2_margin

    i = first_difference(ref, got, prompt_len)
    if i is None:
        return True
    with torch.no_grad():
        logits = base(ref[:, : prompt_len + i]).logits[0, -1]
    margin, top = top2_margin(logits), float(logits.float().max().abs())
    assert margin <= 2 * 2.0**-7 * top, (i, margin)  # two bf16 ulps
    return False


def assert_decodes_like_generate(
    model: MTPModel, prompts: list[torch.Tensor], seqs: list[torch.Tensor], g: torch.Generator
) -> None:
    """Greedy `model.generate()` gives its base's `generate()` tokens, for any decoding runtime.

    On the continuations the heads were fitted to (chain and adaptive trees) most drafts must be accepted; on
    new prompts drafts are rejected, the cache is cropped mid-way and one-token steps run.
    """
    for ids, ref in zip(prompts, seqs, strict=True):
        for tree in ("chain", None):
            new = ref.shape[1] - ids.shape[1]
            out = model.generate(ids, max_new_tokens=new, tree=tree, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), tree
            if ids.shape[1] > 1:  # a one-token prompt gives the heads nothing to draft from at first
                assert out.tau > 2.0, (tree, out.accepted_lengths)
    base = model.base_model
    for plen, new in ((5, 30), (17, 25)):
        ids = torch.randint(3, VOCAB, (1, plen), generator=g)
        ref = base.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=new), ref)
        assert torch.equal(model.generate(ids, max_new_tokens=new, speculative=False), ref)


_FITTED: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def fitted():
    """fitted(arch) -> (model, prompts, reference sequences) with accurate heads; cached."""

    def get(arch: str):
        if arch not in _FITTED:
            base = tiny_model(arch, seed=1)
            g = torch.Generator().manual_seed(123)
            prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (1, 4, 7, 12)]
            model, seqs = fit_heads(base, prompts)
            _FITTED[arch] = (model, prompts, seqs)
        return _FITTED[arch]

    return get
