"""Prometheus metrics in text format, named after vLLM's so existing dashboards translate directly.

Written by hand (a few dozen lines) rather than with `prometheus_client`: one dependency fewer, and
the exposition format is simple. Every sample carries `model_name`, as vLLM's do.

Speculative counters follow vLLM's `SpecDecodingStats`: a *draft* is one verify step that verified
at least one drafted token; *draft tokens* are the tree nodes verified (root excluded); *accepted
tokens* are the drafted tokens that became output (the bonus token is not a draft). Mean acceptance
length (τ, bonus included) = 1 + accepted / drafts; per-position counts give the acceptance rate of
each draft depth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PREFIX = "mtp:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
FORWARD_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class SpecDecodingStats:
    """Speculative-decoding counts of one request (or a sum of requests)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_steps(cls, accepted_lengths: Iterable[int], draft_tokens: Iterable[int]) -> SpecDecodingStats:
        """From the decoder's per-step lists: tokens emitted (bonus included) and nodes verified.

        A step that emitted `a` tokens accepted the drafts at positions 0 .. a-2.
        """
        stats = cls()
        for emitted, drafted in zip(accepted_lengths, draft_tokens, strict=True):
            if drafted <= 0:
                continue  # no speculation this step (speculative=False or no room left)
            accepted = max(0, emitted - 1)
            stats.num_drafts += 1
            stats.num_draft_tokens += drafted
            stats.num_accepted_tokens += accepted
            if len(stats.accepted_per_pos) < accepted:
                stats.accepted_per_pos.extend([0] * (accepted - len(stats.accepted_per_pos)))
            for pos in range(accepted):
                stats.accepted_per_pos[pos] += 1
        return stats

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def _fmt(value: float) -> str:
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items()) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = PREFIX + name, help, labelnames
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self, const: dict[str, str]) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [
            f"{self.name}{_labels({**const, **dict(zip(self.labelnames, k, strict=True))})} {_fmt(v)}" for k, v in items
        ]


class Gauge(_Metric):
    """A value read at scrape time from a callback (queue lengths live in the scheduler)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]):
        super().__init__(name, help)
        self.read = read

    def samples(self, const: dict[str, str]) -> list[str]:
        return [f"{self.name}{_labels(const)} {_fmt(self.read())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets)) + (float("inf"),)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def samples(self, const: dict[str, str]) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, cumulative = [], 0
        for bound, c in zip(self.buckets, counts, strict=True):
            cumulative += c
            lines.append(f"{self.name}_bucket{_labels({**const, 'le': _fmt(bound)})} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(const)} {_fmt(total)}")
        lines.append(f"{self.name}_count{_labels(const)} {n}")
        return lines


class ServerMetrics:
    """All of the server's metrics; thread-safe (the worker thread and the event loop both record)."""

    def __init__(self, model_name: str, running: Callable[[], float], waiting: Callable[[], float]):
        self.const = {"model_name": model_name}
        c, h = Counter, Histogram
        self.num_running = Gauge("num_requests_running", "Requests being generated now.", running)
        self.num_waiting = Gauge("num_requests_waiting", "Requests waiting in the queue.", waiting)
        self.requests = c("requests_total", "API requests received, by endpoint.", ("endpoint",))
        self.errors = c(
            "request_errors_total", "API requests answered with an error, by status.", ("endpoint", "status")
        )
        self.success = c(
            "request_success_total", "Finished generations by finish reason (abort: client left).", ("finished_reason",)
        )
        self.prompt_tokens = c("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens_total", "Tokens generated.")
        self.ttft = h("time_to_first_token_seconds", "Arrival to first generated token (queue included).", TTFT_BUCKETS)
        self.itl = h(
            "inter_token_latency_seconds",
            "Time per output token after the first: a verify step's time shared by the tokens it emitted.",
            ITL_BUCKETS,
        )
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Time spent waiting for the model.", LATENCY_BUCKETS)
        self.spec_drafts = c("spec_decode_num_drafts_total", "Verify steps that checked drafted tokens.")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens_total", "Drafted tokens (tree nodes) verified.")
        self.spec_accepted = c("spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.")
        self.spec_accepted_per_pos = c(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Drafted tokens accepted, by draft position.",
            ("position",),
        )
        self.batch_size = h("batch_size", "Requests (rows) in one batched verify forward.", BATCH_BUCKETS)
        self.forward_tokens = h(
            "tokens_per_forward", "Tokens in one batched verify forward (rows x tree nodes, padding included).",
            FORWARD_BUCKETS,
        )  # fmt: skip
        self._all = [
            self.num_running,
            self.num_waiting,
            self.batch_size,
            self.forward_tokens,
            self.requests,
            self.errors,
            self.success,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted,
            self.spec_accepted_per_pos,
        ]

    def init_positions(self, num_positions: int) -> None:
        """Show every draft position from the start (at 0), as vLLM does, so rates are defined early."""
        for pos in range(num_positions):
            self.spec_accepted_per_pos.inc(0, position=str(pos))

    def record_step(self, batch_size: int, forward_tokens: int) -> None:
        """One batched verify forward (called from the worker thread)."""
        self.batch_size.observe(batch_size)
        self.forward_tokens.observe(forward_tokens)

    def record_spec(self, stats: SpecDecodingStats) -> None:
        if not stats.num_drafts:
            return
        self.spec_drafts.inc(stats.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_accepted.inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.accepted_per_pos):
            self.spec_accepted_per_pos.inc(n, position=str(pos))

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._all:
            lines += metric.header()
            lines += metric.samples(self.const)
        return "\n".join(lines) + "\n"
