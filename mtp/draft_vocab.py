"""Draft vocabulary: the heads propose only from the tokens the model actually writes.

Why: at batch size 1 the heads' cost is reading the vocabulary projection (49152 x 576 for SmolLM2, a
fifth of the whole model) once per draft depth. The model's answers use a small part of its vocabulary:
a few thousand frequent tokens cover almost every position, so projecting onto those rows only cuts the
drafting cost several times and loses a draft only where the base would pick a rare token (the
verifier then simply rejects it: output is unchanged, only τ drops a little). EAGLE-3 and vLLM's
speculators use the same trick with a trained draft vocabulary.

Verification always uses the base model's full lm_head; only drafting is restricted.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn import functional as F


class DraftProjection(nn.Module):
    """The base lm_head restricted to `token_ids`, returning full-vocabulary logits (-inf elsewhere).

    Full-width output keeps every proposer unchanged (top-k indices are token ids, sampled draft
    distributions are over the whole vocabulary and give zero mass outside the draft vocabulary,
    which lossless rejection sampling accepts as any other q).
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor):
        super().__init__()
        weight = lm_head.weight
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        self.vocab_size = weight.shape[0]
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("weight", weight.detach().index_select(0, ids).contiguous(), persistent=False)
        bias = getattr(lm_head, "bias", None)
        self.register_buffer(
            "bias", bias.detach().index_select(0, ids).contiguous() if bias is not None else None, persistent=False
        )

        self.packed: nn.Module | None = None  # see to_packed

    def to_packed(self) -> DraftProjection:
        """This projection with its rows in oneDNN's layout (mtp.packed): cheaper to run on a CPU."""
        from .packed import PackedLinear

        out = copy.copy(self)
        out._modules = dict(self._modules)
        out.packed = PackedLinear(self.weight, self.bias, own_one_row=False)  # a drafter's: no bits to match
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, sub)


def frequent_tokens(
    sequences: Iterable[Sequence[int]], size: int, vocab_size: int, always: Iterable[int] = ()
) -> torch.Tensor:
    """The `size` most frequent token ids in `sequences` (plus `always`, e.g. EOS), sorted ascending."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    chosen = {int(t) for t in always if 0 <= int(t) < vocab_size}
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if 0 <= token < vocab_size:
            chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(sequences: Iterable[Sequence[int]], token_ids: torch.Tensor) -> float:
    """Share of the tokens in `sequences` that lie in the draft vocabulary."""
    allowed = set(token_ids.tolist())
    total = hit = 0
    for seq in sequences:
        total += len(seq)
        hit += sum(int(t) in allowed for t in seq)
    return hit / total if total else 0.0
