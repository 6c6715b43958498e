"""Per-depth top-1 of an MTP checkpoint's drafter on held-out text, teacher-forced and free-running.

    python -m mtp.bench.drafter_accuracy                               # the shipped heads
    python -m mtp.bench.drafter_accuracy --heads runs/a/heads runs/b/heads --n 24 --positions 32

The text: the base model's own greedy answers (`generate()`, greedy, in --dtype, bfloat16 by default) to the
held-out prompts of bench/heldout.py, chat and code (and follow-ups: `--kinds chat,code,followup`) reported
apart. Answers are cached as token ids in a JSON file per base model, dtype and length under --cache-dir
(default ``$MTP_CACHE_DIR/drafter_accuracy``), so a second run, or a run on other heads of the same base, reuses
them.

Positions: for a text x_0..x_{L-1} whose answer starts at P, position t drafts from the context x_0..x_{t+1}
(root = x_{t+1}, the token the base just chose) and depth k (1-based) guesses x_{t+k+1}: t runs over
P-1 .. L-K-2, the positions of the answer where all K depths have a target.

Two ways to score depth k at position t:

- **teacher-forced**: one forward of the heads over the whole text, `heads(features, lm_head, num_heads=K,
  input_ids=ids)` -> (K, B, T, V), as in training and `mtp train`'s held-out table (lm_head: the drafting
  projection, restricted to the model's draft vocabulary when it has one): depth k sees the true tokens
  before its target, whatever it would have drafted itself.
- **free-running**: what the decoder drafts. A fresh proposer (`model.make_proposer()`, with the model's
  draft vocabulary) gets `begin(features of x_0..x_t, x_0..x_t)` and `propose(x_{t+1}, chain of K)`; the
  k-th drafted token is compared with x_{t+k+1}. Depth k therefore builds on the drafter's own depths
  1..k-1. Positions are subsampled (--positions per text, evenly spaced) to stay cheap.

"acceptance" is the free-running conditional "depth k right given depths 1..k-1 right": the share of chain
drafts that survive depth k once they survived depth k-1, what verification accepts. "chain τ" is
1 + the mean number of leading right drafts of a chain of K (tokens per verify step of a chain, bonus
included, the text being the base's own greedy answer).

Features: the final hidden state, or for drafters that observe several base layers (``feature_layers`` on
the heads / the proposer, the EAGLE drafter) `mtp.eagle.select_features(hidden_states, feature_layers)`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .heldout import SETS as KINDS  # the held-out sets a run can score: chat, code, followup

# ---- scoring one text --------------------------------------------------------------------------------------


def features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] | None) -> torch.Tensor:
    """What a drafter observes of the base (the final hidden state, or fused layer inputs)."""
    if layers is None:
        return hidden_states[-1]
    from mtp.eagle import select_features

    return select_features(hidden_states, tuple(layers))


def drafting_lm_head(model) -> nn.Module:
    """The projection the model's proposer drafts with: the base lm_head, restricted to the model's draft
    vocabulary when it has one (as `MTPModel.make_proposer` does). Heads with their own projection ignore it."""
    lm_head = model.base_model.get_output_embeddings()
    if getattr(model, "draft_vocab", None) is not None:
        from mtp.draft_vocab import DraftProjection

        lm_head = DraftProjection(lm_head, model.draft_vocab)
    return lm_head


def answer_positions(prompt_len: int, length: int, depth: int) -> range:
    """Positions t whose root x_{t+1} is an answer token and whose K targets x_{t+2..t+K+1} all exist."""
    return range(max(0, prompt_len - 1), max(0, length - depth - 1))


def sample_positions(positions: range, count: int) -> list[int]:
    """`count` evenly spaced positions (first and last included); all of them when count <= 0 or too few."""
    n = len(positions)
    if count <= 0 or n <= count:
        return list(positions)
    if count == 1:
        return [positions[0]]
    return sorted({positions[round(i * (n - 1) / (count - 1))] for i in range(count)})


def teacher_forced_hits(
    model, ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], positions: list[int], depth: int
) -> torch.Tensor:
    """(N, K) bool: the heads' top-1 at depth k (from one forward over the text) == x_{t+k+1}."""
    if not positions:
        return torch.zeros(0, depth, dtype=torch.bool)
    heads = model.heads
    feats = features(hidden_states, getattr(heads, "feature_layers", None))
    logits = heads(feats, drafting_lm_head(model), num_heads=depth, input_ids=ids)  # (K, 1, T, V)
    guess = logits[:, 0].argmax(dim=-1).cpu()  # (K, T)
    pos = torch.tensor(positions)
    tokens = ids[0].cpu()
    cols = [guess[k, pos] == tokens[pos + k + 2] for k in range(depth)]
    return torch.stack(cols, dim=1)


