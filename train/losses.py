"""Head losses and accuracies: the quantities Medusa training optimises and reports.

Head k (0-based) at position t guesses token t+k+2 (the base lm_head guesses t+1), so its targets
are the input shifted by k+2. Loss = sum_k weight_k * CE_k with weight_k = decay**k (Medusa's λ^k).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def head_targets(input_ids: torch.Tensor, k: int, T: int) -> tuple[slice, torch.Tensor]:
    """Positions of head k that have a target, and those targets. input_ids: (B, T)."""
    shift = k + 2
    return slice(0, max(0, T - shift)), input_ids[:, shift:]


def medusa_loss(
    head_logits: torch.Tensor,
    input_ids: torch.Tensor,
    decay: float = 0.8,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum of per-head cross-entropies.

    head_logits: (K, B, T, V); input_ids: (B, T); loss_mask: (B, T) 1 where a *target* token counts.
    Returns the loss and the per-head CE values (floats, for logging).
    """
    K, _, T, V = head_logits.shape
    total = head_logits.new_zeros((), dtype=torch.float32)
    per_head: list[float] = []
    for k in range(K):
        pos, tgt = head_targets(input_ids, k, T)
        if tgt.shape[1] == 0:
            per_head.append(float("nan"))
            continue
        logits = head_logits[k, :, pos].float().reshape(-1, V)
        ce = F.cross_entropy(logits, tgt.reshape(-1), reduction="none")
        if loss_mask is not None:
            m = loss_mask[:, k + 2 :].reshape(-1).float()
            ce = (ce * m).sum() / m.sum().clamp(min=1)
        else:
            ce = ce.mean()
        total = total + (decay**k) * ce
        per_head.append(float(ce.detach()))
    return total, per_head


@torch.no_grad()
def head_topk_correct(
    head_logits: torch.Tensor, input_ids: torch.Tensor, topk: tuple[int, ...] = (1, 5)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts for accuracy: (K, len(topk)) correct, (K,) totals. Head logits (K, B, T, V)."""
    K, _, T, _ = head_logits.shape
    kmax = max(topk)
    correct = torch.zeros(K, len(topk), dtype=torch.long)
    totals = torch.zeros(K, dtype=torch.long)
    for k in range(K):
        pos, tgt = head_targets(input_ids, k, T)
        if tgt.shape[1] == 0:
            continue
        top = head_logits[k, :, pos].topk(kmax, dim=-1).indices  # (B, T', kmax)
        hit = top == tgt[..., None]
        for j, n in enumerate(topk):
            correct[k, j] += int(hit[..., :n].any(-1).sum())
        totals[k] += tgt.numel()
    return correct, totals


# ---- chunked vocabulary projection + cross-entropy (training at real vocabulary sizes) ---------------
#
# Why: full head logits are (K, B, T, V) floats; for SmolLM2 (V = 49152), K = 4 heads and 4 x 512 tokens
# that is 1.6 GB before the softmax and its gradient. The functions below never hold more than
# `chunk_size` rows of logits. The target of a row is a distribution: a one-hot token, the base model's own
# softmax (self-distillation, computed from its hidden state in the same chunk), or a mix of the two:
#     target = (1 - w) * onehot(y) + w * softmax(teacher_x @ W_t^T)
#     loss   = sum_rows row_weight * (-sum_v target_v * log softmax(x @ W^T)_v)
# which is CE for w = 0 and KL(teacher || model) + H(teacher) for w = 1 (same gradient as KL).


class _FusedLinearCE(torch.autograd.Function):
    """Projection + soft cross-entropy whose gradient is computed chunk by chunk in the forward pass.

    Memory: one (chunk, V) block at a time. Compute: the same three matmuls as the unfused version
    (logits, d/dx, d/dW) with no recomputation, because the gradient of softmax-CE w.r.t. the logits
    (softmax - target) is known as soon as the logits are. Backward only scales the saved gradients, so
    this is one autograd node: DDP and DeepSpeed see a single ordinary backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, targets, row_weight, teacher_x, teacher, soft_weight, chunk, need_grad):
        # x: (N, d); weight: (V, d); targets: (N,) long; row_weight: (N,) float; teacher_x: (N, d) or None
        cdtype = weight.dtype  # matmuls run in the projection's dtype (bf16 on a bf16 backbone)
        w = weight.detach()
        want_x, want_w = need_grad and x.requires_grad, need_grad and weight.requires_grad
        want_b = need_grad and bias is not None and bias.requires_grad
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        row_loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, min(start + chunk, x.shape[0]))
            xc = x[rows].detach().to(cdtype)
            logits = (xc @ w.T).float()  # (n, V)
            if bias is not None:
                logits += bias.detach().float()
            logp = torch.log_softmax(logits, dim=-1)
            target = _target_distribution(targets[rows], logits.shape, teacher_x, teacher, rows, soft_weight)
            losses = -(target * logp).sum(-1)  # (n,)
            row_loss[rows] = losses
            rw = row_weight[rows].float()
            total += (losses * rw).sum()
            if grad_x is None and grad_w is None and grad_b is None:
                continue
            dlogits = logp.exp_().sub_(target).mul_(rw[:, None])  # (n, V): d loss / d logits
            if grad_x is not None:
                grad_x[rows] = (dlogits.to(cdtype) @ w).float()
            if grad_w is not None:
                grad_w += (dlogits.T.to(cdtype) @ xc).float()
            if grad_b is not None:
                grad_b += dlogits.sum(0)
        ctx.save_for_backward(
            grad_x if grad_x is not None else torch.empty(0),
            grad_w if grad_w is not None else torch.empty(0),
            grad_b if grad_b is not None else torch.empty(0),
        )
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.have = (grad_x is not None, grad_w is not None, grad_b is not None)
        ctx.mark_non_differentiable(row_loss)
        return total, row_loss

    @staticmethod
    def backward(ctx, grad_total, _grad_rows):
        gx, gw, gb = ctx.saved_tensors
        have_x, have_w, have_b = ctx.have
        dx, dw, db = ctx.dtypes
        out_x = (gx * grad_total).to(dx) if have_x else None
        out_w = (gw * grad_total).to(dw) if have_w else None
        out_b = (gb * grad_total).to(db) if have_b else None
        return out_x, out_w, out_b, None, None, None, None, None, None, None


