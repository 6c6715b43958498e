"""KV-cache operations for tree verification, on transformers' `DynamicCache` with in-place layers.

A verify step appends the keys/values of every tree node after the prefix; afterwards only the
root and the accepted path may stay, in path order, so the cache again equals what sequential
decoding of the accepted tokens would have produced. No prefix recompute is ever needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def grown(buffer: torch.Tensor, used: int, need: int) -> torch.Tensor:
    """`buffer` (.., capacity, D) if `need` positions fit, else a larger one (by half again, at least) holding its
    first `used` positions: the growth rule of every in-place cache layer (`GrowingLayer`, `batch_cache.SlotLayer`),
    so appends copy the cache only O(log length) times."""
    cap = buffer.shape[-2]
    if need <= cap:
        return buffer
    out = buffer.new_empty((*buffer.shape[:-2], max(need, cap + cap // 2 + 64), buffer.shape[-1]))
    out[..., :used, :] = buffer[..., :used, :]
    return out


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values live in preallocated buffers written in place.

    Why: `DynamicLayer.update` grows by `torch.cat`, a copy of the layer's whole cache on every forward
    (`mtp.attention` has the measured gain of the two together). Here a forward writes only its new
    positions; the buffers grow by half again when full, so copies are amortised away. `keys`/`values`
    stay what `DynamicLayer` promises, (B, H, length, D) tensors, as views of the buffers' first
    `length` positions: code that reads them (or writes into them, like `keep_accepted`) is unchanged.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self._set_length(0)
        self.is_initialized = True

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._k[..., :length, :], self._v[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.length, key_states.shape[-2]
        self._k, self._v = grown(self._k, start, start + n), grown(self._v, start, start + n)
        self._k[..., start : start + n, :] = key_states
        self._v[..., start : start + n, :] = value_states
        self._set_length(start + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        if self.is_initialized:
            self._set_length(0)

    def _replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._k, self._v = keys.contiguous(), values.contiguous()
        self._set_length(keys.shape[-2])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys[indices, ...], self.values[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            idx = beam_idx.to(self.device)
            self._replace(self.keys.index_select(0, idx), self.values.index_select(0, idx))


def new_cache() -> DynamicCache:
    """A cache with full (non-sliding) `GrowingLayer`s for every model.

    Sliding-window limits are applied through the attention mask instead (see `decoding`), because a
    sliding cache layer silently drops old positions and index-selecting the accepted path needs
    every position to stay where it was written.
    """
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def keep_accepted(cache: DynamicCache, prefix_len: int, keep: Sequence[int]) -> None:
    """Keep positions [0, prefix_len) plus tree nodes `keep` (node ids, root first), drop the rest.

    E.g. prefix_len=5, tree of 4 nodes (cache length 9), keep=[0, 1, 3]
         -> cache positions [0, 1, 2, 3, 4, 5, 6, 8], new length 8.
    A contiguous keep (always the case for chains) is a plain crop; otherwise the accepted rows are
    copied down over the rejected ones in place and the tail is cropped.
    """
    total = cache.get_seq_length()
    n_keep = len(keep)
    contiguous = list(keep) == list(range(n_keep))
    if not contiguous:
        src = torch.tensor(keep, dtype=torch.long) + prefix_len
        for layer in cache.layers:
            idx = src.to(layer.keys.device)
            layer.keys[..., prefix_len : prefix_len + n_keep, :] = layer.keys[..., idx, :]
            layer.values[..., prefix_len : prefix_len + n_keep, :] = layer.values[..., idx, :]
    drop = total - (prefix_len + n_keep)
    if drop > 0:
        cache.crop(-drop)
