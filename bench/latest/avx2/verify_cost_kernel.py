"""bf16 forward cost over k new tokens (300 cached), interleaved: the model's own weights, fp32 copies, the AVX2 kernel."""
import time, torch
from transformers import AutoModelForCausalLM
from mtp.default_model import default_model_dir
from mtp.kv_cache import new_cache
from mtp import packed
m = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.bfloat16).eval()
orig = packed.bf16_kernel
packed.bf16_kernel = lambda: False
cp = packed.packed_copy(m)
packed.bf16_kernel = orig
pk = packed.packed_copy(m)
variants = {"own": m, "fp32 copies": cp, "kernel": pk}
g = torch.Generator().manual_seed(0)
prefix = torch.randint(0, 49152, (1, 300), generator=g)
caches = {}
with torch.inference_mode():
    for n, mm in variants.items():
        caches[n] = new_cache(); mm(prefix, use_cache=True, cache=caches[n])
    best = {n: {} for n in variants}
    for k in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        for r in range(8):
            x = torch.randint(0, 49152, (1, k), generator=g)
            for n, mm in variants.items():
                if n == "own" and k > 16: continue
                t0 = time.perf_counter(); mm(x, use_cache=True, cache=caches[n]); t = time.perf_counter() - t0
                caches[n].crop(-k)
                if r: best[n][k] = min(best[n].get(k, 9), t)
    one = best["own"][1]
    for n in variants:
        print(f"{n:12s} ms", {k: round(v * 1000, 1) for k, v in best[n].items()})
        print(f"{n:12s} / own one-token step", {k: round(v / one, 2) for k, v in best[n].items()})
