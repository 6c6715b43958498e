"""Head losses and accuracies: the quantities Medusa training optimises and reports.

Head k (0-based) at position t guesses token t+k+2 (the base lm_head guesses t+1), so its targets
are the input shifted by k+2. Loss = sum_k weight_k * CE_k with weight_k = decay**k (Medusa's λ^k).
"""

from __future__ import annotations

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
