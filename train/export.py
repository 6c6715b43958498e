"""Turn a training run into a checkpoint the decoder and servers load with `MTPModel.from_pretrained`.

Medusa-1 heads sit on the untouched base, so a heads-only checkpoint (pointing at the base) or a full one
(base copied in) both work. Medusa-2 heads were trained on the LoRA-adapted backbone: they are only right
on that backbone, so the adapter is merged into the base weights (`--merge-lora`) and a full checkpoint
is written; the base-weights probe stored with the heads is then the merged model's, and loading the heads
on the original base is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mtp.config import CONFIG_NAME
from mtp.files import share_weights
from mtp.model import MTPModel

from .checkpointing import ADAPTER_DIR, HEADS_FILE
from .config import load_saved_config
from .evaluation import load_eval
from .precision import DTYPES


def export(source: str | Path, out: str | Path, merge_lora: bool = False, heads_only: bool = False,
           dtype: str = "float32", draft_vocab: int = 0, draft_data: str | Path | None = None,
           assistant: bool = False, to: str = "mtp") -> Path:  # fmt: skip
    """`draft_vocab` > 0: the heads draft only from the that many most frequent tokens of `draft_data`
    (a `mtp distill` output or any `save_to_disk` dataset with `input_ids`; see mtp.draft_vocab).
    `assistant`: the run trained a `draft_lm`; write it as a plain HF checkpoint for assisted generation.
    `to="vllm"`: write the heads in vLLM's format for their head type instead (mtp.export_vllm)."""
    source, out = Path(source), Path(out)
    if to not in ("mtp", "vllm"):
        raise ValueError(f"--to must be mtp or vllm, got {to!r}")
    if to == "vllm" and (heads_only or assistant):
        raise ValueError("--to vllm writes a whole model directory; --heads-only and --assistant do not apply")
    if draft_vocab and draft_data is None:
        raise ValueError("--draft-vocab needs --draft-data: the token ids to count (e.g. the mtp distill output)")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not source.is_dir():
        raise FileNotFoundError(f"training output not found: {source}")
    has_adapter = (source / ADAPTER_DIR).is_dir()
    if has_adapter and not merge_lora:
        raise ValueError(
            f"{source} holds a LoRA adapter (Medusa-2): its heads only fit the adapted backbone. "
            "Pass --merge-lora to write a merged checkpoint"
        )
    if has_adapter and heads_only:
        raise ValueError("--heads-only cannot be combined with --merge-lora: the merged base must be written too")
    if merge_lora and not has_adapter:
        raise ValueError(f"--merge-lora given but {source} has no {ADAPTER_DIR}/ (a Medusa-1 run?)")
    model, tokenizer = _load(source, has_adapter, DTYPES[dtype])
    if to == "vllm":
        return _export_vllm(model, tokenizer, out, dtype, draft_vocab, draft_data)
    is_draft = model.config.head_type == "draft_lm"
    if assistant and not is_draft:
        raise ValueError(f"--assistant exports a draft model (heads.head_type: draft_lm); this run trained "
                         f"{model.config.head_type!r} heads")  # fmt: skip
    if is_draft and not assistant:
        raise ValueError("this run trained a draft model (head_type draft_lm): export it with --assistant")
    if assistant:
        return _export_assistant(model, tokenizer, out)
    model.tokenizer = tokenizer
    accuracies = load_eval(source / "eval_accuracy.json")
    if accuracies is not None:
        model.config.head_accuracies = [h["rank_probs"] for h in accuracies["heads"]]
    if not heads_only:  # the base now lives in `out` itself (merged, for Medusa-2)
        model.config.base_model_name_or_path = str(out.resolve())
    if draft_vocab:
        model.set_draft_vocab(_draft_vocab(Path(draft_data), draft_vocab, model, tokenizer))
    return model.save_pretrained(out, heads_only=heads_only)


def _export_vllm(model: MTPModel, tokenizer: Any, out: Path, dtype: str, draft_vocab: int,
                 draft_data: str | Path | None) -> Path:  # fmt: skip
    from mtp.export_vllm import EXPORT_INFO, export_vllm

    if draft_vocab:
        model.set_draft_vocab(_draft_vocab(Path(draft_data), draft_vocab, model, tokenizer))
    result = export_vllm(model, out, dtype=dtype, tokenizer=tokenizer)
    for note in result.notes:
        print(f"note: {note}")
    print(f"speculative_config: {json.dumps(result.speculative_config)}")
    print(f"serve it with: {result.serve_command()}")
    print(f"(both written to {out / EXPORT_INFO})")
    return result.path


def _export_assistant(model: MTPModel, tokenizer: Any, out: Path) -> Path:
    """A trained draft_lm -> an ordinary `*ForCausalLM` checkpoint with the base's embeddings and tokenizer."""
    lm = model.heads.to_causal_lm(model.base_model)
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    share_weights(out)
    n = sum(p.numel() for p in lm.parameters())
    print(f"draft model: {lm.config.num_hidden_layers} layers (from base layers {lm.config.mtp_draft_layers}), "
          f"{n / 1e6:.1f}M parameters; load it with AutoModelForCausalLM.from_pretrained('{out}') and pass it "
          "to generate(assistant_model=...) or `mtp bench --assistant`")  # fmt: skip
    return out


def _draft_vocab(data: Path, size: int, model: MTPModel, tokenizer: Any) -> torch.Tensor:
    from mtp.draft_vocab import coverage, frequent_tokens

    from .distill import load_distilled

    if not data.is_dir():
        raise FileNotFoundError(f"--draft-data {data} is not a dataset directory")
    rows = load_distilled(data)
    if "input_ids" not in rows.column_names:
        raise ValueError(f"--draft-data {data} has no input_ids column (expected a mtp distill output)")
    prompt_lens = rows["prompt_len"] if "prompt_len" in rows.column_names else [0] * len(rows)
    answers = [ids[n:] for ids, n in zip(rows["input_ids"], prompt_lens, strict=True)]  # what the model writes
    special = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
    ids = frequent_tokens(answers, size, model.info.vocab_size, always=special)
    print(f"draft vocabulary: {len(ids)} tokens cover {coverage(answers, ids):.2%} of {data}'s answer tokens")
    return ids


def _load(source: Path, has_adapter: bool, dtype: torch.dtype) -> tuple[MTPModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .trainer import resolve_model_path

    if (source / CONFIG_NAME).is_file() and not (source / HEADS_FILE).is_file():  # Medusa-1 final output
        model = MTPModel.from_pretrained(source, torch_dtype=dtype)
        base_path = resolve_model_path(model.config.base_model_name_or_path)
        return model, AutoTokenizer.from_pretrained(str(base_path))
    cfg = load_saved_config(source)
    base_path = resolve_model_path(cfg.model.path)
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    if has_adapter:
        from peft import PeftModel

        base = PeftModel.from_pretrained(base, str(source / ADAPTER_DIR)).merge_and_unload().eval()
    base = base.to(dtype)
    h = cfg.heads
    model = MTPModel.from_base(
        base, num_heads=h.num_heads, head_type=h.head_type, num_layers=h.num_layers, own_lm_head=h.own_lm_head,
        **h.extra,
    )  # fmt: skip
    state = load_file(str(source / HEADS_FILE))
    model.heads.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    model.config.base_model_name_or_path = "default" if cfg.model.path == "default" else str(base_path)
    tok_path = cfg.model.tokenizer or str(base_path)
    return model, AutoTokenizer.from_pretrained(tok_path)
