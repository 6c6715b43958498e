"""Decoding from prepacked weights (`MTPModel.pack_decoding`, `mtp.packed`): the same tokens as `generate()`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, assert_decodes_like_generate, same_or_near_tie, tiny_model
from test_mtp_modules import fit
from torch import nn
from torch.nn import functional as F

from mtp import MTPModel, bf16_avx2, packed
from mtp.draft_vocab import DraftProjection
from mtp.packed import PackedLinear, bf16_matmul_units, can_pack, packed_copy

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="packed weights need torch built with oneDNN (mkldnn)"
)
BF16 = bf16_matmul_units()


def _counting_packed(monkeypatch) -> list[int]:
    """Rows of every PackedLinear call."""
    calls: list[int] = []
    forward = PackedLinear.forward

    def counted(self, x):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_the_linear(dtype):
    if dtype == torch.bfloat16 and not BF16:
        pytest.skip("this CPU has no oneDNN bf16 support (test_bf16_upcast_* cover bf16 here)")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    for rows in (1, 9, 33):
        x = torch.randn(1, rows, 64, generator=g).to(dtype)
        for b in (None, bias):
            got, want = PackedLinear(weight, b)(x), F.linear(x, weight, b)
            assert got.shape == want.shape and got.dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(got, want)  # the same oneDNN kernel, so the same bits
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("units", [True, False])
def test_bf16_weights_are_upcast_exactly_where_the_cpu_has_no_bf16_units(monkeypatch, units):
    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: units)
    assert packed.upcasts(torch.bfloat16) is not units and not packed.upcasts(torch.float32)
    base = tiny_model("llama").to(torch.bfloat16)
    assert packed.unpackable_reason(base) is None  # bf16 packs everywhere, as fp32 copies where it must
    if units and not BF16:
        return  # packing bf16 in oneDNN's bf16 layout needs the units themselves
    layers = [m for m in packed_copy(base).modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.upcast is not units for m in layers)


@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_upcast_decoding_matches_bf16_generate_with_most_drafts_accepted(fitted, monkeypatch, kernel):
    """bf16 on a CPU without bf16 matmul units: verify steps multiply in fp32 (through the AVX2 kernel or from
    fp32 copies), and output stays the bf16 base's own `generate()` (identical here; a difference would have to
    sit at a near-tie, where bf16's own kernels already disagree with each other)."""
    if kernel and not bf16_avx2.available():
        pytest.skip("the AVX2 kernel needs a CPU that runs torch's AVX2 kernels and a C++ compiler (apt install g++)")
    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: False)
    monkeypatch.setattr(packed, "bf16_kernel", lambda: kernel)
    fitted_model, prompts, _ = fitted("llama")
    model = copy.deepcopy(fitted_model).to(torch.bfloat16).pack_decoding()
    base = model.base_model
    layers = [m for m in model._packed[0].modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.upcast and (m.blocked is not None) == kernel for m in layers)
    drafter = [m for m in model._packed[1].modules() if isinstance(m, PackedLinear)]
    assert all(m.own_one_row for m in layers) and drafter and not any(m.own_one_row for m in drafter)
    calls = _counting_packed(monkeypatch)
    taus = []
    for ids in prompts:
        ref = base.generate(ids, max_new_tokens=40, do_sample=False)
        for tree in ("chain", None):
            out = model.generate(ids, max_new_tokens=40, tree=tree, return_dict_in_generate=True)
            taus.append(out.tau)
            same_or_near_tie(base, ref, out.sequences, ids.shape[1])
    assert calls and max(calls) > 2  # tree steps ran in fp32
    assert min(taus) > 2.0, taus


def test_packed_copy_shares_every_tensor_and_leaves_the_original_alone():
    base = tiny_model("llama")
    params = {id(p) for p in base.parameters()}
    packed = packed_copy(base)
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert sum(type(m) is PackedLinear for m in packed.modules()) == 2 * 7 + 1  # 2 layers x 7, lm_head
    assert all(id(p) in params for p in packed.parameters())  # no second copy of the model's own tensors
    assert sum(type(m) is nn.Linear for m in base.modules()) == 15  # the original is untouched
    ids = torch.randint(3, VOCAB, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)


