"""Self-distillation data for the shipped SmolLM2 heads: the model's own greedy answers to ShareGPT prompts.

Why a script: the shipped heads' data was produced before `mtp distill` existed; this file is the exact
recipe that made it (resumable: rerun the same command and it continues after the last written prompt).
Output: JSONL lines {"id", "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}, which
`mtp train` reads as chat data (rendered with the same chat template that serving uses).

  python scripts/distill_sharegpt.py --out ~/.cache/mtp/distill/sharegpt-greedy.jsonl \
      --limit 20000 --batch-size 16 --max-new-tokens 192 --dtype bfloat16
MT-Bench is never used here (it is for evaluation only); the last `--holdout` prompts of the shuffled
list are skipped so that a held-out ShareGPT slice stays unseen.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from mtp.default_model import load_default_model
from mtp.train.sharegpt import first_user_turns, read_sharegpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=20000)
    ap.add_argument("--holdout", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    records, report = read_sharegpt()
    prompts = [p for p in first_user_turns(records) if p.strip()]
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[: len(prompts) - args.holdout][: args.limit]
    model, tok = load_default_model(torch_dtype=getattr(torch, args.dtype))
    tok.padding_side = "left"
    done = 0
    if args.out.exists():
        done = sum(1 for _ in args.out.open())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{report.complete} conversations, {len(prompts)} prompts, {done} already done", flush=True)
    t0, new_tokens = time.time(), 0
    with args.out.open("a") as f:
        for start in range(done, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            texts = [
                tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in batch
            ]
            enc = tok(
                texts,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=args.max_prompt_tokens,
                add_special_tokens=False,
            )
            with torch.inference_mode():
                out = model.generate(
                    **enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                )
            for i, p in enumerate(batch):
                ids = out[i, enc.input_ids.shape[1] :]
                ids = ids[ids != tok.pad_token_id] if tok.pad_token_id != tok.eos_token_id else ids
                answer = tok.decode(ids, skip_special_tokens=True)
                new_tokens += len(ids)
                msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"id": start + i, "messages": msgs}) + "\n")
            f.flush()
            dt = time.time() - t0
            print(
                f"{start + len(batch)}/{len(prompts)} prompts, {new_tokens} tokens, "
                f"{new_tokens / dt:.1f} tok/s, {dt / 60:.1f} min",
                flush=True,
            )


if __name__ == "__main__":
    main()
