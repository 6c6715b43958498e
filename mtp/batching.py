"""Continuous batching with self-speculative decoding: many sequences, one base forward per step.

Each running sequence (a *row*) has its own prompt, KV length, positions, stop rules, sampling parameters,
generator, proposer state and acceptance statistics. One `BatchDecoder.step()`:

  1. admit      waiting requests join while a row and the KV budget allow; prompts are prefilled on their
                own (batch 1, the model's causal mask: the very forward `generate()` runs), long ones in
                chunks of `prefill_chunk` tokens per step so they never stall the running rows for seconds
  2. plan       pick the step's node budget N (1 = plain decoding) that maximises the batch's expected
                tokens per second (`StepCost`: forward seconds as a function of the tokens in one forward,
                measured on this machine, plus each drafting row's drafting, priced per drafted depth; each
                row's expected length from its own measured acceptance, its tree of N nodes as deep as pays).
                Under heavy load this is N = 1: plain batched decoding.
  3. propose    each row's proposer drafts its best tree of <= N nodes (+ its prompt-lookup chain); a greedy
                row whose drafter grows draft-time trees (`mtp.dynamic_tree`, the EAGLE drafter) grows one of
                N nodes instead, as `MTPModel.generate()` does alone: the plan picks the size, the drafter's
                confidence the shape; the growing rows draft together (`Proposer.propose_dynamic_rows`: the
                EAGLE drafter runs each depth once for all of them, priced by `StepCost.row_share`)
  4. score      ONE forward over every row's tree, padded to the widest; row i's 4D mask lets its nodes see
                its own prefix (and sliding window) and their ancestors, nothing of other rows or padding
  5. verify     per row, exactly as the batch-1 decoder does (greedy argmax walk, or lossless rejection
                sampling), then `BatchCache.commit` keeps each row's accepted path in place
  6. emit       per row, stopping at EOS / max_new_tokens exactly where `generate()` would

Greedy rows are therefore token-identical to their own `generate()` whatever else is in the batch (up to the
float rounding of a differently shaped forward: fp32 identical in the tests; half precision only at near-ties,
as batch-1 already is). Sampled rows keep exactly their distribution; their random draws depend on the trees
the load chose, so a seed reproduces a request's tokens only under the same batch composition.
"""

from __future__ import annotations

import collections
import ctypes
import inspect
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .adaptive import LADDER, AdaptiveDraft
from .batch_cache import BatchCache
from .decoding import GreedyStrategy, SamplingStrategy, resolve_stopping
from .dynamic_tree import DYNAMIC_DEPTH, DYNAMIC_WIDTH, DynamicTree
from .eagle import select_features
from .kv_cache import new_cache
from .ngram import NODE_COST_FULL, NODE_COST_HALF, NgramDraft, carry_rows
from .proposer import Proposer
from .sampling import SamplingParams
from .tree import Tree, best_trees, resolve_tree

# Configs whose CausalLM head does more than `lm_head(hidden)` (scaling, soft-capping): for those the engine
# runs the whole CausalLM forward instead of the decoder + lm_head on the real (unpadded) nodes only.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# What acceptance probes may cost a batch that decodes plain, as a share of its decoding time (`_probe_interval`).
PROBE_SHARE = 0.02


