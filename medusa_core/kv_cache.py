"""A preallocated KV cache that the stock transformers forward writes into,
and that a Medusa step compacts in place after verification.

Layout per layer: keys/values ``(1, kv_heads, capacity, head_dim)``. The first
``length`` slots hold the committed sequence (``token_ids``). A forward pass
writes its q new entries at ``[length, length + q)`` without committing them;
the loop then commits either all of them (prefill) or the accepted tree path,
copied down to follow the prefix. Nothing is reallocated per step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# Capacity is rounded up so that growth between turns is rare and mask rows stay
# aligned for fused attention kernels.
_ROUND = 64


class ContextOverflowError(ValueError):
    """The conversation does not fit the model's context window."""


class _Layer(CacheLayerMixin):
    """One layer's buffers; allocated on first write so dtype/device follow the model."""

    is_sliding = False

    def __init__(self, owner: "TreeKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        cap = self.owner.capacity
        self.keys = key_states.new_zeros(b, h, cap, d)
        self.values = value_states.new_zeros(b, h, cap, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        end = start + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            # The loop checks room before each forward; reaching this is a bug, not user error.
            raise ContextOverflowError(f"KV cache overflow: writing up to {end} in a cache of {self.keys.shape[-2]}")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def grow(self, capacity: int) -> None:
        if not self.is_initialized:
            return
        keep = self.owner.length
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, :keep] = old[:, :, :keep]
            setattr(self, name, new)


class TreeKVCache(Cache):
    """KV cache for one conversation, owned by its decoding loop (not by the model)."""

    def __init__(self, num_layers: int, capacity: int, max_context: int):
        self.capacity = 0
        self.max_context = max_context
        self.length = 0                    # committed entries
        self.token_ids: list[int] = []     # the committed tokens, for prefix reuse across turns
        super().__init__(layers=[_Layer(self) for _ in range(num_layers)])
        self.ensure_capacity(capacity)

    def ensure_capacity(self, needed: int) -> None:
        """Grow (between turns only) so that ``needed`` entries fit, capped by the model context."""
        needed = min(needed, self.max_context)
        if needed <= self.capacity:
            return
        capacity = min(-(-needed // _ROUND) * _ROUND, self.max_context)
        for layer in self.layers:
            layer.grow(capacity)
        self.capacity = capacity

    def rewind(self, length: int) -> None:
        """Forget everything after the first ``length`` committed tokens."""
        self.length = min(self.length, length)
        del self.token_ids[self.length:]

    def reuse_prefix(self, prompt_ids: list[int]) -> int:
        """Keep the longest cached prefix of ``prompt_ids`` (at least one prompt token is
        left to run, since its logits start the reply) and return its length."""
        limit = min(len(prompt_ids) - 1, self.length)
        common = 0
        while common < limit and self.token_ids[common] == prompt_ids[common]:
            common += 1
        self.rewind(common)
        return common

    def commit(self, token_ids: list[int]) -> None:
        """Keep the entries just written, in order (prefill, or a path that needs no copy)."""
        self.length += len(token_ids)
        self.token_ids.extend(token_ids)

    def commit_path(self, nodes: torch.Tensor, token_ids: list[int]) -> None:
        """Copy the entries of tree nodes ``nodes`` (long, on device; node i was written at
        ``length + i``) down to follow the prefix, then keep them."""
        start = self.length
        src = nodes + start
        for layer in self.layers:
            if layer.is_initialized:
                # index_select copies first, so overlapping source and target slots are safe
                layer.keys[:, :, start:start + len(token_ids)] = layer.keys.index_select(2, src)
                layer.values[:, :, start:start + len(token_ids)] = layer.values.index_select(2, src)
        self.commit(token_ids)


class StepMask:
    """The additive attention mask for one verification step, kept in one buffer.

    Row i (tree node i) sees every committed entry and the tree columns its tree
    mask allows. Only the tree's columns change between steps, so each step
    clears the previous step's columns and writes the new ones: no allocation.
    """

    def __init__(self, tree_mask: torch.Tensor, capacity: int):
        T = tree_mask.shape[0]
        self.tree_mask = tree_mask                            # (T, T)
        self.buf = tree_mask.new_zeros(1, 1, T, capacity)     # (1, 1, T, capacity)
        self.prev = 0

    def at(self, length: int) -> torch.Tensor:
        """(1, 1, T, length + T) view for a step whose committed prefix is ``length``."""
        T = self.tree_mask.shape[0]
        if self.buf.shape[-1] < length + T:
            self.buf = self.buf.new_zeros(1, 1, T, length + T)
        else:
            self.buf[..., self.prev:self.prev + T] = 0
        self.buf[0, 0, :, length:length + T] = self.tree_mask
        self.prev = length
        return self.buf[..., :length + T]


def causal_mask(past: int, new: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, new, past + new) additive mask for a prefill of ``new`` tokens after ``past``."""
    q = torch.arange(new, device=device)[:, None] + past
    k = torch.arange(past + new, device=device)[None, :]
    mask = torch.zeros(new, past + new, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None]
