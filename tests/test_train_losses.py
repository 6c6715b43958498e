"""The chunked training loss against plain autograd, and the training module against `medusa_loss`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from mtp import MTPModel
from mtp.train.config import LossSection
from mtp.train.losses import checkpointed_cross_entropy, linear_cross_entropy, medusa_loss
from mtp.train.objective import MTPTrainModule


def _reference(x, W, b, y, rw, tx, sw):
    """Unchunked soft cross-entropy with ordinary autograd."""
    logits = x @ W.T + (b if b is not None else 0)
    logp = torch.log_softmax(logits, -1)
    target = F.one_hot(y, W.shape[0]).float() * (1 - sw)
    if tx is not None:
        target = target + sw * torch.softmax(tx @ W.detach().T + (b.detach() if b is not None else 0), -1)
    return (-(target * logp).sum(-1) * rw).sum()


@pytest.mark.parametrize("soft_weight", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_fused_loss_matches_autograd(soft_weight, chunk):
    g = torch.Generator().manual_seed(0)
    N, d, V = 23, 8, 40
    x = torch.randn(N, d, generator=g, requires_grad=True)
    W = torch.randn(V, d, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    rw = torch.rand(N, generator=g)
    tx = torch.randn(N, d, generator=g) if soft_weight else None

    ref = _reference(x, W, b, y, rw, tx, soft_weight)
    ref_grads = torch.autograd.grad(ref, (x, W, b))
    loss, rows = linear_cross_entropy(x, W, y, rw, bias=b, teacher_x=tx, soft_weight=soft_weight, chunk_size=chunk)
    grads = torch.autograd.grad(loss * 2.0, (x, W, b))  # a non-unit upstream gradient must scale through
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, 2.0 * want, rtol=1e-4, atol=1e-5)
    assert rows.shape == (N,) and not rows.requires_grad

    lin = torch.nn.Linear(d, V)
    with torch.no_grad():
        lin.weight.copy_(W)
        lin.bias.copy_(b)
    ck, _ = checkpointed_cross_entropy(x, lin, y, rw, teacher_x=tx, soft_weight=soft_weight, chunk_size=chunk)
    torch.testing.assert_close(ck, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(ck, x)[0], ref_grads[0], rtol=1e-4, atol=1e-5)


def test_fused_loss_skips_gradients_under_no_grad():
    x = torch.randn(5, 4, requires_grad=True)
    W = torch.randn(9, 4)
    with torch.no_grad():
        loss, _ = linear_cross_entropy(x, W, torch.zeros(5, dtype=torch.long), torch.ones(5))
    assert not loss.requires_grad


@pytest.mark.parametrize("impl", ["fused", "checkpoint"])
def test_training_module_equals_medusa_loss(impl):
    """Heads-only loss of the chunked module == the reference `medusa_loss` on full head logits."""
    base = tiny_model("llama", seed=3)
    model = MTPModel.from_base(base, num_heads=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(3, 256, (2, 17), generator=g)
    ref, per_head = medusa_loss(model(ids).head_logits, ids, decay=0.8)

    module = MTPTrainModule(base, model.heads, LossSection(decay=0.8, chunk_size=5, impl=impl))
    out = module(ids)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.head_ce, torch.tensor(per_head), rtol=1e-5, atol=1e-5)
    # the gradient reaches the heads, and only the heads (the backbone is frozen in Medusa-1)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters() if p.dim() == 2)


def test_loss_mask_drops_rows():
    """Masked targets do not count: with a mask keeping only the second half, the loss equals that half's."""
    base = tiny_model("qwen2", seed=2)
    model = MTPModel.from_base(base, num_heads=2)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 10:] = True
    module = MTPTrainModule(base, model.heads, LossSection(decay=1.0))
    masked = module(ids, mask).loss
    ref, _ = medusa_loss(model(ids).head_logits, ids, decay=1.0, loss_mask=mask.long())
    torch.testing.assert_close(masked, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked, module(ids).loss)


def test_batch_without_targets_still_backpropagates():
    """A block with no target tokens (all masked) gives a zero loss that is still attached to the heads."""
    base = tiny_model("llama", seed=0)
    model = MTPModel.from_base(base, num_heads=2)
    ids = torch.randint(3, 256, (2, 12))
    out = MTPTrainModule(base, model.heads, LossSection())(ids, torch.zeros_like(ids, dtype=torch.bool))
    assert float(out.loss.detach()) == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.heads.parameters())
    assert torch.isnan(out.head_ce).all()
