"""The bf16 cost curves of verify-cost.txt: from the model's own weights and from fp32 copies (mtp.packed)."""

import torch
from transformers import AutoModelForCausalLM

from mtp.bench.verify_cost import verify_cost_curve
from mtp.default_model import default_model_dir
from mtp.packed import packed_copy

m = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.bfloat16).eval()
for name, mm in [("bf16 eager", m), ("bf16 packed(upcast)", packed_copy(m))]:
    c = verify_cost_curve(mm, ks=(1, 2, 4, 6, 8, 16), repeats=3)
    print(name, f"k=1 {c[1] * 1000:.1f} ms", {k: round(v / c[1], 2) for k, v in c.items()})
