"""The `mtp` command. Subcommands import their heavy dependencies lazily so `mtp --help` is instant."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from .packed import PACK_HELP, bf16_kernel, unpackable_reason, upcasts

app = typer.Typer(
    help="Multi-token prediction heads and exact self-speculative decoding for Hugging Face causal LMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _parse_tree(tree: str):
    if tree in ("auto", ""):
        return None
    if tree in ("chain", "default", "auto-static"):
        return tree
    if tree.isdigit():
        return int(tree)
    try:
        return [tuple(p) for p in json.loads(tree)]
    except (json.JSONDecodeError, TypeError) as e:
        raise typer.BadParameter(f"--tree must be default, chain, a node count or JSON rank paths ({e})") from e


def _compile_decoding(model, note: str = "") -> None:
    """`model.compile_decoding()` for the commands: report how long the graphs took, and turn a missing C++
    compiler into a clear error instead of a traceback."""
    t0 = time.perf_counter()
    try:
        model.compile_decoding()
    except RuntimeError as e:
        _fail(str(e))
    typer.echo(f"compiled the verify forward in {time.perf_counter() - t0:.0f}s{note}")


def _pack_decoding(model, pack: bool) -> None:
    """`model.pack_decoding()` where the weights can be packed, and say so (and how bf16 weights multiply on a
    CPU without bf16 matmul units: through `mtp.bf16_avx2`'s kernel or from fp32 copies); where they cannot, say
    why."""
    if not pack:
        return
    reason = unpackable_reason(model.base_model)
    if reason is None:
        model.pack_decoding()
        how = ""
        if upcasts(next(model.base_model.parameters()).dtype):
            runtime = "bf16 weights through an AVX2 kernel" if bf16_kernel() else "fp32 copies"
            how = f", {runtime}: this CPU has no bf16 matmul units"
        typer.echo(f"decoding from prepacked weights{how} (--no-pack: the model's own)")
    else:
        typer.echo(f"decoding from the model's own weights: they cannot be prepacked here ({reason})")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def generate(
    model: Path = typer.Option(..., "--model", "-m", help="MTP checkpoint directory (full or heads-only)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (chat-templated if --chat)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate."),
    tree: str = typer.Option(
        "auto", help="auto (adaptive) | auto-static | default | chain | <node count> | JSON rank paths."
    ),
    chat: bool = typer.Option(True, help="Wrap the prompt in the tokenizer's chat template if it has one."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16."),
    compare: bool = typer.Option(True, help="Also run plain generate() and check the outputs are identical."),
    compile: bool = typer.Option(
        False, "--compile", help="Run the verify steps through torch.compile (graphs built first: minutes)."
    ),
    pack: bool = typer.Option(True, help=PACK_HELP),
) -> None:
    """Generate with self-speculative decoding; print the text, τ, tokens/s and the identity check."""
    import torch
    from transformers import AutoTokenizer

    from .model import MTPModel

    try:
        mtp_model = MTPModel.from_pretrained(model, torch_dtype=getattr(torch, dtype))
        tok_dir = model if (model / "tokenizer_config.json").exists() else mtp_model.config.base_model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except (FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e))
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    _pack_decoding(mtp_model, pack)
    if compile:
        _compile_decoding(mtp_model)
    t0 = time.perf_counter()
    out = mtp_model.generate(ids, max_new_tokens=max_new_tokens, tree=_parse_tree(tree), return_dict_in_generate=True)
    dt = time.perf_counter() - t0
    typer.echo(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
    typer.echo(
        f"\n[speculative] {out.num_new_tokens} tokens in {dt:.2f}s = "
        f"{out.num_new_tokens / dt:.1f} tok/s, τ={out.tau:.2f}"
    )
    if compare:
        t0 = time.perf_counter()
        ref = mtp_model.base_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        dt_ref = time.perf_counter() - t0
        same = torch.equal(ref, out.sequences)
        typer.echo(
            f"[plain]       {ref.shape[1] - ids.shape[1]} tokens in {dt_ref:.2f}s; identical: {same}; "
            f"speedup {dt_ref / dt:.2f}x"
        )
        if not same:
            raise typer.Exit(code=1)


@app.command()
def info(model: Path = typer.Argument(..., help="MTP checkpoint directory.")) -> None:
    """Print a checkpoint's MTP config (head type and count, base model, checksum, default tree)."""
    from .config import MTPConfig

    try:
        config = MTPConfig.load(model)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps(config.to_dict(), indent=2))


# Each feature area adds its subcommands through a `register(app)` function in its own module, so
# this file stays small and feature work never edits it. Modules import heavy libraries lazily.
_COMMAND_MODULES = ("mtp.train.cli", "mtp.serve.cli", "mtp.bench.cli", "mtp.quickstart")


def _register_feature_commands() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that feature area has no commands (yet)
                continue
            raise
        module.register(app)


_register_feature_commands()

if __name__ == "__main__":
    app()
