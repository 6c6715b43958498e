"""Draft-time trees against static shapes, on development prompts: is `tree="auto"` worth its default?

`python -m mtp.bench.dynamic_trees --heads mtp/assets/smollm2-135m-instruct-eagle --n 12`
`python -m mtp.bench.dynamic_trees --heads ... --n 8 --budgets 6,6:8:4,12,12:8:4` (τ of fixed trees, heads only)

Plain decoding, the adaptive policy with static shapes (`tree="auto-static"`) and the default (`tree="auto"`:
the same policy, each tree grown at draft time, `mtp.dynamic_tree`), all prepacked, fp32, greedy, 128 new
tokens, one timing each, the order alternating per prompt so the machine's drift hits all three alike. The
prompts are development prompts: ShareGPT held-out prompts 33..32+n of each kind (`bench.heldout.sharegpt`),
past the 16 and 24 that benchmark tables report, so nothing reported chose this default. Prints per-prompt
speedups and τ, per-kind totals, and how many answers equal plain decoding's.

`--budgets`: instead, τ and the depths drafted per step of fixed trees, the heads alone (no prompt lookup, 96
new tokens): `N` is the static best-first tree of N nodes (from the checkpoint's measured accuracies),
`N:D:W` a draft-time budget (`DynamicTree(N, D, W)`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtp import MTPModel
from mtp.default_model import load_default_mtp
from mtp.dynamic_tree import DynamicTree
from mtp.tree import build_tree

from .heldout import sharegpt
from .mtbench import chat_prompt_ids

SKIP = 32  # the prompts reported sets may use (--heldout-n up to 24, with margin)
MODES = ("plain", "auto-static", "auto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--heads", required=True, help="heads of the embedded SmolLM2 (name or directory) that grow draft-time trees"
    )
    parser.add_argument("--n", type=int, default=12, help="development prompts per kind (chat, code)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="", help="comma-separated N (static) or N:D:W (draft-time) trees")
    args = parser.parse_args(argv)
    model, tokenizer, _ = load_default_mtp(torch.float32, args.heads)
    model.pack_decoding()
    prompts = [p.text for kind in ("chat", "code") for p in sharegpt(kind, SKIP + args.n)[SKIP:]]
    ids_all = [chat_prompt_ids(tokenizer, text) for text in prompts]
    if args.budgets:
        return fixed_budgets(model, ids_all, args.n, args.budgets.split(","))
    model.generate(ids_all[0], max_new_tokens=16)  # warm-up
    seconds = {m: [] for m in MODES}
    taus = {m: [] for m in MODES[1:]}
    same = 0
    for i, ids in enumerate(ids_all):
        outs = {}
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            t0 = time.perf_counter()
            tree = None if mode == "plain" else mode
            outs[mode] = model.generate(
                ids,
                max_new_tokens=args.max_new_tokens,
                speculative=mode != "plain",
                tree=tree,
                return_dict_in_generate=True,
            )
            seconds[mode].append(time.perf_counter() - t0)
        for mode in taus:
            taus[mode].append(outs[mode].tau)
        same += all(torch.equal(outs[m].sequences, outs["plain"].sequences) for m in taus)
        speed = {m: f"{seconds['plain'][-1] / seconds[m][-1]:.2f}x" for m in taus}
        print(i, speed, {m: f"{taus[m][-1]:.2f}" for m in taus}, flush=True)
    n = args.n
    for kind, part in (("chat", slice(0, n)), ("code", slice(n, 2 * n))):
        for mode in taus:
            ratios = [p / t for p, t in zip(seconds["plain"][part], seconds[mode][part], strict=True)]
            total = sum(seconds["plain"][part]) / sum(seconds[mode][part])
            print(
                f"{kind} {mode:12s} total {total:.2f}x median {statistics.median(ratios):.2f}x "
                f"min {min(ratios):.2f}x tau {statistics.mean(taus[mode][part]):.2f}"
            )
    print("identical", same, "/", len(ids_all))
    return 0


def fixed_budgets(model: MTPModel, ids_all: list[torch.Tensor], n: int, specs: list[str]) -> int:
    """τ per kind and depths drafted per step for each fixed tree (see the module docstring)."""
    from mtp.eagle_proposer import EagleProposer

    depths: list[int] = []
    own = EagleProposer.propose_dynamic

    def counted(self, root, budget):
        out = own(self, root, budget)
        depths.append(self.drafted_depth)
        return out

    EagleProposer.propose_dynamic = counted
    try:
        for spec in specs:
            if ":" in spec:
                nodes, depth, width = (int(x) for x in spec.split(":"))
                tree = DynamicTree(nodes, depth, width)
            else:
                tree = build_tree(int(spec), model.config.num_heads, model.config.head_accuracies)
            depths.clear()
            taus = [
                model.generate(ids, max_new_tokens=96, tree=tree, prompt_lookup=False, return_dict_in_generate=True).tau
                for ids in ids_all
            ]
            drafted = statistics.mean(depths) if depths else tree.depth
            print(
                f"{spec:10s} tau {statistics.mean(taus):.3f} chat {statistics.mean(taus[:n]):.3f} "
                f"code {statistics.mean(taus[n:]):.3f} depths drafted {drafted:.2f}",
                flush=True,
            )
    finally:
        EagleProposer.propose_dynamic = own
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
