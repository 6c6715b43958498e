"""`mtp distill`: batched generation equals one-at-a-time greedy, output is resumable and trainable."""

from __future__ import annotations

import json
from collections import Counter

import torch
from test_train_support import tiny_ckpt  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from mtp.cli import app
from mtp.train.config import DataSection
from mtp.train.data import load_documents, pack, prepare_data, tokenize_documents
from mtp.train.distill import load_distilled, read_prompts

runner = CliRunner()
PROMPTS = [
    {"prompt": "def add(a, b):"},
    {"turns": ["Write a haiku about the sea.", "Now a limerick."]},  # MT-Bench rows: the first turn
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]},
    {"conversations": [{"from": "human", "value": "what is 2+2?"}, {"from": "gpt", "value": "4"}]},
    {"text": "import os"},
    {"prompt": "a much longer prompt " * 5},
    {
        "prompt": "and in French?",
        "context": [
            {"role": "user", "content": "say hi"},  # a follow-up turn
            {"role": "assistant", "content": "hi there"},
        ],
    },
]


def _distill(tiny_ckpt, data, out, *extra):  # noqa: F811
    args = ["distill", "--model", str(tiny_ckpt), "--data", str(data), "--out", str(out), "--max-new-tokens", "12",
            "--batch-size", "4", "--shard-size", "2", "--dtype", "float32", *extra]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def test_distill_matches_unbatched_greedy_and_resumes(tmp_path, tiny_ckpt):  # noqa: F811
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    assert read_prompts(str(data))[1] == "Write a haiku about the sea."
    out = tmp_path / "distilled"
    _distill(tiny_ckpt, data, out, "--limit", "4")
    assert sorted(load_distilled(out)["prompt_id"]) == [0, 1, 2, 3]
    shards_before = sorted(p.name for p in out.glob("shard-*"))
    _distill(tiny_ckpt, data, out)  # resume: only prompts 4 to 6 are new
    ds = load_distilled(out)
    assert sorted(ds["prompt_id"]) == list(range(7))
    assert sorted(p.name for p in out.glob("shard-*"))[: len(shards_before)] == shards_before

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    prompts = read_prompts(str(data))
    assert prompts[6] == [*PROMPTS[6]["context"], {"role": "user", "content": "and in French?"}]
    for row in ds:
        prompt = prompts[row["prompt_id"]]
        conversation = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        assert row["input_ids"][: row["prompt_len"]] == ids[0].tolist()  # the chat template, as at serving time
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        answer = row["input_ids"][row["prompt_len"] :]
        eos = model.generation_config.eos_token_id
        ref_answer = ref[0, ids.shape[1] :].tolist()
        ref_answer = ref_answer[: ref_answer.index(eos) + 1] if eos in ref_answer else ref_answer
        assert answer == ref_answer  # left-padded batches change nothing
        assert row["messages"][:-1] == conversation  # a follow-up keeps its conversation's earlier turns
        assert row["messages"][-1]["role"] == "assistant"

    # the folder trains directly, with loss on the model's answers only
    section = DataSection(path=str(out), block_size=8, eval_fraction=0.2)
    _, mask = pack(tokenize_documents(load_documents(section), tok, section), 1)  # one token per block: no tail
    assert int(mask.sum()) == sum(len(r["input_ids"]) - r["prompt_len"] for r in ds)  # exactly the answers
    packed = prepare_data(section, tok, 264, seed=0)
    assert 0 < torch.cat([packed.train_mask, packed.eval_mask]).float().mean() < 1


def test_distill_engines_give_the_same_answers(tmp_path, tiny_ckpt, monkeypatch):  # noqa: F811
    """Continuous batching (rows refilled as answers end; from prepacked weights or the model's own) and
    left-padded generate() store the same rows."""
    from mtp.packed import PackedLinear, can_pack

    rows_packed: list[int] = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: rows_packed.append(x.shape[-2]) or forward(self, x))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    _distill(tiny_ckpt, data, tmp_path / "batched", "--batch-size", "3", "--shard-size", "6")
    assert bool(rows_packed) == can_pack(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)))
    calls = len(rows_packed)
    _distill(tiny_ckpt, data, tmp_path / "unpacked", "--batch-size", "3", "--shard-size", "6", "--no-pack")
    _distill(tiny_ckpt, data, tmp_path / "generate", "--engine", "generate")
    assert len(rows_packed) == calls  # --no-pack and generate() run the model's own weights
    rows = {name: sorted(load_distilled(tmp_path / name).to_list(), key=lambda r: r["prompt_id"])
            for name in ("batched", "unpacked", "generate")}  # fmt: skip
    assert rows["batched"] == rows["generate"] and rows["unpacked"] == rows["generate"]
    result = runner.invoke(app, ["distill", "--model", str(tiny_ckpt), "--data", str(data), "--out",
                                 str(tmp_path / "x"), "--engine", "vllm"])  # fmt: skip
    assert result.exit_code == 2 and "unknown engine" in result.output


