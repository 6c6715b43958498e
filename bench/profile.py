"""Where a decode step's time goes: `python -m mtp.bench.profile [--heads eagle] [--dtype bfloat16] [--limit 2]`.

Wraps the phases of `mtp.decoding.speculative_generate` with wall-clock timers (propose, the verify forward,
verification, KV crop, prompt lookup, the proposer's bookkeeping, the adaptive policy) and reports
milliseconds per step next to a plain decode step of the same model (one `generate()` token, and one bare
forward with a KV cache), in milliseconds and in decode steps (one plain `generate()` token). What is left
after the timed phases is the loop's own Python. This is how the README's "why the target was missed"
numbers were made; `--compile` profiles compiled verify steps, `--pack` prepacked weights. `--tree 2,4,8,16
--lookup off` times fixed trees of those sizes: the verify cost per node count and the drafting cost per depth
that tree sizing reads (`drafter_trainer.VERIFY_COST_BF16`).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from mtp import adaptive, decoding, eagle_proposer, ngram, proposer


@contextmanager
def timed_methods(targets, totals: dict[str, float], counts: dict[str, int] | None = None):
    """Patch each (class, method name, phase) so every call adds its wall time to totals[phase] (and one to
    counts[phase]); restore on exit. A method the class only inherits is left alone: it is not its own phase.
    Shared by this profiler and the batched engine's (`bench/batch_profile.py`)."""
    saved = []
    for cls, name, phase in targets:
        if name not in vars(cls):
            continue
        original = vars(cls)[name]
        saved.append((cls, name, original))

        def wrapper(*args, _f=original, _p=phase, **kwargs):
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                totals[_p] += time.perf_counter() - t0
                if counts is not None:
                    counts[_p] += 1

        setattr(cls, name, wrapper)
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def timed_phases(totals: dict[str, float]):
    """The phases of `mtp.decoding.speculative_generate`, timed into totals[phase] (`timed_methods`)."""
    targets = [
        (decoding.TreeScorer, "score", "verify forward"),
        (decoding.TreeScorer, "keep", "KV crop"),
        (decoding.GreedyStrategy, "propose", "propose (heads)"),
        (decoding.GreedyStrategy, "verify", "verify (argmax walk)"),
        (ngram.NgramDraft, "graft", "prompt lookup"),
        (ngram.NgramDraft, "observe", "prompt lookup"),
        (proposer.MTPProposer, "observe", "proposer observe"),
        (proposer.MedusaProposer, "observe", "proposer observe"),
        (eagle_proposer.EagleProposer, "observe", "proposer observe"),
        (adaptive.AdaptiveDraft, "update", "adaptive policy"),
        (adaptive.AdaptiveDraft, "tree", "adaptive policy"),
    ]
    return timed_methods(targets, totals)


def bare_forward_ms(model: torch.nn.Module, ids: torch.Tensor, repeats: int = 20) -> float:
    """One-token forward with a KV cache of the prompt: the floor any decode step pays."""
    from transformers import DynamicCache

    from mtp.arch import describe

    key = describe(model).cache_kwarg
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids, use_cache=True, **{key: cache})
        tok = ids[:, -1:]
        t0 = time.perf_counter()
        for i in range(repeats):
            model(tok, use_cache=True, position_ids=torch.tensor([[ids.shape[1] + i]]), **{key: cache})
        return (time.perf_counter() - t0) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--limit", type=int, default=2, help="MT-Bench questions")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--tree", default="default", help="'default', 'chain', 'auto', or node counts (fixed trees): 2,4,8,16"
    )
    parser.add_argument("--lookup", choices=("both", "on", "off"), default="both", help="prompt lookup runs")
    parser.add_argument("--heads", default=None, help="a shipped head set (mtp, eagle) or a heads dir")
    parser.add_argument("--compile", action="store_true", help="compiled verify steps (MTPModel.compile_decoding)")
    parser.add_argument("--pack", action="store_true", help="prepacked weights (MTPModel.pack_decoding)")
    args = parser.parse_args()

    from mtp.default_model import load_default_mtp

    from .mtbench import first_turn_ids, load_mtbench

    model, tokenizer, _ = load_default_mtp(getattr(torch, args.dtype), args.heads)
    if args.tree.replace(",", "").isdigit():
        trees = [int(n) for n in args.tree.split(",")]
    else:
        trees = [None if args.tree == "auto" else args.tree]
    lookups = {"both": (False, True), "on": (True,), "off": (False,)}[args.lookup]
    prompts = [first_turn_ids(tokenizer, q) for q in load_mtbench(limit=args.limit)]
    if args.pack:
        model.pack_decoding()
    if args.compile:
        from mtp.cli import _compile_decoding

        _compile_decoding(model, " (not timed)")
    model.generate(prompts[0][:, :8], max_new_tokens=4)  # warm-up
    plain_s = plain_tokens = 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        seq = model.base_model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_s += time.perf_counter() - t0
        plain_tokens += seq.shape[1] - ids.shape[1]
    bare = bare_forward_ms(model.base_model, prompts[0])
    plain_ms = plain_s / plain_tokens * 1000
    for tree, lookup in [(t, u) for t in trees for u in lookups]:
        totals: dict[str, float] = defaultdict(float)
        steps = tokens = 0
        wall = 0.0
        with timed_phases(totals):
            for ids in prompts:
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, tree=tree, prompt_lookup=lookup,
                                     return_dict_in_generate=True)  # fmt: skip
                wall += time.perf_counter() - t0
                steps += len(out.accepted_lengths)
                tokens += out.num_new_tokens
        print(f"\n{args.dtype}, tree={tree or 'auto'}, prompt_lookup={lookup}: {steps} steps, {tokens} tokens, "
              f"τ {(tokens - len(prompts)) / steps:.2f}, {tokens / wall:.1f} tok/s "
              f"(plain generate() {plain_tokens / plain_s:.1f} tok/s)")  # fmt: skip
        print(f"  {'phase':<24}{'ms/step':>9}{'share':>8}{'decode steps':>14}")
        accounted = 0.0
        for phase, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            accounted += seconds
            ms = seconds / steps * 1000
            print(f"  {phase:<24}{ms:9.2f}{seconds / wall:8.1%}{ms / plain_ms:14.3f}")
        rest = wall - accounted  # prefill, the loop's own Python, emission, streaming checks
        rest_ms = rest / steps * 1000
        print(f"  {'rest (prefill, loop)':<24}{rest_ms:9.2f}{rest / wall:8.1%}{rest_ms / plain_ms:14.3f}")
        print(f"  {'total':<24}{wall / steps * 1000:9.2f}{'':8}{wall / steps * 1000 / plain_ms:14.3f}")
    print(f"\nplain generate(): {plain_ms:.2f} ms/token (= 1 decode step); bare 1-token forward with cache: "
          f"{bare:.2f} ms (the rest of a generate() step is its own overhead)")  # fmt: skip


if __name__ == "__main__":
    main()
