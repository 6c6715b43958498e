"""A compiled verify forward: the same model and weights, fewer and fused kernels per step.

Why: a small model's eager forward on a CPU spends much of its time outside the matmuls, one dispatch per
op, and a verify step over a tree pays more of it than a one-token step. On a CPU the graphs are built with
inductor's `freezing`: the weights become constants, prepacked for oneDNN's matmuls (the reorder that
`mtp.packed` saves eagerly). For SmolLM2-135M in bf16 on 2 cores a forward over an 8-node tree takes ~43 ms
eagerly, ~32 ms eagerly from packed weights, and ~27 ms compiled and frozen.

What it costs: graphs are built on first use. `dynamic=True` lets one graph serve every tree size and cache
length, but dynamo still builds a few variants: a one-token step specializes size 1, and a cache cropped after
a verify step has other strides than a freshly appended one. `warm_up` drives a scorer through all of them
before the first request: ~5 minutes on 2 cores with freezing (~2 without). Frozen weights are a snapshot:
compile again after changing them.

Exactness is unchanged in kind: compiled kernels round differently from eager ones, as a tree-shaped forward
already rounds differently from a one-token one. Greedy output is checked token for token against `generate()`
in fp32 (tests), and the benchmark counts every bf16 difference with its logit margin, as for the eager forward.

Only the verify forward is compiled. The prompt's forward runs eagerly (`decoding.TreeScorer`), and so do the
drafters, which are small next to the base.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .arch import BaseInfo
from .decoding import TreeScorer
from .tree import Tree


def cpu_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU kernels (`$CXX`, g++, c++ or clang++), or None."""
    candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    return next((found for c in candidates if c and (found := shutil.which(c))), None)


def compile_forward(base_model: nn.Module, **options: Any) -> Callable[..., Any]:
    """`base_model.forward` through `torch.compile(dynamic=True, **options)`; lazy: nothing is built yet.

    On a CPU inductor's `freezing` is on unless `options`/`mode` are given: the graphs treat the weights as
    constants and keep them prepacked for oneDNN. They are a snapshot: compile again after changing them.

    On a CPU, inductor writes C++ kernels: without a compiler the first step would fail deep inside torch, so a
    missing one is refused here with the fix.
    """
    on_cpu = next(base_model.parameters()).device.type == "cpu"
    if on_cpu and options.get("backend", "inductor") == "inductor" and cpu_compiler() is None:
        raise RuntimeError(
            "compiled decoding on a CPU needs a C++ compiler for torch.compile's kernels, and none was found "
            "($CXX, g++, c++, clang++): install one (e.g. apt install g++) or decode without compile_decoding()"
        )
    if on_cpu and "options" not in options and "mode" not in options:
        # weights as constants, prepacked for oneDNN's matmuls (mtp.packed explains why that pays)
        options = {**options, "options": {"freezing": True}}
    return torch.compile(base_model.forward, **{"dynamic": True, **options})


@torch.inference_mode()
def warm_up(
    forward: Callable[..., Any],
    base_model: nn.Module,
    info: BaseInfo,
    tree: Tree,
    prompt_len: int = 16,
) -> None:
    """Build every graph variant a decode can need, so no request waits for a compile.

    The steps: trees and single tokens, each after a step that cropped the cache and after one that did not
    (both sizes, both cache layouts). Prompts shorter than `prompt_len` may still build a graph on their first
    request (a cache of one position is a size dynamo specializes).
    """
    device = next(base_model.parameters()).device
    vocab = base_model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt_len), generator=gen).to(device)
    scorer = TreeScorer(base_model, info, forward=forward)
    scorer.prefill(ids)
    one, chain = Tree([]), Tree([[0], [0, 0]])
    if len(tree) < 2:
        tree = chain
    # (tree, nodes kept): [0] crops the cache (a strided view), every node of a chain keeps it contiguous
    steps = [(tree, [0]), (tree, [0]), (one, [0]), (one, [0]), (tree, [0]), (chain, [0, 1, 2])]
    steps += [(tree, [0]), (one, [0]), (chain, [0, 1, 2]), (one, [0]), (tree, [0])]
    for step_tree, keep in steps:
        draft = torch.randint(0, vocab, (len(step_tree),), generator=gen).to(device)
        prefix = scorer.length
        scorer.score(draft, step_tree)
        scorer.keep(prefix, keep)
