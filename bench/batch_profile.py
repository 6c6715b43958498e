"""Where a batched decode step's time goes, per head set: `python -m mtp.bench.batch_profile --heads mtp,eagle`.

The server decodes every request through `mtp.batching.BatchDecoder`; this runs the same held-out prompts through
one engine per head set, `--concurrency` at a time (continuous batching, as `bench/batch_trees.py`), with
wall-clock timers around its phases: admission and prefill, the plan, drafting (the proposer's `propose` /
`propose_dynamic`, which feeds the drafter the positions it has not seen yet), prompt lookup, the batched
forward (`_score`), verification, the KV commit, and the bookkeeping after a step (the proposer's `observe`,
the acceptance policy). What is left of a step is the engine's own Python. Reported in milliseconds per
decode step and per output token, beside tokens/s and τ, so two head sets compare phase by phase on the same
prompts and the same cost curve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch


def timed_engine_phases(totals: dict[str, float], counts: dict[str, int]):
    """The batched engine's phases, timed into totals[phase] and counted into counts[phase]
    (`mtp.bench.profile.timed_methods`; a proposer without draft-time trees has no such phase of its own)."""
    from mtp import adaptive, batch_cache, batching, decoding, eagle_proposer, ngram, proposer

    from .profile import timed_methods

    targets = [
        (batching.BatchDecoder, "step", "step (total)"),
        (batching.BatchDecoder, "_admit", "admit"),
        (batching.BatchDecoder, "_prefill", "prefill"),
        (batching.BatchDecoder, "_plan", "plan"),
        (batching.BatchDecoder, "_score", "batched forward"),
        (batch_cache.BatchCache, "commit", "KV commit"),
        (decoding.GreedyStrategy, "verify", "verify"),
        (decoding.SamplingStrategy, "verify", "verify"),
        (decoding.GreedyStrategy, "propose", "drafting"),  # static trees
        (decoding.SamplingStrategy, "propose", "drafting"),
        (batching.BatchDecoder, "_grow_trees", "drafting"),  # draft-time trees, every growing row's
        (eagle_proposer.EagleProposer, "_commit", "drafting: catch-up feed"),  # (inside drafting)
        (eagle_proposer._RowBatch, "catch_up", "drafting: catch-up feed"),
        (ngram.NgramDraft, "graft", "prompt lookup"),
        (ngram.NgramDraft, "observe", "prompt lookup"),
        (proposer.MTPProposer, "observe", "proposer observe"),
        (proposer.MedusaProposer, "observe", "proposer observe"),
        (eagle_proposer.EagleProposer, "observe", "proposer observe"),
        (adaptive.AdaptiveDraft, "observe", "policy observe"),
    ]
    return timed_methods(targets, totals, counts)


@contextmanager
def rows_drafting_alone():
    """Every proposer class drafts its rows one after another (`Proposer.propose_dynamic_rows`' default), as
    the engine did before drafters could draft rows together: the baseline of `--alone`."""
    from mtp import eagle_proposer
    from mtp.proposer import Proposer

    cls = eagle_proposer.EagleProposer
    saved = vars(cls)["propose_dynamic_rows"]
    cls.propose_dynamic_rows = classmethod(Proposer.propose_dynamic_rows.__func__)
    try:
        yield
    finally:
        cls.propose_dynamic_rows = saved


def profile_heads(heads: str, dtype: torch.dtype, prompts_text: list[str], levels: list[int], max_new: int) -> dict:
    """One head set: each concurrency level speculative and plain, with phase totals for the speculative run.
    `heads` "NAME/alone": that head set with its rows drafting one after another (`rows_drafting_alone`)."""
    name, _, variant = heads.partition("/")
    with rows_drafting_alone() if variant == "alone" else contextlib.nullcontext():
        return _profile(name, heads, dtype, prompts_text, levels, max_new)


def _profile(name: str, label: str, dtype: torch.dtype, texts: list[str], levels: list[int], max_new: int) -> dict:
    from mtp.batching import StepCost
    from mtp.default_model import load_default_mtp

    from .batch_trees import run_level
    from .mtbench import chat_prompt_ids

    model, tokenizer, _ = load_default_mtp(dtype, name)
    model.pack_decoding()
    prompts = [chat_prompt_ids(tokenizer, text)[0].tolist() for text in texts]
    result: dict = {}
    with torch.inference_mode():
        cost = StepCost.measure(model)
        run_level(model, prompts[:2], 8, 2, "dynamic", cost)  # warm-up: first-call plans, allocator
        for c in levels:
            plain = run_level(model, prompts, max_new, c, "plain", cost)
            totals: dict[str, float] = defaultdict(float)
            counts: dict[str, int] = defaultdict(int)
            with timed_engine_phases(totals, counts):
                spec = run_level(model, prompts, max_new, c, "dynamic", cost)
            steps = counts["step (total)"]
            phases = {k: round(1000 * v / steps, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
            timed = sum(v for k, v in totals.items() if k not in ("step (total)", "drafting: catch-up feed"))
            phases["engine Python (rest)"] = round(1000 * (totals["step (total)"] - timed) / steps, 3)
            result[str(c)] = {
                "plain_tok_s": round(plain["tokens"] / plain["seconds"], 2),
                "spec_tok_s": round(spec["tokens"] / spec["seconds"], 2),
                "tau": round(spec["tau"], 3),
                "tokens": spec["tokens"],
                "steps": steps,
                "ms_per_step": phases,
                "ms_per_token": round(1000 * spec["seconds"] / spec["tokens"], 3),
                "identical_to_plain": sum(a == b for a, b in zip(spec["answers"], plain["answers"], strict=True)),
                "row_share": round(cost.row_share, 3),
            }
            print(f"{label} concurrency {c}: {json.dumps(result[str(c)])}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--heads",
        default="mtp,eagle,eagle/alone",
        help="head sets to compare, comma-separated: mtp, eagle, a directory; NAME/alone: its rows draft one "
        "after another (the engine before drafting rows together)",
    )
    p.add_argument("--n", type=int, default=8, help="held-out prompts of each kind (chat, code)")
    p.add_argument("--concurrency", default="2,8", help="requests decoded together, e.g. 1,2,4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]

    from .heldout import heldout_prompts

    held = [q for kind in ("chat", "code") for q in heldout_prompts(kind, args.n, "both")]
    t0 = time.perf_counter()
    report = {
        "meta": {
            "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens,
            "prompts": [q.id for q in held],
            "threads": torch.get_num_threads(),
        },
        "heads": {
            h: profile_heads(h, getattr(torch, args.dtype), [q.text for q in held], levels, args.max_new_tokens)
            for h in args.heads.split(",")
        },
    }
    report["meta"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    names = list(report["heads"])
    for c in map(str, levels):
        print(f"\nconcurrency {c}: ms per step (" + " | ".join(names) + ")")
        rows = report["heads"]
        rates = [f"{rows[h][c]['spec_tok_s']} / {rows[h][c]['plain_tok_s']} (τ {rows[h][c]['tau']})" for h in names]
        print("  tok/s speculative / plain: " + " | ".join(rates))
        phases = dict.fromkeys(k for h in names for k in rows[h][c]["ms_per_step"])
        for ph in phases:
            print(f"  {ph:28s} " + " | ".join(f"{rows[h][c]['ms_per_step'].get(ph, 0.0):8.3f}" for h in names))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
