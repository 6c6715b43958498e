"""Adaptive drafting: pick the tree size that maximises tokens per second, and stop drafting when
the heads miss.

Speculation only pays when the expected tokens per step beat what the step costs. Both change with
the prompt (code vs chit-chat), the heads and the hardware, so the policy measures both online:

* accuracy:  after every verify step, each tree node whose parent lies on the accepted path is a
             trial for (depth, rank): hit if its draft equals the base model's choice there. Counts
             start from a weak prior (the model's measured head accuracies, or generic defaults).
* cost:      wall seconds per step in two parts, each an exponential moving average: the verify part per
             tree size actually used, and the drafting part per drafting depth actually used; sizes and
             depths not tried yet are estimated from the prior curves relative to what was.

Every `every` steps the policy rebuilds the best tree for each size on a ladder (best-first, from
the estimated accuracies) and each depth limit, and keeps the tree with the highest expected-length /
expected-seconds. The depth limit matters for drafters that run depth after depth (the MTP modules, the
EAGLE drafter: `Proposer.depth_cost`): there a tree's drafting costs one drafter step per depth, so the
deepest tree of a size is not always the fastest one. With fp32 on an AVX2 CPU (packed), a depth of the
EAGLE drafter costs ~0.05 decode steps while a verify of 4 nodes costs 1.07 and of 8 nodes 1.19 (bench/profile.py).
With `timed=False` only the prior cost curve is used, so the tree sequence depends on the text alone:
sampling needs that, because which tree a step uses decides which random numbers it draws, and a
seeded generate() must give the same tokens on a busy machine as on a quiet one. Half precision needs
it too: the tree decides how the verify forward rounds, so a timed policy's bf16 greedy output would
change at near-ties with the machine's load.

`shapes` pins the tree of a size (the model's default tree, say): that size is then only switched on or
off, never reshaped from the online estimates. Half precision uses it: on MT-Bench in bf16 the reshaped
16-node trees came out behind the fixed default tree in every comparison (80 questions: 2.09x vs 2.17x),
their estimates being noisier than the held-out accuracies the default tree is built from.

Size 1 means no drafting at all (one plain decode step, no head cost); while there, a small probe
tree runs every `probe_every` steps so the estimates can recover when the text becomes predictable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import packed as packing
from .tree import DEFAULT_ACCURACIES, Path, Tree, best_trees, build_tree

# Drafting itself (running the heads, top-k, building the step's inputs), relative to one decode step; the
# verify-cost curves below are forwards only. Without it, weak heads on hardware where verifying is free
# would look worth running forever. Drafters that run depth after depth add their `depth_cost` for every depth
# after the first.
DRAFT_OVERHEAD = 0.15
# Accuracy counts fade by this factor per step (a memory of ~100 steps), so the policy follows the text
# from chit-chat to code and back instead of averaging over the whole answer.
FORGET = 0.99

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Forward cost over k new tokens relative to k = 1 (a CPU fp32 curve, conservative for bf16/GPU); the
# online timings replace it as soon as a size has been used.
PRIOR_COST = {1: 1.0, 2: 1.3, 3: 1.4, 4: 1.5, 6: 1.5, 8: 1.5, 12: 1.55, 16: 1.6, 24: 1.9, 32: 2.1, 48: 2.8, 64: 3.4}
# bf16/fp16 on a CPU with bf16 matrix units: a 16-token forward costs about one decode step (measured with
# bench/verify_cost.py on SmolLM2: 0.8-1.0 for k = 2..16, 1.2 at 32). Other runs of that machine measure more
# (1.17-1.36 at 16, 1.6-2.1 at 32), and the trainer sizes trees from those (drafter_trainer.VERIFY_COST_BF16).
# This runtime prior stays optimistic on purpose: in half precision it only switches the default tree on or
# off, from an expected length that counts the heads alone, while prompt-lookup chains grafted onto head
# nodes reach deeper than either alone. With the measured curve, drafting switched off on 4 of 40
# development prompts, and all 4 ran as fast or faster with it left on.
PRIOR_COST_HALF = {
    1: 1.0,
    2: 1.0,
    3: 1.0,
    4: 1.0,
    6: 1.0,
    8: 1.0,
    12: 1.05,
    16: 1.1,
    24: 1.2,
    32: 1.3,
    48: 1.6,
    64: 1.9,
}


# bf16 on a CPU without bf16 matmul units (AVX2 only). From the model's own weights torch's bf16 kernel reads every
# weight once per row, so k tokens cost about k one-token forwards (SmolLM2-135M, 2 AVX2 cores, bench/verify_cost.py:
# 1.7 / 2.2 / 3.2 / 4.5 / 7.1 at k = 2 / 4 / 6 / 8 / 16): drafting hardly ever pays. Prepacked, the weights are fp32
# copies (mtp.packed) and the curve is nearly flat again, from a dearer start (1.14 / 1.5 / 1.4 / 1.5 / 1.7; a
# 6-node tree verify ~1.55 one-token steps). These stay a little optimistic for the reason given above.
PRIOR_COST_HALF_FP32_COPIES = {
    1: 1.0,
    2: 1.15,
    3: 1.3,
    4: 1.4,
    6: 1.45,
    8: 1.5,
    12: 1.6,
    16: 1.7,
    24: 2.0,
    32: 2.3,
    48: 3.0,
    64: 3.6,
}
# Prepacked for mtp.bf16_avx2's kernel (the bf16 weights blocked, multiplied in fp32, half the bytes of the copies),
# relative to a one-token bf16 step (SmolLM2-135M, 2 AVX2 cores, bench/latest/avx2/verify_cost_kernel.py: 1.0 / 1.09 /
# 1.35 / 1.5 / 1.56 at k = 2 / 4 / 6 / 8 / 16, the copies 1.55 / 1.71 / 1.87 / 2.46 / 2.61 interleaved with it): the
# copies' curve scaled to the kernel's smaller excess, below it at every size.
PRIOR_COST_HALF_KERNEL = {
    1: 1.0,
    2: 1.1,
    3: 1.15,
    4: 1.2,
    6: 1.25,
    8: 1.35,
    12: 1.45,
    16: 1.5,
    24: 1.75,
    32: 2.0,
    48: 2.6,
    64: 3.1,
}
PRIOR_COST_HALF_EMULATED = {
    1: 1.0,
    2: 1.7,
    3: 1.9,
    4: 2.2,
    6: 3.2,
    8: 4.5,
    12: 5.8,
    16: 7.1,
    24: 10.5,
    32: 14.0,
    48: 21.0,
    64: 28.0,
}


def half_precision_prior(device: torch.device, dtype: torch.dtype, packed: bool) -> dict[int, float]:
    """The cost curve that steers half-precision decoding (untimed): chosen from what the hardware and runtime
    are, never from a clock, so that bf16 greedy output stays the same on a busy machine as on a quiet one.

    bf16 on a CPU without bf16 matmul units has its own curves (prepacked for the AVX2 kernel, as fp32 copies, or
    not prepacked); everything else (bf16 matmul units, a GPU, fp16) keeps `PRIOR_COST_HALF`."""
    if device.type != "cpu" or not packing.upcasts(dtype):  # upcasts: bf16 on a CPU without bf16 matmul units
        return PRIOR_COST_HALF
    if not packed:
        return PRIOR_COST_HALF_EMULATED
    return PRIOR_COST_HALF_KERNEL if packing.bf16_kernel() else PRIOR_COST_HALF_FP32_COPIES


class AdaptiveDraft:
    def __init__(
        self,
        num_heads: int,
        max_nodes: int,
        prior_accuracies: Sequence[Sequence[float]] | None = None,
        prior_cost: dict[int, float] | None = None,
        prior_weight: float = 4.0,
        every: int = 4,
        probe_every: int = 16,
        max_rank: int = 8,
        timed: bool = True,
        ladder: Sequence[int] = LADDER,
        shapes: dict[int, Tree] | None = None,
        depth_cost: float = 0.0,
    ):
        """depth_cost: the prior drafting cost of each depth after the first, in decode steps (0: drafting costs
        the same at every depth, as Medusa heads, which draft all depths in one pass); the timings replace it."""
        self.num_heads = num_heads
        self.depth_cost = depth_cost
        self.shapes = dict(shapes or {})
        self.sizes = sorted({n for n in ladder if n <= max(1, max_nodes)} | {1})
        prior = [list(r) for r in (prior_accuracies or DEFAULT_ACCURACIES)][:num_heads]
        while len(prior) < num_heads:
            prior.append([x * 0.7 for x in prior[-1]])
        self.hits = [[prior_weight * (row[r] if r < len(row) else 0.0) for r in range(max_rank)] for row in prior]
        self.trials = [[prior_weight] * max_rank for _ in prior]
        self.prior_cost = prior_cost or PRIOR_COST
        self.seconds: dict[int, float] = {}  # tree size -> seconds of a step besides drafting (timed)
        self.draft_seconds: dict[int, float] = {}  # drafting depth -> seconds of drafting (timed)
        self.every, self.probe_every = every, probe_every
        self.timed = timed
        self.step = 0
        self.current = self._best()

    def accuracies(self) -> list[list[float]]:
        return [
            [h / t if t else 0.0 for h, t in zip(hr, tr, strict=True)]
            for hr, tr in zip(self.hits, self.trials, strict=True)
        ]

    def _cost(self, n: int, depth: int) -> float:
        """Expected seconds (timed, once anything was measured) or decode steps of a step with a tree of `n`
        nodes drafted to `depth`: the verify part plus the drafting part."""
        return self._verify_cost(n) + (self._draft_cost(depth) if n > 1 else 0.0)

    def _verify_cost(self, n: int) -> float:
        if n in self.seconds:
            return self.seconds[n]
        if not self.seconds:
            return self._prior(n)
        # scale the prior by what a measured size actually cost
        ref_n, ref_s = min(self.seconds.items(), key=lambda kv: abs(kv[0] - n))
        return ref_s * self._prior(n) / self._prior(ref_n)

    def _draft_cost(self, depth: int) -> float:
        if depth in self.draft_seconds:
            return self.draft_seconds[depth]
        if self.draft_seconds:
            ref_d, ref_s = min(self.draft_seconds.items(), key=lambda kv: abs(kv[0] - depth))
            return ref_s * self._draft_prior(depth) / self._draft_prior(ref_d)
        if self.seconds:  # measured verify steps but no drafting yet: the prior in the measured unit
            ref_n, ref_s = min(self.seconds.items())
            return self._draft_prior(depth) * ref_s / self._prior(ref_n)
        return self._draft_prior(depth)

    def _prior(self, n: int) -> float:
        keys = sorted(self.prior_cost)
        k = min(keys, key=lambda x: (abs(x - n), x))
        return self.prior_cost[k]

    def _draft_prior(self, depth: int) -> float:
        return DRAFT_OVERHEAD + self.depth_cost * max(0, depth - 1)

    def _candidates(self, acc: list[list[float]]) -> list[tuple[int, int, float, tuple[Path, ...]]]:
        """(size, depth, expected length, paths) of the best tree per ladder size and depth limit.

        Without a depth cost only the deepest limit can win (a deeper tree of the same size never expects
        fewer tokens and costs the same), so only that one is searched."""
        sizes = [n for n in self.sizes if n > 1]
        out: list[tuple[int, int, float, tuple[Path, ...]]] = [(1, 0, 1.0, ())]
        free = [n for n in sizes if n not in self.shapes]
        depths = range(1, self.num_heads + 1) if self.depth_cost > 0 or self.draft_seconds else [self.num_heads]
        seen: set[tuple[int, int]] = set()
        for limit in depths:
            for choice in best_trees(free, limit, acc).values():
                if choice.size > 1 and (choice.size, choice.depth) not in seen:  # nodes with a chance at all
                    seen.add((choice.size, choice.depth))
                    out.append(choice)
        for n, tree in self.shapes.items():
            if n in sizes:
                out.append((len(tree), tree.depth, tree.expected_length(acc), tree.paths))
        return out

    def _best(self) -> Tree:
        best, best_rate = (), 0.0
        # cheapest first: a dearer tree must clearly win (2%) to be chosen
        for n, depth, expected, paths in sorted(self._candidates(self.accuracies()), key=lambda c: (c[0], c[1])):
            rate = expected / self._cost(n, depth)
            if rate > best_rate * 1.02:
                best, best_rate = paths, rate
        tree = Tree(best)
        # the same tree as now: keep the instance, whose per-tree tables (ancestors, positions) are already built
        return self.current if tree == getattr(self, "current", None) else tree

    def tree(self) -> Tree:
        """The tree for the next step: the current choice, or now and then a probe.

        While not drafting, a small tree now and then keeps the accuracy estimates alive. While drafting
        (timed mode), a plain step now and then measures what no drafting costs here; with that anchor the
        measured seconds of the trees compare against plain decoding itself, not only against each other.
        """
        self.step += 1
        if self.step % self.probe_every == 0:
            if len(self.current) == 1:
                return build_tree(min(4, self.sizes[-1]), self.num_heads, self.accuracies())
            if self.timed:
                return Tree([])
        return self.current

    def update(
        self,
        tree: Tree,
        accepted: list[int],
        seconds: float,
        draft_seconds: float | None = None,
        draft_depth: int | None = None,
    ) -> None:
        """Record one verify step (accuracies, and seconds when timed); re-pick the tree every `every` steps.

        seconds: the whole step. draft_seconds: the drafting part of it, drafted to `draft_depth` (the heads'
        tree depth; prompt-lookup nodes grafted on afterwards cost no drafting). Without them the whole step
        counts as the verify part of its size."""
        n = len(tree)
        if self.timed:
            verify = seconds
            if draft_seconds is not None and draft_depth:
                verify = max(seconds - draft_seconds, 0.0)
                old = self.draft_seconds.get(draft_depth)
                self.draft_seconds[draft_depth] = draft_seconds if old is None else 0.8 * old + 0.2 * draft_seconds
            self.seconds[n] = verify if n not in self.seconds else 0.8 * self.seconds[n] + 0.2 * verify
        self.observe(tree, accepted)
        if self.step % self.every == 0 or (n == 1 and len(self.current) > 1):
            self.current = self._best()

    def observe(self, tree: Tree, accepted: list[int]) -> None:
        """Only the accuracy counts: the children of every accepted node were trials, hit if accepted.
        (The batched decoder plans sizes for the whole batch itself and uses just these estimates.)"""
        on_path = set(accepted)
        for row in (*self.hits, *self.trials):
            for r in range(len(row)):
                row[r] *= FORGET
        for parent in accepted:
            for child in tree.children[parent]:
                d, r = tree.depths[child] - 1, tree.ranks[child]
                if d < len(self.trials) and r < len(self.trials[d]):  # prompt-lookup nodes are not heads
                    self.trials[d][r] += 1
                    self.hits[d][r] += child in on_path
