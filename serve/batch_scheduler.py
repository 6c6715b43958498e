"""Continuous batching for the server: one worker thread drives `mtp.batching.BatchDecoder`.

Requests join the running batch between steps and leave when done, cancelled (client gone, stop string) or
when the server drains; a request's first token no longer waits for everyone queued before it. The queue in
front stays bounded (429 past `max_queue` waiting) and the decoder's KV budget decides how many rows run.

Per request, the worker turns the decoder's token updates into the same events the serial runner produced
(`TokenEvent` per token with its verify step, one `FinishEvent`), through the same incremental detokenizer
and stop-string matcher (`engine._RequestStreamer`). A failure inside a step (a bug, an out-of-memory) ends the
requests of that batch with an error and the worker carries on with a fresh decoder: the server stays up.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp.batching import BatchDecoder, RowUpdate

from .engine import Event, FinishEvent, GenerationCancelled, ModelRunner, _RequestStreamer
from .metrics import SpecDecodingStats
from .scheduler import Job, QueueFull, ShuttingDown

logger = logging.getLogger("mtp.serve")


@dataclass
class _Live:
    """A job in the decoder: its streamer (detokenizer + stop strings) and its current verify step."""

    job: Job
    streamer: _RequestStreamer
    step: int | None = None
    stopped: bool = False  # a stop string ended it: the decoder was told to cancel the row


class BatchScheduler:
    """Same interface as the serial `FifoScheduler` (submit / stop / gauges / hooks), batched underneath."""

    def __init__(
        self,
        runner: ModelRunner,
        max_queue: int = 64,
        max_batch_size: int = 16,
        max_kv_tokens: int = 65536,
        on_start: Callable[[Job], None] | None = None,
        on_finish: Callable[[Job, FinishEvent], None] | None = None,
        on_step: Callable[[int, int], None] | None = None,
        own_thread: bool = True,
    ):
        self.runner, self.max_queue, self.own_thread = runner, max_queue, own_thread
        self.on_start, self.on_finish, self.on_step = on_start, on_finish, on_step
        # (a decoder rebuilt after a failed step keeps the runner's cost curve: the same plans as before)
        self._make = lambda: BatchDecoder(
            runner.model,
            max_batch_size=max_batch_size,
            max_kv_tokens=max_kv_tokens,
            tree=runner.tree,
            cost=runner.step_cost,
        )
        self.decoder = self._make()
        self._incoming: collections.deque[Job] = collections.deque()
        self._live: dict[int, _Live] = {}
        # Events of one step, delivered to the event loop in one wake-up (not one per token per request: with
        # two cores, every wake-up of the loop thread takes a core from the model's threads).
        self._outbox: list[tuple[Job, Event]] = []
        self._outbox_lock = threading.Lock()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self.run, name="mtp-batch-worker", daemon=True)
        self._done = threading.Event()

    # ---- called from the event loop ------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread; with `own_thread=False` the owner calls `run()` on a thread of its own."""
        if self.own_thread:
            self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown
            if self._waiting_locked() >= self.max_queue:
                raise QueueFull
            self._incoming.append(job)
            self._cond.notify()

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return self._waiting_locked()

    def _waiting_locked(self) -> int:
        """Jobs not yet decoding (handed over or not); those whose clients already left hold no place."""
        return sum(1 for j in self._incoming if not j.cancelled.is_set()) + self.decoder.num_waiting

    @property
    def num_running(self) -> int:
        return self.decoder.num_running

    @property
    def closed(self) -> bool:
        return self._closed

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, abort what waits, stop what runs at its next step, join the worker."""
        with self._cond:
            self._closed = True
            incoming = list(self._incoming)
            self._incoming.clear()
            self._cond.notify_all()
        for job in incoming:
            job.cancel()
            self._finish(job, FinishEvent("abort", 0, error="server shutting down", t=time.perf_counter()))
        self._flush()
        for live in list(self._live.values()):
            live.job.cancel()
        if not self._done.wait(timeout):
            logger.warning("model worker did not stop within %.0f s", timeout)

    # ---- the worker thread ---------------------------------------------------------------------

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """The decode loop, until `stop()` (or until `alive()` turns false, e.g. the HTTP server failed).

        `mtp serve` runs it on the process's main thread: on this CPU build of torch, element-wise ops of a
        non-main thread run on one core (measured: `torch.exp` on 8M floats 6.7 ms in a worker thread, the same
        as with one thread, 4.8 ms on the main thread with two), which cost the serial server a third of its
        batch-1 speed."""
        try:
            # measure the forward-cost curve now (unless the runner brought one), on this thread, not on the
            # first request
            self.runner.step_cost = self.decoder.cost
            self._loop(alive)
        finally:
            self._done.set()

    def _loop(self, alive: Callable[[], bool]) -> None:
        while True:
            with self._cond:
                while not self._incoming and not self._live and not self._closed:
                    self._cond.wait(0.5)  # a timeout: signal handlers and `alive` get their turn
                    if not alive():
                        return
                if self._closed and not self._live:
                    return
                incoming = list(self._incoming)
                self._incoming.clear()
            for job in incoming:
                self._admit(job)
            self._flush()
            for rid, live in self._live.items():
                if live.job.cancelled.is_set() and not live.stopped:
                    self.decoder.cancel(rid)
            if not self._live:
                continue
            try:
                updates = self.decoder.step()
            except Exception as e:  # never let one batch take the worker down
                logger.exception("decode step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
                self._flush()
                continue
            if self.on_step is not None and self.decoder.last_batch_size:
                self.on_step(self.decoder.last_batch_size, self.decoder.last_forward_tokens)
            for update in updates:
                self._deliver(update)
            self._flush()

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, FinishEvent("abort", 0, t=time.perf_counter()))
            return
        p = job.params
        kwargs: dict = {"speculative": p.speculative}
        if p.sampling is not None:
            s = p.sampling
            generator = torch.Generator(device="cpu")
            generator.manual_seed(s.seed if s.seed is not None else secrets.randbits(63))
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, generator=generator)
        try:
            rid = self.decoder.add(p.prompt_ids, p.max_tokens, **kwargs)
        except ValueError as e:
            self._finish(job, FinishEvent("error", 0, error=str(e), t=time.perf_counter()))
            return
        job.started = time.perf_counter()
        if self.on_start is not None:
            self.on_start(job)
        live = _Live(job, None)  # type: ignore[arg-type]
        live.streamer = _RequestStreamer(
            self.runner._decoder, p, self.runner.eos, lambda e: self._post(job, e), job.cancelled, lambda: live.step
        )
        live.streamer.saw_prompt = True
        self._live[rid] = live

    def _deliver(self, update: RowUpdate) -> None:
        live = self._live.get(update.request_id)
        if live is None:
            return
        live.step = update.step
        if not live.stopped:
            for token in update.tokens:
                try:
                    live.streamer._token(token)
                except GenerationCancelled:  # a stop string completed: the rest of this step is not shown
                    live.stopped = True
                    self.decoder.cancel(update.request_id)
                    break
        if not update.finished:
            return
        del self._live[update.request_id]
        s = live.streamer
        n = len(s.tokens)
        if s.stopped_by_string or (n and s.tokens[-1] in self.runner.eos and update.finish_reason != "abort"):
            reason = "stop"
        elif update.finish_reason == "abort":
            reason = "abort"
        else:
            reason = update.finish_reason or "length"
        lengths, drafts = _shown_steps(update, s.steps)
        self._finish(
            live.job,
            FinishEvent(
                finish_reason=reason,
                completion_tokens=n,
                text=s.remaining_text() if reason in ("length", "stop") else "",
                stats=SpecDecodingStats.from_steps(lengths, drafts),
                accepted_lengths=tuple(lengths),
                speculative=live.job.params.speculative,
                t=time.perf_counter(),
            ),
        )

    def _fail_all(self, error: str) -> None:
        for live in self._live.values():
            self._finish(live.job, FinishEvent("error", len(live.streamer.tokens), error=error, t=time.perf_counter()))
        self._live.clear()
        self.decoder = self._make()

    def _finish(self, job: Job, finish: FinishEvent) -> None:
        job.finish = finish
        if self.on_finish is not None:
            try:
                self.on_finish(job, finish)
            except Exception:
                logger.exception("on_finish hook failed")
        self._post(job, finish)

    def _post(self, job: Job, event: Event) -> None:
        job.record(event)
        with self._outbox_lock:
            self._outbox.append((job, event))

    def _flush(self) -> None:
        """Hand the queued events to their event loops, one call per loop."""
        with self._outbox_lock:
            items, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, event in items:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for job, _ in batch:
                    job.cancel()


def _put_all(batch: list[tuple[Job, Event]]) -> None:
    for job, event in batch:
        job.events.put_nowait(event)


def _shown_steps(update: RowUpdate, steps: list[int | None]) -> tuple[list[int], list[int]]:
    """Per verify step (tokens emitted, nodes drafted), cut to the tokens the client was shown."""
    counts: dict[int, int] = {}
    for step in steps:
        if step is not None:
            counts[step] = counts.get(step, 0) + 1
    ordered = sorted(counts)
    return [counts[s] for s in ordered], [update.draft_tokens[s] for s in ordered if s < len(update.draft_tokens)]
