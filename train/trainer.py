"""The training loop for Medusa-1 / Medusa-2 heads: single process, torchrun (DDP) or DeepSpeed.

Read top to bottom: `train(cfg)` loads the model and data, builds heads (and LoRA), restores a checkpoint
if there is one, then runs `train_step` until `max_steps`, evaluating and checkpointing on the way, and
finally writes the trained heads with their measured accuracies. Launchers only differ in how the
process group is formed (see `distributed.py`) and, for DeepSpeed, in who owns the optimizer step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtp.model import MTPModel

from . import distributed as D
from .checkpointing import (
    TrainerState,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_trainables,
    zero3_gather,
)
from .config import Config, ConfigError, save_config
from .data import BatchPlan, PackedData, prepare_data
from .evaluation import EvalResult, evaluate, format_table, print_table, save_eval
from .objective import MTPTrainModule
from .precision import DTYPES
from .tracking import Tracker, require_wandb

# ---- model ----------------------------------------------------------------------------------------------


def resolve_model_path(spec: str) -> Path:
    """`default` -> the embedded SmolLM2-135M-Instruct (converted once); else a local HF checkpoint dir."""
    if spec == "default":
        from mtp.default_model import default_model_dir

        return default_model_dir().resolve()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"config key 'model.path': no Hugging Face checkpoint (config.json) at {path}")
    return path.resolve()


def load_backbone(cfg: Config, env: D.DistEnv) -> tuple[nn.Module, Any, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtp.packed import bf16_matmul_units

    path = resolve_model_path(cfg.model.path)
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.model.dtype]}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    base = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(env.device).eval()
    if cfg.model.dtype == "bfloat16" and torch.device(env.device).type == "cpu" and not bf16_matmul_units():
        import warnings

        warnings.warn(
            "model.dtype bfloat16 on a CPU without bf16 matmul units (AVX512-BF16 or AMX): bf16 is emulated here "
            "and the backbone runs several times slower than in float32 (-o model.dtype=float32)",
            stacklevel=2,
        )
    tok_path = Path(cfg.model.tokenizer).expanduser() if cfg.model.tokenizer else path
    if not tok_path.exists():
        raise ConfigError(f"config key 'model.tokenizer': tokenizer directory not found: {tok_path}")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_path))
    check_tokenizer(tokenizer, base)
    return base, tokenizer, path


def check_tokenizer(tokenizer: Any, base: nn.Module) -> None:
    """A tokenizer with ids the model has no embedding for is the wrong tokenizer: stop before training."""
    vocab = base.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"tokenizer/model vocabulary mismatch: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocabulary is {vocab}; use the tokenizer that belongs to this model (model.tokenizer)"
        )


def build_model(cfg: Config, base: nn.Module, base_path: Path) -> tuple[MTPModel, Any]:
    """Heads on the base (fp32 master weights), and in Medusa-2 LoRA adapters injected into the base."""
    h = cfg.heads
    mtp_model = MTPModel.from_base(
        base, num_heads=h.num_heads, head_type=h.head_type, num_layers=h.num_layers, own_lm_head=h.own_lm_head,
        **h.extra,
    )  # fmt: skip
    if h.init_from:
        _warm_start(mtp_model.heads, base, Path(h.init_from))
    mtp_model.heads.float()
    # "default" stays a sentinel (resolved at load time), so heads for the embedded model load on any machine
    mtp_model.config.base_model_name_or_path = "default" if cfg.model.path == "default" else str(base_path)
    for p in base.parameters():
        p.requires_grad_(False)
    peft_model = None
    if cfg.mode == "medusa2":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
        )  # fmt: skip
        peft_model = get_peft_model(base, lora)  # injects LoRA layers into `base` in place
    return mtp_model, peft_model


def read_draft_vocab(source: Path) -> torch.Tensor:
    """Token ids from a draft_vocab.json file, a dir with one (a feature cache), or a heads dir whose
    checkpoint carries a draft vocabulary (`mtp export --draft-vocab`, the shipped heads)."""
    import json

    from mtp.checkpoint import load_heads_state

    from .features import VOCAB

    if source.is_file():
        return torch.tensor(json.loads(source.read_text()), dtype=torch.long)
    if (source / VOCAB).is_file():
        return read_draft_vocab(source / VOCAB)
    try:
        _, _, ids = load_heads_state(source)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"config key 'loss.draft_vocab': {e}") from e
    if ids is None:
        raise ConfigError(f"config key 'loss.draft_vocab': the heads in {source} have no draft vocabulary")
    return ids


def _warm_start(heads: nn.Module, base: nn.Module, source: Path) -> None:
    """Continue from trained heads (a longer run on more data) instead of from the base's own weights.

    The same checks as loading for inference: the layout must fit and, when the file records one, the base
    fingerprint must match, since heads trained on another base would start from noise and hide it.
    """
    from mtp.checkpoint import apply_heads_state, load_heads_state

    if not source.is_dir():
        raise ConfigError(f"config key 'heads.init_from': no directory {source}")
    try:
        state, probe, _ = load_heads_state(source)
        apply_heads_state(heads, base, state, probe, source)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"config key 'heads.init_from': {e}") from e


# ---- optimisation -----------------------------------------------------------------------------------------


def build_optimizer(cfg: Config, heads: nn.Module, backbone: nn.Module) -> torch.optim.Optimizer:
    """AdamW with two groups: heads (optim.lr) and the LoRA weights (lora.lr; empty in Medusa-1)."""
    lora_params = [p for p in backbone.parameters() if p.requires_grad]
    groups = [
        {"params": list(heads.parameters()), "lr": cfg.optim.lr, "name": "heads"},
        {"params": lora_params, "lr": cfg.lora.lr, "name": "lora"},
    ]
    groups = [g for g in groups if g["params"]]
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up, then cosine/linear decay to `min_ratio` (or constant). A pure function of step."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1 - min_ratio) * decay


def set_lr(optimizer: Any, cfg: Config, step: int) -> dict[str, float]:
    """Heads follow optim.*; LoRA is off during the heads warm-up, then follows the same shape."""
    lrs = {}
    o = cfg.optim
    for group in optimizer.param_groups:
        if group.get("name") == "lora":
            start = cfg.lora.warmup_heads_steps
            f = 0.0 if step < start else lr_factor(step - start, o_total(cfg) - start, o.warmup_steps, o.schedule,
                                                    o.min_lr_ratio)  # fmt: skip
            group["lr"] = cfg.lora.lr * f
        else:
            group["lr"] = o.lr * lr_factor(step, o_total(cfg), o.warmup_steps, o.schedule, o.min_lr_ratio)
        lrs[group.get("name", "heads")] = group["lr"]
    return lrs


def o_total(cfg: Config) -> int:
    return cfg.train.max_steps


def init_deepspeed(cfg: Config, module: nn.Module, optimizer: torch.optim.Optimizer, env: D.DistEnv) -> Any:
    """Wrap module + our optimizer in a DeepSpeed engine; "auto" entries of the JSON come from our config."""
    import json

    import deepspeed

    ds = json.loads(Path(cfg.deepspeed).read_text())
    if zero_stage(cfg) == 3 and cfg.heads.own_lm_head:
        raise ConfigError("heads.own_lm_head is not supported under ZeRO-3 (sharded trainable vocab projections); "
                          "use ZeRO-2 (configs/ds_zero2.json) or shared heads")  # fmt: skip
    fill = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "train_batch_size": cfg.train.micro_batch_size * cfg.train.grad_accum * env.world_size,
        "gradient_clipping": cfg.optim.grad_clip,
    }
    for key, value in fill.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif ds[key] != value:
            raise ConfigError(
                f"DeepSpeed config {cfg.deepspeed}: {key!r} is {ds[key]} but the training config says {value}"
            )
    for half in ("bf16", "fp16"):
        if isinstance(ds.get(half), dict) and ds[half].get("enabled") == "auto":
            ds[half]["enabled"] = cfg.model.dtype == {"bf16": "bfloat16", "fp16": "float16"}[half]
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError(
            f"{cfg.deepspeed}: remove 'optimizer'/'scheduler'; the trainer supplies AdamW and its lr schedule"
        )
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds)
    return engine


def zero_stage(cfg: Config) -> int:
    import json

    if cfg.deepspeed is None:
        return 0
    return int(json.loads(Path(cfg.deepspeed).read_text()).get("zero_optimization", {}).get("stage", 0))


# ---- one optimizer step ---------------------------------------------------------------------------------------


@dataclass
class StepResult:
    loss: float
    head_ce: list[float]
    base_ce: float
    grad_norm: float


def train_step(
    module: MTPTrainModule,
    optimizer: Any,
    engine: Any,
    data: PackedData,
    plan: BatchPlan,
    cfg: Config,
    env: D.DistEnv,
    step: int,
    trainable: list[nn.Parameter],
) -> StepResult:
    """grad_accum micro-batches, averaged gradients over ranks, clipping, one optimizer update."""
    joint = cfg.mode == "medusa2" and step >= cfg.lora.warmup_heads_steps
    module.backbone.train(joint)  # LoRA dropout only while the backbone trains
    accum = cfg.train.grad_accum
    losses = torch.zeros(2 + module.heads.num_heads, dtype=torch.float64)
    for micro in range(accum):
        idx = plan.indices(step * accum + micro)
        ids = data.train_ids[idx].to(env.device)
        mask = data.train_mask[idx].to(env.device) if data.train_mask is not None else None
        hidden = data.train_hidden[idx].to(env.device) if data.train_hidden is not None else None
        if engine is not None:
            out = engine(ids, mask, joint, hidden)
            engine.backward(out.loss)  # DeepSpeed scales by 1/accum itself
            engine.step()  # applies the update only at the accumulation boundary
        else:
            out = module(ids, mask, joint, hidden)
            (out.loss / accum).backward()
        losses += torch.cat([out.loss.detach().double().cpu().view(1), out.base_ce.double().view(1),
                             out.head_ce.double()]) / accum  # fmt: skip
    grad_norm = float("nan")
    if engine is None:
        D.all_reduce_grads(env, trainable)
        if cfg.optim.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        grad_norm = float(engine.get_global_grad_norm() or float("nan"))
    losses = D.mean_over_ranks(env, losses.to(env.device)).cpu()
    return StepResult(float(losses[0]), [float(x) for x in losses[2:]], float(losses[1]), grad_norm)


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _rss_kb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


class HeapTrimmer:
    """Hands freed heap pages back to the OS once the process has grown `slack_mb` past its last trim.

    Each CPU step allocates and frees hundreds of MB in sizes that vary with the batch's loss mask;
    glibc keeps the freed chunks, fragmented, and the SmolLM2 recipe grew by 100-250 MB per step (24 GiB
    gone in about 100 steps) without holding any more live tensors. Trimming after every step stops that
    but costs ~10% speed (the next step faults its pages in again); trimming only past a slack keeps RSS
    bounded at a fraction of that cost. Forcing those sizes through mmap (MALLOC_MMAP_THRESHOLD_) also
    works but costs ~20%.
    """

    def __init__(self, slack_mb: int = 1024):
        self.slack_kb = slack_mb * 1024
        self.floor_kb: int | None = None
        self.trims = 0

    def __call__(self) -> bool:
        if _TRIM is None:
            return False
        if self.floor_kb is not None and _rss_kb() <= self.floor_kb + self.slack_kb:
            return False
        _TRIM(0)
        self.floor_kb = _rss_kb()
        self.trims += 1
        return True


# ---- the run -------------------------------------------------------------------------------------------------


def train(cfg: Config) -> Path:
    """Run (or continue) the training described by `cfg`; returns the output directory."""
    env = D.setup(use_deepspeed=cfg.deepspeed is not None)
    try:
        return _train(cfg, env)
    finally:
        D.teardown(env)


def _train(cfg: Config, env: D.DistEnv) -> Path:
    require_wandb(cfg)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    out = Path(cfg.train.output_dir)
    resume_from = find_resume_checkpoint(out, cfg.train.resume)
    torch.manual_seed(cfg.train.seed)

    base, tokenizer, base_path = load_backbone(cfg, env)
    if cfg.data.features:  # the frozen backbone's features, computed once: the backbone never runs here
        from .features import packed_from_features

        data = packed_from_features(cfg.data.features, base, cfg.data.eval_max_blocks)  # one cache or a list
    else:
        with D.main_process_first(env):
            data = prepare_data(cfg.data, tokenizer, base.get_output_embeddings().weight.shape[0], cfg.train.seed)
    mtp_model, peft_model = build_model(cfg, base, base_path)
    module = MTPTrainModule(base, mtp_model.heads, cfg.loss, peft_model).to(env.device)
    if cfg.loss.draft_vocab:
        ids = read_draft_vocab(Path(cfg.loss.draft_vocab))
        mtp_model.set_draft_vocab(ids)  # saved with the heads: they will draft from what they trained on
        module.set_draft_vocab(mtp_model.draft_vocab)
    trainable = [p for p in module.parameters() if p.requires_grad]
    D.broadcast_params(env, trainable)
    optimizer = build_optimizer(cfg, mtp_model.heads, base)
    if zero_stage(cfg) == 3:  # before DeepSpeed shards it: a private whole copy of the frozen lm_head
        w, b = module.projection(None)
        module.replicated_lm_head = (w.detach().clone(), None if b is None else b.detach().clone())
    engine = init_deepspeed(cfg, module, optimizer, env) if cfg.deepspeed else None
    step_optimizer = engine.optimizer if engine is not None else optimizer

    state = TrainerState(world_size=env.world_size, num_train_blocks=int(data.train_ids.shape[0]),
                         global_batch=cfg.train.micro_batch_size * cfg.train.grad_accum * env.world_size)  # fmt: skip
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out)
    D.barrier(env)
    if resume_from is not None:
        state = _resume(resume_from, state, env, module, peft_model, optimizer, engine)
    plan = BatchPlan(data.train_ids.shape[0], cfg.train.micro_batch_size, env.world_size, env.rank, cfg.train.seed)
    stop = min(cfg.train.max_steps, cfg.train.stop_after_steps or cfg.train.max_steps)
    tracker = Tracker(cfg, env, out, state.step, cfg.train.max_steps)
    tracker.write(_describe_run(cfg, env, data, trainable, resume_from))

    before = _baseline(cfg, module, data, env, out, state.step)
    block = int(data.train_ids.shape[1])  # a feature cache keeps the block size it was computed with
    step_tokens = cfg.train.micro_batch_size * block * cfg.train.grad_accum * env.world_size
    t_last, tokens_last = time.perf_counter(), state.tokens
    window: list[StepResult] = []  # steps since the last log line
    trim_heap = HeapTrimmer()
    finished_at = cfg.train.max_steps
    while state.step < stop:
        lrs = set_lr(step_optimizer, cfg, state.step)
        t0 = time.perf_counter()
        result = train_step(module, optimizer, engine, data, plan, cfg, env, state.step, trainable)
        trim_heap()
        state.elapsed_s += time.perf_counter() - t0
        state.step += 1
        state.tokens += step_tokens
        tracker.advance()
        window.append(result)
        if state.step % cfg.train.log_every == 0 or state.step == stop:
            now = time.perf_counter()
            tok_s = (state.tokens - tokens_last) / max(now - t_last, 1e-9)
            t_last, tokens_last = now, state.tokens
            summary, window = _average(window), []
            tracker.log(state.step, _metrics(summary, lrs, state, tok_s),
                        show={"loss": f"{summary.loss:.3f}", "tok/s": f"{tok_s:.0f}"})  # fmt: skip
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step < cfg.train.max_steps:
            res = _evaluate(module, data, cfg, env, state.step)
            scores = {f"eval/head{h.head}_top1": h.top1 for h in res.heads}
            scores.update({f"eval/head{h.head}_greedy_top1": h.greedy_top1 for h in res.heads})
            tracker.log(state.step, scores)
            tracker.write(format_table(res, before))
        if cfg.train.max_minutes is not None and _time_up(env, state.elapsed_s, cfg.train.max_minutes):
            stop = finished_at = state.step  # a time-boxed run ends as a finished one
        at_end = state.step == stop
        if (cfg.train.save_every and state.step % cfg.train.save_every == 0) or (at_end and stop < finished_at):
            save_checkpoint(out, state, cfg, env, mtp_model.heads, peft_model, optimizer, engine,
                            keep=cfg.train.save_total_limit)  # fmt: skip
    tracker.close_bar()
    if state.step >= finished_at:
        if finished_at < cfg.train.max_steps:
            tracker.write(f"train.max_minutes={cfg.train.max_minutes} reached at step {state.step}")
        _finish(cfg, env, out, module, mtp_model, peft_model, engine, data, state, before, tracker, tokenizer)
    else:
        tracker.write(f"stopped after step {state.step} of {cfg.train.max_steps} (train.stop_after_steps); "
                      f"run again to resume from {out}/checkpoint-{state.step}")  # fmt: skip
    tracker.close()
    return out


def _time_up(env, elapsed_s: float, max_minutes: float) -> bool:
    """Every rank must stop at the same step: rank 0's clock decides."""
    up = torch.tensor([float(elapsed_s >= max_minutes * 60)])
    if env.world_size > 1:
        up = D.sum_over_ranks(env, up * float(env.rank == 0))
    return bool(up.item() > 0)


