"""An EAGLE-3-style recurrent drafter: one small module applied depth after depth on its own output.

Why a recurrent drafter: sequential MTP modules (`mtp.mtp_modules`) stop at as many depths as there are
modules, and each module projects onto the whole vocabulary. This drafter is one decoder layer that reads
the base model's features once and then its *own* output features, so one module drafts as deep as pays
(6-8 tokens), and it projects onto a reduced draft vocabulary (its own `lm_head` over `draft_ids`).

Layout (EAGLE-3, Li et al. 2025; the parameter names are those of EAGLE-3 checkpoints, so export to vLLM
is a rename-free copy):

    aux_t = [h^{l_1}_t, h^{l_2}_t, h^{l_3}_t]    the base's hidden states entering layers l_1..l_3 at t
    g_t   = fc(aux_t)                              (3d -> d), only for positions the base has processed
    x     = [input_layernorm(emb(x_{t+1})), hidden_norm(g_t)]               (2d)
    r     = g_t + attn(x);  o_t = r + mlp(post_attention_layernorm(r))      (o_t: "prenorm" output)
    logits over the draft vocabulary = lm_head(norm(o_t))  ->  guesses x_{t+2}

A drafter of `num_layers` > 1 stacks plain Llama decoder layers (transformers' `LlamaDecoderLayer`) on o_t
before the head (and before o_t is fed back): more of the base's computation to imitate per depth, at one more
small layer per drafted depth. The next depth takes o_t in place of g (and the drafted token in place of
x_{t+2}) at position t+1, and so on. The attention of every entry sees the real-feature entries of the context
and the entries of its own draft path (a tree mask at inference, EAGLE-3's "training-time test" mask in
training: `unroll`).

Initialisation (no EAGLE checkpoint can be downloaded, and a CPU budget trains for minutes, not days): the
layer is a copy of the base's layer `l_3`, `fc` selects h^{l_3}, the embedding half of q/k/v is zero,
`hidden_norm` takes that layer's input norm, `norm` the base's final norm and `lm_head` the base lm_head's
rows of the draft vocabulary. A fresh drafter thus runs one more base layer on h^{l_3}: a rough
next-token guess that training turns into a guess of the token after, instead of noise. Stacked layers are
copies of the following base layers with their output projections (`o_proj`, `down_proj`) zeroed, so they
start as the identity: a deeper drafter warm-started from a trained shallower one (`drafter_trainer
--init-from`) begins with exactly its drafts and only adds what training finds.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .arch import _first_attr, _text_config, describe, norm_eps
from .heads import register_head
from .mtp_modules import _final_norm, _Shared, decoder_layers


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as vLLM picks them for EAGLE-3 targets: (2, L // 2, L - 3)."""
    if num_layers < 4:
        return (num_layers - 1,) if num_layers >= 1 else (0,)
    # distinct and ascending: vLLM sorts and de-duplicates the ids (4-6-layer bases would repeat one)
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def select_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] | None) -> torch.Tensor:
    """What a drafter observes of the base: the final hidden state (layers=None) or the concatenated
    inputs of the given decoder layers (`hidden_states[i]` of transformers' `output_hidden_states`)."""
    if layers is None:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def _cache_kwarg() -> str:
    """The cache keyword of transformers' Llama attention and decoder layer (renamed in transformers 5.2x)."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


def _rms(size: int, eps: float) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(size, eps=eps)


class EagleLayer(nn.Module):
    """EAGLE-3's first draft layer: a Llama decoder layer whose attention reads [norm(emb), norm(hidden)]."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

        d = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * d, a.q_proj.out_features, bias=False)
        a.k_proj = nn.Linear(2 * d, a.k_proj.out_features, bias=False)
        a.v_proj = nn.Linear(2 * d, a.v_proj.out_features, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = _rms(d, config.rms_norm_eps)
        self.hidden_norm = _rms(d, config.rms_norm_eps)
        self.post_attention_layernorm = _rms(d, config.rms_norm_eps)
        self._cache_kwarg = _cache_kwarg()

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: Any = None,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        kwargs = {self._cache_kwarg: cache} if cache is not None else {}
        attn, _ = self.self_attn(
            hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask, **kwargs
        )
        r = hidden + attn
        return r + self.mlp(self.post_attention_layernorm(r))


def _copy_fitting(src: dict[str, torch.Tensor], targets: tuple[tuple[str, nn.Module], ...]) -> list[nn.Module]:
    """Copy the base layer's `src[name + ".weight"]` into each module whose weight has its shape; returns the
    modules left as they were (another layer layout: GPT-2, ...)."""
    missed = []
    for name, module in targets:
        w = src.get(f"{name}.weight")
        if w is not None and w.shape == module.weight.shape:
            module.weight.copy_(w.float())
        else:
            missed.append(module)
    return missed


def _ttt_attention(
    attn: nn.Module,
    x: torch.Tensor,
    pe: tuple[torch.Tensor, torch.Tensor],
    keys: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
) -> torch.Tensor:
    """One depth of a layer's attention in the training-time test: this depth's keys/values join `keys` (every
    earlier depth's), and `mask` says which of them each entry sees. Returns the o_proj output."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *pe)
    keys.append((k, v))
    K = torch.cat([kk for kk, _ in keys], dim=2)
    V = torch.cat([vv for _, vv in keys], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q, K, V.to(q.dtype), attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def drafter_config(base_model: nn.Module, num_layers: int = 1) -> Any:
    """A Llama config with the base's widths (the drafter layer is Llama-style whatever the base is)."""
    from transformers import LlamaConfig

    c = _text_config(base_model.config)
    d = _first_attr(c, ("hidden_size", "n_embd", "d_model"))
    heads = _first_attr(c, ("num_attention_heads", "n_head")) or max(1, d // 64)
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or d // heads
    inter = _first_attr(c, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * d
    eps = norm_eps(c)
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 1e4)}
    config = LlamaConfig(
        hidden_size=d,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=eps,
        num_hidden_layers=num_layers,
        vocab_size=describe(base_model).vocab_size,
        max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rope_parameters=rope,
    )
    config._attn_implementation = "sdpa"
    return config


@register_head("eagle")
class EagleDrafter(nn.Module):
    """EAGLE-3-style drafter (see module docstring). `num_heads` = the deepest draft it is trained/used for.

    feature_layers: the base layers whose inputs are fused (default `default_feature_layers`).
    num_layers: decoder layers per depth: `EagleLayer` (EAGLE-3's one), then `num_layers - 1` `LlamaDecoderLayer`s.
    draft_vocab_size: size of its own vocabulary projection; the ids are the buffer `draft_ids`
    (draft index -> base token id), set by `set_draft_vocab` before training and saved with the weights.
    """

    needs_base = True

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 6,
        num_layers: int = 1,
        own_lm_head: bool = False,
        base_model: nn.Module | None = None,
        feature_layers: list[int] | tuple[int, ...] | None = None,
        draft_vocab_size: int | None = None,
    ):
        super().__init__()
        if base_model is None:
            raise ValueError("the EAGLE drafter reads the base's embeddings: build it with base_model=")
        if num_layers < 1:
            raise ValueError(f"the EAGLE drafter needs at least one layer, got num_layers={num_layers}")
        info = describe(base_model)
        if (hidden_size, vocab_size) != (info.hidden_size, info.vocab_size):
            raise ValueError(
                f"EAGLE drafter for hidden size {hidden_size} / vocab {vocab_size} cannot run on this base "
                f"({info.hidden_size} / {info.vocab_size})"
            )
        layers = decoder_layers(base_model)
        self.feature_layers = tuple(int(i) for i in (feature_layers or default_feature_layers(len(layers))))
        if not all(0 <= i <= len(layers) for i in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers} outside 0..{len(layers)}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, int(num_layers), False
        self.draft_vocab_size = int(draft_vocab_size or vocab_size)
        self.config = drafter_config(base_model, self.num_layers)
        d, n = hidden_size, len(self.feature_layers)
        self.fc = nn.Linear(n * d, d, bias=False)
        self.midlayer = EagleLayer(self.config)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # layer_idx i: each stacked layer's attention keeps its own slot in the drafter's cache
        self.extra_layers = nn.ModuleList(LlamaDecoderLayer(self.config, i) for i in range(1, self.num_layers))
        self.norm = _rms(d, self.config.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(self.draft_vocab_size, dtype=torch.long))
        self.register_load_state_dict_post_hook(self._check_loaded)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        object.__setattr__(self, "_rotary", LlamaRotaryEmbedding(self.config))
        object.__setattr__(self, "_shared", _Shared(base_model, None))
        self._init_from_base(base_model, layers)
        param = next(base_model.parameters())
        self.to(device=param.device, dtype=param.dtype)
        self.train(base_model.training)

    # ---- construction -------------------------------------------------------------------------

    @torch.no_grad()
    def _init_from_base(self, base_model: nn.Module, layers: nn.ModuleList) -> None:
        d, n = self.hidden_size, len(self.feature_layers)
        eye = torch.eye(d)
        self.fc.weight.copy_(torch.cat([torch.zeros(d, (n - 1) * d), eye], dim=1))
        src_idx = min(self.feature_layers[-1], len(layers) - 1)
        src = dict(layers[src_idx].named_parameters())
        a = self.midlayer.self_attn
        copied = True
        for name in ("q_proj", "k_proj", "v_proj"):
            w = src.get(f"self_attn.{name}.weight")
            proj = getattr(a, name)
            proj.weight.zero_()
            if w is not None and w.shape == (proj.out_features, d):
                proj.weight[:, d:] = w.float()
            else:
                copied = False
        mlp = self.midlayer.mlp
        if _copy_fitting(
            src,
            (
                ("self_attn.o_proj", a.o_proj),
                ("mlp.gate_proj", mlp.gate_proj),
                ("mlp.up_proj", mlp.up_proj),
                ("mlp.down_proj", mlp.down_proj),
            ),
        ):
            copied = False
        _copy_fitting(
            src,
            (
                ("input_layernorm", self.midlayer.hidden_norm),
                ("post_attention_layernorm", self.midlayer.post_attention_layernorm),
            ),
        )
        if not copied:  # another layer layout (GPT-2, ...): a small random start, EAGLE's own default
            for module in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                nn.init.normal_(module.weight, std=0.02)
        for i, block in enumerate(self.extra_layers, start=1):
            self._init_block(block, dict(layers[min(src_idx + i, len(layers) - 1)].named_parameters()))
        base_norm = _final_norm(base_model, d, layers)
        if base_norm is not None and getattr(base_norm, "weight", None) is not None:
            self.norm.weight.copy_(base_norm.weight.float())
        self.set_draft_vocab(self.draft_ids, base_model)

    @staticmethod
    @torch.no_grad()
    def _init_block(block: nn.Module, src: dict[str, torch.Tensor]) -> None:
        """A base layer's weights where the shapes fit (small random ones elsewhere), output projections zero:
        the block starts as the identity on the residual stream (see the module docstring)."""
        a, mlp = block.self_attn, block.mlp
        for module in _copy_fitting(
            src,
            (
                ("self_attn.q_proj", a.q_proj),
                ("self_attn.k_proj", a.k_proj),
                ("self_attn.v_proj", a.v_proj),
                ("mlp.gate_proj", mlp.gate_proj),
                ("mlp.up_proj", mlp.up_proj),
            ),
        ):
            nn.init.normal_(module.weight, std=0.02)
        _copy_fitting(
            src,
            (("input_layernorm", block.input_layernorm), ("post_attention_layernorm", block.post_attention_layernorm)),
        )
        a.o_proj.weight.zero_()
        mlp.down_proj.weight.zero_()

    @torch.no_grad()
    def set_draft_vocab(self, ids: torch.Tensor | list[int], base_model: nn.Module | None = None) -> None:
        """Use base tokens `ids` as the draft vocabulary; with `base_model`, copy its lm_head rows into ours."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        self._check_draft_ids(ids)
        self.draft_ids.copy_(ids.to(self.draft_ids.device))
        if base_model is not None:
            w = base_model.get_output_embeddings().weight
            self.lm_head.weight.copy_(w[ids.to(w.device)].to(self.lm_head.weight))

    def _check_draft_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() != self.draft_vocab_size:
            raise ValueError(f"draft vocabulary of {ids.numel()} ids for a drafter of {self.draft_vocab_size}")
        if ids.numel() and (
            int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or ids.unique().numel() != ids.numel()
        ):
            raise ValueError("draft vocabulary ids must be distinct base token ids")

    @staticmethod
    def _check_loaded(module: nn.Module, incompatible: Any) -> None:
        """After `load_state_dict`: a checkpoint's `draft_ids` get the checks `set_draft_vocab` gives."""
        module._check_draft_ids(module.draft_ids)

    def config_kwargs(self) -> dict[str, Any]:
        kwargs = {"feature_layers": list(self.feature_layers), "draft_vocab_size": self.draft_vocab_size}
        if self.num_layers != 1:  # one-layer checkpoints keep the config they always had
            kwargs["num_layers"] = self.num_layers
        return kwargs

    def make_proposer(self, base_model: nn.Module, lm_head: nn.Module | None = None):
        """`lm_head` is ignored: the drafter projects with its own draft-vocabulary lm_head."""
        from .eagle_proposer import EagleProposer

        return EagleProposer(self)

    # ---- one application of the layer ---------------------------------------------------------

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(aux): the base's fused features (.., n*d) -> the layer's input (.., d)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Any = None,
    ) -> torch.Tensor:
        """One application: hidden (B, L, d) (g or a previous output), tokens (B, L), positions (B|1, L),
        mask (B|1, 1, L, cached + L) additive -> prenorm outputs o (B, L, d)."""
        dtype = self.fc.weight.dtype
        emb = self._shared.embed(tokens).to(dtype)
        pe = self._rotary(emb, positions)
        out = self.midlayer(emb, hidden.to(dtype), pe, mask, cache)
        kwargs = {self.midlayer._cache_kwarg: cache} if cache is not None else {}
        for block in self.extra_layers:
            out = block(out, attention_mask=mask, position_embeddings=pe, **kwargs)
        return out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (.., Dv) of prenorm outputs."""
        return self.lm_head(self.norm(out))

    # ---- training: EAGLE-3's training-time test --------------------------------------------------

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft-vocabulary logits of `steps` unrolled depths at every position, as the drafter runs them.

        aux: (B, T, n*d) the base's fused features; input_ids: (B, T). Entry (j, t) sits at position t+j,
        reads the token x_{t+j+1} and the previous depth's output at t (g_t for j = 0), attends to the
        depth-0 entries at positions <= t and to its own chain (j' <= j at the same t), and guesses
        x_{t+j+2}. Returns [(B, T, Dv)] per depth; entries whose token lies beyond T are padding.
        """
        return [self.logits(h) for h in self.unroll_outputs(aux, input_ids, steps)]

    def unroll_outputs(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`unroll` before the projection: prenorm outputs [(B, T, d)] per depth. Training projects only the
        entries it scores through `logits`: the draft-vocabulary projection is the largest matmul of a
        step, and prompt tokens and the padded tail carry no loss."""
        B, T, _ = aux.shape
        device = aux.device
        h = self.combine(aux)
        ids = torch.nn.functional.pad(input_ids, (0, steps + 1), value=0)
        # Boolean masks (True = attend), so the same code runs under bf16 autocast. (Computing the causal
        # block and the j diagonal scores by hand instead measured no faster than SDPA on this mask.)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
        diag = torch.eye(T, dtype=torch.bool, device=device)
        keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(self.num_layers)]
        first = self.midlayer
        out: list[torch.Tensor] = []
        pos0 = torch.arange(T, device=device)[None]
        for j in range(steps):
            tokens = ids[:, j + 1 : j + 1 + T]
            emb = self._shared.embed(tokens).to(h.dtype)
            pe = self._rotary(emb, pos0 + j)
            mask = torch.cat([causal] + [diag] * j, dim=1)[None, None]
            x = torch.cat([first.input_layernorm(emb), first.hidden_norm(h)], dim=-1)
            r = h + _ttt_attention(first.self_attn, x, pe, keys[0], mask)
            h = r + first.mlp(first.post_attention_layernorm(r))
            for i, block in enumerate(self.extra_layers, start=1):
                r = h + _ttt_attention(block.self_attn, block.input_layernorm(h), pe, keys[i], mask)
                h = r + block.mlp(block.post_attention_layernorm(r))
            out.append(h)
        return out

    # ---- the generic head interface ---------------------------------------------------------------

    def to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> base-vocabulary logits (-inf outside the draft vocabulary)."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = logits
        return full

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module | None = None,
        num_heads: int | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(K, B, T, V) logits: depth k at position t guesses token t+k+2 (like Medusa head k).

        hidden: the fused features (B, T, n*d) (`select_features(..., self.feature_layers)`).
        """
        if input_ids is None:
            raise ValueError("the EAGLE drafter reads the input tokens: call it with input_ids=")
        squeeze = hidden.dim() == 2
        if squeeze:
            hidden, input_ids = hidden[None], input_ids.reshape(1, -1)
        K = self.num_heads if num_heads is None else num_heads
        out = torch.stack([self.to_full_vocab(x) for x in self.unroll(hidden, input_ids, K)])
        return out[:, 0] if squeeze else out
