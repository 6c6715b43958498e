"""Held-out evaluation: per-head top-k accuracy, the numbers the tree builder and users read.

For every head we count how often the true token t+k+2 is the head's rank-r guess, for r = 0..7. From
these exact-rank counts come top-1 / top-5 accuracy (cumulative sums) and the per-rank probabilities that
`mtp.tree.build_tree` consumes as `MTPConfig.head_accuracies` (accuracies[k][r] = P(rank r is right)).
Logits are computed in chunks of rows, as in training, so evaluation fits next to it in memory.

Beside the text's token, each head is also scored against the base's own greedy choice at that position
(`greedy_top1`, `greedy_top5`): a draft is accepted when it is what the base would say, not what the text
says, so this is the number that acceptance follows (the text's token is the base's greedy one only ~60% of
the time on chat data).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .distributed import DistEnv, sum_over_ranks
from .objective import MTPTrainModule

NUM_RANKS = 8  # ranks of each head's guesses the tree builder gets probabilities for


@dataclass
class HeadAccuracy:
    head: int  # 1-based: head 1 guesses the token after next
    top1: float
    top5: float
    loss: float
    rank_probs: list[float]  # P(the rank-r guess is the right token), r = 0..NUM_RANKS-1
    greedy_top1: float | None = None  # P(the head's top guess is the base's greedy token there)
    greedy_top5: float | None = None


@dataclass
class EvalResult:
    heads: list[HeadAccuracy]
    base_top1: float  # the base lm_head's next-token top-1 on the same tokens (a reference point)
    tokens: int  # positions scored per head (head 1)
    step: int = 0
    extra: dict = field(default_factory=dict)

    def head_accuracies(self) -> list[list[float]]:
        return [h.rank_probs for h in self.heads]

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(
    module: MTPTrainModule,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    batch_size: int,
    env: DistEnv,
    chunk_size: int = 1024,
    hidden: torch.Tensor | None = None,
) -> EvalResult:
    """Score the held-out blocks (rank r takes blocks r, r+W, ...; counts are summed over ranks).

    hidden: the blocks' precomputed final hidden states (a feature cache), or None to run the backbone."""
    was_training = module.training
    module.eval()
    K = module.heads.num_heads
    # counts[g, r] = rows whose target is guess r; g = 0 base, g = k+1 head k. loss_sum / rows per g.
    counts = torch.zeros(K + 1, NUM_RANKS, dtype=torch.float64)
    agree = torch.zeros(K + 1, NUM_RANKS, dtype=torch.float64)  # the same against the base's greedy token
    loss_sum = torch.zeros(K + 1, dtype=torch.float64)
    rows = torch.zeros(K + 1, dtype=torch.float64)
    mine = torch.arange(env.rank, ids.shape[0], env.world_size)
    per_rank = -(-ids.shape[0] // env.world_size)
    # Every rank runs the same number of forwards (ZeRO-3 gathers weights collectively inside forward);
    # a rank that has run out of blocks scores a throw-away block with an all-zero mask.
    for start in range(0, per_rank, batch_size):
        idx = mine[start : start + batch_size]
        real = idx.numel() > 0
        idx = idx if real else torch.zeros(1, dtype=torch.long)
        batch = ids[idx].to(env.device)
        m = mask[idx].to(env.device) if mask is not None else torch.ones_like(batch, dtype=torch.bool)
        m = m if real else torch.zeros_like(m)
        if hidden is None:
            h = module.hidden(batch, grad=False)
        else:
            h = hidden[idx].to(device=env.device, dtype=module.lm_head.weight.dtype)
        feats = module.head_features(h, batch)
        _score_batch(module, h, feats, batch, m, counts, agree, loss_sum, rows, chunk_size)
    module.train(was_training)
    counts, agree, loss_sum, rows = (
        sum_over_ranks(env, t.to(env.device)).cpu() for t in (counts, agree, loss_sum, rows)
    )
    probs = counts / rows.clamp(min=1)[:, None]
    greedy = agree / rows.clamp(min=1)[:, None]
    heads = [
        HeadAccuracy(
            head=k + 1,
            top1=float(probs[k + 1, 0]),
            top5=float(probs[k + 1, :5].sum()),
            loss=float(loss_sum[k + 1] / max(rows[k + 1], 1)),
            rank_probs=[round(float(p), 6) for p in probs[k + 1]],
            greedy_top1=float(greedy[k + 1, 0]),
            greedy_top5=float(greedy[k + 1, :5].sum()),
        )
        for k in range(K)
    ]
    return EvalResult(heads=heads, base_top1=float(probs[0, 0]), tokens=int(rows[1]) if K else 0)


def _score_batch(module, hidden, feats, batch, m, counts, agree, loss_sum, rows, chunk_size) -> None:
    """Score the base lm_head (slot 0) and every head (slot k+1) on one batch.

    The base's pass also records its greedy token at every scored position (`greedy`, -1 elsewhere): head k
    at position t guesses token t+k+2, which the base chooses at position t+k+1, so its reference is
    greedy[:, k+1:], scored on the same rows (a row is scored when token t+k+2 is a target, which is exactly
    when the base's pass scored position t+k+1)."""
    greedy = torch.full_like(batch[:, 1:], -1)
    _score(module.projection(None), hidden[:, :-1], batch[:, 1:], m[:, 1:], 0, counts, loss_sum, rows, chunk_size,
           greedy_out=greedy)  # fmt: skip
    T = batch.shape[1]
    for k in range(feats.shape[0]):
        s = k + 2
        if T <= s:
            continue
        _score(module.projection(k), feats[k, :, : T - s], batch[:, s:], m[:, s:], k + 1, counts, loss_sum, rows,
               chunk_size, reference=greedy[:, k + 1 :], agree=agree)  # fmt: skip


def _score(
    proj, feats, targets, mask, g, counts, loss_sum, rows, chunk_size, greedy_out=None, reference=None, agree=None
) -> None:
    """Add exact-rank hit counts and CE of one projection (weight, bias)'s rows into slot g.

    greedy_out: filled with the projection's top-1 at the scored positions; reference/agree: exact-rank
    hit counts against `reference` (same shape as targets) added into agree[g]."""
    w, b = proj
    d = feats.shape[-1]
    keep = mask.reshape(-1)
    x = feats.reshape(-1, d)[keep]
    y = targets.reshape(-1)[keep]
    where = keep.nonzero().squeeze(1) if greedy_out is not None else None  # flat positions of the rows
    ref = reference.reshape(-1)[keep] if reference is not None else None
    for start in range(0, x.shape[0], chunk_size):
        xc, yc = x[start : start + chunk_size].to(w.dtype), y[start : start + chunk_size]
        logits = torch.nn.functional.linear(xc, w, b).float()  # (n, V)
        top = logits.topk(NUM_RANKS, dim=-1).indices  # (n, R)
        counts[g] += (top == yc[:, None]).sum(0).double().cpu()
        loss_sum[g] += float(torch.nn.functional.cross_entropy(logits, yc, reduction="sum"))
        rows[g] += yc.numel()
        if greedy_out is not None:
            greedy_out.view(-1)[where[start : start + chunk_size]] = top[:, 0]
        if ref is not None:
            agree[g] += (top == ref[start : start + chunk_size, None]).sum(0).double().cpu()


def format_table(result: EvalResult, before: EvalResult | None = None) -> str:
    """The accuracy table as plain text (rich renders it on a terminal, see `print_table`)."""
    lines = ["head  predicts  top-1    top-5    eval CE  = base greedy" + ("   top-1 before" if before else "")]
    for i, h in enumerate(result.heads):
        line = f"{h.head:>4}  t+{h.head + 1:<7} {h.top1:7.2%}  {h.top5:7.2%}  {h.loss:7.3f}  {h.greedy_top1 or 0:11.2%}"
        if before is not None:
            line += f"   {before.heads[i].top1:7.2%}"
        lines.append(line)
    lines.append(f"base next-token top-1 on the same data: {result.base_top1:.2%} ({result.tokens} positions/head)")
    return "\n".join(lines)


def print_table(result: EvalResult, before: EvalResult | None = None, title: str = "held-out head accuracy") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{title} (step {result.step}, {result.tokens} positions per head)")
    for col in ("head", "predicts", "top-1", "top-5", "eval CE", "top-1 = base greedy"):
        table.add_column(col, justify="right")
    if before is not None:
        table.add_column("top-1 untrained", justify="right")
        table.add_column("top-5 untrained", justify="right")
    for i, h in enumerate(result.heads):
        cells = [str(h.head), f"t+{h.head + 1}", f"{h.top1:.2%}", f"{h.top5:.2%}", f"{h.loss:.3f}",
                 f"{h.greedy_top1 or 0:.2%}"]  # fmt: skip
        if before is not None:
            cells += [f"{before.heads[i].top1:.2%}", f"{before.heads[i].top5:.2%}"]
        table.add_row(*cells)
    table.caption = (f"base lm_head next-token top-1 on the same positions: {result.base_top1:.2%}; "
                     "the last column counts a guess right when it is the base's own greedy token")  # fmt: skip
    Console().print(table)


def save_eval(path: Path, result: EvalResult, before: EvalResult | None = None) -> Path:
    """`eval_accuracy.json`: per-head top-1/top-5/CE/rank probabilities (and the untrained baseline)."""
    data = {**result.to_dict(), "untrained": before.to_dict() if before is not None else None}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def load_eval(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
