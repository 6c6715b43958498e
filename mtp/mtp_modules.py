"""DeepSeek-V3-style sequential MTP modules: a draft head type that sees the tokens it follows.

Module k (1-based) at position t reads two things: h^{k-1}_t, the previous depth's hidden state at t
(h^0 = the base model's final hidden state), and emb(x_{t+k}), the base embedding of the token k places
ahead. It RMS-normalises each, concatenates them, projects 2d -> d, runs one transformer block of the
base architecture (transformers' own layer class, built from the base config and initialised from the
base's last layer) and gives h^k_t; its own final norm then feeds the *shared* base lm_head, which
guesses x_{t+k+1}. So module k (head index k-1) guesses the same token as Medusa head k-1: t+k+1.

    h^0_t ─┐                      ┌─ norm_1 ─ lm_head ─> x_{t+2}
           ├─ module 1 (x_{t+1}) ─┤
           │                      └─ h^1_t ─┐
           │                                ├─ module 2 (x_{t+2}) ─ ... ─> x_{t+3}

The embeddings, the lm_head and the rotary tables are the base's own: they are referenced, never copied,
and never saved with the heads (a checkpoint holds only the modules' own parameters). Because of that a
module needs the base at construction (`needs_base = True`: `build_heads(..., base_model=base)`).

Training runs every depth over all positions in parallel with a causal mask (`head_hidden`); drafting
runs the modules one after another with a KV cache per module (`mtp.proposer.MTPProposer`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from .arch import _first_attr, _text_config, describe, norm_eps
from .heads import register_head


class _Shared:
    """The base's parts a module uses but does not own. A plain object, so that `.to()`, `.float()`,
    `state_dict()` and `parameters()` of the heads never reach the base through it."""

    def __init__(self, base_model: nn.Module, rotary: nn.Module | None):
        self.base_model = base_model
        self.rotary = rotary

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # Looked up on every call: adapters (peft) may wrap the embedding after the heads were built.
        return self.base_model.get_input_embeddings()(ids)

    def __deepcopy__(self, memo: dict) -> _Shared:  # a copy of the heads still shares the base
        return self


def decoder_layers(base_model: nn.Module) -> nn.ModuleList:
    """The base's stack of decoder layers: the first `ModuleList` of `num_hidden_layers` same-typed modules."""
    config = _text_config(base_model.config)
    n = _first_attr(config, ("num_hidden_layers", "n_layer", "num_layers"))
    root = getattr(base_model, "base_model", base_model)
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and n and len(module) == n and len({type(m) for m in module}) == 1:
            return module
    raise ValueError(
        f"could not find the decoder layers of {type(base_model).__name__} (a ModuleList of "
        f"{n} layers under base_model); MTP modules need the base's own layer class"
    )


def _rotary(base_model: nn.Module, layers: nn.ModuleList) -> nn.Module | None:
    """The base's rotary embedding module (computes (cos, sin) from position ids), if it has one."""
    root = getattr(base_model, "base_model", base_model)
    rotary = getattr(root, "rotary_emb", None)
    if rotary is not None:
        return rotary
    inside = {id(m) for m in layers.modules()}
    for module in root.modules():
        if id(module) not in inside and hasattr(module, "inv_freq"):
            return module
    return None


def _final_norm(base_model: nn.Module, hidden_size: int, layers: nn.ModuleList) -> nn.Module | None:
    """The base's final norm (Llama `norm`, GPT-2 `ln_f`): the last direct child with a (d,) weight."""
    root = getattr(base_model, "base_model", base_model)
    found = None
    for child in root.children():
        if child is layers:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (hidden_size,) and not list(child.children()):
            found = child
    return found


