"""bf16 weights times several rows on a CPU without bf16 matmul units: a small AVX2 kernel, built at first use.

Why: on such a CPU (AVX2 only: AMD Zen 2-3, older Intel) torch's bf16 matmul reads the whole weight once per
row, so a tree verify costs several plain decode steps. `mtp.packed` can multiply from fp32 copies instead,
which read each weight once whatever the row count, but twice the bytes: for SmolLM2-135M a 6-node verify
then reads 540 MB where a plain bf16 step reads 270 MB, and on 2 cores it is memory-bound (~1.5 plain steps).
This kernel reads the bf16 weights themselves, blocked 16 output columns at a time
([N/16][K][16], `block_weight`), widens them to fp32 in registers and multiplies every row with a block while
it sits in cache: one pass over 270 MB for any row count, with the fp32 arithmetic of the copies.

What it needs: a CPU whose torch runs AVX2 kernels (AVX2 + FMA) and a C++ compiler (`$CXX`, g++, c++,
clang++). The source (`kernels/bf16_linear.cpp`, plain C ABI, no torch headers) builds in about 2 s into a
cache directory (`$MTP_KERNEL_CACHE`, default `~/.cache/mtp/kernels`) keyed by its hash, then loads with
ctypes; its OpenMP threads are torch's own (the same libgomp). Without either, `available()` is False and
`mtp.packed` keeps the fp32 copies.

Rounding: the fp32 sum of the same products in another order than oneDNN's, rounded to bf16 by the caller;
like any change of kernel it can move bf16 output at near-ties, which the benchmark counts with their margins.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kernels") / "bf16_linear.cpp"
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
BLOCK = 16  # output columns per weight block (two AVX2 registers of fp32)


def cache_dir() -> Path:
    return Path(os.environ.get("MTP_KERNEL_CACHE") or Path.home() / ".cache" / "mtp" / "kernels")


def cpu_runs_avx2() -> bool:
    """Whether torch runs its AVX2 (or wider) kernels on this CPU: AVX2 and FMA are there."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None (with the reason logged once) where it cannot run or be built here."""
    if not cpu_runs_avx2():
        logger.info("bf16 AVX2 kernel: torch runs no AVX2 kernels on this CPU")
        return None
    from .compiled import cpu_compiler  # (here: mtp.compiled imports the decoder, which imports mtp.packed)

    cxx = cpu_compiler()
    if cxx is None:
        logger.info("bf16 AVX2 kernel: no C++ compiler ($CXX, g++, c++, clang++); multiplying from fp32 copies")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((Path(cxx).name, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"bf16_linear-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved: atomic
                built = Path(tmp) / target.name
                subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True, text=True)
                os.replace(built, target)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("bf16 AVX2 kernel did not build (%s); multiplying from fp32 copies", detail.strip()[:500])
            return None
    lib = ctypes.CDLL(str(target))
    lib.bf16_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    lib.bf16_linear.restype = None
    return lib


def available() -> bool:
    """Whether the kernel runs here (an AVX2 CPU, a C++ compiler, a successful build)."""
    return _library() is not None


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (bf16) laid out as the kernel reads it: [ceil(N / 16), K, 16], zero-padded columns."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x @ W.T + bias` for `blocked = block_weight(W)`; x of any shape [..., K] (any float dtype), bias fp32.

    The rows are multiplied in fp32 from the bf16 weights; the result is fp32 (the caller rounds)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the bf16 AVX2 kernel is not available here (bf16_avx2.available() is False)")
    k = blocked.shape[1]
    if x.shape[-1] != k or blocked.dtype != torch.bfloat16 or not blocked.is_contiguous():
        raise ValueError(f"x [..., {x.shape[-1]}] does not fit a blocked bf16 weight of {k} inputs")
    rows = x.reshape(-1, k).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    lib.bf16_linear(
        rows.data_ptr(), rows.shape[0], k, blocked.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], out_features)
