"""The distilled draft model (head type `draft_lm`): an exact layer-skip copy of the base, trained by
`mtp train`, exported by `mtp export --assistant` as a plain HF checkpoint that assisted generation runs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS, VOCAB, tiny_model
from test_train_support import make_config, tiny_ckpt  # noqa: F401
from transformers import AutoModelForCausalLM

from mtp import MTPModel
from mtp.draft_model import DraftLM, layer_picks


def _deep(arch: str) -> torch.nn.Module:
    return tiny_model(arch, n_layer=4) if arch == "gpt2" else tiny_model(arch, num_hidden_layers=4)


def test_layer_picks_spread_from_first_to_last():
    assert layer_picks(30, 6) == [0, 6, 12, 17, 23, 29]
    assert layer_picks(4, 2) == [0, 3] and layer_picks(4, 1) == [0] and layer_picks(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="num_layers"):
        layer_picks(4, 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_depth_draft_is_the_base_and_assisted_generation_stays_exact(arch):
    base = _deep(arch)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    full = MTPModel.from_base(base, num_heads=1, head_type="draft_lm", num_layers=4)
    with torch.no_grad():
        torch.testing.assert_close(full.heads.to_causal_lm(base)(ids).logits, base(ids).logits, rtol=0, atol=0)
        # head_hidden row t = the draft's state after token t+1: what the trainer scores against token t+2
        small = MTPModel.from_base(base, num_heads=1, head_type="draft_lm", num_layers=2)
        lm = small.heads.to_causal_lm(base)
        hidden = base(ids, output_hidden_states=True).hidden_states[-1]
        rows = base.get_output_embeddings()(small.heads.head_hidden(hidden, input_ids=ids)[0])
        torch.testing.assert_close(rows[:, :-1], lm(ids).logits[:, 1:], rtol=1e-5, atol=1e-5)
    assert small.heads.picks == [0, 3] and lm.config.num_hidden_layers == 2
    # the draft's own parameters exclude the shared embeddings / lm_head
    emb = base.get_input_embeddings().weight
    assert all(p.data_ptr() != emb.data_ptr() for p in small.heads.parameters())
    prompt = ids[:1, :5]
    plain = base.generate(prompt, max_new_tokens=24, do_sample=False)
    assisted = base.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=lm)
    assert torch.equal(plain, assisted)


def test_draft_lm_errors_are_clear():
    base = _deep("llama")
    with pytest.raises(ValueError, match="num_heads must be 1"):
        MTPModel.from_base(base, num_heads=2, head_type="draft_lm", num_layers=2)
    model = MTPModel.from_base(base, num_heads=1, head_type="draft_lm", num_layers=2)
    with pytest.raises(ValueError, match="assistant"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)


def test_trained_draft_beats_layer_skip_and_exports_for_assisted_generation(tmp_path, tiny_ckpt):  # noqa: F811
    from mtp.train.export import export
    from mtp.train.trainer import train

    out = tmp_path / "draft"  # hard labels: the tiny base is random, its soft targets would teach noise
    cfg = make_config(
        tiny_ckpt, out, "heads.head_type=draft_lm", "heads.num_heads=1", "heads.num_layers=1",
        "loss.soft_targets=false", "data.block_size=128", "train.micro_batch_size=8", "train.max_steps=60",
        "train.log_every=20", "optim.lr=3e-3",
    )  # fmt: skip
    train(cfg)
    acc = json.loads((out / "eval_accuracy.json").read_text())
    trained, untrained = acc["heads"][0], acc["untrained"]["heads"][0]
    assert trained["top1"] > untrained["top1"] + 0.05 and trained["loss"] < untrained["loss"] - 0.3
    assert isinstance(MTPModel.from_pretrained(out).heads, DraftLM)

    with pytest.raises(ValueError, match="--assistant"):
        export(out, tmp_path / "as-heads", heads_only=True)
    lm_dir = export(out, tmp_path / "assistant", assistant=True)
    draft = AutoModelForCausalLM.from_pretrained(str(lm_dir)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    assert draft.config.num_hidden_layers == 1 and draft.config.mtp_draft_layers == [0]
    assert (lm_dir / "tokenizer_config.json").is_file() or (lm_dir / "tokenizer.json").is_file()
    prompt = torch.tensor([[104, 101, 108, 108, 111, 32]])
    plain = base.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(plain, base.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=draft))
