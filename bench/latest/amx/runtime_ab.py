"""End-to-end A/B, interleaved per prompt: transformers' DynamicCache + sdpa ("old") against mtp's GrowingLayer
caches + grouped sdpa ("new"), and plain generate(); eagle drafter, prepacked, 6 MT-Bench questions x 2, 128 new
tokens (or the first 6 held-out follow-ups). Run from the repository root:
python bench/latest/amx/runtime_ab.py [bfloat16|float32] [mtbench|followups]"""

import sys
import time

import torch
from transformers import DynamicCache

from mtp import decoding, eagle_proposer, kv_cache, proposer
from mtp.default_model import load_default_mtp

sys.path.insert(0, ".")
from bench.heldout import followups  # noqa: E402
from bench.mtbench import chat_prompt_ids, first_turn_ids, load_mtbench  # noqa: E402

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
model, tok, _ = load_default_mtp(dtype, "eagle")
model.pack_decoding()
if len(sys.argv) > 2 and sys.argv[2] == "followups":
    prompts = [chat_prompt_ids(tok, p.messages()) for p in followups(6)]
else:
    prompts = [first_turn_ids(tok, q) for q in load_mtbench(limit=6)]


def use(runtime: str) -> None:
    for module in (decoding, eagle_proposer, proposer):
        module.new_cache = DynamicCache if runtime == "old" else kv_cache.new_cache
    model.decoding_base.config._attn_implementation = "sdpa" if runtime == "old" else "mtp_grouped_sdpa"


model.generate(prompts[0][:, :8], max_new_tokens=4)
seconds = {"old": 0.0, "new": 0.0, "plain": 0.0}
tokens = dict.fromkeys(seconds, 0)
outs = {}
for _ in range(2):
    for i, ids in enumerate(prompts):
        for name in seconds:
            t0 = time.perf_counter()
            if name == "plain":
                seq = model.base_model.generate(ids, max_new_tokens=128, do_sample=False)
            else:
                use(name)
                seq = model.generate(ids, max_new_tokens=128)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += seq.shape[1] - ids.shape[1]
            outs[(name, i)] = seq
for name in seconds:
    print(name, f"{tokens[name] / seconds[name]:.1f} tok/s")
n = len(prompts)
print("new == old", sum(torch.equal(outs[("new", i)], outs[("old", i)]) for i in range(n)), "/", n)
print("new == plain", sum(torch.equal(outs[("new", i)], outs[("plain", i)]) for i in range(n)), "/", n)