def free_running_hits(
    model, ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], positions: list[int], depth: int
) -> torch.Tensor | None:
    """(N, K) bool: the k-th token of a chain drafted by a fresh proposer from x_0..x_{t+1} == x_{t+k+1}.

    None when the head type has no proposer (a `draft_lm` is a separate draft model, not MTP heads)."""
    from mtp.tree import chain

    try:
        probe = model.make_proposer()
    except ValueError:
        return None
    feats = features(hidden_states, getattr(probe, "feature_layers", None))[0]  # (T, d | n*d)
    tree = chain(depth)
    tokens = ids[0]
    rows = []
    for t in positions:
        proposer = model.make_proposer()
        proposer.begin(feats[: t + 1], tokens[: t + 1])
        draft = proposer.propose(int(tokens[t + 1]), tree)  # node d = depth d of the chain
        rows.append(draft[1 : depth + 1].cpu() == tokens[t + 2 : t + depth + 2].cpu())
    return torch.stack(rows) if rows else torch.zeros(0, depth, dtype=torch.bool)


@dataclass
class TextHits:
    teacher_forced: torch.Tensor  # (N, K) bool, every answer position
    teacher_forced_sampled: torch.Tensor  # (M, K) bool, the free-running positions
    free_running: torch.Tensor | None  # (M, K) bool


@torch.inference_mode()
def score_text(model, ids: torch.Tensor, prompt_len: int, depth: int, max_positions: int = 32) -> TextHits:
    """Both scores on one text (1, L): prompt ids then the answer ids from `prompt_len` on."""
    was_training = model.training
    model.eval()
    try:
        out = model.base_model(input_ids=ids, output_hidden_states=True)
        every = list(answer_positions(prompt_len, ids.shape[1], depth))
        sampled = sample_positions(answer_positions(prompt_len, ids.shape[1], depth), max_positions)
        tf = teacher_forced_hits(model, ids, out.hidden_states, every, depth)
        where = {t: i for i, t in enumerate(every)}
        tf_sampled = tf[[where[t] for t in sampled]] if sampled else tf[:0]
        fr = free_running_hits(model, ids, out.hidden_states, sampled, depth)
    finally:
        model.train(was_training)
    return TextHits(tf, tf_sampled, fr)


def _leading(hits: torch.Tensor) -> torch.Tensor:
    """(N, K) bool -> (N,) number of leading True per row."""
    return hits.long().cumprod(dim=1).sum(dim=1)


def summarize(texts: list[TextHits], depth: int) -> dict[str, Any]:
    """Per-depth top-1 (teacher-forced, free-running), conditional acceptance, chain τ, position counts."""
    empty = torch.zeros(0, depth, dtype=torch.bool)
    tf = torch.cat([t.teacher_forced for t in texts] or [empty])
    tfs = torch.cat([t.teacher_forced_sampled for t in texts] or [empty])
    has_fr = bool(texts) and all(t.free_running is not None for t in texts)
    fr = torch.cat([t.free_running for t in texts]) if has_fr else None

    def mean(x: torch.Tensor) -> float | None:
        return round(float(x.float().mean()), 4) if x.numel() else None

    rows = []
    for k in range(depth):
        row: dict[str, Any] = {
            "depth": k + 1,
            "predicts": f"t+{k + 2}",
            "top1_teacher_forced": mean(tf[:, k]),
            "top1_teacher_forced_sampled": mean(tfs[:, k]),
            "top1_free_running": None,
            "acceptance": None,
        }
        if fr is not None and fr.shape[0]:
            row["top1_free_running"] = mean(fr[:, k])
            survived = fr[:, :k].all(dim=1)  # depths 1..k-1 right (all rows for k = 1)
            if survived.any():
                row["acceptance"] = mean(fr[survived, k])
        rows.append(row)
    chain_tau = round(1 + float(_leading(fr).float().mean()), 4) if fr is not None and fr.shape[0] else None
    return {
        "texts": len(texts),
        "positions_teacher_forced": int(tf.shape[0]),
        "positions_free_running": int(fr.shape[0]) if fr is not None else 0,
        "chain_tau": chain_tau,
        "depths": rows,
    }


