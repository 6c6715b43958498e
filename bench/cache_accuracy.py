"""Per-depth top-1 of EAGLE drafters on the held-out blocks of feature caches, one cache at a time.

    python -m mtp.bench.cache_accuracy --heads runs/eagle-v12/drafter runs/eagle-v13/drafter \
        --features runs/features-v10 runs/features-v12 runs/features-v13

Why per cache: a drafter trains on several caches at once (first turns, follow-ups, ShareGPT's own answers),
and the trainer's evaluation pools their held-out blocks, so a gain on one kind of text can hide a loss on
another. This scores each cache's ``eval/`` split apart with the trainer's own evaluation
(`train.drafter_trainer.evaluate`: real tokens, the drafter's own features at every depth, counted against the
teacher's greedy token over the full vocabulary). The blocks come from the caches, so no answer is generated:
a few seconds per cache and drafter.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch


def cache_accuracy(heads: list[Path], features: list[Path], steps: int = 6, micro_batch: int = 4) -> Iterator[dict]:
    """One row per (drafter, cache), as each is scored: tokens scored and top-1 per depth."""
    from mtp import MTPModel
    from mtp.train.drafter_trainer import evaluate
    from mtp.train.features import load_split

    held = {c: load_split(c / "eval") for c in features}
    base = None  # loaded with the first drafter, then shared: every drafter scored here drafts for one base
    for d in heads:
        model = MTPModel.from_pretrained(d, base_model=base)
        base = model.base_model
        if getattr(model.heads, "draft_ids", None) is None:
            raise ValueError(f"{d}: not an EAGLE drafter (no draft vocabulary); cache accuracy scores EAGLE drafters")
        drafter = model.heads.float()
        teacher_w = model.base_model.float().get_output_embeddings().weight.detach()[drafter.draft_ids.long()]
        for c in features:
            ev = evaluate(drafter, teacher_w, held[c], steps, micro_batch)
            yield {"heads": str(d), "features": str(c), "tokens": ev["tokens"], "top1": ev["top1"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", type=Path, required=True, help="EAGLE drafter checkpoint dirs")
    parser.add_argument("--features", nargs="+", type=Path, required=True, help="feature caches (train.features)")
    parser.add_argument("--steps", type=int, default=6, help="depths scored")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for c in args.features:
        if not (c / "eval").is_dir():
            parser.error(f"{c}: no eval/ split (not a feature cache from `python -m mtp.train.features`?)")
    rows = []
    for r in cache_accuracy(args.heads, args.features, args.steps):
        rows.append(r)
        top1 = " / ".join(f"{100 * x:.1f}" for x in r["top1"])
        print(f"{r['heads']} | {r['features']} | tokens {r['tokens']} | top-1 per depth {top1}", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
