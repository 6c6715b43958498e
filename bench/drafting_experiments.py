"""Two drafting ideas that need no training, measured against the default drafting (neither is shipped).

Why: τ (tokens per verify step) is what limits the speedup, and training better heads costs CPU hours.
These two raise τ without touching the heads, so they were measured first:

* ``datastore``: REST-style retrieval (He et al., 2023). The assistant turns of ShareGPT conversations
  before ``--datastore-end`` (17M tokens) are indexed by their 4-, 3- and 2-grams; each step, when prompt
  lookup finds nothing, the continuations of the longest matching n-gram (up to 256 of them) vote on a
  chain, token by token, while one token holds ``--min-share`` of the votes. The chain is grafted onto the
  heads' tree exactly like a prompt-lookup chain (`mtp.ngram.NgramDraft`, with its own accuracy estimate).
* ``dynamic``: EAGLE-2-style trees (Li et al., 2024). Instead of the static tree shaped by average head
  accuracies, each step grows the tree from the drafter's own confidence: expand the ``--beam`` most
  likely nodes of each depth by their top ``--width`` children, then keep the ``--nodes`` most likely nodes
  (joint draft probability along the path).

Both go through the normal decoder (greedy, the same verification), so outputs stay identical to plain
decoding; the script checks it. Prompts: the first 8 chat and 8 code prompts of ShareGPT conversations
``--datastore-end``..15,000: training split (never reported as held-out), and not in the datastore.

    python -m mtp.bench.drafting_experiments datastore
    python -m mtp.bench.drafting_experiments dynamic --nodes 16 --heads mtp
    python -m mtp.bench.drafting_experiments dynamic --nodes 16 --depth 5 --width 3 --beam 3 --heads eagle

The patches below replace two names inside `mtp.decoding` for the duration of one run; the shipped decoder
has neither idea. Results: docs/benchmarks.md ("Drafting without more training").
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import mtp.decoding as decoding
from mtp.ngram import NgramDraft
from mtp.tree import Tree

GRAMS = (4, 3, 2)
MAX_VOTERS, WINDOW = 256, 10


class Datastore:
    """Token n-grams of a large text -> the continuations that followed them (sorted keys, searchsorted)."""

    def __init__(self, tokens: np.ndarray, min_share: float):
        self.tokens, self.min_share = tokens, min_share
        wide = tokens.astype(np.uint64)
        self.index = {}
        for n in GRAMS:
            key = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
            for j in range(n):  # vocabularies under 2**16: n 16-bit fields in one key
                key = (key << np.uint64(16)) | wide[j : len(tokens) - n + 1 + j]
            order = np.argsort(key, kind="stable")
            self.index[n] = (key[order], order + n - 1)  # position of each n-gram's last token

    def chain(self, context: list[int], length: int) -> list[int]:
        for n in GRAMS:
            if len(context) < n:
                continue
            key = np.uint64(sum(int(t) << (16 * (n - 1 - j)) for j, t in enumerate(context[-n:])))
            keys, ends = self.index[n]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi - lo < 2:
                continue
            ends = ends[lo:hi]
            if len(ends) > MAX_VOTERS:
                ends = ends[np.linspace(0, len(ends) - 1, MAX_VOTERS).astype(int)]
            ends = ends[ends + WINDOW < len(self.tokens)]
            votes = self.tokens[ends[:, None] + 1 + np.arange(WINDOW)]
            out: list[int] = []
            for d in range(min(WINDOW, length)):
                values, counts = np.unique(votes[:, d], return_counts=True)
                best = counts.argmax()
                if counts[best] < 2 or counts[best] < self.min_share * len(votes):
                    break
                out.append(int(values[best]))
                votes = votes[votes[:, d] == values[best]]
            return out
        return []


def build_datastore(tokenizer, end: int, cache: Path) -> np.ndarray:
    """Assistant turns (mostly ASCII) of ShareGPT conversations [0, end), tokenized, each closed by <|im_end|>."""
    if cache.is_file():
        return np.load(cache)
    from mtp.train.sharegpt import ROLE_MAP, iter_sharegpt

    texts = []
    for i, record in enumerate(iter_sharegpt(None)):
        if i >= end:
            break
        for turn in record["conversations"]:
            value = turn["value"].strip()
            if ROLE_MAP.get(turn["from"].lower()) == "assistant" and value:
                if sum(c < "\x80" for c in value) >= 0.95 * len(value):
                    texts.append(value)
    close = tokenizer.convert_tokens_to_ids("<|im_end|>")
    parts = []
    for s in range(0, len(texts), 2000):
        for ids in tokenizer(texts[s : s + 2000], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray([*ids, close], dtype=np.int32))
    tokens = np.concatenate(parts)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, tokens)
    return tokens


class _Tokens:
    """The `NgramIndex` interface over a datastore: it only needs the last few tokens."""

    def __init__(self, store: Datastore, context: list[int]):
        self.store, self.tokens = store, list(context[-8:])

    def extend(self, new: list[int]) -> None:
        self.tokens = (self.tokens + list(new))[-8:]

    def lookup(self, length: int) -> list[int]:
        return self.store.chain(self.tokens, length)


def datastore_drafts(store: Datastore, counts: dict[str, int]):
    """An `NgramDraft` stand-in: prompt lookup first; the datastore's chain when lookup grafts nothing.

    `counts` collects, over every step: steps, steps with a datastore chain, and its tokens the model confirmed
    beyond the ones the step accepted anyway (what retrieval added)."""

    class Both:
        def __init__(self, context: list[int], node_cost: float, **_):
            self.lookup = NgramDraft(context, node_cost=node_cost)
            self.retrieval = NgramDraft([], node_cost=node_cost)
            self.retrieval.index = _Tokens(store, context)

        def graft(self, tree, draft, room, merge=True):
            tree, draft = self.lookup.graft(tree, draft, room, merge)
            if self.lookup.grafted:
                self.retrieval.chain, self.retrieval.grafted = [], 0
                return tree, draft
            return self.retrieval.graft(tree, draft, room, merge)

        def observe(self, emitted: list[int]) -> None:
            chain, right = self.retrieval.chain, 0
            while right < min(len(chain), len(emitted)) and chain[right] == emitted[right]:
                right += 1
            counts["steps"] += 1
            counts["with a chain"] += bool(chain)
            counts["tokens beyond the accepted"] += max(0, right - (len(emitted) - 1))
            self.lookup.observe(emitted)
            self.retrieval.observe(emitted)

    return Both


def dynamic_tree(proposer, root: int, nodes: int, depth: int, width: int, beam: int) -> tuple[Tree, torch.Tensor]:
    """Grow a tree by the drafter's confidence (EAGLE-2): expand, then keep the `nodes` likeliest nodes.

    Each depth re-drafts the partial tree (the proposers draft whole trees); a node's draft depends only on
    its ancestors, so the drafts of the kept nodes equal those a one-shot draft of the final tree gives."""
    paths, score, tokens = [(r,) for r in range(width)], {}, {}
    for k in range(1, depth + 1):
        tree = Tree(paths)
        draft = proposer.propose(root, tree).tolist()
        tokens = {p: draft[i + 1] for i, p in enumerate(tree.paths)}
        for parent, logits in proposer.draft_logits.items():
            logp = torch.log_softmax(logits.float(), -1).topk(width).values.tolist()
            prefix = tree.paths[parent - 1] if parent else ()
            for r in range(width):
                score[(*prefix, r)] = score.get(prefix, 0.0) + logp[r]
        if k < depth:
            frontier = sorted((p for p in tree.paths if len(p) == k), key=lambda p: -score[p])[:beam]
            paths = [*tree.paths, *((*p, r) for p in frontier for r in range(width))]
    keep = set(sorted(score, key=lambda p: (-score[p], len(p)))[: nodes - 1])
    keep |= {p[:j] for p in keep for j in range(1, len(p))}
    final = Tree(list(keep))
    return final, torch.tensor([root] + [tokens[p] for p in final.paths])


@contextmanager
def patched(drafts_class=None, tree_fn=None, full_depth: int = 0):
    """Swap `mtp.decoding`'s prompt-lookup class and/or the greedy proposal for one run.

    `tree_fn(proposer, root)` replaces the draft of every step whose static tree is uncut (`full_depth` deep)."""
    saved_class, saved_propose = decoding.NgramDraft, decoding.GreedyStrategy.propose
    pending: dict[str, Tree] = {}
    base_class = drafts_class or saved_class
    if tree_fn is not None:

        def propose(self, proposer, root, tree):
            if len(tree) > 1 and tree.depth == full_depth:
                pending["tree"], draft = tree_fn(proposer, root)
                return draft, None
            return saved_propose(self, proposer, root, tree)

        class WithTree(base_class):  # the loop grafts onto its static tree: hand it the grown one instead
            def graft(self, tree, draft, room, merge=True):
                return super().graft(pending.pop("tree", tree), draft, room, merge)

        decoding.GreedyStrategy.propose, decoding.NgramDraft = propose, WithTree
    elif drafts_class is not None:
        decoding.NgramDraft = drafts_class
    try:
        yield
    finally:
        decoding.NgramDraft, decoding.GreedyStrategy.propose = saved_class, saved_propose


def unseen_dev_prompts(start: int, per_kind: int) -> list[str]:
    """Training-split prompts from conversations `start`.. (not in the datastore; `tree_sweep.dev_prompts` are)."""
    from mtp.train.prompt_sets import HELDOUT_START, sharegpt_prompts

    picked, count = [], {"chat": 0, "code": 0}
    for index, kind, text in sharegpt_prompts("train"):
        if start <= index < HELDOUT_START and count[kind] < per_kind:
            picked.append(text)
            count[kind] += 1
        if min(count.values()) >= per_kind:
            break
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["datastore", "dynamic"])
    parser.add_argument("--heads", default="mtp")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--per-kind", type=int, default=8)
    parser.add_argument("--datastore-end", type=int, default=14_000)
    parser.add_argument("--datastore-cache", type=Path, default=Path("runs/datastore/sharegpt-train.npy"))
    parser.add_argument("--min-share", type=float, default=0.3)
    parser.add_argument("--nodes", type=int, default=16, help="dynamic: nodes per tree (root included)")
    parser.add_argument("--depth", type=int, default=None, help="dynamic: default = the default tree's depth")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--beam", type=int, default=4)
    args = parser.parse_args(argv)

    from mtp.default_model import load_default_mtp

    from .mtbench import chat_prompt_ids

    model, tokenizer, _ = load_default_mtp(getattr(torch, args.dtype), args.heads)
    model.pack_decoding()
    ids = [chat_prompt_ids(tokenizer, p[:2000]) for p in unseen_dev_prompts(args.datastore_end, args.per_kind)]
    model.generate(ids[0][:, :8], max_new_tokens=4)  # warm-up
    static = model.default_tree
    counts: Counter[str] = Counter()
    runs: list[tuple[str, object, object]] = [(f"static {len(static)} nodes", "default", patched())]
    if args.experiment == "datastore":
        t0 = time.perf_counter()
        store = Datastore(build_datastore(tokenizer, args.datastore_end, args.datastore_cache), args.min_share)
        print(f"datastore: {len(store.tokens):,} tokens indexed in {time.perf_counter() - t0:.0f} s")
        runs.append((f"static {len(static)} nodes + datastore", "default", patched(datastore_drafts(store, counts))))
    else:
        depth = args.depth or static.depth

        def grow(proposer, root):
            return dynamic_tree(proposer, root, args.nodes, depth, args.width, args.beam)

        if args.nodes != len(static):
            runs.append((f"static {args.nodes} nodes", args.nodes, patched()))
        runs.append(
            (f"dynamic {args.nodes} nodes, depth {depth}", "default", patched(tree_fn=grow, full_depth=static.depth))
        )
    outputs = []
    for label, tree, patch in runs:
        taus, tokens, seconds, texts = [], 0, 0.0, []
        with patch:
            for x in ids:
                t0 = time.perf_counter()
                out = model.generate(x, max_new_tokens=args.max_new_tokens, tree=tree, return_dict_in_generate=True)
                seconds += time.perf_counter() - t0
                taus.append(out.tau)
                tokens += out.num_new_tokens
                texts.append(out.sequences[0, x.shape[1] :].tolist())
        outputs.append(texts)
        same = sum(a == b for a, b in zip(outputs[0], texts, strict=True))
        print(f"{label:40s} τ {np.mean(taus):.3f}  {tokens / seconds:5.1f} tok/s  identical {same}/{len(ids)}")
    if counts:
        print("datastore:", dict(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
