"""`mtp serve`: the OpenAI-compatible server (registered into the `mtp` command by `mtp.cli`).

Heavy imports (torch, transformers, fastapi, uvicorn) happen inside the command, so `mtp --help`
stays instant and the serve extras are only needed by people who serve.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import typer

from mtp.packed import PACK_HELP


def register(app: typer.Typer) -> None:
    app.command(name="serve")(serve)


def serve(
    model: Path | None = typer.Option(
        None, "--model", "-m", help="MTP checkpoint directory. Default: the embedded SmolLM2-135M-Instruct."
    ),
    heads: str = typer.Option(
        "", help="Heads of the embedded model: eagle (default), mtp (the MTP modules) or a heads directory."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 exposes the server)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: str | None = typer.Option(
        None, envvar="MTP_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health and the page."
    ),
    served_model_name: str | None = typer.Option(None, help="Model id clients send (default: the directory name)."),
    max_queue: int = typer.Option(64, min=0, help="Waiting requests allowed before answering 429."),
    max_batch_size: int = typer.Option(16, min=1, help="Requests decoded together (continuous batching)."),
    kv_budget: int = typer.Option(
        65536, min=64, help="KV-cache budget in token positions for the whole batch; requests beyond it wait."
    ),
    max_context: int | None = typer.Option(
        None, min=1, help="Context length (prompt + completion); default: the model's max_position_embeddings."
    ),
    dtype: str = typer.Option("float32", help="float32 (exact) | bfloat16."),
    tree: str = typer.Option(
        "auto",
        help="Draft tree: auto (sized per step by load; grown at draft time by drafters that can, greedy) | "
        "auto-static | default | chain | <node count> | JSON rank paths.",
    ),
    step_cost: Path | None = typer.Option(
        None,
        help="JSON file of the forward-cost curve that prices each step's tree: read if it exists (no timing at "
        "startup; every start plans the same trees for the same batch), else measured at startup and written "
        "there. Measure on the machine and with the --dtype/--threads/--pack you serve with.",
    ),
    threads: int | None = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
    pack: bool = typer.Option(True, help=PACK_HELP),
    speculation: str = typer.Option(
        "auto",
        help="Default for requests that do not send 'speculative': on | off | auto (on, unless the heads are "
        "untrained: then drafts are almost never accepted and verifying them only costs time).",
    ),
    smooth_streaming: bool = typer.Option(
        True, help="Spread the tokens of one verify step over the step time instead of sending bursts."
    ),
    shutdown_timeout: float = typer.Option(30.0, help="On SIGTERM, seconds to let running requests finish."),
    log_level: str = typer.Option("info", help="debug | info | warning | error."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with a chat page at / and metrics at /metrics."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    from mtp.cli import _fail, _pack_decoding, _parse_tree

    from .app import ServeConfig, create_app
    from .engine import ModelRunner
    from .loading import load_checkpoint, load_default
    from .prompts import context_length

    if threads is not None:
        torch.set_num_threads(threads)
    if speculation not in ("auto", "on", "off"):
        raise typer.BadParameter("--speculation must be auto, on or off")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise typer.BadParameter("--dtype must be float32, bfloat16 or float16")
    torch_dtype = getattr(torch, dtype)
    if heads and model is not None:
        raise typer.BadParameter("--heads is for the embedded model; a --model checkpoint carries its own heads")
    try:
        loaded = load_checkpoint(model, torch_dtype) if model is not None else load_default(torch_dtype, heads=heads)
        context = context_length(loaded.model, max_context)
    except (FileNotFoundError, ValueError, OSError, ModuleNotFoundError) as e:
        _fail(str(e))
    _pack_decoding(loaded.model, pack)
    cost = None
    if step_cost is not None:
        from mtp.batching import StepCost

        if step_cost.exists():
            try:
                cost = StepCost.load(step_cost)
            except (ValueError, OSError) as e:
                _fail(str(e))
        else:
            cost = StepCost.measure(loaded.model)
            try:
                cost.save(step_cost)
            except OSError as e:
                _fail(f"cannot write the step-cost curve: {e}")
            logging.getLogger("mtp.serve").info("measured the step-cost curve, written to %s", step_cost)
    runner = ModelRunner(
        loaded.model, loaded.tokenizer, tree=None if tree == "auto" else _parse_tree(tree), step_cost=cost
    )
    default_speculative = speculation == "on" or (speculation == "auto" and loaded.trained_heads)
    note = loaded.note
    if not default_speculative:
        note += ("; " if note else "") + "speculation off by default (switch it on per request)"
        logging.getLogger("mtp.serve").warning(
            'speculation is off by default (--speculation %s); requests can turn it on with "speculative": true',
            speculation,
        )
    config = ServeConfig(
        engine_on_caller=True,
        model_name=served_model_name or loaded.name,
        max_context=context,
        api_key=api_key or None,
        max_queue=max_queue,
        max_batch_size=max_batch_size,
        max_kv_tokens=kv_budget,
        smooth_streaming=smooth_streaming,
        default_speculative=default_speculative,
        note=note,
    )
    app = create_app(runner, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
            access_log=log_level == "debug",
        )
    )

    # The model runs on this (main) thread, HTTP on another: torch's element-wise kernels use one core only
    # outside the main thread here (see BatchScheduler.run). SIGTERM/SIGINT start uvicorn's graceful shutdown
    # (stop accepting, let running requests finish, then the app's shutdown stops the decode loop); the exit
    # status is 0: the shutdown was graceful, not a crash.
    def _exit(signum, frame) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    http = threading.Thread(target=server.run, name="mtp-http", daemon=True)
    http.start()
    app.state.scheduler.run(alive=http.is_alive)
    http.join(shutdown_timeout + 10)
    sys.exit(0 if server.started else 1)
