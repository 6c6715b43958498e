"""The benchmark's bookkeeping on a tiny model: identity check, difference reports, outputs.

Speed itself is never asserted here (benchmarks measure it); what must be right is that every method
runs on the same prompts and that a method whose output differs from plain generate() is caught, with the
position and the reference's top-2 margin there.
"""

from __future__ import annotations

import json

import pytest
import torch

from mtp.bench import methods as M
from mtp.bench.run import first_difference, markdown_table, run_prompts, summary_rows, top2_margin, write_outputs


def _broken(model) -> M.Method:
    """Plain greedy with the 3rd new token replaced: what a buggy decoder would return."""

    def run(ids: torch.Tensor, max_new: int) -> M.MethodResult:
        seq = model.base_model.generate(ids, max_new_tokens=max_new, do_sample=False).clone()
        seq[0, ids.shape[1] + 2] = (seq[0, ids.shape[1] + 2] + 1) % model.info.vocab_size
        return M.MethodResult(seq)

    return run


def test_identity_check_and_difference_report(fitted, tmp_path):
    model, prompts, seqs = fitted("llama")
    methods = {
        "plain": M.plain(model),
        "prompt_lookup": M.prompt_lookup(model, num_tokens=3),
        "chain": M.ours(model, "chain"),
        "tree": M.ours(model, None),
        "auto_lookup": M.ours(model, None, prompt_lookup=True),
        "broken": _broken(model),
    }
    max_new = seqs[0].shape[1] - prompts[0].shape[1]
    batch = [(i, ["writing", "coding"][i % 2], p) for i, p in enumerate(prompts)]
    stats = run_prompts(methods, batch, max_new, "float32")
    n = len(prompts)
    for name in ("plain", "prompt_lookup", "chain", "tree", "auto_lookup"):
        assert stats[name].identical == n and not stats[name].differences, name
    assert stats["tree"].tau > 2.0  # fitted heads: the comparison exercises real acceptance
    broken = stats["broken"]
    assert broken.identical == 0 and [d.position for d in broken.differences] == [2] * n
    assert all(d.ref_margin >= 0 for d in broken.differences)

    rows = summary_rows(stats)
    by_name = {r["method"]: r for r in rows}
    assert by_name["plain"]["speedup"] == 1.0 and by_name["broken"]["identical"] == f"0/{n}"
    assert set(by_name["tree"]["per_category_speedup"]) == {"writing", "coding"}
    table = markdown_table(rows)
    assert table.count("\n") == 2 + len(methods)
    write_outputs(tmp_path, rows, {"float32": stats}, {"cpu": "test"})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"][0]["method"] == "plain"
    assert (tmp_path / "results.png").stat().st_size > 1000


def test_first_difference_and_margin():
    ref = torch.tensor([[1, 2, 3, 4, 5]])
    assert first_difference(ref, ref.clone(), 2) is None
    assert first_difference(ref, torch.tensor([[1, 2, 3, 9, 5]]), 2) == 1
    assert first_difference(ref, torch.tensor([[1, 2, 3, 4]]), 2) == 2  # shorter: differs where it ends
    assert top2_margin(torch.tensor([0.5, 2.0, 1.25])) == pytest.approx(0.75)


def test_assistant_option_names_a_bad_directory(tmp_path):
    import typer

    from mtp.bench.cli import _assistant, _methods

    with pytest.raises(typer.BadParameter, match="config.json"):
        _assistant(None, str(tmp_path), 6, None)
    with pytest.raises(typer.BadParameter, match="unknown methods"):
        _methods("plain,tree,fastest")
    assert _methods("tree") == ["plain", "tree"]


def test_worst_prompt_is_compared_per_token():
    """A method whose answer ran twice as long in twice the time is not slower per token than plain."""
    from mtp.bench.run import MethodStats

    plain, ours = MethodStats("plain", "bfloat16"), MethodStats("ours", "bfloat16")
    seq = torch.zeros(1, 1, dtype=torch.long)
    plain.observe(1, "writing", 2.0, M.MethodResult(seq), 50, True)
    ours.observe(1, "writing", 4.0, M.MethodResult(seq), 100, False)  # diverged, twice as long
    plain.observe(2, "math", 4.0, M.MethodResult(seq), 100, True)
    ours.observe(2, "math", 5.0, M.MethodResult(seq), 100, True)  # really 1.25x slower per token
    rows = {r["method"]: r for r in summary_rows({"plain": plain, "ours": ours})}
    assert rows["ours"]["worst_prompt_slowdown"] == pytest.approx(1.25)
    assert rows["ours"]["per_prompt"] == {1: [4.0, 100], 2: [5.0, 100]}


