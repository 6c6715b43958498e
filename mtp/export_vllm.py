"""Export trained draft heads to the formats vLLM serves, so a user can deploy them on vLLM unchanged.

One exporter per head type, picked from a table (`EXPORTERS`). Each writes a directory that vLLM loads
with its own, unmodified model code, and returns the `speculative_config` that serves it:

  head_type "mtp"     -> a merged `MiMoForCausalLM` checkpoint (Xiaomi MiMo's layout: the base plus its
                         MTP modules under `model.mtp_layers.{k}`), served with {"method": "mtp"}.
                         vLLM has no Llama-with-MTP class; MiMo's is a Qwen2 model, which is the Llama
                         layout plus q/k/v biases, so a Llama/Qwen2/Mistral base maps with zero biases.
  head_type "medusa"  -> the base as it is plus a `medusa/` draft (vLLM's `MedusaModel`: `blocks.{h}.layers.
                         {l}` with biases, one shared `lm_head` via `original_lm_head`), served with
                         {"method": "medusa", "model": "<out>/medusa"}. This mapping is exact.
  head_type "eagle"   -> the base as it is plus an `eagle3/` draft in the `speculators` format (vLLM's
                         `Eagle3LlamaForCausalLM`: EAGLE-3's own tensor names, `d2t` for a draft vocabulary),
                         served with {"method": "eagle3", "model": "<out>/eagle3"} or, the method and depth
                         read from its config, as `vllm serve <out>/eagle3`. This mapping is exact.

Where vLLM's model differs from ours the mapping is not exact, and the exporter says how (`notes`):

* vLLM hands an MTP layer the base's hidden state BEFORE the final norm; our modules were trained on the
  normed one. Ours computes g_h * RMS(g_f * RMS(h)), vLLM g'_h * RMS(h) (g_f: the final norm's gain,
  g_h: the module's `hnorm`). RMS(g_f * u) is not a diagonal map of u, so no g'_h is exact; the export
  folds g'_h = g_h * g_f / rms(g_f), which is exact up to one scalar per token, rms(g_f * u) / rms(g_f)
  (u = RMS(h)). On SmolLM2's own answers that scalar is 1.07 +- 0.07 (0.88-1.35); module 1's argmax
  then agrees with ours at ~96% of positions (folding g_f alone, without the 1 / rms(g_f), at ~56%).
* vLLM's generic MTP proposer runs module 1 for every draft position (`spec_step_idx` stays 0; it
  warns "multiple times of forward on same MTP layer"), feeding it its own normed output. Modules 2..K
  are exported (a complete checkpoint) but never run, so depths >= 2 accept less than in our decoder.
* vLLM zeroes the token embedding at position 0 of a sequence; ours does not (a small difference that
  reaches later positions through attention).
* The heads' draft vocabulary cannot be carried. MiMo's MTP layer projects through the base lm_head (no
  place for it). vLLM's Medusa documents one (`token_map` + `truncated_vocab_size`), but 0.32 cannot
  load it: `Medusa.load_weights` makes `token_map` a parameter it never reports as loaded, and the strict
  loader then refuses the checkpoint ("Following weights were not initialized from checkpoint:
  {'token_map'}"). So every export drafts from the full vocabulary (the drafts can only get better;
  drafting costs more).
* vLLM drafts a chain of top-1 tokens (no trees), and its Medusa proposer always drafts one token per
  head: serve a Medusa export with num_speculative_tokens = its number of heads.
* EAGLE-3 (checked in vLLM 0.32's source): vLLM's aux hidden state for layer id i is `hidden + residual`
  entering decoder layer i (id 0: the embeddings), which is transformers' `hidden_states[i]` for i < L;
  transformers' `hidden_states[L]` is after the final norm, vLLM's id L before it, so a drafter reading
  layer L is refused. vLLM concatenates the aux states in increasing layer order (it sorts the ids), so
  `fc`'s column blocks are written in that order. The next depth reads the pre-norm output
  (`norm_output` false), the residual is the raw fused feature (`norm_before_residual` false: the
  speculators loader defaults it to true, so it is written out), and the drafter's embedding, absent from
  the checkpoint, is the target's own (vLLM shares it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .files import share_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
MEDUSA_DIR = "medusa"
EAGLE3_DIR = "eagle3"
EXPORT_INFO = "mtp_vllm_export.json"  # what was exported and how to serve it (read by the bench and tests)

# Bases whose decoder layer is the Llama layout MiMo's Qwen2 blocks reproduce (RMSNorm, rotary attention,
# SwiGLU MLP, no MLP bias).
_QWEN2_LIKE = ("llama", "qwen2", "mistral")
# Bases (HF model_type) whose vLLM model class offers EAGLE-3's aux hidden states (`SupportsEagle3`, fed by
# `EagleModelMixin._maybe_add_hidden_state` at each layer's input) in vLLM 0.32. Others refuse `eagle3`.
_EAGLE3_TARGETS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "granite", "minicpm")
# Head types that have no vLLM format, and why (anything not in EXPORTERS either is unknown).
UNSUPPORTED = {
    "draft_lm": "a draft_lm head is a standalone small model, not heads: write it with `mtp export --assistant` "
    "(a plain HF checkpoint) and give vLLM that directory as speculative_config "
    '{"method": "draft_model", "model": "<dir>"} (not verified here)',
}


@dataclass
class VLLMExport:
    """What was written and how vLLM serves it."""

    path: Path  # the model directory to give vLLM (`vllm serve <path>` / `LLM(model=<path>)`)
    speculative_config: dict[str, Any]  # `--speculative-config` / `LLM(speculative_config=...)`
    notes: list[str] = field(default_factory=list)  # where the export differs from our decoder

    def serve_command(self) -> str:
        return f"vllm serve {self.path} --speculative-config '{json.dumps(self.speculative_config)}'"

    def save(self) -> Path:
        info = {"speculative_config": self.speculative_config, "serve": self.serve_command(), "notes": self.notes}
        target = self.path / EXPORT_INFO
        target.write_text(json.dumps(info, indent=2) + "\n")
        return target


def export_vllm(
    model: nn.Module,
    out: str | Path,
    dtype: str = "bfloat16",
    tokenizer: Any = None,
    num_heads: int | None = None,
) -> VLLMExport:
    """Write `model` (an `MTPModel`) to `out` in the vLLM format of its head type.

    dtype: of every written tensor (vLLM's CPU build runs bf16 fastest). tokenizer: written beside the
    weights (vLLM loads it from the model directory); default `model.tokenizer`. num_heads: export only
    the first N heads / modules (a Medusa export drafts exactly one token per head).
    """
    head_type = model.config.head_type
    if head_type not in EXPORTERS:
        why = UNSUPPORTED.get(head_type, f"no vLLM format is known for it (exportable: {sorted(EXPORTERS)})")
        raise ValueError(f"cannot export head_type {head_type!r} to vLLM: {why}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    k = model.config.num_heads if num_heads is None else num_heads
    if not 1 <= k <= model.config.num_heads:
        raise ValueError(f"num_heads must be in 1..{model.config.num_heads}, got {num_heads}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    export = EXPORTERS[head_type](model, out, DTYPES[dtype], k)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    else:
        export.notes.append("no tokenizer was given: pass vLLM --tokenizer <base dir>")
    gen = getattr(model.base_model, "generation_config", None)
    if gen is not None:  # the base's stop tokens (e.g. a chat end token) are what vLLM stops on
        gen.save_pretrained(out)
    export.save()
    share_weights(out)
    return export


# ---- head_type "mtp" -> MiMoForCausalLM ---------------------------------------------------------------


def fold_scale(final_norm_weight: torch.Tensor) -> float:
    """rms(g_f): the per-token factor rms(g_f * RMS(h)) when every coordinate of RMS(h) has unit mean square."""
    return float(final_norm_weight.float().pow(2).mean().sqrt())


def folded_hidden_norm(hnorm_weight: torch.Tensor, final_norm_weight: torch.Tensor) -> torch.Tensor:
    """The `hidden_layernorm` gain that makes g' * RMS(h) ~ g_h * RMS(g_f * RMS(h)) (see the module doc)."""
    g_f = final_norm_weight.float()
    return hnorm_weight.float() * g_f / fold_scale(g_f)


def _base_parts(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(base config dict, base state dict in the Llama/Qwen2 names), refusing layouts MiMo cannot hold."""
    base = model.base_model
    config = base.config.to_dict()
    kind = config.get("model_type")
    if kind not in _QWEN2_LIKE:
        raise ValueError(
            f"cannot export a {kind!r} base as MiMoForCausalLM: vLLM's MTP layers for dense models are "
            f"Qwen2 decoder layers (RMSNorm, rotary attention, SwiGLU MLP), which hold {_QWEN2_LIKE} bases only"
        )
    if config.get("mlp_bias"):
        raise ValueError("cannot export a base with MLP biases as MiMoForCausalLM: Qwen2's MLP has none")
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(
            f"cannot export as MiMoForCausalLM: head_dim {head_dim} x {config['num_attention_heads']} heads != "
            f"hidden size {config['hidden_size']} (vLLM's Qwen2 attention derives head_dim from the hidden size)"
        )
    window = config.get("sliding_window")
    if kind == "mistral" and window and window < config.get("max_position_embeddings", 0):
        raise ValueError(
            f"cannot export a Mistral base with a {window}-token sliding window as MiMoForCausalLM: Qwen2's "
            "sliding-window layers are laid out differently; a full-attention base exports"
        )
    state = {k: v for k, v in base.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = base.get_output_embeddings().weight
    return config, state


def _with_qkv_bias(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero q/k/v biases where a Llama-layout attention has none (Qwen2's always has them)."""
    extra = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = state.get(f"{prefix}self_attn.{proj}.weight")
        if weight is not None and f"{prefix}self_attn.{proj}.bias" not in state:
            extra[f"{prefix}self_attn.{proj}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return extra


def mimo_state_dict(model: nn.Module, num_heads: int) -> dict[str, torch.Tensor]:
    """The merged MiMo tensors: the base with q/k/v biases, then `model.mtp_layers.{k}` per module.

    Names follow vLLM's `MiMoMTP.hf_to_vllm_mapper`: the block's own names sit directly under the layer
    (`model.mtp_layers.0.self_attn.q_proj.weight`; vLLM adds `mtp_block.` and the layer offset itself).
    """
    heads = model.heads
    if heads.num_layers != 1:
        raise ValueError(f"MiMo MTP layers hold one transformer block each; these modules have {heads.num_layers}")
    config, state = _base_parts(model)
    out = dict(state)
    for i in range(config["num_hidden_layers"]):
        out.update(_with_qkv_bias(f"model.layers.{i}.", state))
    g_f = state["model.norm.weight"]
    for k in range(num_heads):
        depth, prefix = heads.depths[k], f"model.mtp_layers.{k}."
        block = {f"{prefix}{name}": t for name, t in depth.blocks[0].state_dict().items()}
        out.update(block)
        out.update(_with_qkv_bias(prefix, block))
        out[f"{prefix}hidden_layernorm.weight"] = folded_hidden_norm(depth.hnorm.weight, g_f)
        out[f"{prefix}token_layernorm.weight"] = depth.enorm.weight
        out[f"{prefix}input_proj.weight"] = depth.proj.weight  # (d, 2d): [hidden | embedding], MiMo's order
        out[f"{prefix}final_layernorm.weight"] = depth.norm.weight
    return out


def mimo_config(model: nn.Module, num_heads: int, dtype: torch.dtype) -> dict[str, Any]:
    """The base's config as a Qwen2-typed MiMoForCausalLM with `num_heads` MTP layers."""
    config, _ = _base_parts(model)
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "quantization_config", "auto_map"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    config.update(
        architectures=["MiMoForCausalLM"],
        model_type="qwen2",  # a Qwen2 config: MiMo's own model_type needs remote code
        num_nextn_predict_layers=num_heads,
        tie_word_embeddings=False,  # lm_head is written out: the MTP draft loads it by name
        use_sliding_window=False,
        dtype=str(dtype).removeprefix("torch."),
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    return config


def _save(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """Float tensors in `dtype`, each its own copy (tied weights share memory, which safetensors refuses)."""
    cast = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).clone() for k, v in tensors.items()}
    save_file(cast, str(path), metadata={"format": "pt"})


def _export_mtp(model: nn.Module, out: Path, dtype: torch.dtype, num_heads: int) -> VLLMExport:
    _save(mimo_state_dict(model, num_heads), out / WEIGHTS_NAME, dtype)
    (out / "config.json").write_text(json.dumps(mimo_config(model, num_heads, dtype), indent=2) + "\n")
    notes = [
        "hidden_layernorm = hnorm * g_f / rms(g_f): vLLM feeds the pre-final-norm hidden state; exact up to "
        "one scalar per token, rms(g_f * RMS(h)) / rms(g_f)",
        "vLLM runs module 1 for every draft position (spec_step_idx stays 0); modules 2.. are exported unused, "
        "so the suggested config drafts one token (deeper drafts were seldom accepted and cost a pass each)",
    ]
    if model.draft_vocab is not None:
        notes.append(
            f"the heads' {model.draft_vocab.numel()}-token draft vocabulary is dropped: MiMo's MTP layer "
            "projects through the base lm_head, so vLLM drafts from the full vocabulary"
        )
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    return VLLMExport(path=out, speculative_config=spec, notes=notes)


# ---- head_type "medusa" -> vLLM MedusaModel ----------------------------------------------------------


def medusa_state_dict(model: nn.Module, num_heads: int) -> dict[str, torch.Tensor]:
    """vLLM Medusa names: `blocks.{h}.layers.{l}.{weight,bias}`, `lm_head.weight` (shared) or
    `lm_heads.{h}.weight` (own). No `token_map`: vLLM 0.32 cannot load one (see the module doc)."""
    heads = model.heads
    out: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for layer, block in enumerate(heads.blocks[h]):
            out[f"blocks.{h}.layers.{layer}.weight"] = block.linear.weight
            out[f"blocks.{h}.layers.{layer}.bias"] = block.linear.bias
    if heads.lm_heads is None:
        out["lm_head.weight"] = model.base_model.get_output_embeddings().weight
    else:
        for h in range(num_heads):
            out[f"lm_heads.{h}.weight"] = heads.lm_heads[h].weight
    return out


def medusa_config(model: nn.Module, num_heads: int, dtype: torch.dtype) -> dict[str, Any]:
    """vLLM's MedusaConfig keys. No other key may contain both "num" and "heads"/"layers": its
    `from_pretrained` renames any such key to num_heads / num_hidden_layers."""
    heads, shared = model.heads, model.heads.lm_heads is None
    vocab = model.info.vocab_size
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": model.info.hidden_size,
        "vocab_size": vocab,
        "num_heads": num_heads,
        "num_hidden_layers": heads.num_layers,  # residual blocks per head
        "medusa_fc_bias": True,  # our ResBlock is h + SiLU(W h + b)
        "original_lm_head": shared,  # one lm_head for every head (ours: the base's)
        "truncated_vocab_size": vocab,  # the full vocabulary: no token_map
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _write_base(model: nn.Module, out: Path, dtype: torch.dtype) -> None:
    """The target as it is, in `dtype` (its own config and names: vLLM serves it with its own class)."""
    base = model.base_model
    cfg = {k: v for k, v in base.config.to_dict().items() if k not in ("_name_or_path", "quantization_config")}
    cfg.update(dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v for k, v in base.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if model.info.tied_embeddings:
        state.pop("lm_head.weight", None)
    _save(state, out / WEIGHTS_NAME, dtype)


def _export_medusa(model: nn.Module, out: Path, dtype: torch.dtype, num_heads: int) -> VLLMExport:
    _write_base(model, out, dtype)
    draft = out / MEDUSA_DIR
    draft.mkdir(exist_ok=True)
    _save(medusa_state_dict(model, num_heads), draft / WEIGHTS_NAME, dtype)
    (draft / "config.json").write_text(json.dumps(medusa_config(model, num_heads, dtype), indent=2) + "\n")
    notes = ["vLLM's Medusa proposer drafts one top-1 token per head: a chain of num_heads, no tree"]
    if model.draft_vocab is not None:
        notes.append(f"the heads' {model.draft_vocab.numel()}-token draft vocabulary is dropped: vLLM 0.32 cannot "
                     "load a Medusa token_map, so vLLM drafts from the full vocabulary")  # fmt: skip
    spec = {"method": "medusa", "model": str(draft), "num_speculative_tokens": num_heads}
    return VLLMExport(path=out, speculative_config=spec, notes=notes)


# ---- head_type "eagle" -> an EAGLE-3 draft in the speculators format (vLLM Eagle3LlamaForCausalLM) ------------


def eagle3_layer_ids(heads: nn.Module, num_layers: int) -> list[int]:
    """The base layers the drafter reads, as vLLM's `eagle_aux_hidden_state_layer_ids` (increasing: vLLM
    sorts them and concatenates in that order), refusing what vLLM would feed differently."""
    layers = [int(i) for i in heads.feature_layers]
    if len(set(layers)) != len(layers):
        raise ValueError(
            f"cannot export an EAGLE drafter reading layers {layers} to vLLM: vLLM keeps each aux layer once "
            "(a set), so a repeated layer leaves fc without its input"
        )
    if max(layers) >= num_layers:
        raise ValueError(
            f"cannot export an EAGLE drafter reading layer {max(layers)} of a {num_layers}-layer base to vLLM: "
            f"transformers' hidden_states[{num_layers}] is after the final norm, vLLM's aux layer "
            f"{num_layers} before it; layers 0..{num_layers - 1} (the inputs of decoder layers) map exactly"
        )
    return sorted(layers)


def eagle3_state_dict(heads: nn.Module) -> dict[str, torch.Tensor]:
    """EAGLE-3 checkpoint tensors: `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight` (+ `d2t`, `t2d`).

    fc's column blocks follow the increasing layer order vLLM concatenates in. The draft vocabulary is
    written sorted (EAGLE-3's convention: d2t >= 0): `d2t[i] = target id of draft i - i` (vLLM maps draft
    logit i to token i + d2t[i]), `t2d` marks the target ids in the draft vocabulary (vLLM ignores it).
    With the full vocabulary there is no d2t (vLLM has no mapping then: its lm_head rows are token ids), so
    lm_head's rows are put in token order. The embedding is not written: vLLM shares the target's.
    """
    d, layers = heads.hidden_size, [int(i) for i in heads.feature_layers]
    order = sorted(range(len(layers)), key=lambda i: layers[i])
    fc = heads.fc.weight
    out = {"fc.weight": torch.cat([fc[:, i * d : (i + 1) * d] for i in order], dim=1)}
    out.update({f"midlayer.{name}": t for name, t in heads.midlayer.state_dict().items()})
    out["norm.weight"] = heads.norm.weight
    ids = heads.draft_ids.detach().cpu().long()
    ids, rows = torch.sort(ids)
    out["lm_head.weight"] = heads.lm_head.weight[rows.to(heads.lm_head.weight.device)]
    if ids.numel() < heads.vocab_size:
        out["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(heads.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


# PreTrainedConfig bookkeeping that says nothing about the drafter layer (token ids: the target's apply).
_GENERIC_CONFIG_KEYS = (
    "_name_or_path", "architectures", "transformers_version", "_attn_implementation_autoset", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip


def eagle3_config(model: nn.Module, num_heads: int, dtype: torch.dtype, verifier: str) -> dict[str, Any]:
    """The speculators `Eagle3SpeculatorConfig` that vLLM's `SpeculatorsConfig` reads (no `model_type`: vLLM
    recognises the format by `speculators_config`). `transformer_layer_config` is written in full: vLLM
    builds a bare `PreTrainedConfig` from it, so nothing falls back to LlamaConfig's defaults."""
    heads, base = model.heads, model.base_model
    name = str(dtype).removeprefix("torch.")
    layer = {k: v for k, v in heads.config.to_dict().items() if k not in _GENERIC_CONFIG_KEYS}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, dtype=name)
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" not in layer and "rope_theta" in rope:  # the pre-5.x key, for older readers
        layer["rope_theta"] = rope["rope_theta"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": heads.draft_vocab_size,
        "target_hidden_size": heads.hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": eagle3_layer_ids(heads, base.config.num_hidden_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_heads,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],  # fmt: skip
            "verifier": {"name_or_path": verifier, "architectures": list(model.info.architectures)},
        },
        "dtype": name,
        "torch_dtype": name,
    }


def _export_eagle(model: nn.Module, out: Path, dtype: torch.dtype, num_heads: int) -> VLLMExport:
    kind = model.base_model.config.model_type
    if kind not in _EAGLE3_TARGETS:
        raise ValueError(
            f"cannot export an EAGLE drafter on a {kind!r} base to vLLM: vLLM 0.32 feeds EAGLE-3 drafters only "
            f"from targets with its SupportsEagle3 interface; bases known to work: {_EAGLE3_TARGETS}"
        )
    if model.heads.num_layers != 1:
        raise ValueError(
            f"cannot export a {model.heads.num_layers}-layer EAGLE drafter to vLLM: its eagle3 checkpoint format holds "
            "one draft layer (`midlayer`)"
        )
    config = eagle3_config(model, num_heads, dtype, verifier=str(out.resolve()))  # refuses unmappable layers
    _write_base(model, out, dtype)
    draft = out / EAGLE3_DIR
    draft.mkdir(exist_ok=True)
    _save(eagle3_state_dict(model.heads), draft / WEIGHTS_NAME, dtype)
    (draft / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    notes = [
        "vLLM drafts one top-1 chain of num_speculative_tokens with the drafter (no tree); the verifier named "
        f"in {EAGLE3_DIR}/config.json is this directory, so `vllm serve {draft}` serves it as well",
    ]
    layers = [int(i) for i in model.heads.feature_layers]
    if layers != sorted(layers):
        notes.append(f"feature layers {layers} are written in vLLM's increasing order (fc's columns permuted)")
    if model.draft_vocab is not None:
        notes.append("the MTPModel-level draft vocabulary does not apply: the EAGLE drafter has its own "
                     f"({model.heads.draft_vocab_size} tokens, written as d2t)")  # fmt: skip
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_heads}
    return VLLMExport(path=out, speculative_config=spec, notes=notes)


EXPORTERS: dict[str, Callable[[nn.Module, Path, torch.dtype, int], VLLMExport]] = {
    "mtp": _export_mtp,
    "medusa": _export_medusa,
    "eagle": _export_eagle,
}
