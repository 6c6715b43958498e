"""`mtp quickstart`: the whole promise on the embedded model in one command.

Loads SmolLM2-135M-Instruct with the shipped heads, answers a customer-support question with plain
`generate()` and with self-speculative decoding (streamed as it comes), checks the two answers are the
same tokens, and prints tokens/s, τ and the speedup.
"""

from __future__ import annotations

import time

import typer

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
    heads: str = typer.Option("", help="Heads directory (default: the heads shipped for SmolLM2)."),
    tree: str = typer.Option("auto", help="auto (adaptive) | default | chain | <node count>."),
    threads: int = typer.Option(0, help="torch threads (0: leave torch's default)."),
) -> None:
    """Answer a customer-support question with plain and self-speculative decoding, and compare."""
    import torch

    from .cli import _parse_tree
    from .default_model import load_default_mtp

    if threads:
        torch.set_num_threads(threads)
    heads_dir = heads or None
    t0 = time.perf_counter()
    model, tokenizer, trained = load_default_mtp(getattr(torch, dtype), heads_dir)
    typer.echo(f"loaded SmolLM2-135M-Instruct ({dtype}) in {time.perf_counter() - t0:.1f}s")
    if not trained:
        typer.secho("no trained heads found: fresh heads keep the output exact but give no speedup", fg="yellow")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    typer.echo(f"\nuser: {prompt}\n")

    model.generate(ids[:, :8], max_new_tokens=4)  # warm-up: first-call allocations are not the method's cost
    t0 = time.perf_counter()
    plain = model.base_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    t_plain = time.perf_counter() - t0
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
    typer.echo(f"speedup: {t_plain / t_spec:.2f}x   identical to plain generate(): {same}")
    if not same:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    app.command("quickstart")(quickstart)
