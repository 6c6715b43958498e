"""Pick a head set's default tree size on development prompts, never on a reported set.

`python -m mtp.bench.tree_sweep --heads DIR --sizes 8,12,16 --n 12`

The trainer chooses `tree_nodes` from measured accuracies and a verify-cost prior (`default_tree_size`); the
prior does not know what drafting one more depth costs on this machine, so this measures it: plain
`generate()` against the adaptive decoder with each candidate default tree, on prompts from the training
split that no training step read (the tail of `data/prompts-train.jsonl`: ShareGPT conversations 0-14,999,
well past the distilled ones), neither MT-Bench nor the held-out sets. `--write` stores the winner in the
head set's `mtp_config.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def dev_prompts(path: Path, n: int) -> list[str]:
    """The last n/2 chat and n/2 code prompts of the training-split prompt file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chat = [r["prompt"] for r in rows if r.get("kind") == "chat"][-(n - n // 2) :]
    code = [r["prompt"] for r in rows if r.get("kind") == "code"][-(n // 2) :]
    return [p for pair in zip(chat, code, strict=False) for p in pair]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="a shipped head set name or a heads dir")
    parser.add_argument("--sizes", default="8,12,16", help="candidate default tree sizes (nodes)")
    parser.add_argument("--prompts", type=Path, default=Path("data/prompts-train.jsonl"))
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--write", action="store_true", help="store the fastest size in the heads' config")
    args = parser.parse_args(argv)

    from mtp.config import MTPConfig
    from mtp.default_model import load_default_mtp, resolve_heads

    from .mtbench import chat_prompt_ids

    model, tokenizer, _ = load_default_mtp(getattr(torch, args.dtype), args.heads)
    ids = [chat_prompt_ids(tokenizer, p[:2000]) for p in dev_prompts(args.prompts, args.n)]
    model.generate(ids[0][:, :8], max_new_tokens=4)  # warm-up
    sizes = [int(s) for s in args.sizes.split(",")]
    # Interleaved per prompt (plain, then every size), so the machine's drift hits every candidate alike.
    plain = 0.0
    wall = dict.fromkeys(sizes, 0.0)
    steps, tokens = dict.fromkeys(sizes, 0), dict.fromkeys(sizes, 0)
    for x in ids:
        t0 = time.perf_counter()
        model.base_model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain += time.perf_counter() - t0
        for size in sizes:
            model.config.tree_nodes = size
            t0 = time.perf_counter()
            out = model.generate(x, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
            wall[size] += time.perf_counter() - t0
            steps[size] += len(out.accepted_lengths)
            tokens[size] += out.num_new_tokens
    results = {}
    for size in sizes:
        tau = (tokens[size] - len(ids)) / max(1, steps[size])
        results[size] = {"speedup": round(plain / wall[size], 3), "tau": round(tau, 2)}
        print(f"tree_nodes {size:3d}: {results[size]['speedup']:.2f}x, τ {results[size]['tau']:.2f}", flush=True)
    best = max(results, key=lambda s: results[s]["speedup"])
    print(f"fastest on {len(ids)} development prompts: tree_nodes {best}")
    if args.write:
        directory = resolve_heads(args.heads)
        cfg = MTPConfig.load(directory)
        cfg.tree_nodes = best
        print(f"wrote tree_nodes {best} to {cfg.save(directory)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
