"""KV storage for many sequences that share one batched forward, each at its own length.

Row i of the batch holds its sequence's keys/values at positions [0, lengths[i]); positions from there to the
batch width are stale (rejected tree nodes, or a shorter row's padding) and every forward masks them out with
the row's own 4D mask. A verify step appends every row's tree nodes after the width, then `commit` moves each
row's accepted nodes down to [lengths[i], lengths[i] + accepted) in one gather per layer and cuts the width to
the longest row. Rows join (their solo prefill cache is copied in) and leave (index-select) between steps.

Why not transformers' `DynamicCache` as is: its layers grow by `torch.cat`, a copy of the whole cache per layer
per forward, and it has no notion of rows of different lengths. `SlotLayer` keeps that class's interface
(`update` returns the keys/values to attend over) on preallocated buffers written in place, so the model code
is unchanged; the per-row bookkeeping lives in `BatchCache`. Sliding windows are enforced by the mask, as in the
batch-1 decoder (`mtp.kv_cache`), so every position stays where it was written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .kv_cache import grown


class SlotLayer(DynamicLayer):
    """One layer's (B, H, capacity, D) key/value buffers; `length` positions are in use (the batch width)."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.is_initialized = True

    def reserve(self, need: int) -> None:
        """Grow the buffers (`kv_cache.grown`) so that `need` positions fit."""
        self.keys, self.values = grown(self.keys, self.length, need), grown(self.values, self.length, need)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(self.length + n)
        self.keys[..., self.length : self.length + n, :] = key_states
        self.values[..., self.length : self.length + n, :] = value_states
        self.length += n
        return self.keys[..., : self.length, :], self.values[..., : self.length, :]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, max_length: int) -> None:
        self.length = max_length if max_length >= 0 else max(0, self.length + max_length)


class BatchCache(Cache):
    """The batch's KV cache: `SlotLayer`s plus each row's own length."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=SlotLayer)
        self.lengths: list[int] = []
        self._appended = 0

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.layers[0].length if self.layers else 0

    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not just the used width)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def add_row(self, solo: DynamicCache) -> None:
        """Append a sequence prefilled on its own (batch 1) as the last row."""
        src = [(layer.keys, layer.values) for layer in solo.layers]
        n = src[0][0].shape[-2]
        if not self.layers:
            for k, v in src:
                layer = SlotLayer()
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k[:0, :, :0], v[:0, :, :0]
                self.layers.append(layer)
        width = max(self.width, n)
        for layer, (k, v) in zip(self.layers, src, strict=True):
            cap = max(layer.keys.shape[-2], width + 64)
            for name, new_row in (("keys", k), ("values", v)):
                old = getattr(layer, name)
                grown = old.new_zeros((old.shape[0] + 1, new_row.shape[1], cap, new_row.shape[3]))
                grown[:-1, :, : layer.length] = old[..., : layer.length, :]
                grown[-1:, :, :n] = new_row
                setattr(layer, name, grown)
            layer.length = width
        self.lengths.append(n)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order); the width shrinks to the longest kept row."""
        lengths = [self.lengths[i] for i in rows]
        if not lengths:
            self.layers.clear()
            self.lengths = []
            return
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.layers[0].keys.device)
        width = max(lengths)
        for layer in self.layers:
            layer.keys = layer.keys[:, :, :width].index_select(0, idx)
            layer.values = layer.values[:, :, :width].index_select(0, idx)
            layer.length = width
        self.lengths = lengths

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        """After a verify forward appended N nodes per row at [width, width + N): keep row i's `accepted[i]`
        (node ids, root first) at [lengths[i], lengths[i] + len(accepted[i])), in path order.

        One scatter per layer of just the accepted entries (their sum over rows), whatever the rows' lengths.
        """
        layer0 = self.layers[0]
        width_before = layer0.length - self._appended
        rows, dst, src = [], [], []
        for i, (n, acc) in enumerate(zip(self.lengths, accepted, strict=True)):
            rows += [i] * len(acc)
            dst += range(n, n + len(acc))
            src += [width_before + a for a in acc]
        device = layer0.keys.device
        rows_t, dst_t, src_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, dst, src))
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf[rows_t, :, dst_t] = buf[rows_t, :, src_t]  # the right side is gathered before any write
        self.lengths = [n + len(a) for n, a in zip(self.lengths, accepted, strict=True)]
        width = max(self.lengths)
        for layer in self.layers:
            layer.length = width

    def begin_forward(self, num_nodes: int) -> None:
        """Record how many positions the next forward appends (so `commit` knows where the nodes start)."""
        self._appended = num_nodes
        for layer in self.layers:
            layer.reserve(layer.length + num_nodes)
