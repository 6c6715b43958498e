"""The batched engine (the server's) with draft-time trees vs static tree shapes: tokens/s, τ, every answer checked.

    python -m mtp.bench.batch_trees --heads eagle --n 8 --concurrency 1,4 --dtype float32

Why: `mtp serve` decodes every request through `mtp.batching.BatchDecoder`, also a lone one, so the gain of
draft-time trees measured with `MTPModel.generate()` reaches users only if the engine grows them too.

Prompts: held-out chat and code (bench/heldout.py, ``--n`` of each, handwritten and ShareGPT alternating).
For each concurrency C the prompts run through one engine C at a time (a new request joins as soon as one
finishes: continuous batching), in three modes: ``dynamic`` (``BatchDecoder()``: the plan picks each step's
node budget, greedy rows of a drafter that grows draft-time trees grow one of that size), ``static``
(``BatchDecoder(tree="auto-static")``: the plan's static shapes) and ``plain`` (``speculative=False``). The
modes alternate their order per level. Output tokens/s = all new tokens / the level's wall time; τ = new
tokens per verify step over all rows; each answer is compared with the base's own greedy `generate()` of
its prompt alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MODES = ("dynamic", "static", "plain")


def run_level(model, prompts: list[list[int]], max_new: int, concurrency: int, mode: str, cost) -> dict:
    """Decode every prompt through one engine, `concurrency` at a time; answers, seconds, steps."""
    from mtp.batching import BatchDecoder

    tree = "auto-static" if mode == "static" else None
    engine = BatchDecoder(model, max_batch_size=concurrency, tree=tree, cost=cost, guard=False)
    queue = list(range(len(prompts)))
    ids: dict[int, int] = {}
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    steps = 0
    t0 = time.perf_counter()
    while queue or engine.has_work:
        while queue and engine.num_running + engine.num_waiting < concurrency:
            i = queue.pop(0)
            ids[engine.add(prompts[i], max_new, speculative=mode != "plain")] = i
        for u in engine.step():
            out[ids[u.request_id]].extend(u.tokens)
            if u.finished:
                steps += len(u.accepted_lengths)
    seconds = time.perf_counter() - t0
    answers = [out[i] for i in range(len(prompts))]
    new = sum(len(a) for a in answers)
    # the first token of each answer comes from its prompt's forward, not a verify step
    return {"answers": answers, "seconds": seconds, "tokens": new, "tau": (new - len(prompts)) / max(1, steps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="eagle", help="head set of the embedded model: mtp | eagle | a directory")
    p.add_argument("--n", type=int, default=8, help="held-out prompts of each kind (chat, code)")
    p.add_argument("--source", default="both", help="held-out prompts: handwritten | sharegpt | both")
    p.add_argument("--concurrency", default="1,4", help="requests decoded together, e.g. 1,4,8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-pack", action="store_true", help="decode from the model's own weights (not prepacked)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        p.error("--concurrency: positive integers, e.g. 1,4")

    from mtp.batching import StepCost
    from mtp.default_model import load_default_mtp

    from .heldout import heldout_prompts
    from .mtbench import chat_prompt_ids

    model, tokenizer, _ = load_default_mtp(getattr(torch, args.dtype), args.heads)
    if not args.no_pack:
        model.pack_decoding()
    held = [q for kind in ("chat", "code") for q in heldout_prompts(kind, args.n, args.source)]
    prompts = [chat_prompt_ids(tokenizer, q.text)[0].tolist() for q in held]
    t_start = time.perf_counter()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.base_model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            refs.append(out[0, len(ids) :].tolist())
        cost = StepCost.measure(model)  # once, the same curve for every engine (as one server keeps it)
        run_level(model, prompts[:2], 8, 2, "dynamic", cost)  # warm-up: first-call plans, allocator
        report: dict = {
            "meta": {
                "heads": args.heads,
                "dtype": args.dtype,
                "packed": not args.no_pack,
                "max_new_tokens": args.max_new_tokens,
                "prompts": [q.id for q in held],
                "threads": torch.get_num_threads(),
            },
            "levels": {},
        }
        for li, c in enumerate(levels):
            order = MODES if li % 2 == 0 else tuple(reversed(MODES))
            results = {}
            for mode in order:
                r = run_level(model, prompts, args.max_new_tokens, c, mode, cost)
                identical = sum(a == b for a, b in zip(r["answers"], refs, strict=True))
                results[mode] = {
                    "tok_s": round(r["tokens"] / r["seconds"], 2),
                    "tau": round(r["tau"], 3),
                    "seconds": round(r["seconds"], 1),
                    "identical": f"{identical}/{len(prompts)}",
                }
                print(f"concurrency {c} {mode}: {results[mode]}", flush=True)
            plain = results["plain"]["tok_s"]
            for mode in ("dynamic", "static"):
                results[mode]["vs_plain"] = round(results[mode]["tok_s"] / plain, 3)
            report["levels"][str(c)] = results
    report["meta"]["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    print("| concurrency | plain tok/s | static: tok/s, x plain, τ | dynamic: tok/s, x plain, τ | identical |")
    print("|---|---|---|---|---|")
    for c, r in report["levels"].items():
        s, d = r["static"], r["dynamic"]
        print(
            f"| {c} | {r['plain']['tok_s']} | {s['tok_s']}, {s['vs_plain']}x, {s['tau']} | "
            f"{d['tok_s']}, {d['vs_plain']}x, {d['tau']} | {d['identical']}, {s['identical']}, "
            f"{r['plain']['identical']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