def test_repeats_keep_the_median_time_and_count_outputs_that_change(monkeypatch):
    """`repeats`: every (prompt, method) is timed that often, round-robin, and the median kept, so one run
    hit by the machine's noise does not decide a prompt's speedup; a method whose output changes between
    repeats is counted, not hidden."""
    from mtp.bench import run as R

    clock = iter([0.0, 1.0, 0.0, 9.0, 0.0, 3.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0] + [0.0] * 100)
    monkeypatch.setattr(R.time, "perf_counter", lambda: next(clock))
    order: list[str] = []
    calls = {"flaky": 0}

    def fixed(name: str) -> M.Method:
        def run(ids: torch.Tensor, max_new: int) -> M.MethodResult:
            order.append(name)
            return M.MethodResult(torch.tensor([[1, 2, 3]]))

        return run

    def flaky(ids: torch.Tensor, max_new: int) -> M.MethodResult:
        order.append("flaky")
        calls["flaky"] += 1
        return M.MethodResult(torch.tensor([[1, 2, 3 + calls["flaky"] % 2]]))

    methods = {"plain": fixed("plain"), "flaky": flaky}
    stats = run_prompts(methods, [(0, "writing", torch.tensor([[1]]))], 2, "float32", repeats=3)
    assert order == ["plain", "flaky"] * 3  # round-robin, not three plain runs then three of ours
    # plain took 1, 3, 2 s (median 2), flaky 9, 2, 2 (median 2): the 9 s outlier does not count
    assert stats["plain"].per_prompt[0] == (2.0, 2) and stats["flaky"].per_prompt[0] == (2.0, 2)
    assert stats["plain"].repeat_mismatches == 0 and stats["flaky"].repeat_mismatches == 1
    with pytest.raises(ValueError, match="repeats"):
        run_prompts(methods, [(0, "writing", torch.tensor([[1]]))], 2, "float32", repeats=0)


def test_tree_sweep_candidates_and_write_guard():
    """Head sets side by side: each with its own sizes or the shared --sizes; --write needs exactly one."""
    from mtp.bench.tree_sweep import _candidates, main

    assert _candidates(["eagle@4,8", "runs/x/drafter", "mtp@16"], "8,12") == [
        ("eagle", [4, 8]),
        ("runs/x/drafter", [8, 12]),
        ("mtp", [16]),
    ]
    with pytest.raises(SystemExit):
        main(["--heads", "eagle", "--heads", "mtp", "--write"])


def test_tree_sweep_dev_prompts_come_from_the_development_lines(tmp_path):
    """Only the lines asked for (by default those no shipped head set trained on), chat and code alternating."""
    import json

    from mtp.bench.tree_sweep import dev_prompts

    rows = [{"prompt": f"{kind}{i}", "kind": kind} for i in range(1, 11) for kind in ("chat", "code")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # line 2i-1: chat{i}, line 2i: code{i}
    assert dev_prompts(path, 4, "5-12") == ["chat5", "code5", "chat6", "code6"]
    assert dev_prompts(path, 2, "") == ["chat10", "code10"]
    with pytest.raises(ValueError, match="fewer than"):
        dev_prompts(path, 4, "5-21")
    with pytest.raises(ValueError, match="START-END"):
        dev_prompts(path, 4, "12-5")


def test_tree_sweep_sizes_share_one_model():
    """Each candidate sets its own default tree size on the shared model right before decoding."""
    from types import SimpleNamespace

    from mtp.bench.tree_sweep import with_tree_nodes

    seen = []

    class Fake:
        config = SimpleNamespace(tree_nodes=16)

        def generate(self, ids, max_new_tokens, return_dict_in_generate):
            seen.append(self.config.tree_nodes)
            new = torch.ones(1, max_new_tokens, dtype=ids.dtype)
            return SimpleNamespace(sequences=torch.cat([ids, new], 1), accepted_lengths=[2] * (max_new_tokens // 2))

    model = Fake()
    four, eight = with_tree_nodes(model, 4), with_tree_nodes(model, 8)
    x = torch.tensor([[5, 6]])
    assert eight(x, 4).accepted_lengths == [2, 2]
    four(x, 4)
    eight(x, 4)
    assert seen == [8, 4, 8]


def test_extra_head_sets_run_under_the_requested_runtime(monkeypatch):
    """`--extra-heads` with packed or compiled methods must time the other heads packed or compiled too;
    timing them eager beside packed ours compared two runtimes, not two head sets."""
    from mtp.bench import cli

    other, packed, compiled = object(), object(), object()
    seen = []
    monkeypatch.setattr(cli, "_packed", lambda m: seen.append(("packed", m)) or packed)
    monkeypatch.setattr(cli, "_compiled", lambda m: seen.append(("compiled", m)) or compiled)
    table = cli._extra_head_methods("v1", other, ["plain", "auto_packed", "auto_compiled"], "default")
    assert list(table) == ["v1-auto_packed", "v1-auto_compiled"]
    assert seen == [("packed", other), ("compiled", other)]
    assert list(cli._extra_head_methods("v1", other, ["plain", "auto"], "default")) == ["v1-auto"]
    assert list(cli._extra_head_methods("v1", other, ["plain"], "default")) == ["v1-chain", "v1-tree"]
    # one prepacked copy serves every method that asks for one; the baselines are not built here
    seen.clear()
    table = cli._decoding_methods(other, ["plain", "plain_packed", "auto_packed", "tree_lookup"], "default")
    assert list(table) == ["plain_packed", "auto_packed", "tree_lookup"]
    assert seen == [("packed", other)]
