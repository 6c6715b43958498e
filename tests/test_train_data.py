"""Data pipeline: every source format, chat-template rendering with assistant masks, packing, split, batches."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_support import stdlib_files

from mtp.train.config import DataSection
from mtp.train.data import BatchPlan, DataError, load_documents, pack, prepare_data, render_chat, tokenize_documents
from mtp.train.tiny import byte_tokenizer

TOK = byte_tokenizer()
CHAT = [
    {"role": "user", "content": "ping"},
    {"role": "assistant", "content": "pong"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok"},
]


def test_render_chat_masks_exactly_the_assistant_turns():
    ids, mask = render_chat(TOK, CHAT, assistant_only=True)
    assert ids == list(TOK.apply_chat_template(CHAT, return_dict=True)["input_ids"])  # same ids as serving
    trained = TOK.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "pong<|im_end|>\nok<|im_end|>\n"  # answers and their end markers, nothing of the prompts
    _, all_mask = render_chat(TOK, CHAT, assistant_only=False)
    assert all(all_mask)


def _docs(tmp_path, fmt: str):
    rows = [{"text": f"document number {i} " * 20} for i in range(30)]
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        from datasets import Dataset

        path = tmp_path / "d.parquet"
        Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "disk":
        from datasets import Dataset, DatasetDict

        path = tmp_path / "saved"
        DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(path))
    elif fmt == "text":
        path = tmp_path / "d.txt"
        path.write_text("\n".join(r["text"] for r in rows))
    elif fmt == "chat":
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(30)))
    elif fmt == "sharegpt":
        conv = [{"from": "human", "value": "ping"}, {"from": "gpt", "value": "pong"}]
        path = tmp_path / "sg.json"
        path.write_text(json.dumps([{"id": str(i), "conversations": conv} for i in range(30)])[:-40])  # truncated
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "disk", "text", "chat", "sharegpt"])
def test_every_source_format_tokenizes(tmp_path, fmt):
    data = DataSection(path=_docs(tmp_path, fmt), block_size=16, eval_fraction=0.2)
    packed = prepare_data(data, TOK, vocab_size=264, seed=0)
    assert packed.train_ids.shape[1] == 16 and packed.train_ids.shape[0] > 0 and packed.eval_ids.shape[0] > 0
    if fmt in ("chat", "sharegpt"):  # chat rows train on assistant tokens only
        assert packed.train_mask is not None and 0 < packed.train_mask.float().mean() < 0.5
        assert TOK.convert_tokens_to_ids("<|im_start|>") in packed.train_ids  # rendered with the template
    elif fmt == "text":  # a text file is one document (its EOS falls in the dropped tail here)
        assert packed.train_mask is None and packed.num_documents == 1
    else:
        assert packed.train_mask is None and packed.num_documents == 30
        assert TOK.eos_token_id in torch.cat([packed.train_ids, packed.eval_ids])  # documents end with EOS


def test_pretokenized_rows_mask_the_prompt(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(10, 20)), "prompt_len": 4}) + "\n" for _ in range(8)))
    docs = load_documents(DataSection(path=str(path)))
    tok = tokenize_documents(docs, TOK, DataSection(path=str(path)))
    assert tok[0]["input_ids"] == list(range(10, 20))
    assert tok[0]["loss_mask"] == [0] * 4 + [1] * 6


def test_distilled_ids_and_chat_sources_mix_in_one_run(tmp_path):
    """`data.path: [<mtp distill out>, sharegpt]`: rows of one source have None in the other's columns."""
    ids_path = tmp_path / "ids.jsonl"
    ids_path.write_text(json.dumps({"input_ids": list(range(10, 20)), "prompt_len": 4}) + "\n")
    chat_path = tmp_path / "chat.jsonl"
    opens_with_answer = [{"role": "assistant", "content": "hello"}, *CHAT]  # ShareGPT has such conversations
    only_answer = [{"role": "assistant", "content": "orphan"}]
    chat_path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CHAT, opens_with_answer, only_answer)))
    data = DataSection(path=[str(ids_path), str(chat_path)])
    tok = tokenize_documents(load_documents(data), TOK, data)
    assert tok[0]["loss_mask"] == [0] * 4 + [1] * 6
    assert tok[1]["input_ids"] == render_chat(TOK, CHAT, True)[0]
    assert tok[2]["input_ids"] == tok[1]["input_ids"]  # the leading answer without a question is dropped
    assert tok[3]["input_ids"] == []


def test_pack_and_split_are_disjoint_and_seeded(tmp_path):
    data = DataSection(path=stdlib_files(["textwrap.py"]), block_size=32, eval_fraction=0.1)
    a = prepare_data(data, TOK, 264, seed=0)
    b = prepare_data(data, TOK, 264, seed=0)
    c = prepare_data(data, TOK, 264, seed=1)
    assert torch.equal(a.eval_ids, b.eval_ids) and not torch.equal(a.eval_ids, c.eval_ids)
    train_rows = {tuple(r.tolist()) for r in a.train_ids}
    assert not any(tuple(r.tolist()) in train_rows for r in a.eval_ids)
    text_len = len(TOK(open(data.path[0]).read())["input_ids"]) + 1
    assert a.train_ids.numel() + a.eval_ids.numel() == (text_len // 32) * 32  # only the tail is dropped


def test_pack_shapes():
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "loss_mask": [[1, 1, 1], [0, 1, 1, 1, 1]]})
    ids, mask = pack(ds, 3)
    assert ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert mask.tolist() == [[True, True, True], [False, True, True]]


def test_batch_plan_ranks_split_the_global_batch():
    one = BatchPlan(num_blocks=20, micro_batch=4, world_size=1, rank=0, seed=3)
    r0 = BatchPlan(num_blocks=20, micro_batch=2, world_size=2, rank=0, seed=3)
    r1 = BatchPlan(num_blocks=20, micro_batch=2, world_size=2, rank=1, seed=3)
    for step in range(12):  # crosses epochs (5 steps each)
        assert torch.equal(one.indices(step), torch.cat([r0.indices(step), r1.indices(step)]))
    epoch0 = torch.cat([one.indices(s) for s in range(5)])
    assert sorted(epoch0.tolist()) == list(range(20))  # each block once per epoch
    assert not torch.equal(epoch0, torch.cat([one.indices(s) for s in range(5, 10)]))  # reshuffled


def test_too_little_data_is_an_error(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("x" * 10)
    with pytest.raises(DataError, match="block"):
        prepare_data(DataSection(path=str(path), block_size=64), TOK, 264, seed=0)
