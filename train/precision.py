"""Which floating-point type trains and computes fastest on this CPU.

Why: bf16 is only fast where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere (AVX2-only
CPUs, common in cloud VMs) oneDNN emulates it: a batched bf16 forward of SmolLM2 measured 7x slower than fp32 on
an AVX2 machine, and a bf16-autocast drafter training step 20x slower. Commands whose dtype only affects speed
(feature caching, distillation, the drafter's autocast) therefore default to ``"auto"``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mtp.packed import bf16_matmul_units

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(name: str) -> str:
    """``"auto"`` resolved for this CPU ("bfloat16" with bf16 matmul units, else "float32"); others checked."""
    if name == "auto":
        return "bfloat16" if bf16_matmul_units() else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return name


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype of `dtype_name(name)`."""
    return DTYPES[dtype_name(name)]


def autocast(name: str = "auto") -> Any:
    """A bf16 autocast context where bf16 is fast (or asked for), else a no-op context (fp32)."""
    if resolve_dtype(name) == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
