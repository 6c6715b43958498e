"""`train.prompt_sets`: first and second user turns of a ShareGPT file, split at HELDOUT_START."""

from __future__ import annotations

import json

import pytest

from mtp.train import prompt_sets as P


def _conversation(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def _write(tmp_path, records: list[dict]) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return str(path)


FOLLOW_UP = "Now write the same function in Python, please."
RECORDS = [
    _conversation(
        ("human", "Explain what a mutex is, briefly."),
        ("gpt", "A lock that one thread holds."),
        ("human", FOLLOW_UP),
        ("gpt", "def f(): ..."),
    ),
    _conversation(("human", "Tell me a story about the sea."), ("gpt", "Once upon a time...")),  # no second turn
    _conversation(
        ("gpt", "Hello, how can I help?"), ("human", "Summarise the plot of Hamlet for me."), ("gpt", "A prince...")
    ),  # opens with the assistant
    _conversation(
        ("human", "What is the capital of France?"),
        ("gpt", "Paris. " * 400),  # context too long
        ("human", "And what is its population today?"),
    ),
    _conversation(
        ("human", "Name three rivers in Europe."), ("gpt", "Danube, Rhine, Seine."), ("human", "ok")
    ),  # the follow-up is too short to be a prompt
    _conversation(
        ("human", "Give me a name for a bakery."),
        ("gpt", "Rise & Shine."),
        ("human", "Something shorter and friendlier, maybe?"),
    ),
]


def test_second_turns_carry_their_first_exchange(tmp_path, monkeypatch):
    path = _write(tmp_path, RECORDS)
    monkeypatch.setattr(P, "HELDOUT_START", len(RECORDS))
    found = list(P.sharegpt_second_turns("train", path))
    assert [(index, kind, prompt) for index, kind, _, prompt in found] == [
        (0, "code", FOLLOW_UP),  # the follow-up asks for Python
        (5, "chat", "Something shorter and friendlier, maybe?"),
    ]
    assert found[0][2] == [{"role": "user", "content": "Explain what a mutex is, briefly."},
                           {"role": "assistant", "content": "A lock that one thread holds."}]  # fmt: skip

    rows = P.select("train", chat=5, code=5, path=path, turn="second")
    assert [r["sharegpt_index"] for r in rows] == [5, 0]  # one chat, then the code prompt
    assert rows[1]["context"] == found[0][2] and rows[1]["prompt"] == FOLLOW_UP
    first = P.select("train", chat=9, code=9, path=path)  # every conversation has a usable first user turn
    assert all("context" not in r for r in first) and sorted(r["sharegpt_index"] for r in first) == list(range(6))

    # the split boundary holds for second turns too
    monkeypatch.setattr(P, "HELDOUT_START", 3)
    assert [i for i, *_ in P.sharegpt_second_turns("train", path)] == [0]
    assert [i for i, *_ in P.sharegpt_second_turns("heldout", path)] == [5]
    with pytest.raises(ValueError, match="turn must be"):
        P.select("train", 1, 1, path=path, turn="third")


def test_a_new_stage_passes_over_the_prompts_of_earlier_ones(tmp_path, monkeypatch):
    path = _write(tmp_path, RECORDS)
    monkeypatch.setattr(P, "HELDOUT_START", len(RECORDS))
    earlier = P.select("train", chat=2, code=0, path=path)
    assert [r["sharegpt_index"] for r in earlier] == [0, 1]
    done = P.write_jsonl(earlier, tmp_path / "stage1.jsonl")
    assert P.read_indices([done]) == {0, 1}
    fresh = P.select("train", chat=2, code=0, path=path, exclude=P.read_indices([done]))
    assert [r["sharegpt_index"] for r in fresh] == [2, 3]  # as many as asked, none answered before
    rest = P.select("train", chat=9, code=9, path=path, exclude={0, 1, 2, 3})
    assert sorted(r["sharegpt_index"] for r in rest) == [4, 5]


def test_whole_conversations_for_feature_caches(tmp_path, monkeypatch):
    records = [
        *RECORDS,
        _conversation(("human", "Was ist ein Mutex? Bitte genau."), ("gpt", "Ein Schloss, " + "é" * 40)),
        _conversation(("human", "Only a question, never answered.")),  # no assistant turn
        _conversation(("human", "Write a haiku about rain."), ("gpt", "Soft rain on the roof")),
    ]
    path = _write(tmp_path, records)
    monkeypatch.setattr(P, "HELDOUT_START", 8)
    rows = P.conversations("train", n=10, start=1, path=path)
    # from index 1 on, the non-ASCII one and the unanswered one are skipped; index 8 is held out
    assert [r["sharegpt_index"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["conversations"] == records[1]["conversations"]
    assert [r["sharegpt_index"] for r in P.conversations("train", n=2, path=path)] == [0, 1]
    with pytest.raises(ValueError, match="training text"):  # held-out conversations never become a cache
        P.conversations("heldout", n=2, path=path)

    # written as a ShareGPT array, it is a data source the feature cache reads like the packaged file
    from mtp.train.config import DataSection
    from mtp.train.data import load_documents

    out = tmp_path / "conversations.json"
    out.write_text(json.dumps(rows))
    docs = load_documents(DataSection(path=str(out)))
    assert len(docs) == 5
    assert docs[0]["messages"][0] == {"role": "user", "content": "Tell me a story about the sea."}