def _target_distribution(
    targets: torch.Tensor,
    shape: torch.Size,
    teacher_x: torch.Tensor | None,
    teacher_proj: tuple[torch.Tensor, torch.Tensor | None] | None,
    rows: slice,
    soft_weight: float,
) -> torch.Tensor:
    """(n, V) target probabilities: one-hot, the teacher's softmax, or their mix."""
    onehot = torch.zeros(shape, dtype=torch.float32, device=targets.device)
    onehot.scatter_(1, targets[:, None], 1.0)
    if teacher_x is None or soft_weight == 0.0:
        return onehot
    tw, tb = teacher_proj[0].detach(), teacher_proj[1]
    teacher_logits = (teacher_x[rows].detach().to(tw.dtype) @ tw.T).float()
    if tb is not None:
        teacher_logits += tb.detach().float()
    teacher = torch.softmax(teacher_logits, dim=-1)
    if soft_weight == 1.0:
        return teacher
    return onehot.mul_(1.0 - soft_weight).add_(teacher, alpha=soft_weight)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    teacher_x: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    soft_weight: float = 0.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_rows row_weight * CE(x @ weight^T + bias, target), computed in chunks of rows (fused gradient).

    x: (N, d) features; weight: (V, d) vocab projection; targets: (N,) token ids; row_weight: (N,) per-row
    weights (e.g. decay**k / rows_of_head_k). teacher_x: (N, d) hidden states whose softmax through
    `teacher_weight`/`teacher_bias` (default: `weight`/`bias`) are the soft targets, mixed in with `soft_weight`.
    Returns (weighted loss, per-row losses detached (N,)).
    """
    if x.dim() != 2 or targets.shape != (x.shape[0],) or row_weight.shape != (x.shape[0],):
        raise ValueError(
            f"bad shapes: x {tuple(x.shape)}, targets {tuple(targets.shape)}, rows {tuple(row_weight.shape)}"
        )
    if teacher_x is not None and teacher_weight is None:
        teacher_weight, teacher_bias = weight, bias
    teacher = (teacher_weight, teacher_bias) if teacher_x is not None else None
    need_grad = torch.is_grad_enabled()
    return _FusedLinearCE.apply(
        x, weight, bias, targets, row_weight, teacher_x, teacher, soft_weight, chunk_size, need_grad
    )


def checkpointed_cross_entropy(
    x: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    row_weight: torch.Tensor,
    teacher_x: torch.Tensor | None = None,
    teacher_project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    soft_weight: float = 0.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `linear_cross_entropy`, through ordinary autograd with per-chunk recomputation.

    `project` maps (n, d) features to (n, V) logits (a module or a function). An independent implementation
    of the same math, used to cross-check the fused one; it costs one extra projection per chunk.
    """
    from torch.utils.checkpoint import checkpoint

    teacher_project = teacher_project or project

    def chunk_loss(xc: torch.Tensor, tc: torch.Tensor, yc: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(project(xc).float(), dim=-1)
        target = torch.zeros_like(logp).scatter_(1, yc[:, None], 1.0)
        if tc.numel():
            with torch.no_grad():
                soft = torch.softmax(teacher_project(tc).float(), dim=-1)
            target = target * (1.0 - soft_weight) + soft * soft_weight
        return -(target * logp).sum(-1)

    total = x.new_zeros((), dtype=torch.float32)
    rows_out = []
    empty = x.new_zeros((0,))
    for start in range(0, x.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        tc = teacher_x[rows].detach() if teacher_x is not None and soft_weight > 0 else empty
        losses = checkpoint(chunk_loss, x[rows], tc, targets[rows], row_weight[rows], use_reentrant=False)
        total = total + (losses * row_weight[rows].float()).sum()
        rows_out.append(losses.detach())
    return total, torch.cat(rows_out) if rows_out else x.new_zeros((0,), dtype=torch.float32)
