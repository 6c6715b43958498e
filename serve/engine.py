"""The model side of serving: run one request through `MTPModel.generate` and report what happens.

`ModelRunner.run` is called only from the scheduler's single worker thread: the model, its heads
and the proposer state are not thread-safe, and batch size 1 is what the decoder supports. It turns
the decoder's token stream into events (`TokenEvent` per token, one `FinishEvent`) and stops the
generation early — by raising `GenerationCancelled` from the streamer's `put` — when a stop string
is completed or the client is gone; `generate()` simply propagates the exception.
"""

from __future__ import annotations

import copy
import inspect
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .metrics import SpecDecodingStats
from .streaming import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from mtp.batching import StepCost

logger = logging.getLogger("mtp.serve")


class GenerationCancelled(Exception):
    """Raised inside the streamer to unwind `generate()` (stop string reached, client gone, shutdown)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float = 1.0  # 1.0: off
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: a fresh random seed per request


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    speculative: bool = True
    sampling: SamplingParams | None = None  # None: greedy (exactly the base model's output)


@dataclass(frozen=True)
class TokenEvent:
    text: str  # text this token releases ('' while held back: partial character or possible stop string)
    index: int  # 0-based position in the completion
    step: int | None  # verify step that produced it (None: the prefill, or unknown)
    t: float  # time.perf_counter() when the decoder emitted it


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    completion_tokens: int
    text: str = ""  # held-back text released at the end (not a stop string after all)
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    accepted_lengths: tuple[int, ...] = ()
    speculative: bool = True
    error: str | None = None
    t: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 1.0

    def extension(self) -> dict[str, Any]:
        """The response's `mtp` field: how speculation went for this request."""
        return {
            "tau": round(self.tau, 4),
            "speculative": self.speculative,
            "verify_steps": len(self.accepted_lengths),
            "draft_tokens": self.stats.num_draft_tokens,
            "accepted_draft_tokens": self.stats.num_accepted_tokens,
        }


Event = TokenEvent | FinishEvent


