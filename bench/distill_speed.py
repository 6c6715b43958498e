"""How fast `mtp distill` writes the model's own answers, per engine, and whether the engines agree.

`python -m mtp.bench.distill_speed --n 64 --batch-size 32 --engines batched,generate`

Self-distilled answers are the drafter's best training data and, on a CPU, the most expensive part of a training
stage, so the engine that writes them is worth timing on its own: `batched` (continuous batching through
`mtp.batching`, drafting off, from prepacked weights where the CPU can; `batched-unpacked` from the model's
own) against `generate` (the model's own `generate()` over left-padded batches). The prompts are the same for
every engine: `--n` prompts starting at `--start` of a prompt file (by default the training split, far past
the prompts any shipped head set was distilled on), sorted by templated length as `mtp distill` sorts a
shard. Greedy answers must be identical across engines; the table says how many are.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from mtp.train.distill import ENGINES, DistillOptions, _template, answer_prompts, read_prompts


def run_engine(name: str, model, tokenizer, encoded: list[list[int]], opts: DistillOptions) -> list[list[int]]:
    """Every prompt's answer (cut after EOS), in prompt order; prompts go in sorted by length, as in a shard."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    engine, _, unpacked = name.partition("-")
    opts = replace(opts, engine=engine, pack=unpacked != "unpacked")
    got = answer_prompts(model, tokenizer, {i: encoded[i] for i in order}, opts)
    return [got[i] for i in range(len(encoded))]


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtp.train.precision import DTYPES, dtype_name
    from mtp.train.trainer import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--data", default="data/prompts-train.jsonl")
    p.add_argument("--start", type=int, default=3000, help="first prompt (index into the prompt file)")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--engines", default="batched,generate")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    choices = (*ENGINES, "batched-unpacked")
    if unknown := [e for e in engines if e not in choices]:
        p.error(f"unknown engine(s) {unknown}: choose from {', '.join(choices)}")

    torch.manual_seed(0)
    dtype = dtype_name(args.dtype)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    prompts = read_prompts(args.data, args.start + args.n)[args.start :]
    encoded = [_template(tokenizer, prompt) for prompt in prompts]
    opts = DistillOptions(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, dtype=dtype)
    results, answers = [], {}
    for name in engines:
        t0 = time.perf_counter()
        answers[name] = run_engine(name, model, tokenizer, encoded, opts)
        seconds = time.perf_counter() - t0
        tokens = sum(len(a) for a in answers[name])
        results.append({"engine": name, "prompts": len(encoded), "batch_size": args.batch_size, "dtype": dtype,
                        "seconds": round(seconds, 1), "answer_tokens": tokens,
                        "tokens_per_s": round(tokens / seconds, 1),
                        "answers_per_min": round(60 * len(encoded) / seconds, 1)})  # fmt: skip
    first = next(iter(answers.values()))
    same_as = f"identical to {results[0]['engine']}"
    print(f"{'engine':<10} {'answers/min':>11} {'tok/s':>7} {'seconds':>8} {same_as:>22}")
    for r in results:
        same = sum(a == b for a, b in zip(answers[r["engine"]], first, strict=True))
        r["identical_to_first"] = same
        print(f"{r['engine']:<10} {r['answers_per_min']:>11} {r['tokens_per_s']:>7} {r['seconds']:>8} "
              f"{f'{same}/{len(first)}':>22}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
