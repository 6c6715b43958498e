"""Which oneDNN weight layout decodes faster: the same prompts, two packed copies, one process, round-robin.

    python -m mtp.bench.pack_layout --heads eagle --hints 1,16 --n 8 --max-new-tokens 128

`mtp.packed.PackedLinear` lays each weight out for a row count (`BATCH_HINT`). First the matmuls alone: every
linear layer of the base, in forward order, per layout and row count (`--rows`; the median of 9 passes, each
reading all the weights from memory as a forward does). Then decoding: this loads the default model with the
given heads once per hint, packs each copy with that hint, and times, per prompt and in turn: plain
`generate()` (the model's own weights: the reference), then for every hint one-token decoding
(`speculative=False`) and speculative decoding from that copy. The machine's speed drifts, so every method
runs on every prompt within seconds of the others and only ratios to plain `generate()` are reported. Each
answer is checked token for token against plain `generate()`.

Prompts: the held-out chat and code sets (bench/heldout.py), `--n` of each, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest.mock import patch

import torch


def _load(heads: str, dtype: torch.dtype, hint: int):
    from mtp import packed
    from mtp.default_model import load_default_mtp

    with patch.dict(packed.BATCH_HINT, {dtype: hint}):
        model, tokenizer, _ = load_default_mtp(dtype, heads)
        model.pack_decoding()
    return model, tokenizer


def time_linears(bases: dict[int, torch.nn.Module], rows: list[int], reps: int = 9) -> None:
    """Milliseconds for one pass over every packed linear layer of each base (forward order), per hint and row
    count."""
    from mtp.packed import PackedLinear

    layers = {h: [m for m in base.modules() if isinstance(m, PackedLinear)] for h, base in bases.items()}
    first = next(iter(layers.values()))
    print(f"{len(first)} linear layers, ms per pass over all of them (median of {reps}):")
    with torch.inference_mode():
        for n in rows:
            xs = {m.in_features: torch.randn(n, m.in_features, dtype=m.weight.dtype) for m in first}
            cells = []
            for h, layout in layers.items():

                def one_pass(layout=layout, xs=xs) -> None:
                    for m in layout:
                        m(xs[m.in_features])

                one_pass()
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    one_pass()
                    times.append(time.perf_counter() - t0)
                cells.append(f"hint {h}: {1e3 * statistics.median(times):6.1f}")
            print(f"  {n:3d} rows  " + "  ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    from mtp.bench.heldout import heldout_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="eagle", help="a shipped head set (mtp, eagle) or a heads dir")
    ap.add_argument("--hints", default="1,16", help="batch-size hints to compare, comma-separated")
    ap.add_argument("--n", type=int, default=8, help="prompts per kind (chat, code)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64", help="row counts for the matmul table ('' skips it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hints = [int(h) for h in args.hints.split(",")]
    models = {h: _load(args.heads, dtype, h) for h in hints}
    model0, tokenizer = models[hints[0]]
    if args.rows:
        time_linears({h: m.decoding_base for h, (m, _) in models.items()}, [int(r) for r in args.rows.split(",")])
    chat, code = heldout_prompts("chat", args.n), heldout_prompts("code", args.n)
    prompts = [p for pair in zip(chat, code, strict=True) for p in pair]

    def ids_of(text: str) -> torch.Tensor:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]

    for model, _ in models.values():  # warm-up: first-call allocations are no method's cost
        model.generate(ids_of("Hello")[:, :8], max_new_tokens=4)
    ratios: dict[str, list[float]] = {}
    taus: dict[int, list[float]] = {h: [] for h in hints}
    identical = {f"{kind} hint {h}": 0 for h in hints for kind in ("one-token", "speculative")}
    for i, prompt in enumerate(prompts):
        ids = ids_of(prompt.text)
        t0 = time.perf_counter()
        ref = model0.base_model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        n_ref = ref.shape[1] - ids.shape[1]
        plain_tps = n_ref / (time.perf_counter() - t0)
        line = [f"{i + 1:2d} {prompt.kind:4s} plain {plain_tps:5.1f} tok/s"]
        for h in hints:
            model = models[h][0]
            for kind, speculative in (("one-token", False), ("speculative", True)):
                t0 = time.perf_counter()
                out = model.generate(
                    ids, max_new_tokens=args.max_new_tokens, speculative=speculative, return_dict_in_generate=True
                )
                tps = out.num_new_tokens / (time.perf_counter() - t0)
                key = f"{kind} hint {h}"
                ratios.setdefault(key, []).append(tps / plain_tps)
                identical[key] += int(torch.equal(out.sequences, ref))
                if speculative:
                    taus[h].append(out.tau)
                line.append(f"{key} {tps / plain_tps:.2f}x")
        print("  ".join(line), flush=True)
    print(f"\n{args.heads} heads, {args.dtype}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    for key, values in ratios.items():
        h = int(key.rsplit(" ", 1)[1])
        tau = f", τ {statistics.mean(taus[h]):.2f}" if key.startswith("speculative") else ""
        print(
            f"  {key:22s} median {statistics.median(values):.2f}x (min {min(values):.2f}x){tau}, "
            f"identical {identical[key]}/{len(prompts)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
