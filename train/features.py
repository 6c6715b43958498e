"""Offline features: run the frozen base once over the training text and store what a drafter learns from.

Why: a drafter that reads the base's hidden states (EAGLE) needs the backbone only as a feature extractor.
Re-running a 30-layer backbone in every training step of a one-layer drafter spends most of a CPU's time
on the backbone; computing its features once turns every further epoch into drafter-only work.

Per packed block (``data.block_size`` tokens, `train.data.prepare_data`, assistant-token masks) the cache
stores, as a `datasets` dataset (``eval/`` then ``train/``, in ``shard-NNNNN`` folders; a rerun skips finished
shards, so a killed job loses at most one shard, and a drafter can train on the finished shards of a cache
whose ``features_info.json`` still says ``"complete": false``):

  input_ids  (T,) int32       the tokens
  loss_mask  (T,) uint8       1 where the token is a training target (assistant text)
  aux        (T, n*d) float16 the inputs of the drafter's feature layers, concatenated (EAGLE-3 fusion)
  final      (T, d) float16   the base's final normalised hidden state: the teacher's logits over any
                              draft vocabulary are exactly ``final @ lm_head[draft_ids].T``
  target     (T,) int32       the teacher's greedy next token (argmax over the full vocabulary)

Storing ``final`` instead of top-k probabilities keeps the targets exact over the whole draft vocabulary
at 2·d bytes per token (1.2 KB for SmolLM2, less than a top-64 list of ids and probabilities). The draft
vocabulary (the most frequent target tokens) is chosen here and written to ``draft_vocab.json``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

INFO = "features_info.json"
VOCAB = "draft_vocab.json"


@dataclass
class FeatureOptions:
    model: str = "default"
    data: list[str] = field(default_factory=lambda: ["sharegpt"])
    out: Path = Path("runs/features")
    max_documents: int | None = None
    # compute only the first N train blocks (a prefix of the full cache: the same shards, the same draft
    # vocabulary, counted over every block), to stop a cache at a chosen size reproducibly
    max_train_blocks: int | None = None
    block_size: int = 512
    eval_fraction: float = 0.04
    eval_max_blocks: int = 48
    feature_layers: list[int] | None = None
    draft_vocab_size: int = 8192
    batch_size: int = 4
    shard_blocks: int = 32
    dtype: str = "auto"  # auto: bf16 where the CPU has bf16 matmul units, else fp32 (train.precision)
    seed: int = 0


def load_base(model: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The base model (eval mode) and its tokenizer; ``default`` is the embedded SmolLM2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "default":
        from mtp.default_model import default_model_dir

        path = str(default_model_dir())
    else:
        path = model
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    base.requires_grad_(False)
    return base, AutoTokenizer.from_pretrained(path)


def _shards(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("shard-*") if p.is_dir() and not p.name.endswith(".tmp"))


COLUMNS = ("input_ids", "loss_mask", "aux", "final", "target")


def _tensors(table: dict[str, Any], columns: Sequence[str]) -> dict[str, torch.Tensor]:
    """numpy columns as the trainers' tensors: token ids long, masks bool, features as stored."""
    cols = {name: torch.from_numpy(table[name]) for name in columns}
    for name in ("input_ids", "target"):
        if name in cols:
            cols[name] = cols[name].long()
    if "loss_mask" in cols:
        cols["loss_mask"] = cols["loss_mask"].bool()
    return cols


def _open_split(directory: Path | Sequence[Path], columns: Sequence[str]) -> Any:
    """One split's finished shards, of one cache or of several (concatenated in the order given)."""
    from datasets import concatenate_datasets, load_from_disk

    shards = []
    for d in [directory] if isinstance(directory, (str, Path)) else directory:
        found = _shards(Path(d))
        if not found:
            raise FileNotFoundError(f"no feature shards in {d}: run `python -m mtp.train.features` first")
        shards += found
    return concatenate_datasets([load_from_disk(str(p)) for p in shards]).select_columns(list(columns))


