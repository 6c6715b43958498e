"""`mtp distill`: the base model's own answers to dataset prompts, as a `datasets` dataset.

Why: heads are drafts for *this model's* outputs, so the best targets are what the model itself writes
(Medusa's self-distillation), rendered with its chat template exactly as at serving time. Each prompt is
templated (a row with ``context``, earlier turns of its conversation, as that conversation's next turn) and
answered by continuous batching (`mtp.batching.BatchDecoder`, plain decoding: a finished answer's row is
refilled by the next prompt at once, and no prompt is padded to its batch's longest), or with
`engine="generate"` by the model's own `generate()` over left-padded batches, where every row keeps decoding
until the batch's longest answer ends (1.4-1.55x slower in fp32 on a 2-core CPU, batch 32, 256 new tokens,
answers identical: `python -m mtp.bench.distill_speed`). Each answer is stored with
  prompt_id   index of the prompt in the source (resumption key)
  messages    the conversation: [user prompt, assistant answer], or a row's ``context`` turns before them
              (text, for inspection or re-templating)
  input_ids   the exact token ids: templated prompt + generated answer (what training reads)
  prompt_len  how many of input_ids are prompt (training masks them with data.loss_on: assistant)
Output is written as `shard-NNNNN/` datasets, each renamed into place when complete; a rerun skips every
prompt already in a finished shard, so a killed job loses at most one shard of work. Train on the folder
directly (`data.path: <out>`), or load it with `load_distilled(out)`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

INFO_NAME = "distill_info.json"
SKIPPED_NAME = "skipped_prompt_ids.json"
PROMPT_FIELDS = ("prompt", "instruction", "question", "text")
ENGINES = ("batched", "generate")  # see `answer_prompts`
Prompt = str | list[dict]  # a user turn, or a conversation ending with one (from a row's ``context``)


@dataclass
class DistillOptions:
    model: str = "default"
    data: str = "sharegpt"
    out: Path = Path("distilled")
    max_new_tokens: int = 256
    batch_size: int = 32
    limit: int | None = None
    sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.95
    dtype: str = "auto"  # auto: bf16 where the CPU has bf16 matmul units, else fp32 (train.precision)
    shard_size: int = 64
    max_prompt_tokens: int = 512
    seed: int = 0
    engine: str = "batched"  # batched: continuous batching (mtp.batching) | generate: left-padded generate()
    pack: bool = True  # batched engine: decode from prepacked weights where this CPU can (mtp.packed)


# ---- prompts ----------------------------------------------------------------------------------------------


def _first_user(messages: list[dict]) -> str | None:
    for m in messages:
        if m.get("role") in ("user", "human") and str(m.get("content", "")).strip():
            return str(m["content"])
    return None


def prompt_of(row: dict[str, Any]) -> Prompt | None:
    """The prompt of one row: a prompt-like text field, MT-Bench `turns`, or the first user chat turn. A
    prompt field beside a ``context`` list (earlier turns, as `train.prompt_sets --turn second` writes) is
    that conversation's next user turn: the context's messages followed by it."""
    for name in PROMPT_FIELDS:
        if isinstance(row.get(name), str) and row[name].strip():
            if isinstance(row.get("context"), list) and row["context"]:
                return [*row["context"], {"role": "user", "content": row[name]}]
            return row[name]
    if isinstance(row.get("turns"), list) and row["turns"]:
        return str(row["turns"][0])
    if isinstance(row.get("messages"), list):
        return _first_user(row["messages"])
    if isinstance(row.get("conversations"), list):
        from .sharegpt import to_messages

        return _first_user(to_messages(row))
    return None


def read_prompts(data: str, limit: int | None = None) -> list[Prompt]:
    """Prompts from "sharegpt", a ShareGPT .json array, .jsonl/.json rows, .txt lines, or a dataset dir."""
    from .data import _is_json_array_of_conversations, _is_saved_dataset

    if data == "sharegpt" or _is_json_array_of_conversations(Path(data)):
        from .sharegpt import first_user_turns, read_sharegpt

        records, _ = read_sharegpt(None if data == "sharegpt" else data, limit=None if limit is None else 4 * limit)
        prompts = first_user_turns(records)
        return prompts[:limit] if limit is not None else prompts
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"prompt data not found: {data}")
    if path.is_dir() and _is_saved_dataset(path):
        from datasets import load_from_disk

        rows: Any = load_from_disk(str(path))
    elif path.suffix.lower() in (".jsonl", ".json"):
        text = path.read_text()
        is_array = text.lstrip().startswith("[")
        rows = json.loads(text) if is_array else [json.loads(x) for x in text.splitlines() if x.strip()]
    elif path.suffix.lower() == ".parquet":
        from datasets import load_dataset

        rows = load_dataset("parquet", data_files=[str(path)], split="train")
    else:
        return [line for line in path.read_text().splitlines() if line.strip()][:limit]
    prompts = []
    for row in rows:
        p = prompt_of(row)
        if p is not None:
            prompts.append(p)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{data}: no prompts found (fields tried: {PROMPT_FIELDS}, turns, messages, conversations)")
    return prompts


# ---- resumable output -------------------------------------------------------------------------------------------


def finished_shards(out: Path) -> list[Path]:
    from .data import _is_saved_dataset

    return sorted(p for p in out.glob("shard-*") if p.is_dir() and _is_saved_dataset(p))


def done_prompt_ids(out: Path) -> set[int]:
    """Prompts in finished shards, plus those skipped as too long (recorded so reruns do not retry them)."""
    from datasets import load_from_disk

    skipped = out / SKIPPED_NAME
    done: set[int] = set(json.loads(skipped.read_text())) if skipped.is_file() else set()
    for shard in finished_shards(out):
        done.update(int(i) for i in load_from_disk(str(shard))["prompt_id"])
    return done


def load_distilled(out: str | Path) -> Any:
    """All finished shards as one `datasets.Dataset`."""
    from .data import _load_disk

    return _load_disk(Path(out))


def _write_shard(out: Path, rows: list[dict]) -> Path:
    from datasets import Dataset

    index = len(finished_shards(out))
    final = out / f"shard-{index:05d}"
    tmp = out / f".tmp-shard-{index:05d}-{os.getpid()}"
    Dataset.from_list(rows).save_to_disk(str(tmp))
    if final.exists():  # an unfinished leftover of the same name (no dataset files): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _check_info(out: Path, opts: DistillOptions, model_path: Path) -> None:
    """Refuse to mix answers of two different models (or settings) in one output folder."""
    info = {"model": str(model_path), "data": opts.data, "sample": opts.sample, "max_new_tokens": opts.max_new_tokens,
            "temperature": opts.temperature if opts.sample else None, "dtype": opts.dtype}  # fmt: skip
    path = out / INFO_NAME
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in info.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{out} was written with other settings {diff}; use a new --out to change them")
    else:
        path.write_text(json.dumps({**info, "options": {k: str(v) for k, v in asdict(opts).items()}}, indent=2))


# ---- generation ---------------------------------------------------------------------------------------------------


def _messages(prompt: Prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _template(tokenizer: Any, prompt: Prompt) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(_messages(prompt), add_generation_prompt=True, return_dict=True)
        return list(enc["input_ids"])
    if not isinstance(prompt, str):
        raise ValueError("a prompt with context needs a tokenizer with a chat template")
    return list(tokenizer(prompt)["input_ids"])


def _sampling_kwargs(opts: DistillOptions) -> dict[str, Any]:
    """The sampling settings both engines get; greedy passes None for each, so that generate() neither applies
    nor warns about the sampling defaults of the model's generation_config."""
    if not opts.sample:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": opts.temperature, "top_p": opts.top_p, "top_k": 0}


