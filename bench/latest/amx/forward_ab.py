"""One bf16 forward over k new tokens (400 cached), prepacked SmolLM2: transformers' DynamicCache + sdpa against
mtp's GrowingLayer cache + grouped sdpa; the four combinations interleaved, best of 6 per repetition, 4 repetitions.
Also checks that every combination gives the same logits. Run from the repository root."""

import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from mtp import packed
from mtp.attention import use_grouped_sdpa
from mtp.default_model import default_model_dir
from mtp.kv_cache import new_cache

m = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.bfloat16).eval()
p = packed.packed_copy(m)
p2 = packed.packed_copy(m)
use_grouped_sdpa(p2)
g = torch.Generator().manual_seed(0)
prefix = torch.randint(0, 49152, (1, 400), generator=g)
res: dict = {}
variants = (("base", p, DynamicCache), ("grow", p, new_cache), ("gqa", p2, DynamicCache), ("both", p2, new_cache))
with torch.inference_mode():
    for _rep in range(4):
        for name, model, make in variants:
            for k in (1, 6):
                cache = make()
                model(prefix, use_cache=True, cache=cache)
                x = torch.randint(0, 49152, (1, k), generator=torch.Generator().manual_seed(k))
                mask = None
                if k > 1:
                    mask = torch.zeros(1, 1, k, 400 + k, dtype=torch.bfloat16)
                    mask[..., 400:] = torch.triu(torch.full((k, k), -3e38, dtype=torch.bfloat16), 1)
                best = 1e9
                for _ in range(6):
                    t0 = time.perf_counter()
                    out = model(x, use_cache=True, cache=cache, attention_mask=mask).logits
                    best = min(best, time.perf_counter() - t0)
                    cache.crop(-k)
                res.setdefault((name, k), []).append(best * 1000)
                res.setdefault(("out", k), {})[name] = out.clone()
for k in (1, 6):
    ref = res[("out", k)]["base"]
    same = {n: torch.equal(ref, o) for n, o in res[("out", k)].items()}
    ms = {n: round(min(res[(n, k)]), 1) for n, *_ in variants}
    print(f"k={k}: same logits {same}; ms (best over repetitions) {ms}")