def _resume(directory: Path, fresh: TrainerState, env, module, peft_model, optimizer, engine) -> TrainerState:
    state = load_checkpoint(directory, env, module.heads, peft_model, optimizer, engine)
    if (state.global_batch, state.num_train_blocks) != (fresh.global_batch, fresh.num_train_blocks):
        import warnings

        warnings.warn(
            f"resuming {directory} with a different global batch or data ({fresh.global_batch} vs "
            f"{state.global_batch} blocks per step, {fresh.num_train_blocks} vs {state.num_train_blocks} "
            "blocks): the run continues but will not reproduce an uninterrupted one",
            stacklevel=2,
        )
    state.world_size, state.global_batch = fresh.world_size, fresh.global_batch
    return state


def _evaluate(module, data: PackedData, cfg: Config, env: D.DistEnv, step: int) -> EvalResult:
    res = evaluate(module, data.eval_ids, data.eval_mask, cfg.train.micro_batch_size, env, cfg.loss.chunk_size,
                   hidden=data.eval_hidden)  # fmt: skip
    res.step = step
    return res


def _baseline(cfg, module, data, env, out: Path, step: int) -> EvalResult | None:
    """Accuracy of the untrained heads, measured once at step 0 and kept for the final table."""
    import json

    path = out / "eval_untrained.json"
    if step == 0 and cfg.train.eval_at_start and data.eval_ids.shape[0]:
        res = _evaluate(module, data, cfg, env, 0)
        if env.is_main:
            save_eval(path, res)
        return res
    if path.is_file():
        raw = json.loads(path.read_text())
        from .evaluation import HeadAccuracy

        raw.pop("untrained", None)
        raw["heads"] = [HeadAccuracy(**h) for h in raw["heads"]]
        return EvalResult(**raw)
    return None