def _module_config(base_model: nn.Module):
    """A copy of the base text config for a block that runs under our own 4D float masks."""
    config = copy.deepcopy(_text_config(base_model.config))
    types = getattr(config, "layer_types", None)
    if types:
        # Every block mirrors the base's last layer (the one its weights come from).
        config.layer_types = [types[-1]] * len(types)
    if getattr(config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        config._attn_implementation = "sdpa"  # kernels without additive masks (flash) cannot run a tree mask
    return config


# Output projections of the attention and MLP branches (Llama/Qwen2/Mistral, GPT-2, OPT/BART-style, NeoX).
_BRANCH_OUTPUTS = ("o_proj", "down_proj", "c_proj", "out_proj", "fc2", "dense_4h_to_h")


def _silence_residual_branches(block: nn.Module) -> None:
    """Zero the block's residual-branch output projections, so it starts as the identity.

    Why: a copy of the base's last layer expects that layer's un-normalised residual stream; fed the
    module's normalised input it first adds large, meaningless updates (held-out CE above 25 nats
    measured on SmolLM2), and training spends its first hundreds of steps undoing them. A silent block
    starts from the base's own next-token guess instead, and the zeroed projections still get full
    gradients at once (their inputs, the copied layer's attention and MLP activations, are not zero).
    A layer class with none of these names keeps the copied weights.
    """
    with torch.no_grad():
        for name, module in block.named_modules():
            if name.rsplit(".", 1)[-1] in _BRANCH_OUTPUTS and hasattr(module, "weight"):
                module.weight.zero_()
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


class MTPDepth(nn.Module):
    """One sequential module: norms, the 2d -> d projection, the block(s), its own final norm."""

    def __init__(self, hidden_size: int, eps: float, blocks: list[nn.Module], final_norm: nn.Module):
        super().__init__()
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        with torch.no_grad():  # start as norm(h): together with the silent block below, a module starts
            # out as the base's own next-token guess (Medusa's start), and learns to use the new token's
            # embedding through the zero half of this projection
            eye = torch.eye(hidden_size)
            self.proj.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], dim=1))
        self.blocks = nn.ModuleList(blocks)
        self.norm = final_norm


