"""Pick a head set's default tree size on development prompts, never on a reported set.

`python -m mtp.bench.tree_sweep --heads DIR --sizes 8,12,16 --n 40`
`python -m mtp.bench.tree_sweep --heads eagle@8 --heads DIR@4,8 --heads mtp@16 --n 40` (head sets side by side)

The trainer chooses `tree_nodes` from measured accuracies and a verify-cost prior (`default_tree_size`); the
prior does not know what drafting one more depth costs on this machine, so this measures it: plain
`generate()` against the adaptive decoder with each candidate default tree, on development prompts: lines
4,401-5,500 of `data/prompts-train.jsonl` (the README's recipe writes it), the prompts of a training stage that
was not kept, so no shipped head set learned the model's answers to them (the EAGLE drafter's stages read every
other line of that file, up to its end), and neither MT-Bench nor the held-out sets. `--write` stores the
winner in the head set's `mtp_config.json`.

Decoding runs from prepacked weights where this CPU can pack them (`--no-pack`: the model's own), as `mtp
generate`, `mtp serve` and the quickstart do by default: a tree size chosen on the unpacked path is chosen for
costs users do not see (in fp32 on AVX2, a 2-node verify forward costs 1.36 decode steps unpacked and 1.01
packed; `python -m mtp.bench.profile --pack`). The reference stays plain `generate()`, which never packs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtp.model import MTPModel

from .methods import Method, MethodResult

# The development range of data/prompts-train.jsonl (1-based, inclusive, as `sed -n`): see the module docstring.
DEV_LINES = "4401-5500"


def dev_prompts(path: Path, n: int, lines: str = DEV_LINES) -> list[str]:
    """The last n/2 chat and n/2 code prompts of `lines` ("START-END", or "" for all) of a prompt file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if lines:
        start, _, end = lines.partition("-")
        if not (start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
            raise ValueError(f"--lines wants START-END (1-based, inclusive), got {lines!r}")
        if int(end) > len(rows):
            raise ValueError(f"{path} has {len(rows)} prompts, fewer than --lines {lines} asks for")
        rows = rows[int(start) - 1 : int(end)]
    chat = [r["prompt"] for r in rows if r.get("kind") == "chat"][-(n - n // 2) :]
    code = [r["prompt"] for r in rows if r.get("kind") == "code"][-(n // 2) :]
    return [p for pair in zip(chat, code, strict=False) for p in pair]


def _candidates(specs: list[str], default_sizes: str) -> list[tuple[str, list[int]]]:
    """`SET[@SIZES]` per head set (a shipped name or a heads dir; sizes comma-separated, else --sizes)."""
    out = []
    for spec in specs:
        heads, _, sizes = spec.partition("@")
        out.append((heads, [int(x) for x in (sizes or default_sizes).split(",") if x.strip()]))
    return out


def with_tree_nodes(model: MTPModel, size: int) -> Method:
    """The adaptive decoder with `size` as the head set's default tree (several sizes share one model)."""

    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        model.config.tree_nodes = size
        out = model.generate(ids, max_new_tokens=max_new, return_dict_in_generate=True)
        return MethodResult(out.sequences, accepted_lengths=out.accepted_lengths)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--heads", action="append", required=True,
        help="a shipped head set name or a heads dir, optionally with its own sizes: DIR@4,8; repeat to compare "
        "head sets in the same run",
    )  # fmt: skip
    parser.add_argument("--sizes", default="8,12,16", help="candidate default tree sizes (nodes)")
    parser.add_argument("--prompts", type=Path, default=Path("data/prompts-train.jsonl"))
    parser.add_argument(
        "--lines", default=DEV_LINES,
        help="which lines of --prompts to draw from (START-END, 1-based; '' for all): by default the ones no "
        "shipped head set trained on",
    )  # fmt: skip
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="time each (prompt, size) N times, keep the median")
    parser.add_argument(
        "--pack", action=argparse.BooleanOptionalAction, default=True,
        help="decode from prepacked weights where this CPU can (the CLI's default); plain generate() never packs",
    )  # fmt: skip
    parser.add_argument("--write", action="store_true", help="store the fastest size in the heads' config")
    args = parser.parse_args(argv)
    candidates = _candidates(args.heads, args.sizes)
    if args.write and len(candidates) > 1:
        parser.error("--write stores one head set's size: give one --heads with it")

    from mtp.cli import _pack_decoding
    from mtp.config import MTPConfig
    from mtp.default_model import load_default_mtp, resolve_heads

    from .methods import plain
    from .mtbench import chat_prompt_ids
    from .run import run_prompts, summary_rows

    first, tokenizer, _ = load_default_mtp(getattr(torch, args.dtype), candidates[0][0])
    models = [first] + [
        MTPModel.from_pretrained(resolve_heads(h), base_model=first.base_model) for h, _ in candidates[1:]
    ]
    for model in models:
        _pack_decoding(model, args.pack)  # the CLI's own: packs where the CPU can, says why not where it cannot
    variants = [
        (f"{h} tree_nodes {n:3d}", model, n)
        for (h, sizes), model in zip(candidates, models, strict=True)
        for n in sizes
    ]
    ids = [chat_prompt_ids(tokenizer, p[:2000]) for p in dev_prompts(args.prompts, args.n, args.lines)]
    first.generate(ids[0][:, :8], max_new_tokens=4)  # warm-up
    methods = {"plain": plain(first)} | {label: with_tree_nodes(model, size) for label, model, size in variants}
    prompts = [(i, "dev", x) for i, x in enumerate(ids)]
    # run_prompts interleaves the candidates per prompt (drift hits them alike), keeps the median of --repeats
    # and checks every answer against plain generate(); speedups are per token (summary_rows).
    rows = {r["method"]: r for r in summary_rows(run_prompts(methods, prompts, args.max_new_tokens, args.dtype,
                                                             repeats=args.repeats))}  # fmt: skip
    results = {}
    for label, _, size in variants:
        r = rows[label]
        results[label] = {k: r[k] for k in ("speedup", "tau", "identical", "min_prompt_speedup", "repeat_mismatches")}
        results[label]["size"] = size
        print(
            f"{label}: {r['speedup']:.2f}x, τ {r['tau']:.2f}, identical {r['identical']}, "
            f"slowest prompt {r['min_prompt_speedup']:.2f}x",
            flush=True,
        )
    best = max(results, key=lambda k: results[k]["speedup"])
    print(f"fastest on {len(ids)} development prompts: {best}")
    if args.write:
        directory = resolve_heads(candidates[0][0])
        cfg = MTPConfig.load(directory)
        cfg.tree_nodes = results[best]["size"]
        print(f"wrote tree_nodes {cfg.tree_nodes} to {cfg.save(directory)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
