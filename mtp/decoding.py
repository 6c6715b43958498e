"""The self-speculative decoding loop, batch size 1 (greedy, or sampled through `SamplingStrategy`).

One step, numbered as in the code below:
  1. propose   the heads draft a token for every node of the tree, rooted at the last emitted token
  2. score     one forward pass of the base model over all nodes, with a tree attention mask
               (prefix + ancestors) and positions = prefix length + node depth
  3. verify    walk the tree along the base model's argmax: accepted path + bonus token
  4. crop KV   keep only the root and the accepted path in the cache
  5. emit      accepted tokens + bonus, stopping at EOS / max_new_tokens exactly where
               `generate()` would; the proposer observes the accepted hidden states

Greedy output is token-identical to `base_model.generate(do_sample=False)` because every emitted
token is the base model's own argmax given exactly the tokens before it; the drafts only decide how
many of those argmaxes one forward pass gets to confirm.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from .adaptive import AdaptiveDraft
from .arch import BaseInfo
from .dynamic_tree import DynamicTree
from .eagle import select_features
from .kv_cache import keep_accepted, new_cache
from .ngram import NODE_COST_FULL, NODE_COST_HALF, NgramDraft, carry_rows, lookup_nodes
from .proposer import Proposer
from .sampling import SamplingParams, sample, verify_sampled, verify_typical
from .tree import Tree, chain
from .verify import verify_greedy


class GreedyStrategy:
    """Drafts: top-k of the heads. Acceptance: the base model's argmax."""

    def first(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def propose(self, proposer: Proposer, root: int, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        return proposer.propose(root, tree), None

    def verify(
        self, tree: Tree, draft: list[int], q: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[list[int], int]:
        return verify_greedy(tree, draft, logits.argmax(dim=-1).tolist())


class SamplingStrategy:
    """Lossless: drafts sampled from the heads' warped q, recursive rejection sampling against p.

    With `acceptance="typical"`: top-k drafts and Medusa's typical acceptance (lossy, opt-in).
    """

    def __init__(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        acceptance: str = "lossless",
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
    ):
        if acceptance not in ("lossless", "typical"):
            raise ValueError(f"acceptance must be 'lossless' or 'typical', got {acceptance!r}")
        self.params, self.generator, self.acceptance = params, generator, acceptance
        self.epsilon, self.delta = typical_epsilon, typical_delta

    def first(self, logits: torch.Tensor) -> int:
        return sample(self.params.probs(logits[None])[0], self.generator)

    def propose(self, proposer: Proposer, root: int, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.acceptance == "typical":
            return proposer.propose(root, tree), None
        return proposer.propose_sampled(root, tree, self.params.probs, self.generator)

    def verify(
        self, tree: Tree, draft: list[int], q: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[list[int], int]:
        p = self.params.probs(logits)  # (N, V)
        if self.acceptance == "typical":
            return verify_typical(tree, draft, p, self.generator, self.epsilon, self.delta)
        return verify_sampled(tree, draft, p, q, self.generator, fixed=lookup_nodes(tree))


@dataclass
class GenerateOutput:
    """`sequences`: prompt + new tokens, as `generate()` returns them.

    `accepted_lengths[i]`: tokens emitted by verify step i (bonus included, after any EOS/length
    cut). The first new token comes from the prefill, not from a verify step, so
    ``1 + sum(accepted_lengths) == number of new tokens``. τ (mean acceptance length) is their mean.
    """

    sequences: torch.Tensor
    accepted_lengths: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)  # tree nodes verified per step (root excluded)
    prompt_length: int = 0

    @property
    def tau(self) -> float:
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def num_new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length


# Generation-config settings that change greedy output and that this decoder does not apply.
_UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "stop_strings": None,
    "num_beams": 1,
}


def check_generation_config(generation_config) -> None:
    """Refuse settings we would silently ignore: the promise is *identical* output."""
    bad = []
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, name, neutral)
        if value not in (neutral, None) and not (neutral is None and value in ([], 0)):
            bad.append(f"{name}={value!r}")
    if bad:
        raise ValueError(
            "the base model's generation_config sets " + ", ".join(bad) + ", which self-speculative "
            "decoding does not apply yet; reset them (model.base_model.generation_config) to compare "
            "against plain greedy decoding"
        )


def resolve_stopping(
    generation_config,
    prompt_len: int,
    max_new_tokens: int | None,
    eos_token_id,
    max_position_embeddings: int | None = None,
) -> tuple[int, set[int]]:
    """max_new_tokens and EOS ids exactly as `generate()` (transformers 5.x) resolves them.

    With neither `max_new_tokens` nor `max_length` set anywhere, generate() makes 20 new tokens,
    capped at `max_position_embeddings` in total.
    """
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
    if max_new_tokens is None:
        max_length = getattr(generation_config, "max_length", None)
        if max_length is None:
            max_length = prompt_len + 20
            if max_position_embeddings is not None:
                max_length = min(max_length, max_position_embeddings)
        max_new_tokens = max_length - prompt_len
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if eos_token_id is None:
        eos = set()
    elif isinstance(eos_token_id, int):
        eos = {eos_token_id}
    else:
        eos = {int(t) for t in (eos_token_id.tolist() if torch.is_tensor(eos_token_id) else eos_token_id)}
    return max(0, int(max_new_tokens)), eos


@lru_cache(maxsize=64)
def _tree_bias(tree: Tree, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(N, N) additive mask: 0 where a node may attend (itself and its ancestors), dtype-min elsewhere.

    A *float* additive mask: a bool 4D mask is silently misread by some eager attention paths.
    """
    return torch.where(tree.ancestors, 0.0, torch.finfo(dtype).min).to(dtype=dtype, device=device)


def tree_attention_mask(
    tree: Tree, prefix_len: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """(1, 1, N, prefix_len + N): every node sees the prefix and its own ancestors.

    With a sliding `window`, a node at position q sees prefix position k only if k > q - window,
    the rule transformers' own sliding masks use.
    """
    n = len(tree)
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
    mask[:, prefix_len:] = _tree_bias(tree, dtype, str(device))
    if window is not None and prefix_len + tree.depth >= window:
        q = prefix_len + tree.depth_tensor.to(device)[:, None]  # (N, 1)
        k = torch.arange(prefix_len, device=device)[None, :]  # (1, L)
        mask[:, :prefix_len].masked_fill_(k <= q - window, torch.finfo(dtype).min)
    return mask[None, None]


class TreeScorer:
    """Runs the base model over a prefix or a tree and keeps the KV cache consistent.

    `forward`: what runs the verify steps (default: the model itself), e.g. a compiled forward
    (`mtp.compiled`). The prompt's forward always runs eagerly: its length changes with every prompt
    and it runs once per request, so compiling it would buy little for another graph to build.
    """

    def __init__(
        self,
        base_model: nn.Module,
        info: BaseInfo,
        feature_layers: tuple[int, ...] | None = None,
        forward: Callable[..., Any] | None = None,
    ):
        self.model, self.info = base_model, info
        self.forward = forward if forward is not None else base_model
        self.feature_layers = feature_layers  # which hidden states the proposer observes (Proposer.feature_layers)
        self.cache = new_cache()
        self.dtype = next(base_model.parameters()).dtype
        self.device = next(base_model.parameters()).device

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def _run(self, ids: torch.Tensor, last_only: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs[self.info.cache_kwarg] = self.cache
        if last_only and self.info.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        forward = self.model if last_only else self.forward  # last_only: the prompt's forward
        out = forward(input_ids=ids, use_cache=True, output_hidden_states=True, **kwargs)
        return out.logits[0], select_features(out.hidden_states, self.feature_layers)[0]  # (T|1, V), (T, d | n*d)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt forward with the model's own causal mask. Returns last logits (V,), the proposer's features
        (T, d) (or (T, n*d): `feature_layers`)."""
        logits, hidden = self._run(input_ids, last_only=True)
        return logits[-1], hidden

    def score(self, draft: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over all tree nodes. Returns logits (N, V) and the proposer's features (N, d | n*d)."""
        prefix = self.length
        window = self.info.sliding_window
        mask = tree_attention_mask(tree, prefix, self.dtype, self.device, window)
        if self.info.mixed_layer_types:
            full = tree_attention_mask(tree, prefix, self.dtype, self.device)
            mask = {"full_attention": full, "sliding_attention": mask}
        positions = (tree.depth_tensor.to(self.device) + prefix)[None]
        return self._run(draft[None], last_only=False, attention_mask=mask, position_ids=positions)

    def keep(self, prefix_len: int, accepted: list[int]) -> None:
        keep_accepted(self.cache, prefix_len, accepted)


def speculative_generate(
    base_model: nn.Module,
    info: BaseInfo,
    proposer: Proposer,
    input_ids: torch.Tensor,
    tree: Tree | AdaptiveDraft | DynamicTree,
    max_new_tokens: int,
    eos: set[int],
    streamer=None,
    strategy: GreedyStrategy | SamplingStrategy | None = None,
    prompt_lookup: bool = False,
    forward: Callable[..., Any] | None = None,
    dynamic: DynamicTree | None = None,
) -> GenerateOutput:
    """Self-speculative decoding of one sequence (see the module docstring for the steps).

    prompt_lookup: graft prompt-lookup drafts onto each step's tree (see mtp.ngram).
    forward: runs the verify steps in place of `base_model` (see `TreeScorer`).
    dynamic: grow each step's tree at draft time (`mtp.dynamic_tree`, the proposer's `propose_dynamic`) with
    this depth and width, as many nodes as the step's tree (`tree`, or the policy's choice) has. A `tree` that
    is itself a `DynamicTree` is a fixed budget."""
    strategy = strategy or GreedyStrategy()
    if isinstance(tree, DynamicTree):
        dynamic, tree = tree, chain(tree.nodes - 1)  # a stand-in of the budget's size
    if dynamic is not None and not isinstance(strategy, GreedyStrategy):
        raise ValueError("draft-time trees (DynamicTree) are for greedy decoding; sampling needs a static tree")
    prompt = input_ids[0]
    if max_new_tokens <= 0:
        return GenerateOutput(sequences=input_ids.clone(), prompt_length=input_ids.shape[1])
    scorer = TreeScorer(base_model, info, getattr(proposer, "feature_layers", None), forward)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # 0. prefill: the first new token is the base model's own choice after the prompt.
    logits, hidden = scorer.prefill(input_ids)
    token = strategy.first(logits)
    proposer.begin(hidden, prompt)
    out_tokens = [token]
    if streamer is not None:
        streamer.put(torch.tensor([token]))
    lengths: list[int] = []
    drafted: list[int] = []
    ngram = None
    # lossless sampling keeps the lookup as its own branch and verifies it as point-mass drafts
    lossless = isinstance(strategy, SamplingStrategy) and strategy.acceptance == "lossless"
    if prompt_lookup:
        half = scorer.dtype in (torch.bfloat16, torch.float16)
        ngram = NgramDraft(prompt.tolist() + [token], node_cost=NODE_COST_HALF if half else NODE_COST_FULL)
    done = token in eos or len(out_tokens) >= max_new_tokens
    while not done:
        prefix = scorer.length
        # Never draft past max_new_tokens or the model's position table.
        room = max_new_tokens - len(out_tokens) - 1
        if info.max_positions is not None:
            room = min(room, info.max_positions - 1 - prefix)
        policy = tree if isinstance(tree, AdaptiveDraft) else None
        t_step = time.perf_counter()

        # 1. propose  2. score
        step_tree = (policy.tree() if policy else tree).limit(room)
        if dynamic is not None and len(step_tree) > 1:
            budget = dataclasses.replace(dynamic, nodes=len(step_tree)).limit(room)
            step_tree, draft = proposer.propose_dynamic(token, budget)
            q, draft_depth = None, proposer.drafted_depth
        else:
            draft, q = strategy.propose(proposer, token, step_tree)  # (N,), (D, V) | None
            draft_depth = step_tree.depth
        draft_seconds = time.perf_counter() - t_step
        if ngram is not None and room > 0:
            heads_tree = step_tree
            step_tree, draft = ngram.graft(step_tree, draft, room, merge=not lossless)
            if q is not None:
                q = carry_rows(q, heads_tree, step_tree)
        logits, hidden = scorer.score(draft, step_tree)  # (N, V), (N, d)

        # 3. verify
        draft_list = draft.tolist()
        accepted, bonus = strategy.verify(step_tree, draft_list, q, logits)

        # 4. crop KV: prefix + root + accepted path
        scorer.keep(prefix, accepted)
        if policy is not None:
            policy.update(step_tree, accepted, time.perf_counter() - t_step, draft_seconds, draft_depth)

        # 5. emit, stopping exactly where generate() would
        new = [draft_list[i] for i in accepted[1:]] + [bonus]
        emitted = 0
        for tok in new:
            out_tokens.append(tok)
            emitted += 1
            if streamer is not None:
                streamer.put(torch.tensor([tok]))
            if tok in eos or len(out_tokens) >= max_new_tokens:
                done = True
                break
        lengths.append(emitted)
        drafted.append(len(step_tree) - 1)
        token = bonus
        if not done:
            if ngram is not None:
                ngram.observe(new)
            acc = torch.tensor(accepted, device=hidden.device)
            proposer.observe(hidden[acc], draft[acc])
    if streamer is not None:
        streamer.end()
    new_ids = torch.tensor(out_tokens, dtype=input_ids.dtype, device=input_ids.device)
    sequences = torch.cat([prompt, new_ids])[None]
    return GenerateOutput(
        sequences=sequences, accepted_lengths=lengths, draft_tokens=drafted, prompt_length=len(prompt)
    )
