"""Training checkpoints: everything needed to continue a killed run exactly where it stopped.

Layout of `output_dir/checkpoint-<step>/`:
  heads.safetensors         trainable head weights (fp32 master copy)
  adapter/                  Medusa-2: the LoRA adapter in peft's format (safetensors)
  optimizer.pt              optimizer state (tensors and numbers only; read back with weights_only=True)
  rng_state_rank<r>.pt      every rank's torch RNG state (LoRA dropout), as tensors
  deepspeed/                under DeepSpeed: the engine's own (partitioned) optimizer state instead
  train_config.json         the resolved config the run used
  trainer_state.json        step, micro-step, tokens seen: written last, so its presence = complete
The lr schedule is a pure function of the step and the data order a pure function of (seed, micro-step)
(see `BatchPlan`), so step + optimizer + RNG state is the whole state. A checkpoint is written into a
hidden temp directory and renamed into place, so a kill during a save never leaves a half checkpoint
that `--resume` would pick up.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mtp.files import share_weights

from .config import Config, ConfigError, save_config
from .distributed import DistEnv, barrier

PREFIX = "checkpoint-"
STATE_NAME = "trainer_state.json"
HEADS_FILE = "heads.safetensors"
ADAPTER_DIR = "adapter"


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # input tokens consumed, all ranks
    elapsed_s: float = 0.0  # training wall time so far (excluding evaluation)
    world_size: int = 1
    global_batch: int = 0  # micro_batch * grad_accum * world_size, in blocks
    num_train_blocks: int = 0
    rank_checksums: list[str] = field(default_factory=list)  # filled at the end: identical on every rank

    def save(self, directory: Path) -> None:
        (directory / STATE_NAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> TrainerState:
        data = json.loads((directory / STATE_NAME).read_text())
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with trainer_state.json), oldest first."""
    found = []
    for p in output_dir.glob(f"{PREFIX}*"):
        suffix = p.name[len(PREFIX) :]
        if p.is_dir() and suffix.isdigit() and (p / STATE_NAME).is_file():
            found.append((int(suffix), p))
    return sorted(found)


def find_resume_checkpoint(output_dir: Path, mode: str) -> Path | None:
    """auto: newest checkpoint if any; always: the newest, or an error; never: none, and refuse to mix runs."""
    checkpoints = list_checkpoints(output_dir)
    if mode == "never":
        if checkpoints:
            raise ConfigError(
                f"{output_dir} already holds checkpoints ({checkpoints[-1][1].name}); resume them "
                "(train.resume: auto) or choose another train.output_dir"
            )
        return None
    if not checkpoints:
        if mode == "always":
            raise ConfigError(f"train.resume is 'always' but {output_dir} has no complete checkpoint")
        return None
    return checkpoints[-1][1]


def zero3_gather(engine: Any, params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    """Under ZeRO-3 parameters are sharded; gather them to read full weights. Elsewhere: nothing to do."""
    if engine is not None and getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def save_trainables(directory: Path, heads: nn.Module, peft_model: Any, engine: Any = None, write: bool = True) -> None:
    """Heads as safetensors (+ the LoRA adapter via peft).

    Under ZeRO-3 every rank must call this (gathering sharded weights is collective); only `write` ranks write.
    """
    params = list(heads.parameters()) + ([p for p in peft_model.parameters() if p.requires_grad] if peft_model else [])
    with zero3_gather(engine, params):
        if not write:
            return
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in heads.state_dict().items()}
        save_file(tensors, str(directory / HEADS_FILE), metadata={"format": "pt"})
        if peft_model is not None:
            peft_model.save_pretrained(str(directory / ADAPTER_DIR))
        share_weights(directory)


def load_trainables(directory: Path, heads: nn.Module, peft_model: Any) -> None:
    state = load_file(str(directory / HEADS_FILE))
    ref = heads.state_dict()
    heads.load_state_dict({k: v.to(ref[k].dtype) for k, v in state.items()})
    if peft_model is not None:
        from peft import set_peft_model_state_dict

        adapter = load_file(str(directory / ADAPTER_DIR / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(peft_model, adapter)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise ValueError(f"adapter in {directory} does not fit this model: unexpected keys {unexpected[:3]}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: Path,
    state: TrainerState,
    cfg: Config,
    env: DistEnv,
    heads: nn.Module,
    peft_model: Any,
    optimizer: torch.optim.Optimizer | None,
    engine: Any = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint-<step> atomically (every rank must call this: RNG states are per rank)."""
    final = output_dir / f"{PREFIX}{state.step}"
    tmp = output_dir / f".tmp-{PREFIX}{state.step}"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    torch.save(_rng_state(), tmp / f"rng_state_rank{env.rank}.pt")
    if engine is not None:  # DeepSpeed saves its partitioned optimizer from every rank
        engine.save_checkpoint(str(tmp), tag="deepspeed", exclude_frozen_parameters=True)
    save_trainables(tmp, heads, peft_model, engine, write=env.is_main)
    if env.is_main:
        if optimizer is not None and engine is None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        save_config(cfg, tmp)
    barrier(env)
    if env.is_main:
        state.save(tmp)  # last: marks the checkpoint complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if keep is not None:
            for _, old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def load_checkpoint(
    directory: Path,
    env: DistEnv,
    heads: nn.Module,
    peft_model: Any,
    optimizer: torch.optim.Optimizer | None,
    engine: Any = None,
) -> TrainerState:
    """Restore weights, optimizer and this rank's RNG; return the trainer state (step, tokens)."""
    state = TrainerState.load(directory)
    if engine is not None:  # the engine restores its (possibly sharded) trainable weights and optimizer
        engine.load_checkpoint(str(directory), tag="deepspeed", load_module_strict=False)
    else:
        load_trainables(directory, heads, peft_model)
    if optimizer is not None and engine is None:
        optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True, map_location="cpu"))
    rng_file = directory / f"rng_state_rank{env.rank}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than the run that saved it
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state
