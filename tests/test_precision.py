"""train.precision: bf16 only where the CPU multiplies it in hardware; "auto" is recorded resolved."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_support import tiny_ckpt  # noqa: F401
from typer.testing import CliRunner

from mtp.cli import app
from mtp.packed import bf16_matmul_units
from mtp.train import precision

runner = CliRunner()


@pytest.mark.parametrize("units", [True, False])
def test_auto_picks_bf16_only_with_bf16_units(monkeypatch, units):
    monkeypatch.setattr(precision, "bf16_matmul_units", lambda: units)
    expected = torch.bfloat16 if units else torch.float32
    assert precision.resolve_dtype("auto") == expected
    x = torch.randn(4, 8)
    with precision.autocast():
        y = torch.nn.functional.linear(x, torch.randn(3, 8))
    assert y.dtype == expected  # autocast on, or a plain fp32 context


def test_named_dtypes_and_refusal():
    assert precision.resolve_dtype("float32") == torch.float32
    assert precision.dtype_name("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="auto or one of"):
        precision.resolve_dtype("fp8")


def test_distill_records_the_resolved_dtype(tmp_path, tiny_ckpt):  # noqa: F811
    data = tmp_path / "p.txt"
    data.write_text("one\n")
    out = tmp_path / "d"
    args = ["distill", "--model", str(tiny_ckpt), "--data", str(data), "--out", str(out), "--max-new-tokens", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "distill_info.json").read_text())["dtype"]
    assert recorded == ("bfloat16" if bf16_matmul_units() else "float32")
    # a rerun that names the other dtype would mix answers of two precisions: refused
    other = "float32" if recorded == "bfloat16" else "bfloat16"
    result = runner.invoke(app, [*args, "--dtype", other])
    assert result.exit_code == 2 and "dtype" in result.output
