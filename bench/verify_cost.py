"""How much one forward over k new tokens costs relative to k = 1, with a ~300-token cache.

This curve decides what tree a machine can afford: if verifying 16 nodes costs 1.5 decode steps, a
tree must buy more than 1.5 tokens per step to pay off. `mtp bench --verify-cost` prints it and the
decoder's tree picker (`mtp.tree.pick_tree`) consumes it.
"""

from __future__ import annotations

import time

import torch

from mtp.arch import describe
from mtp.kv_cache import new_cache

KS = (1, 2, 4, 8, 16, 32, 64)


@torch.inference_mode()
def verify_cost_curve(
    base: torch.nn.Module, ks: tuple[int, ...] = KS, cache_len: int = 300, repeats: int = 5, seed: int = 0
) -> dict[int, float]:
    """{k: seconds for one forward over k tokens} (minimum over `repeats`, after a warm-up)."""
    g = torch.Generator().manual_seed(seed)
    vocab = base.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(0, vocab, (1, cache_len), generator=g)
    info = describe(base)
    kwarg = info.cache_kwarg
    keep = {"logits_to_keep": 1} if info.logits_to_keep else {}
    times: dict[int, float] = {}
    for k in ks:
        best = float("inf")
        for rep in range(repeats + 1):
            cache = new_cache()
            base(prefix, use_cache=True, **keep, **{kwarg: cache})
            x = torch.randint(0, vocab, (1, k), generator=g)
            t0 = time.perf_counter()
            base(x, use_cache=True, **{kwarg: cache})
            if rep:  # the first run is a warm-up
                best = min(best, time.perf_counter() - t0)
        times[k] = best
    return times


def relative(times: dict[int, float]) -> dict[int, float]:
    return {k: v / times[min(times)] for k, v in times.items()}