@dataclass
class StepCost:
    """Seconds of one batched forward as a function of the tokens in it, plus drafting per row.

    Fixed once measured, not updated from the clock while serving: the plan then depends on the batch and
    the text alone, so a lone greedy request in half precision, or a seeded sampled one, decodes the same
    tokens on a busy machine as on a quiet one.
    """

    tokens: tuple[int, ...]  # forward sizes measured (ascending)
    seconds: tuple[float, ...]
    draft_seconds: float  # one row's drafting (heads + tree) of a one-depth tree per step
    # Each further drafted depth: the MTP modules and the EAGLE drafter run one drafter step per depth, so a
    # deep tree's drafting can cost a row as much as its share of the verify forward (Medusa heads: ~0).
    depth_seconds: float = 0.0
    # What each further row adds, as a share of one row's drafting, when the rows of a step draft their
    # draft-time trees together (`Proposer.propose_dynamic_rows`): 1 where they draft one after another; the
    # EAGLE drafter runs each depth once for all of them, so a few rows draft for little more than one.
    row_share: float = 1.0

    def draft(self, depth: int) -> float:
        """Seconds of one row's drafting of a tree `depth` deep."""
        return self.draft_seconds + self.depth_seconds * max(0, depth - 1)

    def together(self, rows: int) -> float:
        """Each row's share of its drafting when `rows` rows draft together (1.0 for a lone row)."""
        rows = max(1, rows)
        return (1.0 + self.row_share * (rows - 1)) / rows

    def forward(self, n: int) -> float:
        """Seconds for a forward over n tokens: linear between measured sizes, linear growth beyond."""
        xs, ys = self.tokens, self.seconds
        if n <= xs[0]:
            return ys[0]
        for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:], strict=False):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
        return ys[-1] + slope * (n - xs[-1])

    def save(self, path: str | Path) -> None:
        """Write the curve as JSON, so a later start can price its plans with it (`load`)."""
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCost:
        """A curve written by `save`. Loading one instead of measuring at startup makes every start plan the
        same trees for the same batch (and starts faster); a file that is not such a curve raises ValueError."""
        try:
            raw = json.loads(Path(path).read_text())
            cost = cls(
                tokens=tuple(int(n) for n in raw["tokens"]),
                seconds=tuple(float(s) for s in raw["seconds"]),
                draft_seconds=float(raw["draft_seconds"]),
                depth_seconds=float(raw.get("depth_seconds", 0.0)),
                row_share=float(raw.get("row_share", 1.0)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path} is not a step-cost curve (JSON written by StepCost.save): {e}") from None
        xs, ys = cost.tokens, cost.seconds
        if not xs or len(xs) != len(ys) or list(xs) != sorted(set(xs)) or xs[0] < 1:
            raise ValueError(f"{path}: 'tokens' must be ascending positive sizes, one per entry of 'seconds'")
        if min(ys) <= 0 or min(cost.draft_seconds, cost.depth_seconds, cost.row_share) < 0:
            raise ValueError(f"{path}: seconds must be positive, drafting costs and row_share non-negative")
        return cost

    @classmethod
    def measure(cls, model, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256), context: int = 256) -> StepCost:
        """Time forwards of `sizes` new tokens over a `context`-token cache, and one row's drafting (of the
        default tree's first depth and of the whole default tree, which gives the cost per depth)."""
        base, device = model.decoding_base, next(model.parameters()).device
        vocab = model.info.vocab_size
        gen = torch.Generator().manual_seed(0)
        seconds = []
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
            cache = new_cache()
            base(input_ids=prompt, use_cache=True, **{model.info.cache_kwarg: cache})
            for n in sizes:
                ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
                pos = torch.arange(context, context + n, device=device)[None]
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    base(input_ids=ids, position_ids=pos, use_cache=True, **{model.info.cache_kwarg: cache})
                    best = min(best, time.perf_counter() - t)
                    cache.crop(-n)
                seconds.append(best)
            proposer = model.make_proposer()
            m = min(64, context - 1)
            states = base(input_ids=prompt[:, :m], output_hidden_states=True).hidden_states
            hidden = select_features(states, getattr(proposer, "feature_layers", None))[0]
            proposer.begin(hidden, prompt[0, :m])
            full, root = model.default_tree, int(prompt[0, m])
            first = Tree([p for p in full.paths if len(p) == 1])
            drafting = []
            for tree in (first, full):
                proposer.propose(root, tree)  # warm-up (first call builds plans)
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    proposer.propose(root, tree)
                    best = min(best, time.perf_counter() - t)
                drafting.append(best)
            share = 1.0
            if proposer.dynamic_trees and type(proposer).propose_dynamic_rows.__func__ is not (
                Proposer.propose_dynamic_rows.__func__
            ):
                share = _row_share(model, hidden, prompt[0, :m], root, len(full))
        per_depth = max(0.0, drafting[1] - drafting[0]) / max(1, full.depth - 1)
        return cls(tuple(sizes), tuple(seconds), drafting[0], per_depth, share)


def _row_share(model, hidden: torch.Tensor, tokens: torch.Tensor, root: int, nodes: int, rows: int = 4) -> float:
    """`StepCost.row_share`: one round of `rows` identical rows' draft-time trees drafted together against one
    row's, (t_rows / t_1 - 1) / (rows - 1); each timing the best of three from the same state."""

    def best(n: int) -> float:
        proposers = []
        for _ in range(n):
            p = model.make_proposer()
            p.begin(hidden, tokens)
            proposers.append(p)
        budget = DynamicTree(nodes, DYNAMIC_DEPTH, DYNAMIC_WIDTH)
        kind = type(proposers[0])
        kind.propose_dynamic_rows(proposers, [root] * n, [budget] * n)  # warm-up: feeds the prompt once
        t_best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            kind.propose_dynamic_rows(proposers, [root] * n, [budget] * n)
            t_best = min(t_best, time.perf_counter() - t)
        return t_best

    one = best(1)
    return min(1.0, max(0.0, (best(rows) / one - 1.0) / (rows - 1)))


