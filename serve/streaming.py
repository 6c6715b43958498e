"""From token ids to the text a client sees: incremental detokenization, stop strings, pacing.

Three small pieces, each pure and unit-tested without a model:

* `IncrementalDetokenizer` turns one token at a time into text deltas. Decoding tokens one by one
  is wrong for byte-level BPE (a character can span tokens) and for SentencePiece (leading spaces
  depend on the previous token), so it decodes a short window and emits only the new suffix.
* `StopMatcher` ends the answer at the first stop string and never shows any of it: text that could
  still become a stop string is held back until the next token decides.
* `StepPacer` makes accepted blocks scroll evenly. A verify step can accept five tokens at once;
  sent as they come, they land as a burst and then nothing for a step. The pacer spreads each
  block over the time a step takes, which costs at most one step of display latency and no
  throughput (generation runs ahead in the worker).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas whose concatenation equals `tokenizer.decode(all_ids)` (TGI/vLLM's window method)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window re-decoded for correct spacing
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end comes out as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Cuts the text stream at the first occurrence of any stop string (the stop string is not shown)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def _held_length(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to show now, whether a stop string was completed)."""
        if self.stopped:
            return "", True
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[: min(hits)]
            self.pending, self.stopped = "", True
            return out, True
        keep = self._held_length()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """At the end of generation the held text was not a stop string after all: release it."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class StepPacer:
    """Delay between tokens of one burst, so a block of accepted tokens spans about one step.

    It learns the step time (an exponential moving average of the gaps between verify steps, as the
    worker timestamps them) and spaces the n tokens that arrived together by step_time / n, capped by
    `max_gap` so a slow step never makes the page crawl.
    """

    def __init__(self, max_gap: float = 0.05, alpha: float = 0.3):
        self.max_gap, self.alpha = max_gap, alpha
        self.step_time: float | None = None
        self._last_step: int | None = None
        self._last_t: float | None = None

    def observe(self, step: int | None, t: float) -> None:
        """A token produced at time `t` by verify step `step` (None: the prefill / unknown)."""
        if step is None or step == self._last_step:
            return
        if self._last_t is not None:
            gap = max(0.0, t - self._last_t)
            self.step_time = gap if self.step_time is None else (1 - self.alpha) * self.step_time + self.alpha * gap
        self._last_step, self._last_t = step, t

    def gap(self, burst: int) -> float:
        """Seconds to wait before each token after the first of a burst of `burst` tokens."""
        if burst <= 1 or self.step_time is None:
            return 0.0
        return min(self.max_gap, self.step_time / burst)
