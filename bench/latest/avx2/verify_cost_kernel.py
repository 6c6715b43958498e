"""bf16 forward cost over k new tokens (300 cached), the three runtimes interleaved per repetition: the model's own
weights, fp32 copies (mtp.packed without the kernel) and the AVX2 kernel (mtp.bf16_avx2). Best of 7 per size."""

import time

import torch
from transformers import AutoModelForCausalLM

from mtp import packed
from mtp.default_model import default_model_dir
from mtp.kv_cache import new_cache

model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.bfloat16).eval()
with_kernel = packed.bf16_kernel
packed.bf16_kernel = lambda: False
copies = packed.packed_copy(model)
packed.bf16_kernel = with_kernel
variants = {"own": model, "fp32 copies": copies, "kernel": packed.packed_copy(model)}
g = torch.Generator().manual_seed(0)
prefix = torch.randint(0, 49152, (1, 300), generator=g)
with torch.inference_mode():
    caches = {name: new_cache() for name in variants}
    for name, m in variants.items():
        m(prefix, use_cache=True, cache=caches[name])
    best: dict[str, dict[int, float]] = {name: {} for name in variants}
    for k in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        for rep in range(8):
            x = torch.randint(0, 49152, (1, k), generator=g)
            for name, m in variants.items():
                if name == "own" and k > 16:
                    continue  # k forwards' worth each: too slow to be worth timing
                t0 = time.perf_counter()
                m(x, use_cache=True, cache=caches[name])
                seconds = time.perf_counter() - t0
                caches[name].crop(-k)
                if rep:  # the first is a warm-up
                    best[name][k] = min(best[name].get(k, float("inf")), seconds)
    one = best["own"][1]
    for name in variants:
        print(f"{name:12s} ms", {k: round(v * 1000, 1) for k, v in best[name].items()})
        print(f"{name:12s} / own one-token step", {k: round(v / one, 2) for k, v in best[name].items()})
