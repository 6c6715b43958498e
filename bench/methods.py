"""The decoding methods the benchmark compares, each behind one small function.

Every method gets the same chat-templated prompt ids and returns the full sequence plus, for ours,
the acceptance lengths. Timing and memory are measured by the caller around the call, so every
method is timed the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtp import MTPModel


@dataclass
class MethodResult:
    sequences: torch.Tensor  # (1, prompt + new)
    accepted_lengths: list[int] = field(default_factory=list)  # ours only
    step_logits: list[torch.Tensor] | None = None  # plain only: the reference's logits per step


Method = Callable[[torch.Tensor, int], MethodResult]


def plain(model: MTPModel) -> Method:
    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        out = model.base_model.generate(
            ids, max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        return MethodResult(out.sequences, step_logits=[lg[0] for lg in out.logits])

    return run


def prompt_lookup(model: MTPModel, num_tokens: int = 10) -> Method:
    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        seq = model.base_model.generate(
            ids, max_new_tokens=max_new, do_sample=False, prompt_lookup_num_tokens=num_tokens
        )
        return MethodResult(seq)

    return run


def assisted(model: MTPModel, assistant: torch.nn.Module) -> Method:
    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        seq = model.base_model.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=assistant)
        return MethodResult(seq)

    return run


def ours(model: MTPModel, tree, prompt_lookup: bool = False) -> Method:
    """`prompt_lookup=False`: the heads' drafts alone (what the heads are worth); True: heads + lookup."""

    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        out = model.generate(
            ids, max_new_tokens=max_new, tree=tree, prompt_lookup=prompt_lookup, return_dict_in_generate=True
        )
        return MethodResult(out.sequences, accepted_lengths=out.accepted_lengths)

    return run


def ours_one_token(model: MTPModel) -> Method:
    """Our loop with drafting off: one token per step. With a compiled model, what compiling alone gives."""

    def run(ids: torch.Tensor, max_new: int) -> MethodResult:
        out = model.generate(ids, max_new_tokens=max_new, speculative=False, return_dict_in_generate=True)
        return MethodResult(out.sequences, accepted_lengths=out.accepted_lengths)

    return run


def truncated_assistant(base: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A layer-skip draft model: the base's first `num_layers` layers with its own embeddings and head.

    It shares the tokenizer (a requirement of HF assisted generation) and costs num_layers / L of a
    forward pass. It is NOT trained: a distilled draft model would accept more; see the README.
    """
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(base.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config).to(next(base.parameters()).dtype)
    state = {k: v for k, v in base.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state, strict=False)
    draft.generation_config = copy.deepcopy(base.generation_config)
    return draft.eval()
