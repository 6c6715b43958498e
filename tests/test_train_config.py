"""Config validation and the user-error paths of `mtp train`: one clear line, non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_train_support import REPO, tiny_ckpt, write_config  # noqa: F401
from typer.testing import CliRunner

from mtp.cli import app
from mtp.train.config import ConfigError, load_config
from mtp.train.tiny import make_tiny_checkpoint

runner = CliRunner()


def _train(config: Path):
    return runner.invoke(app, ["train", "--config", str(config)])


@pytest.mark.parametrize("name", ["medusa1-frozen.yaml", "medusa2-lora.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.mode == name.split("-")[0]
    assert cfg.optim.lr == pytest.approx(1e-3)


def test_shipped_heads_config_validates():
    """The recipes of the shipped heads (configs/smollm2-mtp*.yaml, four stages) stay loadable and chained."""
    cfg = load_config(REPO / "configs" / "smollm2-mtp.yaml")
    assert (cfg.heads.head_type, cfg.heads.num_heads, cfg.loss.soft_targets) == ("mtp", 3, True)
    assert cfg.data.eval_path and "sharegpt" in cfg.data.path
    previous = cfg
    for name in ("smollm2-mtp-continue.yaml", "smollm2-mtp-stage3.yaml"):
        stage = load_config(REPO / "configs" / name)
        assert stage.heads.init_from == previous.train.output_dir  # each stage continues the one before
        assert (stage.heads.head_type, stage.heads.num_heads) == (cfg.heads.head_type, cfg.heads.num_heads)
        assert stage.data.eval_path == cfg.data.eval_path  # the same held-out answers, never trained on
        assert stage.train.output_dir != previous.train.output_dir
        previous = stage
    # stage 4: stage 3's export, continued on a feature cache, with the loss over that export's draft vocabulary
    stage4 = load_config(REPO / "configs" / "smollm2-mtp-features.yaml")
    assert stage4.data.features and stage4.heads.init_from == stage4.loss.draft_vocab
    assert (stage4.heads.head_type, stage4.heads.num_heads) == (cfg.heads.head_type, cfg.heads.num_heads)
    assert f"--out {stage4.heads.init_from}" in (REPO / "README.md").read_text()  # the README exports stage 3 there
    # stage 5 (measured, not shipped): stage 4's export, continued on its cache and one more, same draft vocabulary
    stage5 = load_config(REPO / "configs" / "smollm2-mtp-stage5.yaml")
    assert stage5.heads.init_from == stage5.loss.draft_vocab and stage4.data.features in stage5.data.features
    assert f"--out {stage5.heads.init_from}" in (REPO / "configs" / "smollm2-mtp-stage5.yaml").read_text()


@pytest.mark.parametrize("name", ["ds_zero2.json", "ds_zero3.json"])
def test_shipped_deepspeed_configs_are_used_by_the_deepspeed_key(name, tmp_path):
    cfg = load_config(None, ["data.path=x.txt", f"deepspeed={REPO / 'configs' / name}"])
    from mtp.train.trainer import zero_stage

    assert zero_stage(cfg) == int(name[len("ds_zero")])


def test_unknown_nested_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"path": "x.txt"}, "optim": {"lerning_rate": 1e-3}}))
    with pytest.raises(ConfigError, match=r"'optim\.lerning_rate'"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.max_steps=ten", "train.max_steps"),
        ("heads.own_lm_head=maybe", "heads.own_lm_head"),
        ("mode=medusa3", "mode"),
        ("optim.lr=[1]", "optim.lr"),
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("model.dtype=int8", "model.dtype"),
    ],
)
def test_wrong_type_or_value_is_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["data.path=x.txt", override])


def test_yaml_scientific_notation_and_overrides():
    cfg = load_config(
        None, ["data.path=[a.txt, b.txt]", "optim.lr=3e-4", "model=/some/dir", "lora.target_modules=[q_proj]"]
    )
    assert cfg.optim.lr == pytest.approx(3e-4)  # YAML reads `3e-4` as a string; the schema accepts it as float
    assert cfg.data.path == ["a.txt", "b.txt"]
    assert cfg.model.path == "/some/dir"  # `model: <dir>` shorthand
    assert cfg.lora.target_modules == ["q_proj"]


def test_cli_bad_key_exits_nonzero_with_the_key(tmp_path, tiny_ckpt):  # noqa: F811
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, tmp_path / "out", "train.bogus_key=1")
    result = _train(config)
    assert result.exit_code == 2
    assert "train.bogus_key" in result.output
    assert "Traceback" not in result.output


def test_cli_missing_data_file(tmp_path, tiny_ckpt):  # noqa: F811
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, tmp_path / "out", data=str(tmp_path / "nope.jsonl"))
    result = _train(config)
    assert result.exit_code == 2
    assert "data file not found" in result.output and "nope.jsonl" in result.output


def test_cli_missing_model_dir(tmp_path, tiny_ckpt):  # noqa: F811
    config = write_config(tmp_path / "c.yaml", tmp_path / "no-model", tmp_path / "out")
    result = _train(config)
    assert result.exit_code == 2
    assert "model.path" in result.output


def test_cli_tokenizer_vocab_mismatch(tmp_path, tiny_ckpt):  # noqa: F811
    # a tokenizer with 10 more tokens than the model has embeddings for
    wrong = make_tiny_checkpoint(tmp_path / "wrong-tok", extra_tokens=10)
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, tmp_path / "out", f"model.tokenizer={wrong}")
    result = _train(config)
    assert result.exit_code == 2
    assert "vocabulary mismatch" in result.output and "271" in result.output and "264" in result.output


def test_cli_token_ids_outside_vocab(tmp_path, tiny_ckpt):  # noqa: F811
    """Pre-tokenized data from another model (ids >= vocab) is refused before training."""
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i % 300, 5, 6, 7, 8, 9, 10, 11]}) + "\n" for i in range(400)))
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, tmp_path / "out", "data.block_size=8", data=str(data))
    result = _train(config)
    assert result.exit_code == 2
    assert "outside the model's vocabulary" in result.output


def test_run_script_reports_errors_with_exit_code(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"path": "x.txt"}, "nonsense": 1}))
    proc = subprocess.run([sys.executable, str(REPO / "train" / "run.py"), "--config", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "unknown config key 'nonsense'" in proc.stderr
