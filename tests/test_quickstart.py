"""`mtp quickstart`'s identity verdict: fp32 must be identical; bf16 may differ only at a near-tie."""

from __future__ import annotations

import pytest
import torch
import typer

from mtp.quickstart import _explain_difference


def _case(margin: float):
    plain = torch.tensor([[7, 7, 1, 2, 3]])
    spec = torch.tensor([[7, 7, 1, 9, 3]])  # differs at new token 1
    logits = [torch.tensor([[5.0, 1.0, 0.0]]), torch.tensor([[4.0, 4.0 - margin, 0.0]])]
    return plain, spec, logits


def test_bf16_near_tie_is_explained_not_failed(capsys):
    plain, spec, logits = _case(0.125)
    _explain_difference(plain, spec, 2, logits, "bfloat16")
    out = capsys.readouterr().out
    assert "new token 1" in out and "0.125" in out and "near-tie" in out


@pytest.mark.parametrize(("margin", "dtype"), [(3.0, "bfloat16"), (0.125, "float32")])
def test_real_differences_fail(margin, dtype):
    plain, spec, logits = _case(margin)
    with pytest.raises(typer.Exit) as e:
        _explain_difference(plain, spec, 2, logits, dtype)
    assert e.value.exit_code == 1
