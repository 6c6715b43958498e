"""The FastAPI app: OpenAI routes, health, metrics and the chat page, on top of the scheduler.

Request path: parse strictly (400) → check model (404) → prompt ids and limits (400) → queue (429)
→ stream server-sent events or collect one JSON body. The handler never touches the model; it reads
events from its `Job` and cancels the job when its client disconnects, so the worker stops early.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .batch_scheduler import BatchScheduler
from .engine import FinishEvent, ModelRunner, TokenEvent
from .metrics import ServerMetrics
from .prompts import chat_prompt_ids, completion_prompt_ids, generation_params
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ResponseBuilder, parse_request, sse, usage
from .scheduler import Job, QueueFull, ShuttingDown
from .streaming import StepPacer

logger = logging.getLogger("mtp.serve")

STATIC_DIR = Path(__file__).parent / "static"
API_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics")
MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused (413) before it is read


@dataclass
class ServeConfig:
    model_name: str
    max_context: int
    api_key: str | None = None
    max_queue: int = 64
    max_batch_size: int = 16  # requests decoded together (continuous batching)
    max_kv_tokens: int = 65536  # KV-cache budget in token positions for the padded batch
    # True: the caller runs `app.state.scheduler.run()` on its own (main) thread and the HTTP server elsewhere
    engine_on_caller: bool = False
    smooth_streaming: bool = True
    default_speculative: bool = True  # for requests that do not say (`"speculative": true|false`)
    max_pacing_gap: float = 0.05  # seconds; longest pause pacing inserts between two tokens
    note: str = ""  # shown by /health and the page (e.g. "untrained heads: exact output, no speedup")


def create_app(runner: ModelRunner, config: ServeConfig) -> FastAPI:
    scheduler = BatchScheduler(
        runner,
        max_queue=config.max_queue,
        max_batch_size=config.max_batch_size,
        max_kv_tokens=config.max_kv_tokens,
        own_thread=not config.engine_on_caller,
    )
    metrics = ServerMetrics(
        config.model_name, running=lambda: scheduler.num_running, waiting=lambda: scheduler.num_waiting
    )
    metrics.init_positions(runner.num_heads)
    scheduler.on_finish = lambda job, finish: _record(metrics, job, finish)
    scheduler.on_step = metrics.record_step

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        logger.info("mtp serve: model %s ready (context %d tokens)", config.model_name, config.max_context)
        yield
        logger.info("mtp serve: shutting down")
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="mtp serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.config = scheduler, metrics, config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        draining = scheduler.closed
        body = {
            "status": "draining" if draining else "ok",
            "model": config.model_name,
            "auth_required": config.api_key is not None,
            "speculative_default": config.default_speculative,
            "note": config.note,
        }
        return JSONResponse(body, status_code=503 if draining else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "mtp",
                    "max_model_len": config.max_context,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await request.body())
        _check_model(req.model, config)
        ids = chat_prompt_ids(runner.tokenizer, req)
        return await _serve(request, req, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await request.body())
        _check_model(req.model, config)
        ids = completion_prompt_ids(runner.tokenizer, req, runner.model.info.vocab_size)
        return await _serve(request, req, ids, chat=False)

    async def _serve(
        request: Request, req: ChatCompletionRequest | CompletionRequest, ids: list[int], chat: bool
    ) -> Response:
        params = generation_params(req, ids, config.max_context, runner.supports_sampling, config.default_speculative)
        job = Job(params)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy ({config.max_queue} requests already waiting); retry shortly",
                type="rate_limit_exceeded",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        builder = ResponseBuilder(chat, config.model_name)
        if req.stream:
            pacer = StepPacer(config.max_pacing_gap) if config.smooth_streaming else None
            return StreamingResponse(
                _stream(job, builder, req.include_usage(), len(ids), pacer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(await _collect(request, job, builder, len(ids)))

    static = StaticFiles(directory=STATIC_DIR)
    app.mount("/static", static, name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)
    return app


def _check_model(name: str | None, config: ServeConfig) -> None:
    if name is not None and name != config.model_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{config.model_name}'",
            param="model",
            code="model_not_found",
        )


async def _events(job: Job, pacer: StepPacer | None) -> AsyncIterator[TokenEvent | FinishEvent]:
    """The job's events; with a pacer, the visible tokens of one burst are spread over a step time."""
    while True:
        burst = [await job.events.get()]
        while not job.events.empty():
            burst.append(job.events.get_nowait())
        visible = [e for e in burst if isinstance(e, TokenEvent) and e.text]
        gap = 0.0
        if pacer is not None:
            for e in burst:
                if isinstance(e, TokenEvent):
                    pacer.observe(e.step, e.t)
            gap = pacer.gap(len(visible))
        shown = 0
        for event in burst:
            if isinstance(event, TokenEvent) and event.text:
                if shown and gap:
                    await asyncio.sleep(gap)
                shown += 1
            yield event
            if isinstance(event, FinishEvent):
                return


