"""Training prompts and held-out prompts, chat and code, from ShareGPT: one fixed, documented split.

Why a fixed split by position: every earlier training run of the shipped heads read ShareGPT from its start
(at most the first 9,000 conversations as raw text, and the first-turn prompts of the first few thousand as
distillation prompts). Conversations from ``HELDOUT_START`` on were never read by any training or tuning
step, so prompts taken from there are held out for the shipped heads and for every drafter trained with
``training_prompts`` (which only reads conversations before ``HELDOUT_START``).

"Code" is a prompt that asks for or shows code (a keyword or code-like syntax); everything else is "chat".
Prompts are kept when they are mostly ASCII (SmolLM2 is an English model) and of a length a chat user
sends (``MIN_CHARS``..``MAX_CHARS``).

Second turns (``turn="second"``): a chat assistant also answers follow-ups ("now in Python", "shorter"), which
read the conversation so far. The second user turn of a conversation comes with its first exchange as
``context`` (the user's first turn and ShareGPT's answer to it, at most ``MAX_CONTEXT_CHARS``), so
`mtp distill` answers it as the model would in that conversation. A split's second turns are new prompts
for a drafter trained on its first turns, from the same conversations, so they stay on the same side of
``HELDOUT_START``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

HELDOUT_START = 15_000
MIN_CHARS = 20
MAX_CHARS = 1_500
MAX_CONTEXT_CHARS = 1_800  # the first exchange of a second-turn prompt: ~450 tokens, under distill's 512
TURNS = ("first", "second")

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


def _ascii(text: str) -> bool:
    return sum(1 for c in text if ord(c) < 128) >= 0.95 * len(text)


def _usable(prompt: str) -> bool:
    return MIN_CHARS <= len(prompt) <= MAX_CHARS and _ascii(prompt)


def _split_records(split: str, path: str | None) -> Iterator[tuple[int, dict]]:
    """(conversation index, record) of one split: "train" before ``HELDOUT_START``, "heldout" from it on."""
    from .sharegpt import iter_sharegpt

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for index, record in enumerate(iter_sharegpt(path)):
        if split == "train" and index >= HELDOUT_START:
            return
        if split == "heldout" and index < HELDOUT_START:
            continue
        yield index, record


def sharegpt_prompts(split: str, path: str | None = None) -> Iterator[tuple[int, str, str]]:
    """(conversation index, kind, first user turn) of the usable prompts of one split ("train"/"heldout")."""
    from .sharegpt import ROLE_MAP

    for index, record in _split_records(split, path):
        for turn in record["conversations"]:
            if ROLE_MAP.get(turn["from"].lower()) == "user" and turn["value"].strip():
                prompt = turn["value"].strip()
                if _usable(prompt):
                    yield index, ("code" if is_code(prompt) else "chat"), prompt
                break


def sharegpt_second_turns(split: str, path: str | None = None) -> Iterator[tuple[int, str, list[dict], str]]:
    """(conversation index, kind, first exchange, second user turn) of a split's conversations that open with
    user, assistant, user turns, the second user turn usable and the first exchange mostly ASCII and at most
    ``MAX_CONTEXT_CHARS``. The kind is "code" when the follow-up or its context asks for or shows code."""
    from .sharegpt import ROLE_MAP

    for index, record in _split_records(split, path):
        turns = [(ROLE_MAP.get(t["from"].lower()), t["value"].strip()) for t in record["conversations"][:3]]
        if [role for role, _ in turns] != ["user", "assistant", "user"] or not all(text for _, text in turns):
            continue
        context = [{"role": role, "content": text} for role, text in turns[:2]]
        first_exchange = turns[0][1] + turns[1][1]
        prompt = turns[2][1]
        if not _usable(prompt) or len(first_exchange) > MAX_CONTEXT_CHARS or not _ascii(first_exchange):
            continue
        code = is_code(prompt) or is_code(first_exchange)
        yield index, ("code" if code else "chat"), context, prompt


def select(
    split: str,
    chat: int,
    code: int,
    path: str | None = None,
    turn: str = "first",
    exclude: Collection[int] = (),
) -> list[dict]:
    """``chat`` chat and ``code`` code prompts of a split, interleaved so that any prefix holds both kinds.
    ``turn="second"``: second user turns, each with its conversation's first exchange as ``context``.
    ``exclude``: conversation indices to pass over (the prompts of earlier stages, `read_indices`), so that a
    new training stage gets prompts no earlier stage answered."""
    if turn not in TURNS:
        raise ValueError(f"turn must be one of {TURNS}, got {turn!r}")
    if turn == "first":
        found = ((index, kind, None, prompt) for index, kind, prompt in sharegpt_prompts(split, path))
    else:
        found = sharegpt_second_turns(split, path)
    chats: list[dict] = []
    codes: list[dict] = []
    skip = set(exclude)
    for index, kind, context, prompt in found:
        if index in skip:
            continue
        bucket, want = (codes, code) if kind == "code" else (chats, chat)
        if len(bucket) < want:
            row = {"prompt": prompt, "kind": kind, "sharegpt_index": index}
            bucket.append(row if context is None else {**row, "context": context})
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


def conversations(split: str, n: int, start: int = 0, path: str | None = None) -> list[dict]:
    """``n`` whole conversations of a split from conversation index ``start`` on, as ShareGPT records, kept when
    every turn is mostly ASCII and the conversation has an assistant turn.

    Why: a drafter that trains on the base's features over ShareGPT's own answers needs no distillation (the
    teacher's targets come from the base's hidden states at every position, whoever wrote the text), so a
    CPU-minute buys about three times the tokens of a distilled stage. (On SmolLM2 they taught the EAGLE drafter
    ShareGPT's text but not the model's own answers: docs/benchmarks.md.) ``start`` picks conversations no
    earlier stage read as text. Only the training split: these are training text, and whole held-out
    conversations would carry the held-out prompts into a cache."""
    if split != "train":
        raise ValueError(f"whole conversations are training text: split must be 'train', got {split!r}")
    from .sharegpt import ROLE_MAP

    rows: list[dict] = []
    for index, record in _split_records(split, path):
        if index < start:
            continue
        turns = record["conversations"]
        roles = [ROLE_MAP.get(t["from"].lower()) for t in turns]
        if "assistant" not in roles or not all(t["value"].strip() and _ascii(t["value"]) for t in turns):
            continue
        rows.append({"id": record.get("id", str(index)), "sharegpt_index": index, "conversations": turns})
        if len(rows) >= n:
            break
    return rows


def read_indices(paths: Iterable[str | Path]) -> set[int]:
    """The ``sharegpt_index`` of every row of these .jsonl prompt files (written by this module)."""
    found: set[int] = set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                found.add(int(json.loads(line)["sharegpt_index"]))
    return found


def write_jsonl(rows: list[dict], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["train", "heldout"], required=True)
    parser.add_argument("--chat", type=int, default=0)
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="write N whole mostly-ASCII conversations as a ShareGPT JSON array (for train.features) instead",
    )
    parser.add_argument("--start", type=int, default=0, help="with --conversations: first conversation index")
    parser.add_argument(
        "--turn",
        choices=TURNS,
        default="first",
        help="second: follow-up user turns, each with its conversation's first exchange as context",
    )
    parser.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="JSONL",
        help="pass over the conversations of these prompt files (earlier stages' prompts, the same --turn)",
    )
    parser.add_argument("--out", required=True, help=".jsonl with prompt, kind, sharegpt_index (and context)")
    args = parser.parse_args(argv)
    if args.conversations is not None:
        try:
            records = conversations(args.split, args.conversations, args.start)
        except ValueError as err:  # the held-out split: a usage error, said as one
            parser.error(f"--conversations: {err}")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records))
        span = f"{records[0]['sharegpt_index']}-{records[-1]['sharegpt_index']}" if records else "none"
        print(f"{args.out}: {len(records)} conversations (indices {span}) from the {args.split} split")
        return 0
    if args.chat + args.code == 0:
        parser.error("give --chat/--code (prompts) or --conversations")
    rows = select(args.split, args.chat, args.code, turn=args.turn, exclude=read_indices(args.exclude))
    write_jsonl(rows, args.out)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("chat", "code")}
    counts = f"{kinds['chat']} chat, {kinds['code']} code, {args.turn} turns"
    print(f"{args.out}: {len(rows)} prompts ({counts}) from the {args.split} split")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
