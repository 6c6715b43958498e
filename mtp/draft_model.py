"""A small stand-alone draft model, trained with the same tools as the heads: the "second model" approach.

HF assisted generation (`generate(assistant_model=...)`) and classic speculative decoding run a separate
small LM with the same tokenizer as the drafter. MTP heads replace it; to compare the two fairly the
benchmark needs a *trained* draft model for SmolLM2, and there is none in the registry. So the project
distils one itself, reusing everything the heads use: `mtp train` with `heads.head_type: draft_lm`
trains it on the model's own distilled answers with the base's soft targets, `mtp export --assistant`
writes it as an ordinary Hugging Face checkpoint that `assistant_model=` loads.

The draft is the base architecture with `num_layers` of its layers, picked evenly from first to last
(layer-skip initialisation: the untrained draft is already a weak copy of the base), its own final norm,
and the base's embeddings and lm_head, shared (never copied into the heads checkpoint, never trained:
for SmolLM2 they are 28M of its 135M parameters and tied).

As a head type it plugs into the trainer unchanged: `head_hidden` at position t returns the draft's state
after reading tokens up to t+1, whose lm_head guess is token t+2: the same target as MTP module 1 /
Medusa head 1, so the trainer's rows, soft targets (the base's distribution for t+2) and the held-out
accuracy table apply as they are, and the numbers compare directly with the heads'.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .arch import _text_config, describe
from .heads import register_head
from .mtp_modules import _Shared, decoder_layers


def layer_picks(total: int, n: int) -> list[int]:
    """`n` layer indices spread evenly over 0..total-1, first and last included (n=1: the first)."""
    if not 1 <= n <= total:
        raise ValueError(f"a draft model needs 1 <= num_layers <= {total} (the base's layers), got {n}")
    if n == 1:
        return [0]
    return sorted({round(i * (total - 1) / (n - 1)) for i in range(n)})


@register_head("draft_lm")
class DraftLM(nn.Module):
    """A `num_layers`-layer copy of the base that reads tokens only (not the base's hidden states)."""

    needs_base = True

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 1,
        num_layers: int = 4,
        own_lm_head: bool = False,
        base_model: nn.Module | None = None,
    ):
        super().__init__()
        if base_model is None:
            raise ValueError("a draft_lm is built from the base's own layers: build it with base_model=")
        if num_heads != 1:
            raise ValueError(f"a draft_lm is one model: num_heads must be 1, not {num_heads}")
        if own_lm_head:
            raise ValueError("a draft_lm shares the base lm_head; own_lm_head=True is not supported")
        info = describe(base_model)
        if (hidden_size, vocab_size) != (info.hidden_size, info.vocab_size):
            raise ValueError(
                f"a draft_lm of hidden size {hidden_size} / vocab {vocab_size} cannot share this base's "
                f"embeddings ({info.hidden_size} / {info.vocab_size})"
            )
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = 1, num_layers, False
        self.lm_heads = None  # projects through the base lm_head

        root = getattr(base_model, "base_model", base_model)
        layers = decoder_layers(base_model)
        picks = layer_picks(len(layers), num_layers)
        config = copy.deepcopy(_text_config(root.config))
        config.num_hidden_layers = len(picks)
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[j] for j in picks]
        self.decoder = type(root)(config)
        prefix = next(name for name, module in root.named_modules() if module is layers)
        embed = next(name for name, module in root.named_modules() if module is root.get_input_embeddings())
        renumber = {j: i for i, j in enumerate(picks)}
        state: dict[str, torch.Tensor] = {}
        for key, value in root.state_dict().items():
            if key.startswith(embed + "."):
                continue
            if key.startswith(prefix + "."):
                idx, rest = key[len(prefix) + 1 :].split(".", 1)
                if int(idx) in renumber:
                    state[f"{prefix}.{renumber[int(idx)]}.{rest}"] = value
            else:
                state[key] = value
        self.decoder.set_input_embeddings(None)  # the base's, looked up through _shared
        missing, unexpected = self.decoder.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"copying the base's layers into a draft_lm: missing {missing}, unexpected {unexpected}")
        self.picks = picks
        param = next(base_model.parameters())
        self.to(device=param.device, dtype=param.dtype)
        self.train(base_model.training)
        object.__setattr__(self, "_shared", _Shared(base_model, None))

    def config_kwargs(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers}

    def make_proposer(self, base_model: nn.Module, lm_head: nn.Module | None = None):
        raise ValueError(
            "draft_lm heads are a separate draft model for assisted generation, not MTP heads: write it as a "
            "Hugging Face checkpoint with `mtp export RUN --assistant --out DIR` and pass it as assistant_model="
        )

    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d) final (normed) states: position t guesses token t+1."""
        emb = self._shared.embed(input_ids).to(next(self.decoder.parameters()).dtype)
        return self.decoder(inputs_embeds=emb, use_cache=False).last_hidden_state

    def head_hidden(
        self, hidden: torch.Tensor, num_heads: int | None = None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, T, d) + ids (B, T) -> (1, B, T, d): row t is the draft's state at t+1 (it guesses t+2, like
        head 1). `hidden` only gives the shape: the draft reads tokens, not the base's states. The last row
        has no state to take and is zero (it has no target either)."""
        if input_ids is None:
            raise ValueError("a draft_lm reads the input tokens: call it with input_ids=")
        T = hidden.shape[-2]
        h = self.states(input_ids.reshape(-1, input_ids.shape[-1]))[:, 1 : T + 1]
        h = torch.nn.functional.pad(h, (0, 0, 0, T - h.shape[1]))
        return h.reshape(*hidden.shape[:-1], -1)[None]

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        num_heads: int | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return lm_head(self.head_hidden(hidden, num_heads, input_ids=input_ids))

    def to_causal_lm(self, base_model: nn.Module) -> nn.Module:
        """An ordinary `*ForCausalLM` (the base's class) with these layers and the base's embeddings/lm_head,
        for `generate(assistant_model=...)` and `save_pretrained`."""
        config = copy.deepcopy(base_model.config)
        text = _text_config(config)
        text.num_hidden_layers = self.decoder.config.num_hidden_layers
        if getattr(text, "layer_types", None):
            text.layer_types = list(self.decoder.config.layer_types)
        lm = type(base_model)(config)
        missing, unexpected = lm.base_model.load_state_dict(self.decoder.state_dict(), strict=False)
        embed = lm.base_model.get_input_embeddings()
        embed_name = next(n for n, m in lm.base_model.named_modules() if m is embed)
        if unexpected or any(not k.startswith(embed_name + ".") for k in missing):  # only the embeddings may miss
            raise ValueError(f"draft_lm -> causal LM: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            embed.weight.copy_(base_model.get_input_embeddings().weight)
            if not getattr(text, "tie_word_embeddings", False):
                lm.get_output_embeddings().weight.copy_(base_model.get_output_embeddings().weight)
        lm.tie_weights()
        lm.generation_config = copy.deepcopy(base_model.generation_config)
        lm.config.mtp_draft_layers = self.picks  # which base layers it started from (provenance)
        param = next(self.decoder.parameters())
        return lm.to(device=param.device, dtype=param.dtype).eval()
