"""The training objective: backbone forward, head features, and the chunked Medusa loss.

Medusa-1  the backbone is frozen: its forward runs under `no_grad` in its own dtype (bf16 halves its
          cost), only the heads get gradients, and the base's hidden states double as the teacher for
          soft targets (the base distribution for token t+k+2 is its logits at position t+k+1).
Medusa-2  the backbone carries LoRA adapters. For `warmup_heads_steps` it is treated exactly as in
          Medusa-1 (heads only); then it trains jointly with the base next-token loss kept:
              loss = base_weight * CE_base + heads_weight * sum_k decay^k * CE_k
          The teacher for soft targets is then the *original* model (adapters disabled, no_grad).
Head k (0-based) at position t predicts token t+k+2; its rows are positions 0..T-k-3 of every sequence.
Head logits are never materialised for the whole batch: see `mtp.train.losses.linear_cross_entropy`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import LossSection
from .losses import checkpointed_cross_entropy, linear_cross_entropy


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backprop
    head_ce: torch.Tensor  # (K,) mean per-head loss (detached), nan for a head without rows
    base_ce: torch.Tensor  # () mean base LM loss (nan when not trained)
    tokens: int  # input tokens in the batch


@dataclass
class Rows:
    """Training rows of one projection: features, targets, per-row weights, teacher features."""

    x: torch.Tensor  # (N, d)
    targets: torch.Tensor  # (N,)
    weight: torch.Tensor  # (N,)
    teacher: torch.Tensor | None  # (N, d)
    group: torch.Tensor  # (N,) which loss term (0 = base, k+1 = head k) a row belongs to


class MTPTrainModule(nn.Module):
    """Backbone + heads with a `forward` that returns the loss; what DeepSpeed wraps and DDP ranks run.

    backbone: the HF causal LM (with LoRA layers injected in Medusa-2); peft_model: the PeftModel around it
    (for `disable_adapter`), or None.
    """

    def __init__(self, backbone: nn.Module, heads: nn.Module, loss_cfg: LossSection, peft_model: Any = None):
        super().__init__()
        self.backbone = backbone
        self.heads = heads
        self.loss_cfg = loss_cfg
        self.peft_model = peft_model
        self.impl = loss_cfg.impl
        # Under DeepSpeed ZeRO-3 every module weight is sharded, and the vocab projections read the lm_head
        # weight directly (not through a module call that would gather it). The lm_head is frozen, so the
        # trainer keeps a plain replicated copy here (V x d per rank) instead; elsewhere this stays None.
        self.replicated_lm_head: tuple[torch.Tensor, torch.Tensor | None] | None = None
        params = inspect.signature(backbone.forward).parameters
        self._keep_kwarg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._heads_take_ids = "input_ids" in inspect.signature(heads.head_hidden).parameters
        self._draft_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Score the heads' training loss over these token ids only (`loss.draft_vocab`); None: all.

        The rows of the frozen lm_head are copied once. Evaluation keeps the full vocabulary (`projection`),
        so accuracies stay comparable with heads trained without a draft vocabulary."""
        if token_ids is None:
            self._draft_rows = None
            return
        weight, bias = self.projection(None)
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=weight.device)
        self._draft_rows = (
            weight.detach().index_select(0, ids).contiguous(),
            None if bias is None else bias.detach().index_select(0, ids).contiguous(),
        )

    # ---- pieces ---------------------------------------------------------------------------------------

    @property
    def lm_head(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    def hidden(self, input_ids: torch.Tensor, grad: bool) -> torch.Tensor:
        """Final hidden states (B, T, d), the input of lm_head. The lm_head itself is skipped here."""
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            out = self.backbone(input_ids=input_ids, output_hidden_states=True, use_cache=False, **self._keep_kwarg)
        return out.hidden_states[-1]

    def teacher_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The original model's hidden states (adapters off): the self-distillation teacher in Medusa-2."""
        with torch.no_grad(), self.peft_model.disable_adapter():
            return self.hidden(input_ids, grad=False)

    def head_features(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (K, B, T, d) in the heads' dtype (fp32 master weights)."""
        h = hidden.to(next(self.heads.parameters()).dtype)
        if self._heads_take_ids:
            return self.heads.head_hidden(h, input_ids=input_ids)
        return self.heads.head_hidden(h)

    def projection(self, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight (V, d), bias) of head k's vocabulary projection (k=None: the base lm_head)."""
        own = getattr(self.heads, "lm_heads", None)
        if k is not None and own is not None:
            return own[k].weight, own[k].bias
        if self.replicated_lm_head is not None:
            return self.replicated_lm_head
        return self.lm_head.weight, self.lm_head.bias if isinstance(self.lm_head.bias, torch.Tensor) else None

    # ---- loss ---------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        joint: bool = False,
        hidden: torch.Tensor | None = None,
    ) -> LossOutput:
        """Loss of one micro-batch. joint=False: heads only (Medusa-1, Medusa-2 warm-up).

        hidden: the frozen backbone's final hidden states of `input_ids`, precomputed (a feature cache);
        then the backbone does not run at all."""
        cfg = self.loss_cfg
        if hidden is None:
            hidden = self.hidden(input_ids, grad=joint)
        elif joint:
            raise ValueError("precomputed hidden states are a frozen backbone's: joint training runs the backbone")
        else:
            hidden = hidden.to(self.lm_head.weight.dtype)
        soft = cfg.soft_targets and cfg.soft_weight > 0
        teacher = None
        if soft:
            teacher = self.teacher_hidden(input_ids) if joint and self.peft_model is not None else hidden.detach()
        feats = self.head_features(hidden if joint else hidden.detach(), input_ids)  # (K, B, T, d)
        K = feats.shape[0]
        mask = loss_mask if loss_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        rows = [head_rows(feats[k], input_ids, mask, k, cfg.decay**k * (cfg.heads_weight if joint else 1.0), teacher)
                for k in range(K)]  # fmt: skip
        if joint:
            rows.insert(0, base_rows(hidden, input_ids, mask, cfg.base_weight, teacher))
        total, per_group = self._project_and_score(rows, soft)
        # A batch can have no target rows at all (a block inside a long user prompt with loss_on: assistant).
        # Keep the loss attached to every trainable weight anyway, so each rank produces the same gradients
        # (zeros here) and the cross-rank gradient all-reduce stays in step.
        total = total + 0.0 * feats.sum()
        head_ce = per_group[-K:]
        base_ce = per_group[0] if joint else torch.tensor(float("nan"))
        return LossOutput(loss=total, head_ce=head_ce, base_ce=base_ce, tokens=input_ids.numel())

    def _project_and_score(self, rows: list[Rows], soft: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the chunked CE over every row set; rows sharing the base lm_head go in one call."""
        num_groups = len(rows)
        shared = getattr(self.heads, "lm_heads", None) is None
        batches: list[tuple[int | None, list[int]]] = []  # (projection: None = base lm_head, row groups)
        if shared:
            batches.append((None, list(range(num_groups))))
        else:
            base_first = num_groups - self.heads.num_heads  # 1 when the base rows lead, else 0
            batches += [(None, [0])] if base_first else []
            batches += [(k, [base_first + k]) for k in range(self.heads.num_heads)]
        total = torch.zeros((), dtype=torch.float32, device=rows[0].x.device)
        sums = torch.zeros(num_groups, dtype=torch.float64)
        counts = torch.zeros(num_groups, dtype=torch.float64)
        for proj, groups in batches:  # proj: head index or None (base lm_head)
            x = torch.cat([rows[g].x for g in groups])
            if x.shape[0] == 0:
                continue
            y = torch.cat([rows[g].targets for g in groups])
            w = torch.cat([rows[g].weight for g in groups])
            gid = torch.cat([torch.full_like(rows[g].targets, g) for g in groups])
            t = torch.cat([rows[g].teacher for g in groups]) if soft else None
            loss, per_row = self._ce(proj, x, y, w, t)
            total = total + loss
            sums.index_add_(0, gid.cpu(), per_row.detach().double().cpu())
            counts.index_add_(0, gid.cpu(), torch.ones_like(per_row, dtype=torch.float64).cpu())
        return total, (sums / counts).float()

    def _ce(self, k: int | None, x, y, w, teacher) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.loss_cfg
        sw = cfg.soft_weight if teacher is not None else 0.0
        weight, bias = self.projection(k)
        teacher_weight, teacher_bias = self.projection(None)
        if self._draft_rows is not None:  # the config check guarantees sw == 1: y is never read
            weight, bias = teacher_weight, teacher_bias = self._draft_rows
            y = torch.zeros_like(y)
        if self.impl == "checkpoint":
            project = lambda z: nn.functional.linear(z, weight, bias)  # noqa: E731
            teacher_project = lambda z: nn.functional.linear(z, teacher_weight, teacher_bias)  # noqa: E731
            return checkpointed_cross_entropy(x, project, y, w, teacher_x=teacher, teacher_project=teacher_project,
                                              soft_weight=sw, chunk_size=cfg.chunk_size)  # fmt: skip
        return linear_cross_entropy(
            x, weight, y, w, bias=bias, teacher_x=teacher, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
            soft_weight=sw, chunk_size=cfg.chunk_size,
        )  # fmt: skip


def head_rows(
    feats: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, k: int, scale: float, teacher: torch.Tensor | None
) -> Rows:
    """Rows of head k: features at t, target token t+k+2, teacher state at t+k+1; weight scale / #rows.

    E.g. T = 6, k = 1: positions 0..2 predict tokens 3..5 and take the teacher from positions 2..4.
    """
    shift = k + 2
    T, d = input_ids.shape[1], feats.shape[-1]
    keep = mask[:, shift:].reshape(-1)  # (B*(T-shift),)
    x = feats[:, : T - shift].reshape(-1, d)[keep]
    targets = input_ids[:, shift:].reshape(-1)[keep]
    t = teacher[:, shift - 1 : T - 1].reshape(-1, teacher.shape[-1])[keep] if teacher is not None else None
    n = max(int(keep.sum()), 1)
    weight = torch.full((x.shape[0],), scale / n, device=x.device)
    return Rows(x, targets, weight, t, torch.full_like(targets, k + 1))


def base_rows(
    hidden: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, scale: float, teacher: torch.Tensor | None
) -> Rows:
    """Rows of the base next-token loss (Medusa-2): hidden at t, target t+1, teacher at t."""
    T, d = input_ids.shape[1], hidden.shape[-1]
    keep = mask[:, 1:].reshape(-1)
    x = hidden[:, : T - 1].reshape(-1, d)[keep]
    targets = input_ids[:, 1:].reshape(-1)[keep]
    t = teacher[:, : T - 1].reshape(-1, d)[keep] if teacher is not None else None
    n = max(int(keep.sum()), 1)
    weight = torch.full((x.shape[0],), scale / n, device=x.device)
    return Rows(x, targets, weight, t, torch.zeros_like(targets))