def _finish(cfg, env, out, module, mtp_model, peft_model, engine, data, state, before, tracker, tokenizer) -> None:
    """Final evaluation, the table, and the trained heads written where serving can read them."""
    result = _evaluate(module, data, cfg, env, state.step) if data.eval_ids.shape[0] else None
    params = [p for p in module.parameters() if p.requires_grad]
    state.rank_checksums = D.gather_strings(env, D.params_checksum(params))
    if len(set(state.rank_checksums)) > 1:
        raise RuntimeError(f"ranks ended with different weights: {state.rank_checksums}")
    with zero3_gather(engine, params):  # collective under ZeRO-3; a no-op otherwise
        if not env.is_main:
            return
        if result is not None:
            save_eval(out / "eval_accuracy.json", result, before)
            mtp_model.config.head_accuracies = result.head_accuracies()
            print_table(result, before)
            tracker.summary({f"eval/head{h.head}_top1": h.top1 for h in result.heads})
        if peft_model is None:  # Medusa-1: the output dir is a heads-only MTP checkpoint on the untouched base
            mtp_model.save_pretrained(out, heads_only=True)
            tracker.write(f"heads written to {out} (load with MTPModel.from_pretrained('{out}'))")
        else:  # Medusa-2: heads belong to the adapted backbone; `mtp export --merge-lora` makes it servable
            save_trainables(out, mtp_model.heads, peft_model)
            tracker.write(f"LoRA adapter + heads written to {out}; make a servable checkpoint with:\n"
                          f"  mtp export {out} --merge-lora --out {out}/merged")  # fmt: skip
    state.save(out)