# ---- the text: the base's own greedy answers, cached --------------------------------------------------------


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def base_key(base_model: nn.Module, dtype: torch.dtype, max_new_tokens: int) -> str:
    """Cache key of a base's answers: its weight fingerprint (the one heads checkpoints record), dtype, length."""
    from mtp.checkpoint import base_fingerprint, base_probe

    return _digest([base_fingerprint(base_probe(base_model)), str(dtype), int(max_new_tokens)])


@torch.inference_mode()
def greedy_answers(
    base_model: nn.Module,
    prompts: list[tuple[str, torch.Tensor]],
    max_new_tokens: int,
    cache_file: Path | None = None,
    log=print,
) -> list[dict]:
    """[{id, prompt_ids, answer_ids}] for (id, (1, P) prompt ids) pairs: greedy `generate()` of the base.

    With `cache_file`, answers found there (keyed by the prompt ids) are reused and new ones added to it."""
    cache: dict[str, Any] = {"answers": {}}
    if cache_file is not None and cache_file.is_file():
        cache = json.loads(cache_file.read_text())
    answers = cache.setdefault("answers", {})
    out, added = [], 0
    for pid, ids in prompts:
        prompt = [int(x) for x in ids[0].tolist()]
        key = _digest(prompt)
        if key not in answers:
            t0 = time.perf_counter()
            seq = base_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            answers[key] = {"id": pid, "prompt_ids": prompt, "answer_ids": seq[0, ids.shape[1] :].tolist()}
            added += 1
            log(f"  answer {pid}: {seq.shape[1] - ids.shape[1]} tokens, {time.perf_counter() - t0:.1f}s")
            if cache_file is not None and added % 8 == 0:
                _write_json(cache_file, cache)
        out.append({**answers[key], "id": pid})
    if cache_file is not None and added:
        _write_json(cache_file, cache)
    return out


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)


# ---- checkpoints ----------------------------------------------------------------------------------------------


def _base_source(directory: Path) -> str:
    """Where a checkpoint's base lives: the dir itself (full checkpoint), "default", or the recorded path."""
    from mtp.config import MTPConfig

    if (directory / "config.json").is_file():
        return str(directory)
    source = MTPConfig.load(directory).base_model_name_or_path
    if not source:
        raise ValueError(f"{directory} holds heads only and records no base model")
    return source


def _load_base(source: str, dtype: torch.dtype):
    """(base model, tokenizer) of a base source."""
    if source == "default":
        from mtp.default_model import load_default_model

        return load_default_model(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    return base, AutoTokenizer.from_pretrained(source)


def evaluate(
    model,
    texts: dict[str, list[dict]],
    depth: int | None = None,
    max_positions: int = 32,
) -> dict[str, Any]:
    """Per kind: `summarize` of every text (`greedy_answers` rows) scored with `model`'s drafter."""
    depth = min(depth or model.config.num_heads, model.config.num_heads)
    device = next(model.base_model.parameters()).device
    results = {}
    for kind, rows in texts.items():
        hits = []
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["answer_ids"]], dtype=torch.long, device=device)
            if len(answer_positions(len(row["prompt_ids"]), ids.shape[1], depth)):
                hits.append(score_text(model, ids, len(row["prompt_ids"]), depth, max_positions))
        results[kind] = summarize(hits, depth)
    return results


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "–"


