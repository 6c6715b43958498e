"""Prepacked linear weights: the same decode, cheaper matmuls on a CPU, no compile step.

Why: on a CPU, a bf16 `F.linear` goes to oneDNN, which first reorders the weight into its blocked (VNNI)
layout and then multiplies, on every call. At batch 1 the matmuls only read weights, so that reorder about
doubles the memory traffic of a decode step. oneDNN can keep a weight in its own layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's `freezing` does for CPU inference): for
SmolLM2-135M in bf16 on 2 cores an eager one-token forward drops from ~36 to ~28 ms and a 9-node verify
forward from ~43 to ~32 ms, from the same oneDNN kernel. Rounding can still differ from the unpacked call
at some row counts (in bf16 a one-token step; in fp32 oneDNN's kernel replaces the default one), like any
change of kernel or batch shape: greedy fp32 output is checked against `generate()` token for token, and the
benchmark counts every bf16 difference with its logit margin (all at near-ties, ≤ 0.25).

What it costs: a second copy of every packed weight (the model's own weights stay as they are, for training,
saving and `generate()`): +270 MB for SmolLM2 in bf16. And packed weights are a snapshot: weights changed
after packing are not seen until the model is packed again.

`packed_copy(module)` returns a copy of a module tree that shares every tensor with the original except that
each `nn.Linear` (and the drafting projection) runs from a packed weight. Nothing of the original changes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
# The row count oneDNN lays a weight out for (`_reorder_linear_weight`'s batch-size hint). Decoding runs
# 1 row (a plain step) and 2-32 rows (tree verifies, drafting, batched rows). In fp32 the layout for 1 row is
# a matrix-vector one: every call with 2 or more rows is ~1.6x slower from it than from a blocked layout, and
# even one row is no faster (SmolLM2-135M, 2 AVX2 cores, the 211 linear layers of a forward: 27 / 42 / 53 ms
# at 1 / 2 / 8 rows from the 1-row layout, 23 / 24 / 35 ms from a 16-row one; whole forwards 45-50 / 66-76 /
# 79-91 ms against 45-49 / 50-57 / 61-66 ms). Hints 2-64 give the same layout there, and from 2 rows on the
# same bits as the 1-row layout. bf16 keeps the 1-row layout, measured on AVX512-BF16 (a 9-node verify ~32 ms
# against ~28 ms for one token).
BATCH_HINT = {torch.float32: 16, torch.bfloat16: 1}
# the --pack/--no-pack option of every command that decodes
PACK_HELP = "Decode from weights prepacked for the CPU's matmul kernels (faster, a second copy of the weights)."


def bf16_matmul_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without, bf16 is emulated and slow."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def unpackable_reason(module: nn.Module) -> str | None:
    """Why `module`'s weights cannot be packed here (None: they can): packing needs a CPU module, oneDNN, and
    fp32 weights or bf16 ones on a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    param = next(module.parameters(), None)
    if param is None:
        return "the module has no weights"
    if param.device.type != "cpu":
        return f"the weights are on {param.device.type}, not the CPU"
    if param.dtype not in PACKABLE_DTYPES:
        return f"the weights are {param.dtype}; bfloat16 or float32 can be packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if param.dtype == torch.bfloat16 and not bf16_matmul_units():
        return "bfloat16 weights need a CPU with bf16 matmul units (AVX512-BF16 or AMX); use float32 here"
    return None


def can_pack(module: nn.Module) -> bool:
    """Whether `module`'s weights can be packed here (`unpackable_reason` says why not)."""
    return unpackable_reason(module) is None


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` from a weight kept in oneDNN's layout (a frozen copy: inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight  # the original, shared (code that reads a layer's dtype and device finds it)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT.get(weight.dtype, 1))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.weight.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def packed_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing all its tensors, with every `nn.Linear` replaced by a `PackedLinear`.

    Modules with a projection of their own (`DraftProjection`) pack it through their `to_packed()` method.
    """
    reason = unpackable_reason(module)
    if reason is not None:
        raise ValueError(f"cannot pack weights here: {reason}")
    tensors = [*module.parameters(), *module.buffers()]
    out = copy.deepcopy(module, memo={id(t): t for t in tensors})
    return pack_in_place(out)


def pack_in_place(module: nn.Module) -> nn.Module:
    """Replace the linear layers under `module` (itself included if it is one) by packed ones."""
    if type(module) is nn.Linear:
        return PackedLinear(module.weight, module.bias)
    to_packed = getattr(module, "to_packed", None)
    if callable(to_packed):
        return to_packed()
    for name, child in list(module.named_children()):
        replaced = pack_in_place(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module