@dataclass
class RowUpdate:
    """What one step did for one request: tokens to stream, and whether (and why) it finished."""

    request_id: int
    tokens: list[int]
    step: int | None  # the row's verify step that produced them (None: the prefill)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS) | "length" | "abort" (cancelled)
    accepted_lengths: list[int] = field(default_factory=list)  # on finish: tokens per verify step
    draft_tokens: list[int] = field(default_factory=list)  # on finish: nodes drafted per verify step


class _Row:
    """One sequence's decoding state (see the module docstring)."""

    def __init__(self, rid: int, prompt: list[int], max_new: int, eos: set[int], strategy, speculative: bool):
        self.rid, self.prompt, self.max_new, self.eos = rid, prompt, max_new, eos
        self.strategy, self.speculative = strategy, speculative
        self.out: list[int] = []
        self.prefilled = 0  # prompt tokens already in the solo cache (while prefilling)
        self.solo_cache = None
        self.hidden_parts: list[torch.Tensor] = []
        self.proposer = None
        self.policy: AdaptiveDraft | None = None
        self.ngram: NgramDraft | None = None
        self.trees: dict[int, tuple[Tree, float]] = {}  # node budget -> (tree, expected length)
        self.lengths: list[int] = []
        self.drafted: list[int] = []
        self.cancelled = False

    @property
    def token(self) -> int:
        return self.out[-1]