def _describe_run(cfg: Config, env: D.DistEnv, data: PackedData, trainable: list, resume_from: Path | None) -> str:
    n = sum(p.numel() for p in trainable)
    how = f"{env.world_size} process(es), {env.backend or 'single'}" + (", DeepSpeed" if cfg.deepspeed else "")
    resumed = f", resuming from {resume_from}" if resume_from else ""
    return (
        f"{cfg.mode}: {cfg.heads.num_heads} {cfg.heads.head_type} heads, {n / 1e6:.2f}M trainable params, {how}; "
        f"{data.train_ids.shape[0]} train / {data.eval_ids.shape[0]} held-out blocks of {data.train_ids.shape[1]} "
        f"tokens from {data.num_documents} documents{resumed}"
        + (f"; base features from {cfg.data.features}" if cfg.data.features else "")
    )


def _average(window: list[StepResult]) -> StepResult:
    """Mean of the logged quantities over the steps since the last log line (NaN entries skipped)."""

    def mean(values: list[float]) -> float:
        finite = [v for v in values if not math.isnan(v)]
        return sum(finite) / len(finite) if finite else float("nan")

    return StepResult(
        loss=mean([r.loss for r in window]),
        head_ce=[mean([r.head_ce[k] for r in window]) for k in range(len(window[-1].head_ce))],
        base_ce=mean([r.base_ce for r in window]),
        grad_norm=mean([r.grad_norm for r in window]),
    )


def _metrics(result: StepResult, lrs: dict[str, float], state: TrainerState, tok_s: float) -> dict[str, Any]:
    """One metrics.jsonl record: losses averaged over the log interval (null where a value is undefined)."""
    m: dict[str, Any] = {"loss": result.loss, "tokens": state.tokens, "tok_s": round(tok_s, 1)}
    m.update({f"lr_{k}": v for k, v in lrs.items()})
    m.update({f"ce_head{k + 1}": None if math.isnan(v) else v for k, v in enumerate(result.head_ce)})
    if not math.isnan(result.base_ce):
        m["ce_base"] = result.base_ce
    if not math.isnan(result.grad_norm):
        m["grad_norm"] = result.grad_norm
    return m