def generate_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]], opts: DistillOptions, seed: int
) -> list[list[int]]:
    """Left-pad, generate, and cut each answer after its first end-of-sequence token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    eos = model.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    kwargs = {**_sampling_kwargs(opts), "max_new_tokens": opts.max_new_tokens, "pad_token_id": pad}
    if opts.sample:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kwargs)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
        answers.append(row[:cut])
    return answers


def generate_continuous(
    model: Any, prompts: dict[int, list[int]], opts: DistillOptions, on_done: Callable[[int], None] | None = None
) -> dict[int, list[int]]:
    """Answer every prompt by continuous batching; returns {prompt id: answer ids, cut after EOS}.

    Why not `generate()`: a left-padded batch prefills every prompt at its batch's longest length and keeps
    every row decoding until the longest answer ends; here a row leaves when its answer ends and the next
    prompt takes its place. Rows decode plainly (no drafting: batched fp32 speculation measured slower than
    plain here, and distillation usually runs before there are heads), so greedy answers are the model's own
    `generate()` answers. A sampled prompt draws from its own generator seeded with `seed + prompt id`: the
    same answer whatever else shares its batch.
    """
    from mtp.batching import BatchDecoder
    from mtp.cli import _pack_decoding
    from mtp.model import MTPModel

    # the engine drives an MTPModel; its one Medusa head (a d x d block, the projection shared) is never run
    mtp_model = MTPModel.from_base(model, num_heads=1)
    # fp32, 2 AVX2 cores, 64 rows: the forward's matmuls ~130 ms from packed weights against ~157 ms
    _pack_decoding(mtp_model, opts.pack)
    engine = BatchDecoder(mtp_model, max_batch_size=opts.batch_size, guard=False)
    kwargs = _sampling_kwargs(opts)
    ids: dict[int, int] = {}
    for i, prompt in prompts.items():
        generator = torch.Generator(device=model.device).manual_seed(opts.seed + i) if opts.sample else None
        ids[engine.add(prompt, opts.max_new_tokens, speculative=False, generator=generator, **kwargs)] = i
    answers: dict[int, list[int]] = {i: [] for i in prompts}
    while engine.has_work:
        for update in engine.step():
            answers[ids[update.request_id]].extend(update.tokens)
            if update.finished and on_done is not None:
                on_done(len(answers[ids[update.request_id]]))
    return answers


def answer_prompts(
    model: Any,
    tokenizer: Any,
    prompts: dict[int, list[int]],
    opts: DistillOptions,
    on_done: Callable[[int], None] | None = None,
) -> dict[int, list[int]]:
    """{prompt id: answer ids, cut after EOS} by `opts.engine`; `on_done(answer tokens)` as each answer ends.
    "generate" batches the prompts in their given order (callers sort them by length: less padding)."""
    if opts.engine == "batched":
        return generate_continuous(model, prompts, opts, on_done)
    ids, answers = list(prompts), {}
    for b in range(0, len(ids), opts.batch_size):
        batch = ids[b : b + opts.batch_size]
        got = generate_batch(model, tokenizer, [prompts[i] for i in batch], opts, opts.seed + batch[0])
        for i, ans in zip(batch, got, strict=True):
            answers[i] = ans
            if on_done is not None:
                on_done(len(ans))
    return answers


def distill(opts: DistillOptions) -> Path:
    """Generate answers for every prompt not yet in `opts.out`; returns the output directory."""
    if opts.engine not in ENGINES:
        raise ValueError(f"unknown engine {opts.engine!r}: {' or '.join(ENGINES)}")
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .precision import DTYPES, dtype_name
    from .trainer import resolve_model_path

    # resolved before it is recorded: a rerun on another CPU must not mix fp32 and bf16 answers unnoticed
    opts = replace(opts, dtype=dtype_name(opts.dtype))
    model_path = resolve_model_path(opts.model)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_info(out, opts, model_path)
    prompts = read_prompts(opts.data, opts.limit)
    done = done_prompt_ids(out)
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        print(f"all {len(prompts)} prompts already distilled in {out}")
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=DTYPES[opts.dtype]).eval()
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", initial=0)
    new_tokens, t0, skipped = 0, time.perf_counter(), 0

    def progress(answer_tokens: int) -> None:
        nonlocal new_tokens
        new_tokens += answer_tokens
        bar.update(1)
        bar.set_postfix({"tok/s": f"{new_tokens / (time.perf_counter() - t0):.0f}"}, refresh=False)

    for s in range(0, len(todo), opts.shard_size):
        shard_ids = todo[s : s + opts.shard_size]
        encoded = {i: _template(tokenizer, prompts[i]) for i in shard_ids}
        keep = [i for i in shard_ids if len(encoded[i]) <= opts.max_prompt_tokens]
        skipped += len(shard_ids) - len(keep)
        keep.sort(key=lambda i: len(encoded[i]))  # similar lengths per batch: less padding
        answers = answer_prompts(model, tokenizer, {i: encoded[i] for i in keep}, opts, on_done=progress)
        rows = []
        for i in keep:
            ans = answers[i]
            text = tokenizer.decode(ans, skip_special_tokens=True)
            rows.append({"prompt_id": i, "input_ids": encoded[i] + ans, "prompt_len": len(encoded[i]),
                         "messages": [*_messages(prompts[i]), {"role": "assistant", "content": text}]})  # fmt: skip
        bar.update(len(shard_ids) - len(keep))
        if rows:
            _write_shard(out, sorted(rows, key=lambda r: r["prompt_id"]))
        too_long = sorted(set(shard_ids) - set(keep))
        if too_long:
            path = out / SKIPPED_NAME
            old = json.loads(path.read_text()) if path.is_file() else []
            path.write_text(json.dumps(sorted(set(old) | set(too_long))))
    bar.close()
    note = f"; skipped {skipped} prompts longer than {opts.max_prompt_tokens} tokens" if skipped else ""
    print(f"distilled {len(todo) - skipped} prompts ({new_tokens} tokens) into {out}{note}")
    return out
