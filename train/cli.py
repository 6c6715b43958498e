"""`mtp train`, `mtp distill` and `mtp export`: registered into the main `mtp` app by `register(app)`.

Heavy libraries (torch, transformers, datasets, peft) are imported inside the commands so `mtp --help`
stays instant. User mistakes (bad config key, missing file, wrong tokenizer) end with one `error:` line
and exit code 2, not a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, ModuleNotFoundError, OSError)


def _error(message: str) -> int:
    rank = __import__("os").environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    return 2


def run_training(config: str | Path, overrides: list[str] | None = None, resume: str | None = None) -> int:
    """Load + validate the config, then train. Returns the process exit code (shared by CLI and run.py)."""
    from .config import ConfigError, load_config
    from .data import DataError

    try:
        cfg = load_config(config, list(overrides or []) + ([f"train.resume={resume}"] if resume else []))
    except ConfigError as e:
        return _error(str(e))
    from .trainer import train

    try:
        train(cfg)
    except (ConfigError, DataError, FileNotFoundError) as e:
        return _error(str(e))
    return 0


def train_command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML training config (see configs/)."),
    override: list[str] = typer.Option(None, "--override", "-o", help="key.path=value, repeatable."),
    resume: str = typer.Option(None, help="auto | always | never (default: the config's train.resume)."),
) -> None:
    """Train Medusa heads (Medusa-1: frozen backbone; Medusa-2: + LoRA). Multi-GPU: see train/run.py."""
    code = run_training(config, override or [], resume)
    if code:
        raise typer.Exit(code=code)


def distill_command(
    model: str = typer.Option("default", "--model", "-m", help="HF checkpoint dir or 'default'."),
    data: str = typer.Option(..., "--data", "-d", help="Prompts: .jsonl/.json/.txt/dataset dir, or 'sharegpt'."),
    out: Path = typer.Option(..., "--out", help="Output directory (a datasets dataset in shard-* folders)."),
    max_new_tokens: int = typer.Option(256, help="Tokens generated per prompt."),
    batch_size: int = typer.Option(32, help="Prompts decoded together."),
    limit: int = typer.Option(None, help="Use at most this many prompts."),
    sample: bool = typer.Option(False, "--sample/--greedy", help="Sample (temperature/top-p) or greedy."),
    temperature: float = typer.Option(0.7, help="With --sample."),
    top_p: float = typer.Option(0.95, help="With --sample."),
    dtype: str = typer.Option(
        "auto", help="auto | float32 | bfloat16. auto: bf16 where the CPU multiplies bf16 in hardware, else fp32."
    ),
    shard_size: int = typer.Option(64, help="Prompts per saved shard (the unit of resumption)."),
    max_prompt_tokens: int = typer.Option(512, help="Skip prompts longer than this after templating."),
    seed: int = typer.Option(0, help="Sampling seed."),
    engine: str = typer.Option(
        "batched",
        help="batched: continuous batching, a finished answer's row goes to the next prompt (~1.4x faster); "
        "generate: the model's own generate() over left-padded batches.",
    ),
    pack: bool = typer.Option(
        True, "--pack/--no-pack", help="batched engine: decode from weights prepacked for the CPU's matmul kernels."
    ),
) -> None:
    """Generate self-distillation data: the model's own answers to dataset prompts (resumable)."""
    from .distill import DistillOptions, distill

    opts = DistillOptions(
        model=model, data=data, out=out, max_new_tokens=max_new_tokens, batch_size=batch_size, limit=limit,
        sample=sample, temperature=temperature, top_p=top_p, dtype=dtype, shard_size=shard_size,
        max_prompt_tokens=max_prompt_tokens, seed=seed, engine=engine, pack=pack,
    )  # fmt: skip
    try:
        distill(opts)
    except USER_ERRORS as e:
        raise typer.Exit(code=_error(str(e))) from e


def export_command(
    source: Path = typer.Argument(..., help="Training output dir or checkpoint-N dir."),
    out: Path = typer.Option(..., "--out", help="Where to write the MTP checkpoint."),
    merge_lora: bool = typer.Option(False, "--merge-lora", help="Merge a Medusa-2 LoRA adapter into the base."),
    heads_only: bool = typer.Option(False, "--heads-only", help="Write heads + config only (Medusa-1)."),
    dtype: str = typer.Option("float32", help="dtype of the written base weights."),
    draft_vocab: int = typer.Option(0, help="Draft only from the N most frequent tokens of --draft-data (0: all)."),
    draft_data: Path = typer.Option(None, help="mtp distill output whose answers --draft-vocab counts."),
    assistant: bool = typer.Option(
        False, "--assistant", help="The run trained a draft model (head_type draft_lm): write a plain HF checkpoint."
    ),
    to: str = typer.Option(
        "mtp",
        "--to",
        help="mtp (our layout) | vllm (a model dir vLLM serves; see docs/vllm.md). SOURCE may also "
        "be an MTP checkpoint dir, e.g. mtp/assets/smollm2-135m-instruct-heads.",
    ),
) -> None:
    """Write a servable MTP checkpoint (MTPModel.from_pretrained) from a training run, or a vLLM one (--to vllm)."""
    from .export import export

    try:
        path = export(
            source, out, merge_lora=merge_lora, heads_only=heads_only, dtype=dtype,
            draft_vocab=draft_vocab, draft_data=draft_data, assistant=assistant, to=to,
        )  # fmt: skip
    except USER_ERRORS as e:
        raise typer.Exit(code=_error(str(e))) from e
    typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("distill")(distill_command)
    app.command("export")(export_command)