def test_packed_draft_projection_keeps_its_rows_and_full_width():
    base = tiny_model("llama")
    proj = DraftProjection(base.lm_head, torch.tensor([2, 5, 7, 40]))
    packed = proj.to_packed()
    assert proj.packed is None and isinstance(packed.packed, PackedLinear)
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed(x), proj(x), rtol=1e-5, atol=1e-5)
    assert torch.isinf(packed(x)[:, 3]).all()  # outside the draft vocabulary


def test_unsupported_models_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="cannot pack weights here: the weights are torch.float16"):
        packed_copy(tiny_model("llama").to(torch.float16))
    assert not can_pack(tiny_model("llama").to(torch.float16))


def test_packed_decoding_matches_generate_with_most_drafts_accepted(fitted, monkeypatch):
    fitted_model, prompts, seqs = fitted("llama")
    model = copy.copy(fitted_model).pack_decoding()  # the shared fixture stays unpacked
    assert model.packed and not fitted_model.packed
    calls = _counting_packed(monkeypatch)
    assert_decodes_like_generate(model, prompts, seqs, torch.Generator().manual_seed(9))
    assert calls and max(calls) > 2  # prompt and tree steps ran from packed weights


@pytest.mark.parametrize("head_type", ["mtp", "eagle"])
def test_mtp_modules_and_eagle_drafters_pack_too(head_type, monkeypatch):
    """Their own layers and the draft vocabulary's projection run packed; output stays generate()'s."""
    base = tiny_model("llama", seed=1)
    base.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (4, 9)]
    seqs = [base.generate(p, max_new_tokens=40, do_sample=False) for p in prompts]
    kwargs = {"draft_vocab_size": VOCAB} if head_type == "eagle" else {}
    model = MTPModel.from_base(base, num_heads=3, head_type=head_type, **kwargs)
    if head_type == "mtp":
        model = fit(model, seqs, steps=60, lr=3e-3)
        model.set_draft_vocab(torch.arange(VOCAB // 2, VOCAB))  # drafts outside it are simply not made
    model.pack_decoding()
    heads = model._packed[1]
    assert not any(type(m) is nn.Linear for m in heads.modules())
    calls = _counting_packed(monkeypatch)
    taus = []
    for ids, ref in zip(prompts, seqs, strict=True):
        out = model.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1], return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        taus.append(out.tau)
    assert calls
    if head_type == "mtp":
        assert max(taus) > 1.3, taus  # fitted modules still draft through the packed projection


def test_batched_decoding_from_packed_weights_matches_each_request_alone(monkeypatch):
    """The server's engine decodes from the packed base too; every row is still its own `generate()`."""
    from test_batching import CHEAP_TREES, fitted_model, run, solo

    from mtp.batching import BatchDecoder

    fitted_model_, train = fitted_model("llama")
    model = copy.copy(fitted_model_).pack_decoding()
    calls = _counting_packed(monkeypatch)
    g = torch.Generator().manual_seed(6)
    prompts = train + [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 11)]
    max_new = [30, 22, 41, 17, 28, 35]
    engine = BatchDecoder(model, guard=False, max_batch_size=4, cost=CHEAP_TREES)
    assert engine.base is model.decoding_base
    outs, finish = run(engine, prompts, max_new, join_at=[0, 0, 1, 4, 4, 9])
    for p, m, o in zip(prompts, max_new, outs, strict=True):
        assert o == solo(fitted_model_, p, m), p
    assert calls and max(calls) > 4  # batched steps ran from packed weights
    taus = [sum(f.accepted_lengths) / len(f.accepted_lengths) for f in (finish[i] for i in range(len(train)))]
    assert min(taus) > 1.8, taus