def _progress(event: TokenEvent) -> dict[str, int]:
    """Per-chunk extension: tokens and verify steps so far, from which a client computes live τ."""
    return {"tokens": event.index + 1, "steps": 0 if event.step is None else event.step + 1}


async def _stream(
    job: Job, builder: ResponseBuilder, include_usage: bool, prompt_len: int, pacer: StepPacer | None
) -> AsyncIterator[str]:
    try:
        if builder.chat:
            yield sse(builder.chunk("", role=True, include_usage=include_usage))
        async for event in _events(job, pacer):
            if isinstance(event, TokenEvent):
                if event.text:
                    yield sse(builder.chunk(event.text, include_usage=include_usage, extra=_progress(event)))
                continue
            if event.text:
                yield sse(builder.chunk(event.text, include_usage=include_usage))
            if event.finish_reason in ("error", "abort"):
                err = APIError(500 if event.finish_reason == "error" else 503, event.error or "generation aborted")
                err.type = "server_error"
                yield sse(err.body())
            else:
                yield sse(
                    builder.chunk(
                        None if builder.chat else "",
                        finish_reason=event.finish_reason,
                        include_usage=include_usage,
                        extra=event.extension(),
                    )
                )
            if include_usage:
                yield sse(builder.usage_chunk(usage(prompt_len, event.completion_tokens)))
            yield sse("[DONE]")
            return
    finally:
        if job.finish is None:  # the client left (or the server cancelled us): stop generating
            job.cancel()


async def _collect(request: Request, job: Job, builder: ResponseBuilder, prompt_len: int) -> dict[str, Any]:
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        parts: list[str] = []
        async for event in _events(job, None):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                continue
            if event.finish_reason == "error":
                raise APIError(500, event.error or "generation failed", type="server_error")
            if event.finish_reason == "abort":
                raise APIError(503, event.error or "generation aborted", type="server_error")
            parts.append(event.text)
            use = usage(prompt_len, event.completion_tokens)
            return builder.full("".join(parts), event.finish_reason, use, event.extension())
        raise APIError(500, "generation ended without a result", type="server_error")
    finally:
        watcher.cancel()
        if job.finish is None:
            job.cancel()


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """A non-streaming client that hangs up frees its place: the worker stops at the next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _record(metrics: ServerMetrics, job: Job, finish: FinishEvent) -> None:
    """Per-request metrics, recorded on the worker thread when a job ends (even if its client left)."""
    metrics.success.inc(finished_reason=finish.finish_reason)
    if job.started is None:
        return
    metrics.queue_time.observe(job.started - job.arrival)
    metrics.prompt_tokens.inc(len(job.params.prompt_ids))
    metrics.generation_tokens.inc(finish.completion_tokens)
    times, steps = job.token_times, job.token_steps
    if times:
        metrics.ttft.observe(times[0] - job.arrival)
        metrics.e2e.observe(times[-1] - job.arrival)
        # Tokens of one verify step arrive together; each gets an equal share of the step's time.
        groups: list[tuple[float, int]] = []  # (time of the group's first token, tokens in it)
        last_step: object = object()
        for t, step in zip(times, steps, strict=True):
            if step is None or step != last_step:
                groups.append((t, 1))
            else:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1)
            last_step = step
        for (prev_t, _), (t, n) in zip(groups, groups[1:], strict=False):
            for _ in range(n):
                metrics.itl.observe((t - prev_t) / n)
    metrics.record_spec(finish.stats)


class _Gate:
    """Pure ASGI middleware: the API key check and per-endpoint request/error counts.

    Pure ASGI (not `BaseHTTPMiddleware`) so streamed bodies and disconnect messages pass through
    untouched. /health and the page's static files stay open; everything else needs the key.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = path if path in API_ENDPOINTS else "other"
        counted = path.startswith("/v1/") or path == "/metrics"
        if counted:
            self.metrics.requests.inc(endpoint=endpoint)
        if self.api_key is not None and not _public(path) and not self._authorized(scope):
            if counted:
                self.metrics.errors.inc(endpoint=endpoint, status="401")
            err = APIError(
                401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )
            await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send
            )
            return
        length = _content_length(scope)
        if length is not None and length > MAX_BODY_BYTES:
            if counted:
                self.metrics.errors.inc(endpoint=endpoint, status="413")
            err = APIError(413, f"request body too large ({length} bytes; the limit is {MAX_BODY_BYTES})")
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)
            return
        status: dict[str, int] = {}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            code = status.get("code", 500)
            if counted and code >= 400:
                self.metrics.errors.inc(endpoint=endpoint, status=str(code))

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = token.strip().encode("latin-1")
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self.api_key or b"")
        return False


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _public(path: str) -> bool:
    return path in ("/", "/health", "/favicon.ico") or path.startswith("/static/")