def markdown(report: dict[str, Any]) -> str:
    """One table per checkpoint: a row per (set, depth)."""
    meta = report["meta"]
    lines = [
        "# Drafter accuracy on held-out text",
        "",
        f"Text: the base's greedy answers ({meta['dtype']}, up to {meta['max_new_tokens']} new tokens) to "
        f"{meta['n']} held-out prompts per set (source: {meta['source']}). Free-running: up to "
        f"{meta['positions']} positions per text, evenly spaced (teacher-forced top-1 is given on every answer "
        "position and on those positions). acceptance = depth k right given depths 1..k-1 right (free-running); "
        "chain τ = 1 + mean leading right drafts of a chain.",
        "",
    ]
    for ckpt in report["checkpoints"]:
        lines += [f"## {ckpt['heads']} ({ckpt['head_type']}, depth {ckpt['depth']})", ""]
        lines += [
            "| set | depth | predicts | top-1 teacher-forced | teacher-forced, free-running positions | "
            "top-1 free-running | acceptance |",
            "|---|---|---|---|---|---|---|",
        ]
        notes = []
        for kind, res in ckpt["results"].items():
            for d in res["depths"]:
                lines.append(
                    f"| heldout-{kind} | {d['depth']} | {d['predicts']} | {_pct(d['top1_teacher_forced'])} | "
                    f"{_pct(d['top1_teacher_forced_sampled'])} | {_pct(d['top1_free_running'])} | "
                    f"{_pct(d['acceptance'])} |"
                )
            tau = f"{res['chain_tau']:.2f}" if res["chain_tau"] is not None else "–"
            notes.append(
                f"- heldout-{kind}: {res['texts']} texts, {res['positions_teacher_forced']} teacher-forced / "
                f"{res['positions_free_running']} free-running positions, chain τ {tau}"
            )
        lines += ["", *notes, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", default=None, help="MTP checkpoint dirs (default: the shipped heads)")
    parser.add_argument("--kinds", default="chat,code", help="held-out sets: chat,code,followup")
    parser.add_argument("--n", type=int, default=24, help="prompts per set")
    parser.add_argument("--source", default="both", help="held-out prompts: handwritten | sharegpt | both")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="length of the greedy answers")
    parser.add_argument("--dtype", default="bfloat16", help="of the answers and of the scoring")
    parser.add_argument("--positions", type=int, default=32, help="free-running positions per text (0: all)")
    parser.add_argument("--depth", type=int, default=0, help="depths scored (0: the checkpoint's num_heads)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="answer cache (default: mtp cache dir)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/drafter_accuracy"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args(argv)

    from mtp import MTPModel
    from mtp.default_model import SHIPPED_HEADS_DIR, cache_root

    from .heldout import heldout_set
    from .mtbench import chat_prompt_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: a subset of {KINDS}")
    dtype = getattr(torch, args.dtype)
    cache_dir = args.cache_dir or cache_root() / "drafter_accuracy"
    dirs = [Path(d) for d in (args.heads or [str(SHIPPED_HEADS_DIR)])]
    try:
        prompts = {kind: heldout_set(kind, args.n, args.source) for kind in kinds}
    except (ModuleNotFoundError, ValueError) as err:  # ShareGPT not installed, a bad --source
        parser.error(f"{err} (--source handwritten needs no ShareGPT)")
    by_base: dict[str, list[Path]] = {}
    for d in dirs:
        by_base.setdefault(_base_source(d), []).append(d)

    t_start = time.perf_counter()
    checkpoints = []
    for source, group in by_base.items():
        base, tokenizer = _load_base(source, dtype)
        cache_file = cache_dir / f"answers-{base_key(base, dtype, args.max_new_tokens)}.json"
        print(f"base {source}: answers in {cache_file}")
        texts = {
            kind: greedy_answers(
                base, [(p.id, chat_prompt_ids(tokenizer, p.messages())) for p in ps], args.max_new_tokens, cache_file
            )
            for kind, ps in prompts.items()
        }
        for d in group:
            model = MTPModel.from_pretrained(d, base_model=base)
            depth = min(args.depth or model.config.num_heads, model.config.num_heads)
            t0 = time.perf_counter()
            results = evaluate(model, texts, depth, args.positions)
            print(f"{d}: scored in {time.perf_counter() - t0:.1f}s")
            checkpoints.append(
                {"heads": str(d), "head_type": model.config.head_type, "depth": depth, "results": results}
            )
    report = {
        "meta": {
            "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens,
            "n": args.n,
            "source": args.source,
            "kinds": kinds,
            "positions": args.positions,
            "prompt_ids": {kind: [p.id for p in ps] for kind, ps in prompts.items()},
            "threads": torch.get_num_threads(),
            "wall_seconds": round(time.perf_counter() - t_start, 1),
        },
        "checkpoints": checkpoints,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "drafter_accuracy.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/drafter_accuracy.json, drafter_accuracy.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
