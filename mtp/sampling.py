"""Lossless speculative sampling over token trees, and Medusa's (lossy, opt-in) typical acceptance.

The target distribution p at every tree node is built with the very warpers `generate()` applies, in
its order (temperature, top-k, top-p, min-p; transformers' own classes), so "exactly the model's
distribution" means exactly what `base_model.generate(do_sample=True, ...)` samples from.

Recursive rejection sampling (SpecInfer's multi-candidate speculative sampling): the children of a
node are i.i.d. draws x_1..x_m from the draft distribution q of their depth. Visit them in order with
a residual r (initially p): accept x_i with probability min(1, r(x_i) / q(x_i)); on rejection set
r <- norm(max(0, r - q)) and try the next child; if every child is rejected, sample the bonus token
from r. With one child per node this is plain speculative sampling (Leviathan et al.; Chen et al.),
and in every case the emitted token is distributed exactly as p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .tree import Tree

_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}


def _hf_defaults() -> dict:
    get = getattr(GenerationConfig, "_get_default_generation_params", None)
    defaults = dict(_HF_DEFAULTS)
    if callable(get):
        defaults.update({k: v for k, v in get().items() if k in _HF_DEFAULTS})
    return defaults


# Sampling settings generate() would apply that we do not (yet): refusing beats silently differing.
_UNSUPPORTED_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None

    @classmethod
    def resolve(cls, generation_config, **overrides) -> SamplingParams:
        """Explicit arguments, else the model's generation_config, else generate()'s own defaults."""
        for name, neutral in _UNSUPPORTED_SAMPLING.items():
            value = getattr(generation_config, name, None)
            if value is not None and value != neutral and value != 0.0:
                raise ValueError(f"generation_config.{name}={value!r} is not supported by speculative sampling")
        values = {}
        for name, default in _hf_defaults().items():
            value = overrides.get(name)
            if value is None:
                value = getattr(generation_config, name, None)
            values[name] = default if value is None else value
        if not values["temperature"] > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {values['temperature']}")
        if not 0 < values["top_p"] <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {values['top_p']}")
        return cls(**values)

    def warpers(self) -> LogitsProcessorList:
        """The same warpers, in the same order, as `GenerationMixin._get_logits_processor`."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            procs.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=self.top_p))
        if self.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=self.min_p))
        return procs

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N, V) float32 probabilities after the warpers."""
        scores = logits.float()
        dummy_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
        return torch.softmax(self.warpers()(dummy_ids, scores), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw; on the CPU so that a CPU `torch.Generator` reproduces runs on any device."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def verify_sampled(
    tree: Tree,
    draft: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None,
    fixed: frozenset[int] = frozenset(),
) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree.

    draft[i]:        token at node i (node 0 = root)
    target_probs:    (N, V) p after node i
    draft_probs:     (D, V) q of depth d+1 (all nodes of one depth were drawn from the same q), or
                     (N, V) q per parent: row i = the q the children of node i were drawn from
                     (sequential drafters, whose q depends on the path). A tree of depth D has at
                     least D + 1 nodes, so the two layouts never have the same number of rows.
    fixed:           nodes whose token was not drawn but chosen deterministically (prompt lookup): their
                     q is a point mass, so they are accepted with probability r(x) and a rejection
                     zeroes r(x). Each candidate only has to be independent of its siblings' outcomes,
                     which a lookup continuation (a function of the text so far) is.
    Returns the accepted node ids (root first) and the bonus token (from p or from the residual).
    """
    per_parent = len(tree) > 1 and draft_probs.shape[0] == len(tree)
    node, accepted = 0, [0]
    while True:
        residual = target_probs[node]
        moved = False
        for child in tree.children[node]:
            x = draft[child]
            if child in fixed:  # a point mass at x: accepted with probability r(x), a rejection zeroes r(x)
                q = torch.zeros_like(residual)
                q[x] = 1.0
            else:
                q = draft_probs[node] if per_parent else draft_probs[tree.depths[child] - 1]
            ratio = float(residual[x]) / max(float(q[x]), 1e-30)
            u = float(torch.rand((), generator=generator))
            if u < min(1.0, ratio):
                accepted.append(child)
                node, moved = child, True
                break
            residual = (residual - q).clamp_(min=0)
            total = float(residual.sum())
            if total <= 0:  # r == q exactly: r(x)/q(x) was 1, so this branch is unreachable in exact math
                residual = target_probs[node]
            else:
                residual = residual / total
        if not moved:
            return accepted, sample(residual, generator)


def verify_typical(
    tree: Tree,
    draft: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance. LOSSY: the output no longer follows p exactly.

    A node is acceptable if p_parent(x) > min(epsilon, delta * exp(-H(p_parent))); take the longest
    acceptable path, then sample the bonus token from p at its end.
    """
    p = target_probs
    entropy = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)  # (N,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy)).tolist()
    parents = tree.parents
    ok = [False] + [float(p[parents[i], draft[i]]) > threshold[parents[i]] for i in range(1, len(tree))]
    best = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
        stack.extend([*path, c] for c in tree.children[path[-1]] if ok[c])
    return best, sample(p[best[-1]], generator)