class _StepRecorder:
    """Wraps the decoder's proposer to learn where each verify step starts and how much it drafted.

    `generate()` reports per-step counts only when it returns; a request cut short by a stop string
    or a disconnect never gets them. The decoder calls `propose` exactly once per verify step, before
    emitting that step's tokens, so counting calls gives the step of every token as it streams.
    """

    def __init__(self, inner: Any):
        self._inner = inner
        self.drafts: list[int] = []  # tree nodes drafted per step (root excluded)

    def propose(self, root: int, tree: Any, *args: Any, **kwargs: Any) -> Any:
        self.drafts.append(len(tree) - 1)
        return self._inner.propose(root, tree, *args, **kwargs)

    def propose_sampled(self, root: int, tree: Any, *args: Any, **kwargs: Any) -> Any:
        self.drafts.append(len(tree) - 1)
        return self._inner.propose_sampled(root, tree, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _RequestStreamer:
    """The `streamer=` handed to `generate()`: HF protocol (prompt first, then one token per put)."""

    def __init__(
        self,
        tokenizer: Any,
        params: GenerationParams,
        eos: set[int],
        emit: Callable[[Event], None],
        cancelled: threading.Event,
        step_of: Callable[[], int | None],
    ):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopMatcher(params.stop)
        self.eos, self.emit, self.cancelled, self.step_of = eos, emit, cancelled, step_of
        self.saw_prompt = False
        self.tokens: list[int] = []
        self.stopped_by_string = False
        self.steps: list[int | None] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.saw_prompt:
            self.saw_prompt = True
            return
        if self.cancelled.is_set():
            raise GenerationCancelled("cancelled")
        for token in value.reshape(-1).tolist():
            self._token(int(token))

    def _token(self, token: int) -> None:
        t = time.perf_counter()
        step = self.step_of()
        self.tokens.append(token)
        self.steps.append(step)
        # EOS text is never shown (OpenAI does not show it either), whatever the tokenizer calls special.
        text, hit = ("", False) if token in self.eos else self.stop.push(self.detok.push(token))
        self.emit(TokenEvent(text=text, index=len(self.tokens) - 1, step=step, t=t))
        if hit:
            self.stopped_by_string = True
            raise GenerationCancelled("stop string")

    def end(self) -> None:
        pass

    def remaining_text(self) -> str:
        """Text still held at a normal end: an incomplete character or a stop-string prefix."""
        if self.stopped_by_string:
            return ""
        tail, hit = self.stop.push(self.detok.flush())
        return tail if hit else tail + self.stop.flush()


class ModelRunner:
    """Owns the model and tokenizer; runs one request at a time on the calling (worker) thread."""

    def __init__(self, model: Any, tokenizer: Any, tree: Any = None, step_cost: StepCost | None = None):
        self.model, self.tokenizer, self.tree = model, tokenizer, tree
        # the batched engine's forward-cost curve (`mtp.batching.StepCost`); None: measured at startup
        self.step_cost = step_cost
        # A private copy for decoding on the worker thread: HF fast tokenizers are not safe to encode on
        # one thread while another decodes ("RuntimeError: Already borrowed"); the event loop encodes.
        self._decoder = copy.deepcopy(tokenizer)
        params = inspect.signature(model.generate).parameters
        # Sampling lands with lossless speculative sampling (`temperature=` etc.); probe, don't assume.
        self.supports_sampling = all(p in params for p in ("temperature", "top_p", "top_k", "generator"))
        self.eos = _eos_ids(model)
        self._recorder: _StepRecorder | None = None

    @property
    def num_heads(self) -> int:
        return int(self.model.config.num_heads)

    def _step_of(self) -> int | None:
        rec = self._recorder
        return len(rec.drafts) - 1 if rec is not None and rec.drafts else None

    def run(self, params: GenerationParams, emit: Callable[[Event], None], cancelled: threading.Event) -> FinishEvent:
        """Generate, emitting events; return (not emit) the finish event so the caller can add metrics."""
        self._recorder = None
        streamer = _RequestStreamer(self._decoder, params, self.eos, emit, cancelled, self._step_of)
        ids = torch.tensor([params.prompt_ids], dtype=torch.long, device=_device(self.model))
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "streamer": streamer,
            "return_dict_in_generate": True,
            "speculative": params.speculative,
            "tree": self.tree,
            "do_sample": False,  # explicit: a generation_config with do_sample=True must not make greedy sample
        }
        if params.sampling is not None:
            s = params.sampling
            generator = torch.Generator(device="cpu")
            generator.manual_seed(s.seed if s.seed is not None else secrets.randbits(63))
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, generator=generator)
        out = None
        error: str | None = None
        make, previous = self.model.make_proposer, vars(self.model).get("make_proposer")

        def recording_proposer() -> Any:
            self._recorder = _StepRecorder(make())
            return self._recorder

        # The serve layer's only hook into the model, for this request's generate() alone: count steps as they
        # happen (see _StepRecorder). Only here: the batched engine reads its rows' proposers' own classes
        # (rows draft together), which a wrapper would hide.
        self.model.make_proposer = recording_proposer
        try:
            out = self.model.generate(ids, **kwargs)
        except GenerationCancelled:
            pass
        except Exception as e:  # a bug or an OOM must not kill the worker: report it to this client only
            logger.exception("generation failed")
            error = f"{type(e).__name__}: {e}"
        finally:
            if previous is None:
                del self.model.make_proposer  # the model's own method again
            else:
                self.model.make_proposer = previous
        n = len(streamer.tokens)
        if out is not None:
            lengths, drafts = list(out.accepted_lengths), list(out.draft_tokens)
        else:  # cut short: rebuild the per-step counts from what streamed
            lengths, drafts = _steps_from_stream(streamer.steps, self._recorder)
        if error is not None:
            reason = "error"
        elif streamer.stopped_by_string or (n and streamer.tokens[-1] in self.eos):
            reason = "stop"
        elif cancelled.is_set() and out is None:
            reason = "abort"
        else:
            reason = "length"
        return FinishEvent(
            finish_reason=reason,
            completion_tokens=n,
            text=streamer.remaining_text() if reason in ("length", "stop") else "",
            stats=SpecDecodingStats.from_steps(lengths, drafts),
            accepted_lengths=tuple(lengths),
            speculative=params.speculative,
            error=error,
            t=time.perf_counter(),
        )


def _steps_from_stream(steps: list[int | None], recorder: _StepRecorder | None) -> tuple[list[int], list[int]]:
    """Per-step (tokens emitted, nodes drafted) of the steps that emitted tokens before the cut."""
    if recorder is None:
        return [], []
    counts: dict[int, int] = {}
    for step in steps:
        if step is not None:
            counts[step] = counts.get(step, 0) + 1
    ordered = sorted(counts)
    return [counts[s] for s in ordered], [recorder.drafts[s] for s in ordered]


def _eos_ids(model: Any) -> set[int]:
    """The EOS ids `generate()` stops at (the base model's generation config), for finish_reason."""
    eos = getattr(model.base_model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(t) for t in (eos.tolist() if torch.is_tensor(eos) else eos)}


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device
