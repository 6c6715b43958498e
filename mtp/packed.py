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

bf16 on a CPU without bf16 matmul units (AVX2 only, most AMD Zen 2-3 and older Intel parts): there torch's
bf16 matmul reads the whole weight once per row, so a forward over k rows costs about k one-row forwards
(SmolLM2-135M, 2 AVX2 cores: 8 rows 3.8x, 16 rows 7.4x one row) and a tree verify costs several plain steps:
speculation in bf16 ran at 0.70x of plain bf16 `generate()` there. Such weights are upcast (`upcasts`): a step
of several rows (a verify, drafting, a prompt, batched rows) multiplies in fp32, reading each weight once
whatever the row count, and rounds the result back to bf16; a one-row step keeps the model's own bf16 kernel,
the one `generate()` runs. Where `mtp.bf16_avx2`'s kernel builds (an AVX2 CPU and a C++ compiler: `bf16_kernel`)
it reads the bf16 weights themselves, blocked for it (+270 MB for SmolLM2; a 6-node verify ~1.15-1.3 one-token
steps); elsewhere the weights are fp32 copies in oneDNN's blocked layout (+540 MB, twice the bytes to read per
step: ~1.5-2). Rounding differs from bf16's own kernel like any change of kernel: the benchmark counts every
bf16 difference with its logit margin.

`packed_copy(module)` returns a copy of a module tree that shares every tensor with the original except that
each `nn.Linear` (and the drafting projection) runs from a packed weight. Nothing of the original changes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from . import bf16_avx2

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
    fp32 or bf16 weights (bf16 ones become fp32 copies on a CPU without bf16 matmul units: `upcasts`)."""
    param = next(module.parameters(), None)
    if param is None:
        return "the module has no weights"
    if param.device.type != "cpu":
        return f"the weights are on {param.device.type}, not the CPU"
    if param.dtype not in PACKABLE_DTYPES:
        return f"the weights are {param.dtype}; bfloat16 or float32 can be packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def can_pack(module: nn.Module) -> bool:
    """Whether `module`'s weights can be packed here (`unpackable_reason` says why not)."""
    return unpackable_reason(module) is None


def upcasts(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed as fp32 copies here: bf16 on a CPU without bf16 matmul units, where
    bf16's own kernel reads the weight once per row (the module docstring has the numbers)."""
    return dtype == torch.bfloat16 and not bf16_matmul_units()


def bf16_kernel() -> bool:
    """Whether upcast bf16 weights multiply through `mtp.bf16_avx2` (the bf16 weights, blocked: half the bytes
    of fp32 copies) rather than from fp32 copies in oneDNN's layout: where the kernel builds and runs."""
    return bf16_avx2.available()


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` from a weight kept in oneDNN's layout (a frozen copy: inference only).

    `upcast` (default: `upcasts(weight.dtype)`): a bf16 weight multiplies in fp32 and the result is rounded to
    bf16 for inputs of several rows, from the bf16 weight blocked for `mtp.bf16_avx2`'s kernel where it runs
    (`bf16_kernel`), else from an fp32 copy; one row runs bf16's own `F.linear` (the bits of a plain
    `generate()` step), unless `own_one_row=False`: drafters, whose bits no reference has to match, then run
    one row through the kernel too (about half the time of bf16's own one-row kernel on such a CPU)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        upcast: bool | None = None,
        own_one_row: bool = True,
    ):
        super().__init__()
        self.own_one_row = own_one_row
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight  # the original, shared (code that reads a layer's dtype and device finds it)
        self.upcast = (upcasts(weight.dtype) if upcast is None else upcast) and weight.dtype != torch.float32
        compute = torch.float32 if self.upcast else weight.dtype
        self.own_bias = None if bias is None else bias.detach()  # for upcast one-row steps
        self.bias = None if bias is None else bias.detach().to(compute)
        self.blocked = self.packed = None
        if self.upcast and weight.dtype == torch.bfloat16 and bf16_kernel():
            self.blocked = bf16_avx2.block_weight(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().to(compute), BATCH_HINT.get(compute, 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if not self.upcast:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.numel() == self.in_features and (self.own_one_row or self.blocked is None):
            return F.linear(x, self.weight, self.own_bias)  # one row: the model's own kernel, as generate() runs it
        if self.blocked is not None:
            out = bf16_avx2.linear(x, self.blocked, self.out_features, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias, "none", [], "")
        return out.to(self.weight.dtype)

    def extra_repr(self) -> str:
        kind = "packed"
        if self.upcast:
            kind = "blocked bf16, fp32 arithmetic" if self.blocked is not None else "packed as fp32"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def packed_copy(module: nn.Module, own_one_row: bool = True) -> nn.Module:
    """A copy of `module` sharing all its tensors, with every `nn.Linear` replaced by a `PackedLinear`.

    Modules with a projection of their own (`DraftProjection`) pack it through their `to_packed()` method.
    `own_one_row=False` (drafters): upcast bf16 layers run one row through the kernel too (`PackedLinear`).
    """
    reason = unpackable_reason(module)
    if reason is not None:
        raise ValueError(f"cannot pack weights here: {reason}")
    tensors = [*module.parameters(), *module.buffers()]
    out = copy.deepcopy(module, memo={id(t): t for t in tensors})
    return pack_in_place(out, own_one_row)


def pack_in_place(module: nn.Module, own_one_row: bool = True) -> nn.Module:
    """Replace the linear layers under `module` (itself included if it is one) by packed ones."""
    if type(module) is nn.Linear:
        return PackedLinear(module.weight, module.bias, own_one_row=own_one_row)
    to_packed = getattr(module, "to_packed", None)
    if callable(to_packed):
        return to_packed()
    for name, child in list(module.named_children()):
        replaced = pack_in_place(child, own_one_row)
        if replaced is not child:
            setattr(module, name, replaced)
    return module
