"""`mtp quickstart`: the whole promise on the embedded model in one command.

Loads SmolLM2-135M-Instruct with the shipped heads, answers a customer-support question with plain
`generate()` and with self-speculative decoding (streamed as it comes), checks the two answers are the
same tokens, and prints tokens/s, τ and the speedup.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from .packed import PACK_HELP

DEFAULT_PROMPT = (
    "Hi, I ordered a pair of running shoes last week but they arrived in the wrong size. "
    "How can I exchange them, and will I have to pay for shipping?"
)


class _TokenPrinter:
    """A transformers-style streamer that prints text as tokens arrive (prompt skipped)."""

    def __init__(self, tokenizer):
        from transformers import TextStreamer

        self.inner = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def put(self, value):
        self.inner.put(value)

    def end(self):
        self.inner.end()


def quickstart(
    prompt: str = typer.Option(DEFAULT_PROMPT, help="The user message to answer."),
    max_new_tokens: int = typer.Option(128, help="Answer length cap."),
    dtype: str = typer.Option("float32", help="float32 (exact) or bfloat16."),
    heads: str = typer.Option("", help="Heads directory, or a shipped set for SmolLM2: eagle (default), mtp."),
    tree: str = typer.Option("auto", help="auto (adaptive) | default | chain | <node count>."),
    train_minutes: float = typer.Option(
        0.0, help="First train fresh MTP heads for this many minutes (cached: a second run reuses them)."
    ),
    threads: int = typer.Option(0, help="torch threads (0: leave torch's default)."),
    compile: bool = typer.Option(
        False, "--compile", help="Run the verify steps through torch.compile (graphs built first: minutes)."
    ),
    pack: bool = typer.Option(True, help=PACK_HELP),
) -> None:
    """Answer a customer-support question with plain and self-speculative decoding, and compare."""
    import torch

    from .cli import _compile_decoding, _pack_decoding, _parse_tree
    from .default_model import load_default_mtp

    if threads:
        torch.set_num_threads(threads)
    heads_dir = heads or None
    if train_minutes > 0:
        if heads:
            raise typer.BadParameter("--heads and --train-minutes exclude each other")
        heads_dir = str(train_quick_heads(train_minutes))
    t0 = time.perf_counter()
    model, tokenizer, trained = load_default_mtp(getattr(torch, dtype), heads_dir)
    typer.echo(f"loaded SmolLM2-135M-Instruct ({dtype}) in {time.perf_counter() - t0:.1f}s")
    if not trained:
        typer.secho("no trained heads found: fresh heads keep the output exact but give no speedup", fg="yellow")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    typer.echo(f"\nuser: {prompt}\n")

    _pack_decoding(model, pack)
    if compile:
        _compile_decoding(model)
    model.generate(ids[:, :8], max_new_tokens=4)  # warm-up: first-call allocations are not the method's cost
    t0 = time.perf_counter()
    ref = model.base_model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    t_plain = time.perf_counter() - t0
    plain = ref.sequences
    n_plain = plain.shape[1] - ids.shape[1]
    typer.secho("plain generate():", bold=True)
    typer.echo(tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True))

    typer.secho("\nself-speculative (streaming):", bold=True)
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        tree=_parse_tree(tree),
        streamer=_TokenPrinter(tokenizer),
        return_dict_in_generate=True,
    )
    t_spec = time.perf_counter() - t0
    same = torch.equal(out.sequences, plain)
    typer.echo("")
    typer.echo(f"plain:       {n_plain} tokens in {t_plain:.2f}s = {n_plain / t_plain:.1f} tok/s")
    typer.echo(
        f"speculative: {out.num_new_tokens} tokens in {t_spec:.2f}s = {out.num_new_tokens / t_spec:.1f} tok/s, "
        f"τ = {out.tau:.2f} tokens per verify step"
    )
    # tokens/s, not whole-answer time: a bf16 answer that diverged at a near-tie can have another length
    speedup = (out.num_new_tokens / t_spec) / (n_plain / t_plain)
    typer.echo(f"speedup: {speedup:.2f}x   identical to plain generate(): {same}")
    if not same:
        _explain_difference(plain, out.sequences, ids.shape[1], ref.logits, dtype)


# Half-precision logits are rounded to ~3 significant digits: a top-2 gap this small is a coin flip between
# a batched verify pass and one-token decoding (measured: 0 to 0.25 on SmolLM2 in bf16).
NEAR_TIE = 0.5


def _explain_difference(plain, spec, prompt_len: int, logits, dtype: str) -> None:
    """fp32 must be identical (exit 1 otherwise). bf16 may differ only where the reference itself nearly
    tied: say where, with the margin, and exit 1 if it was not a near-tie."""
    from .bench.run import first_difference, top2_margin  # the benchmark's own identity check

    i = first_difference(plain, spec, prompt_len)
    margin = top2_margin(logits[i][0]) if i < len(logits) else float("nan")
    typer.echo(f"first difference at new token {i}: the reference's top-2 logit margin there is {margin:.3f}")
    if dtype == "float32" or not margin <= NEAR_TIE:
        raise typer.Exit(code=1)
    typer.echo(f"a {dtype} near-tie (margin <= {NEAR_TIE}): batched verification rounds differently from one-token "
               "decoding there; run with --dtype float32 for bit-exact output")  # fmt: skip


def train_quick_heads(minutes: float) -> Path:
    """Train 3 MTP modules on the default model for `minutes`, the same way the shipped heads were made
    (`configs/smollm2-mtp.yaml`) but on ShareGPT alone with soft targets (the model's own next-token
    distribution), so no distillation pass is needed first. Cached per duration."""
    from .default_model import cache_root
    from .train.config import config_from_dict
    from .train.precision import dtype_name
    from .train.trainer import train

    out = cache_root() / f"quickstart-heads-{minutes:g}min"
    if (out / "mtp_config.json").is_file():
        typer.echo(f"reusing heads trained for {minutes:g} min in {out}")
        return out
    # bf16 halves the backbone's cost where the CPU multiplies bf16 in hardware; emulated, it is many times slower
    dtype = dtype_name("auto")
    typer.echo(f"training 3 MTP modules for {minutes:g} min on ShareGPT (heads only, frozen {dtype} SmolLM2) -> {out}")
    # A budget under a minute holds about one step of 8 x 512 tokens, and evaluating before and after (8 blocks
    # each) took three times as long as that: such runs step and evaluate on 2 blocks, so they take about what was
    # asked rather than minutes of bookkeeping.
    blocks = 2 if minutes < 1 else 8
    cfg = config_from_dict(
        {
            "mode": "medusa1",
            "model": {"path": "default", "dtype": dtype},
            "heads": {"head_type": "mtp", "num_heads": 3, "num_layers": 1},
            "loss": {"decay": 0.8, "soft_targets": True, "soft_weight": 1.0},
            "data": {"path": "sharegpt", "max_documents": 400, "block_size": 512, "eval_max_blocks": blocks},
            "optim": {"lr": 1.0e-3, "schedule": "constant", "warmup_steps": 5},
            "train": {
                "output_dir": str(out),
                "micro_batch_size": blocks,
                "max_steps": 100_000,  # the time budget ends the run
                "max_minutes": minutes,
                "log_every": 1,
                "resume": "auto",  # an interrupted run continues within the same time budget
            },
        }
    )
    train(cfg)
    return out


def register(app: typer.Typer) -> None:
    app.command("quickstart")(quickstart)
