"""KV-cache operations for tree verification, on transformers' own `DynamicCache`.

A verify step appends the keys/values of every tree node after the prefix; afterwards only the
root and the accepted path may stay, in path order, so the cache again equals what sequential
decoding of the accepted tokens would have produced. No prefix recompute is ever needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """A cache with full (non-sliding) layers for every model.

    Sliding-window limits are applied through the attention mask instead (see `decoding`), because a
    sliding cache layer silently drops old positions and index-selecting the accepted path needs
    every position to stay where it was written.
    """
    return DynamicCache()


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