class BatchDecoder:
    """Continuous batching over an `MTPModel` (any head type): add requests, call `step()` until idle.

    max_batch_size: rows decoded together; max_kv_tokens: KV budget in token positions for the padded batch
    (rows x the longest row's prompt + max_new_tokens + tree); a request that does not fit waits (never OOM):
    the cache holds at most max_kv_tokens x `kv_bytes_per_token` bytes. guard: check the plan against the
    measured speed of batches (see `_guard`); off, the plan depends on the cost curve and the text alone.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 16,
        max_kv_tokens: int = 65536,
        prefill_chunk: int = 512,
        cost: StepCost | None = None,
        prompt_lookup: bool = True,
        probe_every: int = 16,
        replan_every: int = 4,
        tree=None,
        guard: bool = True,
    ):
        self.model, self.info = model, model.info
        self.base = model.decoding_base  # packed weights where the model has them (MTPModel.pack_decoding)
        self.max_batch_size, self.max_kv_tokens = max_batch_size, max_kv_tokens
        self.prefill_chunk, self.prompt_lookup = prefill_chunk, prompt_lookup
        self.probe_every, self.replan_every, self.guard = probe_every, replan_every, guard
        param = next(self.base.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.half = self.dtype in (torch.bfloat16, torch.float16)
        self.default_tree = model.default_tree
        full = len(self.default_tree)
        # a probe's tree (see `_probe_interval`): small, so it keeps one row's acceptance estimates alive cheaply
        self.probe_nodes = min(4, full)
        # Node budgets the plan chooses from. Half precision alone (batch 1) switches the full default tree on or
        # off, as generate() does (a ~16-node verify costs about one decode step there, so smaller trees only
        # lose tokens); with company, smaller trees can pay where the full one no longer does.
        self.budgets = tuple(n for n in LADDER if n <= full) if not self.half else (1, 4, 8, full)
        self.budgets_alone = (1, full) if self.half else self.budgets
        # A fixed tree (`tree=`: a Tree, rank paths, a node count, "default" or "chain"): every speculating row
        # verifies it at every step, whatever the load; None / "auto": the load-aware plan, whose greedy rows
        # grow draft-time trees of the planned size where their drafter can; "auto-static": the plan's static
        # shapes only (as `MTPModel.generate(tree="auto-static")`).
        self.fixed_tree = None
        if isinstance(tree, DynamicTree):
            raise ValueError(
                "the batched engine plans each step's size itself: pass None (draft-time trees where the drafter "
                "grows them), 'auto-static', a Tree or a node count"
            )
        if tree is not None and tree not in ("auto", "auto-static"):
            self.fixed_tree = resolve_tree(tree, model.config.num_heads, self.default_tree)
        self.dynamic = self.fixed_tree is None and tree != "auto-static"
        self._cost = cost
        self.cache = BatchCache()
        self.rows: list[_Row] = []  # decoding, in cache-row order
        self.prefilling: collections.deque[_Row] = collections.deque()
        self.waiting: collections.deque[_Row] = collections.deque()
        self._next_id = 0
        self._steps = 0
        # Measured tokens/s of decode steps per (batch size, speculated?), for the guard in `_plan` (batches only).
        self._rate: dict[tuple[int, bool], float] = {}
        self._observations = 0  # acceptance observations so far (any row): a plain plan stands until they change
        self._plain_plan: tuple | None = None  # (rows, observations) the plan last chose plain decoding for
        self.last_forward_tokens = 0  # tokens (real + padding) in the last batched forward, for metrics
        self.last_batch_size = 0
        decoder = self.base.get_decoder() if hasattr(self.base, "get_decoder") else self.base
        config = getattr(self.base.config, "get_text_config", lambda: self.base.config)()
        transforms = any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS)
        self._decoder = None if decoder is self.base or transforms else decoder
        if self._decoder is not None:
            params = inspect.signature(self._decoder.forward).parameters
            self._decoder_cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.kv_bytes_per_token = self._kv_bytes_per_token(config, param.element_size())

    # ---- requests -----------------------------------------------------------------------------------

    @property
    def cost(self) -> StepCost:
        if self._cost is None:
            self._cost = StepCost.measure(self.model)
        return self._cost

    def add(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int | None = None,
        *,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        generator: torch.Generator | None = None,
        speculative: bool = True,
        eos_token_id: int | list[int] | None = None,
    ) -> int:
        """Queue a request; returns its id. Bad input raises ValueError here, before anything is queued."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: give at least one prompt token")
        if min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            raise ValueError(f"prompt token ids must be in 0..{self.info.vocab_size - 1}")
        gen_config = self.base.generation_config
        max_new, eos = resolve_stopping(
            gen_config, len(prompt), max_new_tokens, eos_token_id,
            getattr(self.base.config, "max_position_embeddings", None),
        )  # fmt: skip
        if self.info.max_positions is not None and len(prompt) + max_new > self.info.max_positions:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"{self.info.max_positions} positions"
            )
        if len(prompt) + max_new + len(self.default_tree) + 16 > self.max_kv_tokens:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) does not fit the KV budget of "
                f"{self.max_kv_tokens} tokens"
            )
        strategy = GreedyStrategy()
        if do_sample:
            params = SamplingParams.resolve(gen_config, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            strategy = SamplingStrategy(params, generator)
        rid = self._next_id
        self._next_id += 1
        self.waiting.append(_Row(rid, prompt, max_new, eos, strategy, speculative))
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request; its row is freed (and an "abort" update emitted) at the next step."""
        for row in (*self.rows, *self.prefilling, *self.waiting):
            if row.rid == request_id:
                row.cancelled = True

    @property
    def num_running(self) -> int:
        return len(self.rows) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.prefilling or self.waiting)

    # ---- one step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        """Admit, prefill a chunk, run one batched verify step; return what each request got."""
        updates: list[RowUpdate] = []
        self._drop_cancelled(updates)
        self._admit()
        self._prefill(updates)
        if self.rows:
            self._decode(updates)
        return updates

    def _drop_cancelled(self, updates: list[RowUpdate]) -> None:
        for queue in (self.waiting, self.prefilling):
            for row in [r for r in queue if r.cancelled]:
                queue.remove(row)
                updates.append(self._finish(row, "abort"))
        gone = [i for i, r in enumerate(self.rows) if r.cancelled]
        if gone:
            for i in gone:
                updates.append(self._finish(self.rows[i], "abort"))
            self._keep([i for i, r in enumerate(self.rows) if not r.cancelled])

    def _footprint(self, row: _Row) -> int:
        return len(row.prompt) + row.max_new + len(self.default_tree) + 16

    def _admit(self) -> None:
        while self.waiting and self.num_running < self.max_batch_size:
            active = [*self.rows, *self.prefilling]
            longest = max([self._footprint(r) for r in active] + [self._footprint(self.waiting[0])])
            if longest * (len(active) + 1) > self.max_kv_tokens:
                return  # waits for rows to finish: the padded cache would exceed the budget
            self.prefilling.append(self.waiting.popleft())

    def _prefill(self, updates: list[RowUpdate]) -> None:
        budget = self.prefill_chunk
        while self.prefilling and budget > 0:
            row = self.prefilling[0]
            if row.solo_cache is None:
                row.solo_cache = new_cache()
                if row.speculative:  # made now: its `feature_layers` say what the prefill hands it
                    row.proposer = self.model.make_proposer()
            remaining = len(row.prompt) - row.prefilled
            # A prompt that fits in one chunk is prefilled in one forward, as generate() does; a longer one is
            # split so the running rows get a step between its chunks.
            n = remaining if remaining <= self.prefill_chunk else min(remaining, budget)
            ids = torch.tensor([row.prompt[row.prefilled : row.prefilled + n]], device=self.device)
            kwargs = {self.info.cache_kwarg: row.solo_cache}
            if row.prefilled:
                kwargs["position_ids"] = torch.arange(row.prefilled, row.prefilled + n, device=self.device)[None]
            if self.info.logits_to_keep:
                kwargs["logits_to_keep"] = 1
            out = self.base(input_ids=ids, use_cache=True, output_hidden_states=True, **kwargs)
            if row.proposer is not None:
                row.hidden_parts.append(select_features(out.hidden_states, row.proposer.feature_layers)[0])
            row.prefilled += n
            budget -= n
            if row.prefilled < len(row.prompt):
                continue
            self.prefilling.popleft()
            token = row.strategy.first(out.logits[0, -1])
            row.out.append(token)
            parts, row.hidden_parts = row.hidden_parts, []
            done = token in row.eos or len(row.out) >= row.max_new
            updates.append(RowUpdate(row.rid, [token], None))
            if done:
                updates.append(self._finish(row, "stop" if token in row.eos else "length"))
                row.solo_cache = None
                continue
            if row.speculative:
                hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
                row.proposer.begin(hidden, torch.tensor(row.prompt, device=self.device))
                row.policy = AdaptiveDraft(
                    self.model.config.num_heads, len(self.default_tree), self.model.config.head_accuracies,
                    timed=False, probe_every=self.probe_every,
                )  # fmt: skip
                if self.prompt_lookup:
                    row.ngram = NgramDraft(row.prompt + [token], node_cost=self._node_cost())
            self.cache.add_row(row.solo_cache)
            row.solo_cache = None
            self.rows.append(row)

    def _node_cost(self) -> float:
        return NODE_COST_HALF if self.half else NODE_COST_FULL

    # ---- planning -------------------------------------------------------------------------------------

    def _tree(self, row: _Row, budget: int) -> tuple[Tree, float]:
        """The row's best tree of <= `budget` nodes and its expected tokens per step, from its own stats."""
        if budget == 1 or not row.speculative:
            return Tree([]), 1.0
        if self.fixed_tree is not None:
            return self.fixed_tree, self.fixed_tree.expected_length(row.policy.accuracies())
        if budget not in row.trees:
            row.trees = self._trees(row, budget)
        return row.trees[budget]

    def _trees(self, row: _Row, also: int) -> dict[int, tuple[Tree, float]]:
        """The row's tree for every node budget (and `also`), chosen from its own acceptance estimates.

        Where drafting costs per depth (`StepCost.depth_seconds`), each budget's tree is the best of every depth
        limit for this row's tokens per second: expected length over its share of the batch's forward plus its
        own drafting. The deepest tree of a size expects the most tokens but, from a sequential drafter, can
        cost more drafting than its last depths bring. One best-first search per depth limit serves every
        budget (its prefixes are the best trees of each size)."""
        acc = row.policy.accuracies()
        cost, B, heads = self.cost, max(1, len(self.rows)), self.model.config.num_heads
        budgets = sorted((set(self.budgets) | set(self.budgets_alone) | {also}) - {1})
        depths = range(1, heads + 1) if cost.depth_seconds > 0 else [heads]
        best: dict[int, tuple[float, tuple, float]] = {}  # budget -> (rate, paths, expected length)
        share = cost.together(B) if self._grows(row) else 1.0  # drafting with the batch's other rows
        for limit in depths:
            for n, choice in best_trees(budgets, limit, acc).items():
                rate = choice.expected / (cost.forward(B * n) / B + cost.draft(choice.depth) * share)
                if n not in best or rate > best[n][0] * 1.02:  # shallower first: a deeper tree must clearly win
                    best[n] = (rate, choice.paths, choice.expected)
        trees = {n: (Tree(paths), expected) for n, (_, paths, expected) in best.items()}
        if self.half and len(self.default_tree) in trees:  # half precision keeps its pinned default tree
            trees[len(self.default_tree)] = (self.default_tree, self.default_tree.expected_length(acc))
        return trees

    def _plan(self) -> int:
        """The node budget with the most expected tokens per second for the whole batch."""
        spec = [r for r in self.rows if r.speculative]
        if not spec:
            return 1
        if self.fixed_tree is not None:
            return len(self.fixed_tree)
        # A plan for plain decoding stands until the rows or their acceptance estimates change: while plain,
        # only probes add observations, and recomputing every row's trees for the same answer cost a busy
        # server ~2% of its time.
        key = (tuple(r.rid for r in self.rows), self._observations)
        if key == self._plain_plan:
            return 1
        if self._steps % self.replan_every == 0:
            for r in spec:
                r.trees.clear()
        cost, B = self.cost, len(self.rows)
        best, best_rate = 1, len(self.rows) / cost.forward(B)
        for n in sorted(set(self.budgets if B > 1 else self.budgets_alone) - {1}):
            trees = [(r, *self._tree(r, n)) for r in self.rows]
            expected = sum(e for _, _, e in trees)
            together = cost.together(sum(1 for r, t, _ in trees if self._grows(r) and len(t) > 1))
            drafting = sum(cost.draft(t.depth) * (together if self._grows(r) else 1.0) for r, t, _ in trees
                           if r.speculative)  # fmt: skip
            seconds = cost.forward(B * n) + drafting
            rate = expected / seconds
            # The smaller budget unless the bigger one clearly wins; with company by a wider margin, since the
            # per-row work the curve leaves out (verify, KV commit, catching the drafter up) grows with the rows.
            if rate > best_rate * (1.02 if B == 1 else 1.1):
                best, best_rate = n, rate
        self._plain_plan = key if best == 1 else None
        if best > 1 and B > 1 and self.guard:
            best = self._guard(B, best)
        return best

    def _guard(self, B: int, budget: int) -> int:
        """With company, never keep speculating at a batch size where it measured slower than plain decoding.

        The cost curve leaves out per-row work that grows with the batch; so at B > 1 the plan is checked
        against what steps of this batch size actually delivered (tokens per second, speculating or not), with
        a plain step now and then to keep that measure fresh and a speculative retry now and then so a text
        that became predictable gets its chance back. A lone request is never timed (its output stays
        independent of the machine's load)."""
        spec, plain = self._rate.get((B, True)), self._rate.get((B, False))
        if plain is None or self._steps % self.probe_every == 0:
            return 1
        if spec is not None and spec < plain and self._steps % (4 * self.probe_every) != 1:
            return 1
        return budget

    def _probe_interval(self, B: int) -> int:
        """Steps between acceptance probes while a batch of B rows decodes plain.

        A probe gives one row a small tree so that its acceptance estimates can recover when its text becomes
        predictable. The forward pads every row to the widest tree, so one row's probe widens the whole batch's
        forward from B to B x n tokens: with 16 rows in bf16 that step costs about twice a plain one, and a
        probe every `probe_every` steps made the server 4-6% slower at 8-16 users than with speculation off.
        So probes are spaced by what they cost: their extra forward and drafting time stays under
        `PROBE_SHARE` of plain decoding, and they never come more often than every `probe_every` steps (what a
        lone row gets, whose probe costs little more than its drafting). Fixed by the measured cost curve, so
        the schedule depends on the batch alone, not on the machine's load."""
        n = self.probe_nodes
        plain = self.cost.forward(B)
        extra = self.cost.forward(B * n) - plain + self.cost.draft(n - 1)
        return max(self.probe_every, math.ceil(extra / (PROBE_SHARE * plain)))

    # ---- decoding -------------------------------------------------------------------------------------

    def _decode(self, updates: list[RowUpdate]) -> None:
        t0 = time.perf_counter()
        self._steps += 1
        budget = self._plan()
        B = len(self.rows)
        # (only with a speculating row: an engine of plain rows, as distillation runs, never needs the cost curve)
        every = self._probe_interval(B) if budget == 1 and any(r.speculative for r in self.rows) else 0
        probe = every > 0 and self._steps % every == 0
        trees, drafts, qs = [], [], []
        plans = []  # per row: (its tree of the planned size, the draft-time budget it grows instead, room)
        for i, row in enumerate(self.rows):
            room = row.max_new - len(row.out) - 1
            if self.info.max_positions is not None:
                room = min(room, self.info.max_positions - 1 - self.cache.lengths[i])
            n = budget
            if probe and row.speculative and i == self._steps // every % B:
                n = self.probe_nodes  # keeps one row's acceptance estimates alive while plain
            tree = self._tree(row, n)[0].limit(room)
            grow = None
            if self._grows(row) and len(tree) > 1:
                grow = DynamicTree(len(tree), DYNAMIC_DEPTH, DYNAMIC_WIDTH).limit(room)
            plans.append((tree, grow, room))
        grown = self._grow_trees(plans)
        for i, (row, (tree, _, room)) in enumerate(zip(self.rows, plans, strict=True)):
            if i in grown:
                tree, draft = grown[i]
                q = None
            else:
                draft, q = row.strategy.propose(row.proposer, row.token, tree) if row.proposer else (None, None)
            if draft is None:
                draft = torch.tensor([row.token], device=self.device)
            if row.ngram is not None and room > 0 and budget > 1:
                # Under load a longer chain widens every row's forward (padding): cost it per row, and cap it.
                row.ngram.node_cost = self._node_cost() * B
                row.ngram.max_len = 10 if B == 1 else max(1, budget // 2)
                heads_tree = tree
                lossless = isinstance(row.strategy, SamplingStrategy)
                tree, draft = row.ngram.graft(tree, draft, room, merge=not lossless)
                if q is not None:
                    q = carry_rows(q, heads_tree, tree)
            elif row.ngram is not None:
                row.ngram.chain = []
            trees.append(tree)
            drafts.append(draft)
            qs.append(q)
        logits, hidden = self._score(trees, drafts)  # hidden: the features each proposer observes, by layers
        accepted_all, bonuses = [], []
        offset = 0
        for row, tree, draft, q in zip(self.rows, trees, drafts, qs, strict=True):
            n = len(tree)
            row_logits = logits[offset : offset + n]
            offset += n
            accepted, bonus = row.strategy.verify(tree, draft.tolist(), q, row_logits)
            accepted_all.append(accepted)
            bonuses.append(bonus)
        self.cache.commit(accepted_all)
        finished, step_tokens = [], 0
        for i, (row, tree, draft, accepted, bonus) in enumerate(
            zip(self.rows, trees, drafts, accepted_all, bonuses, strict=True)
        ):
            draft_list = draft.tolist()
            new = [draft_list[j] for j in accepted[1:]] + [bonus]
            emitted, done = [], False
            for tok in new:
                emitted.append(tok)
                row.out.append(tok)
                if tok in row.eos or len(row.out) >= row.max_new:
                    done = True
                    break
            row.lengths.append(len(emitted))
            row.drafted.append(len(tree) - 1)
            step_tokens += len(emitted)
            updates.append(RowUpdate(row.rid, emitted, len(row.lengths) - 1))
            if done:
                finished.append(i)
                updates.append(self._finish(row, "stop" if row.out[-1] in row.eos else "length"))
                continue
            if row.policy is not None and len(tree) > 1:
                row.policy.observe(tree, accepted)
                self._observations += 1
            if row.ngram is not None:
                row.ngram.observe(new)
            if row.proposer is not None:
                acc = torch.tensor(accepted, device=self.device)
                row.proposer.observe(hidden[row.proposer.feature_layers][i, acc], draft[acc])
        if B > 1 and not probe:  # a probe step is neither plain nor speculative decoding of the batch
            key = (B, budget > 1)
            rate = step_tokens / max(time.perf_counter() - t0, 1e-9)
            self._rate[key] = rate if key not in self._rate else 0.8 * self._rate[key] + 0.2 * rate
        if finished:
            self._keep([i for i in range(len(self.rows)) if i not in set(finished)])
            if not self.has_work:
                _trim_heap()

    def _grow_trees(self, plans: list[tuple[Tree, DynamicTree | None, int]]) -> dict[int, tuple[Tree, torch.Tensor]]:
        """The draft-time trees of this step's growing rows, drafted together per proposer class
        (`Proposer.propose_dynamic_rows`: the EAGLE drafter runs each depth once for all of them)."""
        groups: dict[type, list[int]] = {}
        for i, (_, grow, _) in enumerate(plans):
            if grow is not None:
                groups.setdefault(type(self.rows[i].proposer), []).append(i)
        grown: dict[int, tuple[Tree, torch.Tensor]] = {}
        for kind, rows in groups.items():
            proposers = [self.rows[i].proposer for i in rows]
            roots = [self.rows[i].token for i in rows]
            results = kind.propose_dynamic_rows(proposers, roots, [plans[i][1] for i in rows])
            grown.update(zip(rows, results, strict=True))
        return grown

    def _grows(self, row: _Row) -> bool:
        """Whether a row drafts draft-time trees: greedy (lossless sampling needs i.i.d. siblings), a drafter
        that grows them, and the engine's plan choosing only their size."""
        return (
            self.dynamic
            and row.proposer is not None
            and row.proposer.dynamic_trees
            and isinstance(row.strategy, GreedyStrategy)
        )

    def _score(
        self, trees: list[Tree], drafts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[tuple[int, ...] | None, torch.Tensor]]:
        """One forward over every row's tree. Returns logits of the real nodes, concatenated row after row
        (sum of tree sizes, V), and per `feature_layers` of the rows' proposers (None: the final hidden
        state) the features (B, N, d | n*d) padded."""
        B, N = len(trees), max(len(t) for t in trees)
        width = self.cache.width
        lengths = torch.tensor(self.cache.lengths, device=self.device)
        ids = torch.empty(B, N, dtype=torch.long, device=self.device)
        depth = torch.zeros(B, N, dtype=torch.long, device=self.device)
        anc = torch.zeros(B, N, N, dtype=torch.bool, device=self.device)
        anc[:, torch.arange(N), torch.arange(N)] = True  # padding nodes see themselves only
        real = torch.zeros(B, N, dtype=torch.bool, device=self.device)
        for i, (tree, draft) in enumerate(zip(trees, drafts, strict=True)):
            n = len(tree)
            ids[i, :n] = draft
            ids[i, n:] = draft[0]
            depth[i, :n] = tree.depth_tensor.to(self.device)
            anc[i, :n, :n] = tree.ancestors.to(self.device)
            real[i, :n] = True
        positions = lengths[:, None] + depth  # (B, N)
        neg = torch.finfo(self.dtype).min
        k = torch.arange(width, device=self.device)[None, None, :]  # (1, 1, T)
        prefix_ok = k < lengths[:, None, None]  # (B, 1, T)
        full = torch.cat([prefix_ok.expand(B, N, width), anc], dim=-1)
        mask: torch.Tensor | dict[str, torch.Tensor] = self._additive(full, neg)
        window = self.info.sliding_window
        if window is not None:
            slide = prefix_ok & (k > positions[:, :, None] - window)  # transformers' rule: k > q - window
            slid = self._additive(torch.cat([slide, anc], dim=-1), neg)
            mask = {"full_attention": mask, "sliding_attention": slid} if self.info.mixed_layer_types else slid
        self.cache.begin_forward(N)
        self.last_forward_tokens, self.last_batch_size = B * N, B
        wanted = {row.proposer.feature_layers for row in self.rows if row.proposer is not None} | {None}
        if self._decoder is not None:
            # the decoder alone: its states only when some row's proposer reads inner layers (EAGLE)
            states = {"output_hidden_states": True} if len(wanted) > 1 else {}
            out = self._decoder(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **states, **{self._decoder_cache_kwarg: self.cache},
            )  # fmt: skip
            last = out.last_hidden_state
            logits = self.base.get_output_embeddings()(last[real])
        else:
            out = self.base(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                output_hidden_states=True, **{self.info.cache_kwarg: self.cache},
            )  # fmt: skip
            last, logits = out.hidden_states[-1], out.logits[real]
        hidden = {layers: last if layers is None else select_features(out.hidden_states, layers) for layers in wanted}
        return logits, hidden

    def _additive(self, allowed: torch.Tensor, neg: float) -> torch.Tensor:
        """(B, N, K) bool -> (B, 1, N, K) float additive mask (a bool 4D mask is misread by some eager paths)."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, neg)[:, None]

    # ---- rows leaving -----------------------------------------------------------------------------------

    def _keep(self, keep: list[int]) -> None:
        self.cache.keep_rows(keep)
        self.rows = [self.rows[i] for i in keep]

    def _finish(self, row: _Row, reason: str) -> RowUpdate:
        row.proposer = row.policy = row.ngram = None
        row.solo_cache = None
        return RowUpdate(row.rid, [], None, True, reason, list(row.lengths), list(row.drafted))

    @staticmethod
    def _kv_bytes_per_token(config, element_size: int) -> int:
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        heads = heads or getattr(config, "n_head", 0)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
        head_dim = getattr(config, "head_dim", None) or (hidden // max(1, getattr(config, "num_attention_heads", None)
                                                                       or getattr(config, "n_head", 1)))  # fmt: skip
        return 2 * int(layers) * int(heads) * int(head_dim) * element_size


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc) when the batch empties: KV buffers of every size come and go
    with the rows, and without a trim the process keeps the fragmented pages (RSS creeps up under load)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] | None = None,
    join_at: Sequence[int] | None = None,
    decoder: BatchDecoder | None = None,
    **kwargs,
) -> list[list[int]]:
    """Decode several prompts together; returns each one's new tokens, in order. `join_at[i]`: the step
    before which prompt i is added (requests arriving mid-run); kwargs go to `BatchDecoder.add`."""
    engine = decoder or BatchDecoder(model)
    maxes = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
    join = list(join_at) if join_at is not None else [0] * len(prompts)
    ids: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_work:
        for i, p in enumerate(prompts):
            if join[i] == step and i not in ids.values():
                ids[engine.add(p, maxes[i], **kwargs)] = i
        for u in engine.step():
            out.setdefault(ids[u.request_id], []).extend(u.tokens)
        step += 1
        if step > 100000:
            raise RuntimeError("generate_batch did not finish")
    return [out.get(i, []) for i in range(len(prompts))]
