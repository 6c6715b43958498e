"""Train an EAGLE-style drafter on cached features (`train.features`), with EAGLE-3's training-time test.

Why offline: the backbone is frozen, so its features are the same in every epoch; they are computed once
and each training step runs only the one-layer drafter. Why the training-time test: at serving time depth
k reads the drafter's own output from depth k-1, not the base's features, so a drafter trained only on
real features loses accuracy with every depth; unrolling `steps` depths in training (`EagleDrafter.unroll`:
own outputs as the next input, the EAGLE-3 attention mask) trains exactly what drafting runs.

Loss: for depth j at position t, the cross-entropy between the drafter's draft-vocabulary distribution and
the teacher's (the base's own next-token distribution at position t+j+1, restricted to the draft
vocabulary and renormalised: exact, from the cached final hidden states), weighted ``decay**j``; only
positions whose guessed token is an assistant token count. Accuracy per depth = how often the drafter's
top-1 equals the teacher's greedy token (over the full vocabulary, so tokens outside the draft vocabulary
count as misses).

Checkpoints every ``save_every`` steps (drafter safetensors, optimizer state loaded with
``weights_only=True``, step, RNG): rerunning the same command resumes; the data order is a function of
(seed, epoch). ``max_minutes`` ends a run cleanly (checkpoint + export) for time-boxed jobs, without
changing the lr schedule; ``init_from`` starts a new run (new schedule) from an earlier drafter's weights
and draft vocabulary, which is how a drafter keeps learning across time-boxed runs and onto bigger caches;
``export_only`` evaluates and exports the latest checkpoint. The export carries, per depth, P(rank r is the
base's token | the chain above it was accepted), measured on the cache's eval blocks: the tree builder
multiplies these along a path, so they must be conditional. The result is an MTP checkpoint directory
(heads only, pointing at the base) that `MTPModel.from_pretrained` and every `mtp` command load.
"""

from __future__ import annotations

import json
import math
import random
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .precision import autocast


@dataclass
class DrafterOptions:
    # one cache, or several trained together (e.g. a new stage's answers beside the earlier stages' caches):
    # their train blocks are concatenated and their held-out blocks evaluated together
    features: Path | list[Path] = Path("runs/features")
    out: Path = Path("runs/eagle")
    model: str = "default"
    num_heads: int = 6  # deepest draft the exported drafter offers the tree builder
    num_layers: int = 1  # decoder layers per depth (EAGLE-3: 1); --init-from a shallower drafter grows it
    steps: int = 5  # training-time-test depth
    decay: float = 0.8
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    micro_batch: int = 4
    max_steps: int = 2000
    max_minutes: float | None = None
    stop_after: int | None = None  # end this run at that step (checkpointed, not exported); rerun to go on
    eval_every: int = 200
    save_every: int = 50
    seed: int = 0
    threads: int | None = None
    # warm start: the weights of an earlier drafter (a checkpoint-N directory or an exported drafter) trained
    # on the same draft vocabulary; the optimizer, the lr schedule and the step count start fresh
    init_from: Path | None = None
    # weight of a cross-entropy against the base's greedy token beside the soft targets (see depth_losses)
    hard_weight: float = 0.0
    export_only: bool = False  # evaluate the latest checkpoint and export it, without training further


def _lr(step: int, opts: DrafterOptions) -> float:
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = min(1.0, (step - opts.warmup_steps) / max(1, opts.max_steps - opts.warmup_steps))
    floor = opts.min_lr_ratio
    return opts.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


RANKS = 8  # rank probabilities kept per depth for the tree builder (MTPConfig.head_accuracies)


def _rank_histogram(logits: torch.Tensor, greedy: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """(RANKS+1,) counts of the rank at which each row's greedy token sits in the drafter's list (draft-vocabulary
    logits (n, Dv), greedy base ids (n,)); index RANKS: not in the top RANKS."""
    top = draft_ids[logits.topk(RANKS, dim=-1).indices]  # (n, RANKS) base ids
    hit = top == greedy[:, None]
    where = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(greedy, RANKS))
    return torch.bincount(where, minlength=RANKS + 1)


