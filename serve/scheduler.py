"""A fair FIFO queue in front of the one worker thread that owns the model.

Why not batch concurrent requests: the self-speculative decoder runs batch size 1 (each sequence
accepts a different number of tokens per step, so sequences drift apart; doing that exactly needs
per-row caches the decoder does not have). So requests are served one at a time, first come first
served, and the queue is bounded: past `max_queue` waiting requests the server answers 429 at once
instead of letting latency grow without limit.

The asyncio side talks to a `Job`: the worker pushes events into the job's asyncio queue with
`call_soon_threadsafe`, and the request handler sets `job.cancelled` when its client goes away —
a waiting job is then skipped, a running one stops at its next token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .engine import Event, FinishEvent, GenerationParams, TokenEvent

logger = logging.getLogger("mtp.serve")


class QueueFull(Exception):
    """More than `max_queue` requests are already waiting."""


class ShuttingDown(Exception):
    """The server is draining and takes no new work."""


class Runner(Protocol):
    def run(
        self, params: GenerationParams, emit: Callable[[Event], None], cancelled: threading.Event
    ) -> FinishEvent: ...


class Job:
    """One request's link between the event loop and the worker thread."""

    def __init__(self, params: GenerationParams, loop: asyncio.AbstractEventLoop | None = None):
        self.params = params
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrival = time.perf_counter()
        self.started: float | None = None
        self.finish: FinishEvent | None = None
        # Written by the worker thread only; read by the metrics hook on that thread when the job ends.
        self.token_times: list[float] = []
        self.token_steps: list[int | None] = []

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        self.record(event)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    def record(self, event: Event) -> None:
        """The worker-side bookkeeping of an event (token times for the metrics), without delivering it."""
        if isinstance(event, TokenEvent):
            self.token_times.append(event.t)
            self.token_steps.append(event.step)

    def cancel(self) -> None:
        self.cancelled.set()


class FifoScheduler:
    """Runs jobs one at a time on a dedicated thread, in arrival order, with a bounded wait queue."""

    def __init__(
        self,
        runner: Runner,
        max_queue: int = 64,
        on_start: Callable[[Job], None] | None = None,
        on_finish: Callable[[Job, FinishEvent], None] | None = None,
    ):
        self.runner, self.max_queue = runner, max_queue
        self.on_start, self.on_finish = on_start, on_finish
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="mtp-model-worker", daemon=True)

    # ---- called from the event loop ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown
            # Jobs whose clients already left do not hold places in the queue.
            live = sum(1 for j in self._queue if not j.cancelled.is_set())
            if live >= self.max_queue:
                raise QueueFull
            self._queue.append(job)
            self._cond.notify()

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return sum(1 for j in self._queue if not j.cancelled.is_set())

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_running(self) -> int:
        return 1 if self._running is not None else 0

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, abort what waits, stop what runs at its next token, join the worker."""
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            running = self._running
            self._cond.notify_all()
        for job in waiting:
            job.cancel()
            self._finish(job, FinishEvent("abort", 0, error="server shutting down", t=time.perf_counter()))
        if running is not None:
            running.cancel()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("model worker did not stop within %.0f s", timeout)

    # ---- the worker thread ---------------------------------------------------------------------

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job = self._queue.popleft()
            self._running = job
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                if job.cancelled.is_set():  # the client left while waiting
                    finish = FinishEvent("abort", 0, t=time.perf_counter())
                else:
                    job.started = time.perf_counter()
                    if self.on_start is not None:
                        self.on_start(job)
                    finish = self.runner.run(job.params, job.emit, job.cancelled)
            except Exception as e:  # never let one request take the worker down
                logger.exception("request failed")
                finish = FinishEvent("error", 0, error=f"{type(e).__name__}: {e}", t=time.perf_counter())
            finally:
                with self._cond:
                    self._running = None
            self._finish(job, finish)

    def _finish(self, job: Job, finish: FinishEvent) -> None:
        job.finish = finish
        if self.on_finish is not None:
            try:
                self.on_finish(job, finish)
            except Exception:
                logger.exception("on_finish hook failed")
        job.emit(finish)