def load_split(directory: Path | Sequence[Path], columns: tuple[str, ...] = COLUMNS) -> dict[str, torch.Tensor]:
    """The finished shards of one split (of one cache, or of several one after another) as in-memory tensors
    (fp16 features stay fp16).

    columns: what to read; MTP modules need only ``final`` (a quarter of the bytes of ``aux`` + ``final``)."""
    return _tensors(_open_split(directory, columns).with_format("numpy")[:], columns)


class FeatureRows:
    """The finished shards of one split, read a few blocks at a time from their memory-mapped Arrow files.

    Why: the drafter reads ``aux`` (three layers' inputs) for every token, 4.7 KB per token in fp16; loaded
    whole, a 1M-token cache took 18 GB of a 24 GB machine, so a bigger cache could not train at all. Arrow
    files are memory-mapped (`datasets`), so a step pages in only its own blocks (about 50 ms for 4 blocks of
    512 tokens, against seconds of drafter compute) and the OS keeps what fits in its page cache. Features come
    back as fp32: the drafter casts them to fp32 anyway, so the values are the same as from `load_split`."""

    def __init__(self, directory: Path | Sequence[Path], columns: tuple[str, ...] = COLUMNS) -> None:
        self.columns = columns
        self._ds = _open_split(directory, columns).with_format("numpy")
        self.block_size = self._ds.features["input_ids"].length  # from the schema: no block read for it

    def __len__(self) -> int:
        return len(self._ds)

    def rows(self, index: Sequence[int]) -> dict[str, torch.Tensor]:
        """The blocks at `index`, in that order, as tensors (the same kinds as `load_split`'s)."""
        return _tensors(self._ds[list(index)], self.columns)


def note_if_incomplete(directory: Path, info: dict[str, Any], used_blocks: int) -> None:
    """Say so when a trainer reads a cache whose computation has not finished (`"complete": false`)."""
    if not info.get("complete", True):
        print(f"{directory} is still being computed: training on its {used_blocks} finished of "
              f"{info['train_blocks']} blocks")  # fmt: skip


def _check_cache(directory: Path, info: dict[str, Any], held: dict[str, torch.Tensor], base: Any) -> None:
    """Refuse a cache of another base: its first held-out block, recomputed, must match (see below)."""
    d = base.config.hidden_size
    if held["final"].shape[-1] != d:
        raise ValueError(f"{directory}: cached hidden size {held['final'].shape[-1]}, this base's {d}")
    x = held["input_ids"][:1]
    ref = base(input_ids=x, output_hidden_states=True).hidden_states[-1].float()
    rel = float((held["final"][:1].float() - ref).norm() / ref.norm().clamp(min=1e-12))
    if rel > 0.05:
        raise ValueError(
            f"{directory} was computed by another model: its hidden states differ from this base's by {rel:.0%} "
            f"on the first held-out block (model {info['options']['model']!r} in {INFO})"
        )