def depth_losses(
    drafter: Any,
    teacher_w: torch.Tensor,
    batch: dict[str, torch.Tensor],
    steps: int,
    ranks: list | None = None,
    cond_ranks: list | None = None,
    hard_weight: float = 0.0,
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Per-depth soft cross-entropy (mean over valid positions) and (correct, counted) top-1 per depth.

    With `ranks` (a list of per-depth count tensors of size RANKS+1), also counts at which rank of the
    drafter's list the teacher's greedy token sits (index RANKS: not in the top RANKS). `cond_ranks` counts
    the same only where the draft chain up to that depth would have been accepted (every shallower depth's
    top-1 was the teacher's greedy token, which is also the text's next token): what the tree builder's
    independence model needs, P(rank r right | parent right). Unconditional counts understate the deep
    depths, since a depth's misses cluster where a shallower depth already missed.

    `hard_weight` (training only) adds that weight times the cross-entropy against the teacher's greedy token
    (where the draft vocabulary holds it): greedy decoding accepts a draft only when it is the base's argmax,
    and the soft targets alone leave the drafter's argmax to chance where the base's top two are close."""
    aux, ids, final = batch["aux"], batch["input_ids"], batch["final"]
    mask, target = batch["loss_mask"], batch["target"]
    B, T = ids.shape
    with autocast():  # bf16 where the CPU multiplies it in hardware; fp32 elsewhere (20x faster there)
        outs = drafter.unroll_outputs(aux.float(), ids, steps)
    losses, acc = [], []
    # Entry (j, t) guesses x_{t+j+2}; the teacher's distribution for it is the base's at position p = t+j+1,
    # and it is scored iff x_{p+1} carries loss, whatever the depth. So the teacher is computed once, at
    # the positions some depth scores, and `row` maps p-1 to its row.
    scored = mask[:, 2:T]
    with torch.no_grad():
        teacher_rows = F.softmax(final[:, 1 : T - 1][scored].float() @ teacher_w.T, dim=-1)
        row = (scored.reshape(-1).long().cumsum(0) - 1).view(B, T - 2)
    chain = torch.ones(B, T, dtype=torch.bool)  # the chain at t was accepted up to this depth
    draft_ids = drafter.draft_ids
    if hard_weight:  # base id -> draft index, -1 outside the draft vocabulary
        index = torch.full((drafter.vocab_size,), -1, dtype=torch.long)
        index[draft_ids] = torch.arange(draft_ids.numel())
    for j, h in enumerate(outs):
        L = T - j - 2
        if L <= 0:
            break
        valid = mask[:, j + 2 : j + 2 + L]
        if cond_ranks is not None:  # evaluation: the accepted chain needs every position's draft
            with autocast():
                lg = drafter.logits(h[:, :L])
            student = lg[valid].float()
            with torch.no_grad():
                greedy_all = target[:, j + 1 : j + 1 + L]
                cond = valid & chain[:, :L]
                cond_ranks[j] += _rank_histogram(lg[cond].float(), greedy_all[cond], draft_ids)
                # accepted, and the text goes on with that token (so depth j+1 reads what drafting would)
                ok = (draft_ids[lg.argmax(-1)] == greedy_all) & (ids[:, j + 2 : j + 2 + L] == greedy_all)
                nxt = torch.zeros_like(chain)
                nxt[:, :L] = chain[:, :L] & ok & valid
                chain = nxt
        else:  # training: project only the scored entries (the largest matmul of the step)
            with autocast():
                student = drafter.logits(h[:, :L][valid]).float()
        if not valid.any():
            losses.append(h.sum() * 0.0)
            acc.append((0, 0))
            continue
        with torch.no_grad():
            teacher = teacher_rows[row[:, j : j + L][valid]]
            greedy = target[:, j + 1 : j + 1 + L][valid]
            correct = int((draft_ids[student.argmax(-1)] == greedy).sum())
            if ranks is not None:
                ranks[j] += _rank_histogram(student, greedy, draft_ids)
        logp = F.log_softmax(student, dim=-1)
        loss = -(teacher * logp).sum(-1).mean()
        if hard_weight and cond_ranks is None:
            where = index[greedy]
            hit = where >= 0
            if hit.any():
                loss = loss + hard_weight * F.nll_loss(logp[hit], where[hit])
        losses.append(loss)
        acc.append((correct, int(valid.sum())))
    return losses, acc


def _batch(data: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    idx = torch.tensor(rows)
    return {k: v[idx] for k, v in data.items()}


@torch.no_grad()
def evaluate(drafter: Any, teacher_w: torch.Tensor, data: dict[str, torch.Tensor], steps: int, mb: int) -> dict:
    """Held-out per-depth top-1 (training-time-test inputs: real tokens, own features) and loss."""
    was = drafter.training
    drafter.eval()
    tot = [[0, 0] for _ in range(steps)]
    rank_counts = [torch.zeros(RANKS + 1, dtype=torch.long) for _ in range(steps)]
    cond_counts = [torch.zeros(RANKS + 1, dtype=torch.long) for _ in range(steps)]
    loss_sum, n = [0.0] * steps, 0
    for lo in range(0, data["input_ids"].shape[0], mb):
        losses, acc = depth_losses(
            drafter,
            teacher_w,
            _batch(data, list(range(lo, min(lo + mb, len(data["input_ids"]))))),
            steps,
            rank_counts,
            cond_counts,
        )
        for j, ((c, k), lval) in enumerate(zip(acc, losses, strict=True)):
            tot[j][0] += c
            tot[j][1] += k
            loss_sum[j] += float(lval)
        n += 1
    drafter.train(was)
    return {
        "top1": [round(c / max(1, k), 4) for c, k in tot],
        "loss": [round(x / max(1, n), 4) for x in loss_sum],
        "rank_probs": [[round(float(c) / max(1, int(r.sum())), 5) for c in r[:RANKS]] for r in rank_counts],
        # P(rank r right | the chain above it accepted), and how many positions each depth had for it
        "cond_rank_probs": [[round(float(c) / max(1, int(r.sum())), 5) for c in r[:RANKS]] for r in cond_counts],
        "cond_counts": [int(r.sum()) for r in cond_counts],
        "tokens": tot[0][1],
    }


def _save(directory: Path, drafter: Any, optim: torch.optim.Optimizer, step: int, extra: dict) -> None:
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "drafter.safetensors"))
    torch.save({"optim": optim.state_dict(), "rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **extra}))
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def _drafter_weights(source: Path) -> dict[str, torch.Tensor]:
    """An earlier drafter's tensors: a `checkpoint-N` (drafter.safetensors) or an export (mtp_heads.safetensors)."""
    from safetensors.torch import load_file

    for name in ("drafter.safetensors", "mtp_heads.safetensors"):
        if (source / name).is_file():
            return load_file(str(source / name))
    raise FileNotFoundError(f"--init-from {source}: no drafter.safetensors or mtp_heads.safetensors there")


def _init_from(drafter: Any, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Load an earlier drafter's weights; refuse a different layout. The drafter was built over the source's
    draft vocabulary (`train_drafter`), so its projection rows keep meaning the same tokens.

    A source with fewer layers grows: its layers load, the stacked ones it lacks keep their identity start
    (`EagleDrafter`'s zeroed output projections), so the run begins with exactly the source's drafts."""
    own = drafter.state_dict()
    deeper = sorted(k for k in weights if k.startswith("extra_layers.") and k not in own)
    if deeper:
        raise ValueError(f"--init-from {source}: a drafter with more layers than this one ({deeper[0]})")
    weights = {k: v for k, v in weights.items() if k in own}
    missing = sorted(set(own) - set(weights))
    grown = sorted({k.split(".")[1] for k in missing if k.startswith("extra_layers.")})
    missing = [k for k in missing if not k.startswith("extra_layers.")]
    if missing:
        raise ValueError(f"--init-from {source}: not an EAGLE drafter of this layout (missing {missing[:3]})")
    for k, v in weights.items():
        if v.shape != own[k].shape:
            shapes = f"{tuple(v.shape)} there, {tuple(own[k].shape)} here"
            raise ValueError(f"--init-from {source}: {k} has shape {shapes}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)
    note = f" (stacked layers {', '.join(str(int(i) + 2) for i in grown)} start as the identity)" if grown else ""
    print(f"initialised from {source}{note}")


def _latest(out: Path) -> Path | None:
    found = sorted(
        (int(p.name.split("-")[1]), p) for p in out.glob("checkpoint-*") if p.is_dir() and (p / "state.json").exists()
    )
    return found[-1][1] if found else None


# What a verify step costs on the reference CPU (SmolLM2, bf16, 2 cores), in plain decode steps: the forward
# over n tree nodes (bench/verify_cost.py over a 300-token cache: 1.01-1.04 at 2 nodes, 1.15 at 8, 1.17-1.36
# at 16, 1.6-2.1 at 32, the spread being the machine's drift; the verify forwards inside decoding cost up to
# 0.1 more), plus DRAFT_COST_PER_DEPTH for every depth drafted (bench/profile.py: one drafter step with its
# draft-vocabulary projection and top-k, and the step's bookkeeping; 0.08-0.09 for the EAGLE drafter and
# the MTP modules alike).
VERIFY_COST_BF16 = {1: 1.0, 2: 1.1, 3: 1.12, 4: 1.15, 6: 1.2, 8: 1.25, 12: 1.35, 16: 1.45, 24: 1.75, 32: 2.0, 48: 2.6,
                    64: 3.2}  # fmt: skip
DRAFT_COST_PER_DEPTH = 0.09


def default_tree_size(accuracies: list[list[float]]) -> int:
    """The default tree size: the ladder size with the most expected tokens per unit of step cost.

    Chosen from the drafter's held-out rank accuracies and the measured step costs above, never from a
    benchmark. Drafting is paid per depth: with the runtime's optimistic on/off prior and a flat drafting
    overhead instead, a six-depth drafter got a 16-node tree that measured slower than 8 nodes.
    """
    from mtp.adaptive import LADDER
    from mtp.tree import build_tree

    def rate(n: int) -> float:
        tree = build_tree(n, len(accuracies), accuracies)
        return tree.expected_length(accuracies) / (VERIFY_COST_BF16[n] + DRAFT_COST_PER_DEPTH * tree.depth)

    return max((n for n in LADDER if n >= 4), key=rate)


def export_drafter(drafter: Any, base: Any, out: Path, metrics: dict | None = None) -> Path:
    """Write the drafter as a heads-only MTP checkpoint (bf16) that `MTPModel.from_pretrained` loads."""
    from mtp.model import MTPModel

    model = MTPModel.from_base(base, num_heads=drafter.num_heads, head_type="eagle", **drafter.config_kwargs())
    model.heads.load_state_dict(drafter.state_dict())
    model.heads.to(torch.bfloat16)
    heldout = (metrics or {}).get("heldout", {})
    probs = heldout.get("cond_rank_probs") or heldout.get("rank_probs")
    if probs:
        # what the tree builder reads: P(rank r of depth k is the base's token | its parent was), measured on
        # the feature cache's eval blocks (never on a reported benchmark set)
        model.config.head_accuracies = probs[: drafter.num_heads]
        model.config.tree_nodes = default_tree_size(model.config.head_accuracies)
    target = out / "drafter"
    model.save_pretrained(target, heads_only=True)
    if metrics is not None:
        (target / "training_metrics.json").write_text(json.dumps(metrics, indent=2))
    return target


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _cache_info(directory: Path, name: str) -> dict[str, Any]:
    """A cache's info file, with the block size it was cut into at the top level: caches trained together
    must agree on it and on their feature layers."""
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {name}; build a cache with `python -m mtp.train.features`")
    info = json.loads(path.read_text())
    return {**info, "block_size": info.get("options", {}).get("block_size")}


def train_drafter(opts: DrafterOptions) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from mtp.heads import build_heads

    from .features import INFO, VOCAB, FeatureRows, load_base, load_split, note_if_incomplete

    if opts.threads:
        torch.set_num_threads(opts.threads)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.export_only and _latest(out) is None:
        raise FileNotFoundError(f"--export-only: no checkpoint in {out}")
    caches = [Path(opts.features)] if isinstance(opts.features, (str, Path)) else [Path(f) for f in opts.features]
    infos = [_cache_info(d, INFO) for d in caches]
    info = infos[0]
    for d, other in zip(caches[1:], infos[1:], strict=True):
        for key in ("feature_layers", "block_size"):
            if other[key] != info[key]:
                raise ValueError(f"{d}: {key} {other[key]}, {caches[0]}: {info[key]}; caches trained together "
                                 "need the same feature layers and block size")  # fmt: skip
    vocab = torch.tensor(json.loads((caches[0] / VOCAB).read_text()), dtype=torch.long)
    # A run that continues (its own checkpoint) or warm-starts (--init-from) keeps the drafter's own draft
    # vocabulary: the cache stores the base's final hidden states, so the teacher's targets are exact over
    # any vocabulary, and a bigger cache (whose most frequent tokens differ a little) can extend a drafter
    # trained on a smaller one. Only a fresh drafter takes the cache's vocabulary.
    ckpt = _latest(out)
    source = ckpt if ckpt is not None else (Path(opts.init_from) if opts.init_from is not None else None)
    earlier = _drafter_weights(source) if source is not None else None  # read once: vocabulary, then weights
    if earlier is not None:
        if "draft_ids" not in earlier:
            raise ValueError(f"--init-from {source}: not an EAGLE drafter (no draft_ids)")
        vocab = earlier["draft_ids"].long()
    base, _ = load_base(opts.model, torch.float32)
    drafter = build_heads(
        "eagle",
        base_model=base,
        hidden_size=base.config.hidden_size,
        vocab_size=base.config.vocab_size,
        num_heads=opts.num_heads,
        num_layers=opts.num_layers,
        feature_layers=info["feature_layers"],
        draft_vocab_size=int(vocab.numel()),
    )
    drafter.set_draft_vocab(vocab, base)
    drafter.float().train()
    teacher_w = base.get_output_embeddings().weight.detach()[vocab].float()
    t_load = time.time()
    # the train split stays on disk (memory-mapped, read per step); the small eval split is loaded whole
    train = None if opts.export_only else FeatureRows([d / "train" for d in caches])
    held = load_split([d / "eval" for d in caches])
    load_s = time.time() - t_load
    optim = torch.optim.AdamW(drafter.parameters(), lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.95))
    step = 0
    if ckpt is None and earlier is not None:
        _init_from(drafter, earlier, source)
    if ckpt is not None:
        if set(earlier) != set(drafter.state_dict()):
            layers = 1 + len({k.split(".")[1] for k in earlier if k.startswith("extra_layers.")})
            raise ValueError(
                f"{ckpt} holds a {layers}-layer drafter, this run builds {opts.num_layers} (--num-layers): "
                "resume with the layout it was trained with, or start a new --out with --init-from"
            )
        drafter.load_state_dict(earlier)
        state = torch.load(ckpt / "optimizer.pt", weights_only=True)
        optim.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        step = json.loads((ckpt / "state.json").read_text())["step"]
        print(f"resumed from {ckpt} (step {step})")
    metrics_path = out / "metrics.jsonl"
    N = 0 if train is None else len(train)
    if train is not None:
        for d, i in zip(caches, infos, strict=True):
            if not i.get("complete", True):  # count a cache's finished blocks only when it is still growing
                note_if_incomplete(d, i, len(FeatureRows(d / "train", ("input_ids",))))
    per_epoch = max(1, N // opts.micro_batch)

    def order(epoch: int) -> list[int]:
        g = random.Random(opts.seed * 100_003 + epoch)
        rows = list(range(N))
        g.shuffle(rows)
        return rows

    if step == 0:
        ev = evaluate(drafter, teacher_w, held, opts.steps, opts.micro_batch)
        (out / "eval_untrained.json").write_text(json.dumps(ev))
        print("untrained held-out top-1 per depth:", ev["top1"])
    t0 = time.time()
    tokens_done = 0
    cpu_seconds = 0.0
    bar = tqdm(total=opts.max_steps, initial=step, desc="drafter", unit="step")
    stop_reason = "max_steps"
    history: list[dict] = []
    if opts.export_only:
        stop_reason = "export_only"
    while step < opts.max_steps and not opts.export_only:
        epoch, k = divmod(step, per_epoch)
        rows = order(epoch)[k * opts.micro_batch : (k + 1) * opts.micro_batch]
        for g in optim.param_groups:
            g["lr"] = _lr(step, opts)
        c0 = time.process_time()
        losses, acc = depth_losses(drafter, teacher_w, train.rows(rows), opts.steps, hard_weight=opts.hard_weight)
        loss = sum(opts.decay**j * lval for j, lval in enumerate(losses))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if opts.grad_clip:
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), opts.grad_clip)
        optim.step()
        cpu_seconds += time.process_time() - c0
        step += 1
        tokens_done += len(rows) * train.block_size
        rate = tokens_done / max(1e-9, time.time() - t0)
        rec = {
            "step": step,
            "loss": round(loss.item(), 4),
            "lr": _lr(step - 1, opts),
            "top1": [round(c / max(1, n), 3) for c, n in acc],
            "tokens_per_s": round(rate, 1),
            "elapsed_s": round(time.time() - t0, 1),
        }
        with metrics_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        bar.set_postfix(loss=f"{loss.item():.3f}", d1=rec["top1"][0], tok_s=f"{rate:.0f}")
        bar.update(1)
        timed_out = opts.max_minutes is not None and (time.time() - t0) / 60 >= opts.max_minutes
        if step % opts.eval_every == 0 or step == opts.max_steps or timed_out:
            ev = evaluate(drafter, teacher_w, held, opts.steps, opts.micro_batch)
            ev.update(step=step, elapsed_s=round(time.time() - t0, 1))
            history.append(ev)
            with (out / "eval_history.jsonl").open("a") as f:
                f.write(json.dumps(ev) + "\n")
            print(f"step {step}: held-out top-1 per depth {ev['top1']}")
        if step % opts.save_every == 0 or step == opts.max_steps or timed_out:
            _save(out / f"checkpoint-{step}", drafter, optim, step, {"tokens": tokens_done})
            for old in sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        if timed_out:
            stop_reason = "max_minutes"
            break
        if opts.stop_after is not None and step >= opts.stop_after:
            _save(out / f"checkpoint-{step}", drafter, optim, step, {"tokens": tokens_done})
            bar.close()
            return {"stop_reason": "stop_after", "steps": step}
    bar.close()
    final_eval = history[-1] if history else evaluate(drafter, teacher_w, held, opts.steps, opts.micro_batch)
    metrics = {
        "options": {k: _jsonable(v) for k, v in asdict(opts).items()},
        "features": info if len(infos) == 1 else infos,
        "stop_reason": stop_reason,
        "steps": step,
        "wall_seconds_this_run": round(time.time() - t0, 1),
        "tokens_per_second_this_run": round(tokens_done / max(1e-9, time.time() - t0), 1),
        "feature_load_seconds": round(load_s, 1),
        # counts the cache's memory-mapped pages that were read (the OS can reclaim them), not only the heap
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "train_blocks_used": N,
        "heldout": final_eval,
        "untrained": json.loads((out / "eval_untrained.json").read_text())
        if (out / "eval_untrained.json").exists()
        else None,
    }
    target = export_drafter(drafter, base, out, metrics)
    (out / "result.json").write_text(json.dumps(metrics, indent=2))
    print(f"drafter written to {target}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Train an EAGLE-style drafter on cached features.")
    d = DrafterOptions()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        kind = type(value) if value is not None else (float if name == "max_minutes" else int)
        if isinstance(value, Path) or name == "init_from":
            kind = Path
        if name == "features":
            p.add_argument(flag, type=Path, nargs="+", default=[value], help="one feature cache or several")
            continue
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
            continue
        p.add_argument(flag, type=kind, default=value)
    a = p.parse_args(argv)
    train_drafter(DrafterOptions(**vars(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
