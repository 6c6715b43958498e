"""The bf16 AVX2 kernel (`mtp.bf16_avx2`): fp32 rows times bf16 weights, built at first use."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mtp import bf16_avx2, packed
from mtp.compiled import cpu_compiler
from mtp.packed import PackedLinear

pytestmark = pytest.mark.skipif(
    not (bf16_avx2.cpu_runs_avx2() and cpu_compiler()),
    reason="the kernel needs a CPU that runs torch's AVX2 kernels and a C++ compiler (apt install g++)",
)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The kernel built anew into an empty cache directory (and forgotten again afterwards)."""
    monkeypatch.setenv("MTP_KERNEL_CACHE", str(tmp_path / "cache"))
    bf16_avx2._library.cache_clear()
    yield tmp_path / "cache"
    bf16_avx2._library.cache_clear()


def test_the_kernel_builds_into_its_cache_and_multiplies_like_fp32(fresh_build):
    assert bf16_avx2.available()
    assert [p.suffix for p in fresh_build.iterdir()] == [".so"]  # built once, no temporary left behind
    g = torch.Generator().manual_seed(0)
    for n, k in [(96, 64), (577, 33), (16, 1), (5, 130)]:  # column blocks full, ragged, single, partial
        weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g)
        blocked = bf16_avx2.block_weight(weight)
        assert blocked.shape == (-(-n // 16), k, 16) and blocked.dtype == torch.bfloat16
        for rows in (0, 1, 2, 5, 6, 7, 13):  # every remainder of the kernel's 6-row tiles
            x = torch.randn(2, rows, k, generator=g).to(torch.bfloat16)
            for b in (None, bias):
                got = bf16_avx2.linear(x, blocked, n, b)
                want = F.linear(x.double(), weight.double(), None if b is None else b.double())
                assert got.shape == (2, rows, n) and got.dtype == torch.float32
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)
    with pytest.raises(ValueError, match="does not fit"):
        bf16_avx2.linear(torch.randn(3, 7), bf16_avx2.block_weight(torch.randn(16, 8).bfloat16()), 16)


def test_a_failed_build_falls_back_to_fp32_copies(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", "/bin/false")  # a "compiler" that always fails
    assert not bf16_avx2.available()
    assert not fresh_build.exists() or not any(fresh_build.iterdir())
    layer = PackedLinear(torch.randn(32, 16).to(torch.bfloat16), upcast=True)
    assert layer.blocked is None and layer.packed.dtype == torch.float32
    with pytest.raises(RuntimeError, match="not available"):
        bf16_avx2.linear(torch.randn(2, 16), bf16_avx2.block_weight(torch.randn(32, 16).bfloat16()), 32)


@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_upcast_linear_runs_one_row_in_bf16_and_several_in_fp32(monkeypatch, kernel):
    """Without bf16 matmul units bf16 weights multiply in fp32: one row keeps bf16's own kernel (the bits of a
    plain decode step), several rows are the fp32 product of the same bf16 numbers, rounded to bf16 (from the
    blocked bf16 weight through the kernel, or from an fp32 copy)."""
    monkeypatch.setattr(packed, "bf16_kernel", lambda: kernel)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        layer = PackedLinear(weight, b, upcast=True)
        assert layer.upcast and layer.weight is weight
        assert (layer.blocked is not None) == kernel and (layer.packed is None) == kernel
        for rows in (1, 2, 9, 33):
            x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
            got = layer(x)
            assert got.shape == (1, rows, 96) and got.dtype == torch.bfloat16
            if rows == 1:
                assert torch.equal(got, F.linear(x, weight, b))
            else:
                fp32 = F.linear(x.float(), weight.float(), None if b is None else b.float())
                torch.testing.assert_close(got.float(), fp32, rtol=8e-3, atol=1e-2)  # one bf16 rounding
    assert not PackedLinear(weight.float(), upcast=True).upcast  # fp32 weights are packed as they are
    # a drafter's layer (own_one_row=False) runs one row through the kernel as well, where the kernel runs
    x = torch.randn(1, 1, 64, generator=g).to(torch.bfloat16)
    drafter = PackedLinear(weight, bias, upcast=True, own_one_row=False)
    want = bf16_avx2.linear(x, drafter.blocked, 96, bias.float()).bfloat16() if kernel else F.linear(x, weight, bias)
    assert torch.equal(drafter(x), want)


def test_batched_bf16_rows_through_the_kernel_decode_what_each_decodes_alone(monkeypatch):
    """The batched engine in bf16 on a CPU without bf16 units: every step's rows (several requests' trees, one
    forward) multiply through the kernel. Each greedy row still gets its own bf16 `generate()`'s tokens, or
    parts from them only at a near-tie (two bf16 ulps of the top logit), with most drafts accepted."""
    import copy

    from conftest import same_or_near_tie
    from test_batching import CHEAP_TREES, fitted_model, run

    from mtp.batching import BatchDecoder

    monkeypatch.setattr(packed, "bf16_matmul_units", lambda: False)
    fitted, prompts = fitted_model("llama")
    model = copy.deepcopy(fitted).to(torch.bfloat16).pack_decoding()
    layers = [m for m in model._packed[0].modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.blocked is not None for m in layers)
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    outs, finish = run(engine, prompts, 30)
    base, identical = model.base_model, 0
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        ref = base.generate(ids, max_new_tokens=30, do_sample=False)
        identical += same_or_near_tie(base, ref, torch.tensor([p + out]), len(p))
    assert identical >= len(prompts) - 1
    lengths = [a for u in finish.values() for a in u.accepted_lengths]
    assert sum(lengths) / len(lengths) > 2.0  # most drafts accepted
