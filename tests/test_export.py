"""`mtp export`: Medusa-2 LoRA merge -> a full checkpoint that reloads and decodes like the unmerged model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_train_support import load_heads, make_config, tiny_ckpt  # noqa: F401
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from mtp import MTPModel
from mtp.cli import app
from mtp.train.trainer import train

runner = CliRunner()


@pytest.fixture(scope="module")
def medusa2_run(tmp_path_factory, tiny_ckpt):  # noqa: F811
    out = tmp_path_factory.mktemp("m2") / "run"
    train(make_config(tiny_ckpt, out, "mode=medusa2", "lora.r=4", "lora.lr=5e-3", "lora.warmup_heads_steps=3",
                      "train.max_steps=8", "train.eval_at_start=false", "loss.soft_targets=true",
                      "loss.soft_weight=0.5"))  # fmt: skip
    return out


def _unmerged(run, tiny_ckpt):  # noqa: F811
    """The model as trained: original base + LoRA layers (not merged) + trained heads."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    adapted = PeftModel.from_pretrained(base, str(run / "adapter")).get_base_model().eval()
    model = MTPModel.from_base(adapted, num_heads=3)
    model.heads.load_state_dict(load_file(str(run / "heads.safetensors")))
    return model


def test_medusa2_merge_export_generates_like_unmerged(medusa2_run, tiny_ckpt, tmp_path):  # noqa: F811
    merged_dir = tmp_path / "merged"
    result = runner.invoke(app, ["export", str(medusa2_run), "--merge-lora", "--out", str(merged_dir)])
    assert result.exit_code == 0, result.output
    merged = MTPModel.from_pretrained(merged_dir)
    unmerged = _unmerged(medusa2_run, tiny_ckpt)

    # LoRA really changed the backbone (else the comparison below proves nothing)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged.base_model.state_dict()[q], original.state_dict()[q])
    torch.testing.assert_close(merged.heads.state_dict(), unmerged.heads.state_dict())
    assert merged.config.head_accuracies is not None and len(merged.config.head_accuracies) == 3

    g = torch.Generator().manual_seed(0)
    for n in (3, 9):
        prompt = torch.randint(3, 256, (1, n), generator=g)
        want = unmerged.generate(prompt, max_new_tokens=24)
        got = merged.generate(prompt, max_new_tokens=24)
        assert torch.equal(got, want)
        assert torch.equal(got, merged.base_model.generate(prompt, max_new_tokens=24, do_sample=False))
    x = torch.randint(3, 256, (2, 16), generator=g)
    torch.testing.assert_close(merged(x).head_logits, unmerged(x).head_logits, rtol=1e-4, atol=1e-4)


def test_export_refuses_adapter_without_merge(medusa2_run, tmp_path):
    result = runner.invoke(app, ["export", str(medusa2_run), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--merge-lora" in result.output


def test_export_medusa1_full_and_heads_only(tmp_path, tiny_ckpt):  # noqa: F811
    run = tmp_path / "m1"
    train(make_config(tiny_ckpt, run, "train.max_steps=6", "train.stop_after_steps=3"))  # stops with checkpoint-3
    # an intermediate training checkpoint -> a full, self-contained MTP checkpoint (base + tokenizer + heads)
    full = tmp_path / "full"
    assert runner.invoke(app, ["export", str(run / "checkpoint-3"), "--out", str(full)]).exit_code == 0
    assert (full / "model.safetensors").is_file() and (full / "tokenizer_config.json").is_file()
    model = MTPModel.from_pretrained(full)
    want = load_heads(run / "checkpoint-3" / "heads.safetensors")
    for k, v in model.heads.state_dict().items():
        torch.testing.assert_close(v, want[k])
    heads_only = tmp_path / "heads"
    assert (
        runner.invoke(app, ["export", str(run / "checkpoint-3"), "--heads-only", "--out", str(heads_only)]).exit_code
        == 0
    )
    assert not (heads_only / "model.safetensors").exists()
    assert MTPModel.from_pretrained(heads_only).config.base_model_name_or_path == str(tiny_ckpt.resolve())
    # the finished run's output dir (a heads-only MTP checkpoint with accuracies) exports too
    train(make_config(tiny_ckpt, run, "train.max_steps=6"))
    final = tmp_path / "final"
    assert runner.invoke(app, ["export", str(run), "--out", str(final)]).exit_code == 0
    exported = MTPModel.from_pretrained(final)
    assert exported.config.head_accuracies == MTPModel.from_pretrained(run).config.head_accuracies
    assert exported.config.head_accuracies is not None
