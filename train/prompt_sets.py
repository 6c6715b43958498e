"""Training prompts and held-out prompts, chat and code, from ShareGPT: one fixed, documented split.

Why a fixed split by position: every earlier training run of the shipped heads read ShareGPT from its start
(at most the first 9,000 conversations as raw text, and the first-turn prompts of the first few thousand as
distillation prompts). Conversations from ``HELDOUT_START`` on were never read by any training or tuning
step, so prompts taken from there are held out for the shipped heads and for every drafter trained with
``training_prompts`` (which only reads conversations before ``HELDOUT_START``).

"Code" is a prompt that asks for or shows code (a keyword or code-like syntax); everything else is "chat".
Prompts are kept when they are mostly ASCII (SmolLM2 is an English model) and of a length a chat user
sends (``MIN_CHARS``..``MAX_CHARS``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

HELDOUT_START = 15_000
MIN_CHARS = 20
MAX_CHARS = 1_500

_CODE_WORDS = re.compile(
    r"```|\bdef \w+\(|\bfunction\b|\bclass \w+|\bimport \w+|#include|\bSELECT\b|\bpython\b|\bjavascript\b|"
    r"\btypescript\b|\bjava\b|\bc\+\+|\bc#|\bsql\b|\bregex\b|\bhtml\b|\bcss\b|\bbash\b|\bcode\b|"
    r"\bapi\b|\breact\b|\bnode\.?js\b|\bdjango\b|\bflask\b|\bpandas\b|\bnumpy\b|\bcompile|\bbug\b|\bsnippet\b|"
    r"\balgorithm\b|\bkotlin\b|\bswift\b|\brust\b|\bgolang\b|\bphp\b|\bdocker|\bgit\b|=>|\{\s*$",
    re.IGNORECASE | re.MULTILINE,
)


def is_code(prompt: str) -> bool:
    """True when a prompt asks for, or contains, code."""
    return _CODE_WORDS.search(prompt) is not None


def _usable(prompt: str) -> bool:
    if not (MIN_CHARS <= len(prompt) <= MAX_CHARS):
        return False
    ascii_chars = sum(1 for c in prompt if ord(c) < 128)
    return ascii_chars >= 0.95 * len(prompt)


def sharegpt_prompts(split: str, path: str | None = None) -> Iterator[tuple[int, str, str]]:
    """(conversation index, kind, first user turn) of the usable prompts of one split ("train"/"heldout")."""
    from .sharegpt import ROLE_MAP, iter_sharegpt

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for index, record in enumerate(iter_sharegpt(path)):
        if split == "train" and index >= HELDOUT_START:
            return
        if split == "heldout" and index < HELDOUT_START:
            continue
        for turn in record["conversations"]:
            if ROLE_MAP.get(turn["from"].lower()) == "user" and turn["value"].strip():
                prompt = turn["value"].strip()
                if _usable(prompt):
                    yield index, ("code" if is_code(prompt) else "chat"), prompt
                break


def select(split: str, chat: int, code: int, path: str | None = None) -> list[dict]:
    """``chat`` chat and ``code`` code prompts of a split, interleaved so that any prefix holds both kinds."""
    chats: list[dict] = []
    codes: list[dict] = []
    for index, kind, prompt in sharegpt_prompts(split, path):
        bucket, want = (codes, code) if kind == "code" else (chats, chat)
        if len(bucket) < want:
            bucket.append({"prompt": prompt, "kind": kind, "sharegpt_index": index})
        if len(chats) >= chat and len(codes) >= code:
            break
    rows: list[dict] = []
    ratio = max(1, round(len(chats) / max(1, len(codes))))
    ci = iter(chats)
    for c in codes:
        rows.extend(x for _, x in zip(range(ratio), ci, strict=False))
        rows.append(c)
    rows.extend(ci)
    return rows


def write_jsonl(rows: list[dict], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["train", "heldout"], required=True)
    parser.add_argument("--chat", type=int, required=True)
    parser.add_argument("--code", type=int, required=True)
    parser.add_argument("--out", required=True, help=".jsonl with prompt, kind, sharegpt_index")
    args = parser.parse_args(argv)
    rows = select(args.split, args.chat, args.code)
    write_jsonl(rows, args.out)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("chat", "code")}
    print(f"{args.out}: {len(rows)} prompts ({kinds['chat']} chat, {kinds['code']} code) from the {args.split} split")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