@torch.no_grad()
def packed_from_features(
    directories: Path | str | Sequence[Path | str], base: Any, eval_max_blocks: int | None = None
) -> Any:
    """One or more feature caches as the Medusa/MTP trainer's data: blocks, loss masks, final hidden states.

    Several caches (e.g. a large mixed one and a newer one of the model's own answers) train together
    without recomputing the first: their train blocks are concatenated, and the held-out blocks are shared
    evenly among them (``eval_max_blocks // n`` each, the first taking the remainder), so the trainer's
    evaluation reports on every kind of data it trains on.

    Why a check: the cached states stand in for the backbone in every step, so a cache of another base (or
    another fine-tune of it) would train heads for a model they never run on. The first held-out block of
    each cache is recomputed with `base` and must match the cache (relative error below 5%; on SmolLM2 the
    bf16 base reproduces its bf16 cache exactly, and the fp32 base differs from it by 1.6%)."""
    from .data import PackedData

    dirs = [Path(directories)] if isinstance(directories, (str, Path)) else [Path(d) for d in directories]
    if not dirs:
        raise ValueError("no feature cache given")
    cols = ("input_ids", "loss_mask", "final")
    trains, helds, documents = [], [], 0
    for i, directory in enumerate(dirs):
        if not (directory / INFO).is_file():
            raise FileNotFoundError(f"{directory}: no {INFO}; build a cache with `python -m mtp.train.features`")
        info = json.loads((directory / INFO).read_text())
        train, held = load_split(directory / "train", cols), load_split(directory / "eval", cols)
        if eval_max_blocks is not None:
            share = eval_max_blocks // len(dirs) + (eval_max_blocks % len(dirs) if i == 0 else 0)
            held = {k: v[:share] for k, v in held.items()}
        _check_cache(directory, info, held, base)
        if trains and train["input_ids"].shape[1] != trains[0]["input_ids"].shape[1]:
            raise ValueError(
                f"{directory}: blocks of {train['input_ids'].shape[1]} tokens, {dirs[0]}: "
                f"{trains[0]['input_ids'].shape[1]}; caches trained together need one block size"
            )
        note_if_incomplete(directory, info, len(train["input_ids"]))
        trains.append(train)
        helds.append(held)
        documents += int(info["documents"])

    def cat(splits: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
        return splits[0][name] if len(splits) == 1 else torch.cat([s[name] for s in splits])

    return PackedData(
        cat(trains, "input_ids"), cat(trains, "loss_mask"), cat(helds, "input_ids"), cat(helds, "loss_mask"),
        num_documents=documents, train_hidden=cat(trains, "final"), eval_hidden=cat(helds, "final"),
    )  # fmt: skip


@torch.no_grad()
def _write_split(
    base: Any,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    layers: tuple[int, ...],
    out: Path,
    opts: FeatureOptions,
    bar: Any,
) -> int:
    import numpy as np
    from datasets import Array2D, Dataset, Features, Sequence, Value

    from mtp.eagle import select_features

    out.mkdir(parents=True, exist_ok=True)
    N, T = ids.shape
    d = base.config.hidden_size
    n = len(layers)
    feats = Features(
        {
            "input_ids": Sequence(Value("int32"), length=T),
            "loss_mask": Sequence(Value("uint8"), length=T),
            "aux": Array2D(shape=(T, n * d), dtype="float16"),
            "final": Array2D(shape=(T, d), dtype="float16"),
            "target": Sequence(Value("int32"), length=T),
        }
    )
    done = {p.name for p in _shards(out)}
    tokens = 0
    for s, lo in enumerate(range(0, N, opts.shard_blocks)):
        hi = min(N, lo + opts.shard_blocks)
        name = f"shard-{s:05d}"
        if name in done:
            bar.update(hi - lo)
            continue
        cols: dict[str, list] = {k: [] for k in feats}
        for b in range(lo, hi, opts.batch_size):
            e = min(hi, b + opts.batch_size)
            x = ids[b:e]
            o = base(input_ids=x, output_hidden_states=True)
            aux = select_features(o.hidden_states, layers)
            cols["input_ids"] += list(x.to(torch.int32).numpy())
            m = mask[b:e] if mask is not None else torch.ones_like(x, dtype=torch.bool)
            cols["loss_mask"] += list(m.to(torch.uint8).numpy())
            cols["aux"] += list(aux.to(torch.float16).numpy())
            cols["final"] += list(o.hidden_states[-1].to(torch.float16).numpy())
            cols["target"] += list(o.logits.argmax(-1).to(torch.int32).numpy())
            tokens += x.numel()
            bar.update(e - b)
        tmp = out / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        Dataset.from_dict({k: [np.asarray(v) for v in vals] for k, vals in cols.items()}, features=feats).save_to_disk(
            str(tmp)
        )
        tmp.rename(out / name)
    return tokens


def cache_features(opts: FeatureOptions) -> dict[str, Any]:
    """Compute (or finish computing) the feature cache described in the module docstring."""
    from tqdm.auto import tqdm

    from mtp.draft_vocab import frequent_tokens
    from mtp.eagle import default_feature_layers
    from mtp.mtp_modules import decoder_layers

    from .config import DataSection
    from .data import prepare_data
    from .precision import resolve_dtype

    dtype = resolve_dtype(opts.dtype)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = load_base(opts.model, dtype)
    layers = tuple(opts.feature_layers or default_feature_layers(len(decoder_layers(base))))
    section = DataSection(
        path=list(opts.data),
        block_size=opts.block_size,
        loss_on="assistant",
        eval_fraction=opts.eval_fraction,
        eval_max_blocks=opts.eval_max_blocks,
        max_documents=opts.max_documents,
    )
    t0 = time.time()
    packed = prepare_data(section, tokenizer, base.config.vocab_size, opts.seed)
    prep_s = time.time() - t0
    train_mask = (
        packed.train_mask if packed.train_mask is not None else torch.ones_like(packed.train_ids, dtype=torch.bool)
    )
    targets = [row[m[1:]].tolist() for row, m in zip(packed.train_ids[:, 1:], train_mask, strict=True)]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = frequent_tokens(targets, opts.draft_vocab_size, base.config.vocab_size, always=eos)
    (out / VOCAB).write_text(json.dumps(vocab.tolist()))
    available = int(packed.train_ids.shape[0])
    train_ids, train_mask_kept = packed.train_ids, packed.train_mask
    if opts.max_train_blocks is not None:
        if opts.max_train_blocks < 1:
            raise ValueError(f"--max-train-blocks must be >= 1, got {opts.max_train_blocks}")
        train_ids = train_ids[: opts.max_train_blocks]
        train_mask_kept = None if train_mask_kept is None else train_mask_kept[: opts.max_train_blocks]
    info = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "feature_layers": list(layers),
        "train_blocks": int(train_ids.shape[0]),
        "train_blocks_available": available,
        "eval_blocks": int(packed.eval_ids.shape[0]),
        "train_target_tokens": int(train_mask[: train_ids.shape[0]].sum()),
        "documents": packed.num_documents,
        "prepare_seconds": round(prep_s, 1),
        "draft_vocab_size": int(vocab.numel()),
        "complete": False,
    }
    # Written before the first block and completed at the end: the eval split comes first and the info file
    # exists from the start, so a drafter can train on the shards finished so far while (or instead of)
    # computing the rest; a rerun of the same command then finishes the cache.
    (out / INFO).write_text(json.dumps(info, indent=2))
    t1 = time.time()
    total = train_ids.shape[0] + packed.eval_ids.shape[0]
    with tqdm(total=total, desc="features", unit="block") as bar:
        n_eval = _write_split(base, packed.eval_ids, packed.eval_mask, layers, out / "eval", opts, bar)
        n_train = _write_split(base, train_ids, train_mask_kept, layers, out / "train", opts, bar)
    info.update(
        complete=True,
        tokens_computed=n_train + n_eval,
        feature_seconds=round(time.time() - t1, 1),
        bytes=sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
    )
    (out / INFO).write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Cache a frozen base's features and targets for drafter training.")
    p.add_argument("--model", default="default")
    p.add_argument("--data", nargs="+", default=["sharegpt"], help="train.data sources (distill dirs, sharegpt, ...)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--max-train-blocks", type=int, default=None, help="compute only the first N train blocks")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--feature-layers", type=int, nargs="+", default=None)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-fraction", type=float, default=0.04)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the base's dtype; auto: bf16 where the CPU multiplies bf16 in hardware, else fp32",
    )
    a = p.parse_args(argv)
    info = cache_features(
        FeatureOptions(
            model=a.model,
            data=a.data,
            out=Path(a.out),
            max_documents=a.max_documents,
            max_train_blocks=a.max_train_blocks,
            block_size=a.block_size,
            feature_layers=a.feature_layers,
            draft_vocab_size=a.draft_vocab_size,
            batch_size=a.batch_size,
            eval_fraction=a.eval_fraction,
            dtype=a.dtype,
        )
    )
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