def test_sampled_distillation_does_not_depend_on_the_batch(tmp_path, tiny_ckpt):  # noqa: F811
    """Each prompt samples from its own seeded generator: batch size and neighbours change nothing."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    answers = {}
    for name, extra in {"alone": ("--batch-size", "1"), "together": ("--batch-size", "4"),
                        "greedy": ("--greedy",)}.items():  # fmt: skip
        sample = () if name == "greedy" else ("--sample", "--temperature", "1.5")
        _distill(tiny_ckpt, data, tmp_path / name, *sample, *extra)
        rows = load_distilled(tmp_path / name)
        answers[name] = {r["prompt_id"]: r["input_ids"][r["prompt_len"] :] for r in rows}
    assert answers["alone"] == answers["together"]
    assert answers["alone"] != answers["greedy"]  # it did sample


def test_distill_refuses_mixing_settings(tmp_path, tiny_ckpt):  # noqa: F811
    data = tmp_path / "p.txt"
    data.write_text("one\ntwo\n")
    out = tmp_path / "d"
    _distill(tiny_ckpt, data, out)
    result = runner.invoke(app, ["distill", "--model", str(tiny_ckpt), "--data", str(data), "--out", str(out),
                                 "--max-new-tokens", "99", "--dtype", "float32"])  # fmt: skip
    assert result.exit_code == 2 and "max_new_tokens" in result.output


def test_distill_missing_data(tmp_path, tiny_ckpt):  # noqa: F811
    result = runner.invoke(app, ["distill", "--model", str(tiny_ckpt), "--data", str(tmp_path / "nope.jsonl"),
                                 "--out", str(tmp_path / "o")])  # fmt: skip
    assert result.exit_code == 2 and "not found" in result.output


def test_export_draft_vocab_from_distilled_answers(tmp_path, tiny_ckpt):  # noqa: F811
    """`mtp export --draft-vocab N --draft-data <distill out>`: the N most frequent answer tokens, saved."""
    from test_train_support import make_config

    from mtp import MTPModel
    from mtp.train.trainer import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "distilled"
    _distill(tiny_ckpt, data, out)
    run = tmp_path / "run"
    train(make_config(tiny_ckpt, run, "train.max_steps=2"))
    exported = tmp_path / "heads"
    args = ["export", str(run), "--heads-only", "--out", str(exported), "--draft-vocab", "8", "--draft-data", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "draft vocabulary: 8 tokens cover" in result.output
    model = MTPModel.from_pretrained(exported)
    assert model.draft_vocab is not None and model.draft_vocab.numel() == 8
    rows = load_distilled(out)
    answers = [t for ids, n in zip(rows["input_ids"], rows["prompt_len"], strict=True) for t in ids[n:]]
    top = {t for t, _ in Counter(answers).most_common(4)}
    assert top <= set(model.draft_vocab.tolist())  # the most frequent answer tokens are in
    missing = runner.invoke(
        app, ["export", str(run), "--heads-only", "--out", str(tmp_path / "x"), "--draft-vocab", "8"]
    )
    assert missing.exit_code != 0 and "--draft-data" in missing.output


def test_distill_speed_bench_times_both_engines_on_the_same_prompts(tmp_path, tiny_ckpt):  # noqa: F811
    from mtp.bench.distill_speed import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "speed.json"
    main(["--model", str(tiny_ckpt), "--data", str(data), "--start", "1", "--n", "4", "--batch-size", "2",
          "--max-new-tokens", "8", "--dtype", "float32", "--out", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    assert [r["engine"] for r in results] == ["batched", "generate"]
    assert all(r["prompts"] == 4 and r["identical_to_first"] == 4 and r["answer_tokens"] > 0 for r in results)