@register_head("mtp")
class MTPModules(nn.Module):
    """D sequential MTP modules (DeepSeek-V3) on a base causal LM; head index k-1 = module k.

    num_layers: transformer blocks per module (1 in DeepSeek-V3), initialised from the base's last
    `num_layers` layers. The vocabulary projection is always the base lm_head (`own_lm_head` must stay
    False: a per-module copy would be as big as a small model).
    """

    needs_base = True

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 3,
        num_layers: int = 1,
        own_lm_head: bool = False,
        base_model: nn.Module | None = None,
    ):
        super().__init__()
        if base_model is None:
            raise ValueError("MTP modules share the base's embeddings and blocks: build them with base_model=")
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"MTP modules need num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers}")
        if own_lm_head:
            raise ValueError("MTP modules always share the base lm_head; own_lm_head=True is not supported")
        info = describe(base_model)
        if hidden_size != info.hidden_size:
            raise ValueError(
                f"MTP modules of hidden size {hidden_size} cannot run on this base (hidden size "
                f"{info.hidden_size}): each module runs one of the base's own transformer blocks on the "
                "base's embeddings, so its hidden size must equal the base's"
            )
        if vocab_size != info.vocab_size:
            raise ValueError(
                f"MTP modules for vocabulary {vocab_size} cannot share this base's lm_head ({info.vocab_size})"
            )
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, False
        self.lm_heads = None  # the trainer and the proposer project through the base lm_head

        layers = decoder_layers(base_model)
        if num_layers > len(layers):
            raise ValueError(f"num_layers={num_layers} exceeds the base's {len(layers)} layers")
        layer_cls = type(layers[-1])
        config = _module_config(base_model)
        takes_idx = "layer_idx" in inspect.signature(layer_cls.__init__).parameters
        sources = list(layers)[-num_layers:]
        base_norm = _final_norm(base_model, hidden_size, layers)
        eps = norm_eps(config)

        def block(j: int) -> nn.Module:
            b = layer_cls(config, layer_idx=j) if takes_idx else layer_cls(config)
            b.load_state_dict(sources[j].state_dict())
            _silence_residual_branches(b)
            return b

        def final_norm() -> nn.Module:
            # The base's norm class with unit weight (and zero bias): h^0 already passed the base's final
            # norm, so a copy of its weights would apply them twice (held-out CE 17.6 instead of 7.3 at
            # init on SmolLM2); unit weight makes a fresh module's guess exactly the base's next-token one.
            norm = copy.deepcopy(base_norm) if base_norm is not None else nn.RMSNorm(hidden_size, eps=eps)
            with torch.no_grad():
                if getattr(norm, "weight", None) is not None:
                    norm.weight.fill_(1.0)
                if getattr(norm, "bias", None) is not None:
                    norm.bias.zero_()
            return norm

        self.depths = nn.ModuleList(
            MTPDepth(hidden_size, eps, [block(j) for j in range(num_layers)], final_norm()) for _ in range(num_heads)
        )
        param = next(base_model.parameters())
        self.to(device=param.device, dtype=param.dtype)
        self.train(base_model.training)

        params = inspect.signature(layer_cls.forward).parameters
        self._cache_kwarg = next((n for n in ("cache", "past_key_values", "layer_past") if n in params), None)
        self._takes = {n for n in ("position_ids", "position_embeddings", "use_cache") if n in params}
        rotary = _rotary(base_model, layers)
        if "position_embeddings" in self._takes and rotary is None:
            raise ValueError(
                f"{layer_cls.__name__} needs rotary position embeddings, but the base has no rotary module"
            )
        object.__setattr__(self, "_shared", _Shared(base_model, rotary))

    # ---- checkpoint / factory hooks -----------------------------------------------------------

    def config_kwargs(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers}

    def make_proposer(self, base_model: nn.Module, lm_head: nn.Module | None = None):
        """`lm_head`: the drafting projection (default: the base's; a DraftProjection restricts it)."""
        from .proposer import MTPProposer

        return MTPProposer(self, lm_head if lm_head is not None else base_model.get_output_embeddings())

    # ---- one module ---------------------------------------------------------------------------

    def run_depth(
        self,
        k: int,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Any = None,
    ) -> torch.Tensor:
        """Module k (0-based) -> h^{k+1} before its final norm, (B, L, d).

        hidden: (B, L, d) the previous depth's states; tokens: (B, L) the token k+1 places ahead of each
        position; positions: (1, L) position ids; mask: (1, 1, L, cached + L) additive float mask;
        cache: the module's own DynamicCache (extended by these L entries), or None.
        """
        depth = self.depths[k]
        dtype = depth.proj.weight.dtype
        emb = self._shared.embed(tokens).to(dtype)
        x = depth.proj(torch.cat([depth.hnorm(hidden.to(dtype)), depth.enorm(emb)], dim=-1))
        kwargs: dict[str, Any] = {"attention_mask": mask}
        if "position_embeddings" in self._takes:
            kwargs["position_embeddings"] = self._shared.rotary(x, positions)
        if "position_ids" in self._takes:
            kwargs["position_ids"] = positions
        if cache is not None and self._cache_kwarg is not None:
            kwargs[self._cache_kwarg] = cache
            if "use_cache" in self._takes:
                kwargs["use_cache"] = True
        for block in depth.blocks:
            out = block(x, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def features(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """The input of the shared lm_head for module k (0-based): its own final norm of h^{k+1}."""
        return self.depths[k].norm(h)

    # ---- training / evaluation forward --------------------------------------------------------

    def head_hidden(
        self, hidden: torch.Tensor, num_heads: int | None = None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-depth lm_head inputs at every position: (B, T, d) + ids (B, T') -> (K, B, T, d).

        Module k (1-based) covers positions t <= min(T, T' - k) - 1 (it needs x_{t+k}); the positions
        beyond are zero (they have no target). T' may exceed T: then the extra ids are tokens after the
        last hidden state (how the drafts of a tree path are computed from scratch in the tests).
        """
        if input_ids is None:
            raise ValueError("MTP modules read the input tokens: call them with input_ids=")
        squeeze = hidden.dim() == 2
        if squeeze:
            hidden, input_ids = hidden[None], input_ids.reshape(1, -1)
        B, T, d = hidden.shape
        K = self.num_heads if num_heads is None else num_heads
        dtype = self.depths[0].proj.weight.dtype
        feats, prev = [], hidden
        for k in range(K):
            L = min(prev.shape[1], input_ids.shape[1] - (k + 1))
            if L <= 0:
                feats.append(hidden.new_zeros((B, T, d), dtype=dtype))
                prev = prev[:, :0]
                continue
            mask = torch.full((L, L), torch.finfo(dtype).min, dtype=dtype, device=hidden.device).triu_(1)
            positions = torch.arange(L, device=hidden.device)[None]
            prev = self.run_depth(k, prev[:, :L], input_ids[:, k + 1 : k + 1 + L], positions, mask[None, None])
            f = self.features(k, prev)
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, T - L)) if L < T else f)
        out = torch.stack(feats)
        return out[:, 0] if squeeze else out

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        num_heads: int | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head logits (K, B, T, V): module k at position t guesses token t+k+1 (head index k-1)."""
        return lm_head(self.head_hidden(hidden, num_heads, input_ids=input_ids))
