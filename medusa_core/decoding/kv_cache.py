"""A conversation's KV cache: fixed-capacity buffers that the stock transformers
forward writes into at a position held on the device, so one decoding step can
run (and be captured as a CUDA graph) without reading anything back to the host.

Layout: one tensor ``(layers, 2, 1, kv_heads, capacity, head_dim)`` holds every
layer's keys and values, so copying an accepted tree path down is one gather and
one scatter for all layers together. The first ``length`` slots are committed;
``position`` (1,) on the device mirrors ``length``. A forward writes its q new
entries at ``[position, position + q)`` and returns the whole buffer: the
attention mask (as wide as the buffer) hides the slots that are not committed.
An eager forward (every prefill; every step not replayed from a CUDA graph) narrows that to
the used slots, since it knows the length on the host (``narrowed``).

Capacity comes in buckets (256, 512, 1024, ... up to the model's context) so a
short chat does not attend over a 4k-slot buffer; moving to a bigger bucket
reallocates the buffers, copies the committed entries, and drops the decoding
steps (and their CUDA graphs) that were bound to the old buffers.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

SMALLEST_BUCKET = 256


class ContextOverflowError(ValueError):
    """The conversation does not fit the model's context window."""


def cache_keyword(module: nn.Module) -> str:
    """The name under which ``module``'s forward takes a KV cache. transformers 5.24 renamed
    ``past_key_values`` to ``cache``: the old name still works there but warns on every forward
    and goes in 5.40, while 5.17-5.23 (the GPU image has 5.17) know only the old one."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def bucket(needed: int, max_context: int) -> int:
    """The smallest capacity bucket (256 * 2**k) holding ``needed`` slots, capped at the context."""
    capacity = SMALLEST_BUCKET
    while capacity < needed:
        capacity *= 2
    return min(capacity, max_context)


class _Layer(CacheLayerMixin):
    """One layer's view of the shared buffer; the buffer is allocated on the first write,
    so its dtype, device and head shapes follow the model."""

    is_sliding = False

    def __init__(self, owner: "KVCache", index: int):
        super().__init__()
        self._owner, self.index = weakref.ref(owner), index   # weak: no cycle, so a dropped cache is freed at once

    @property
    def owner(self) -> "KVCache":
        return self._owner()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.owner.storage is None:
            self.owner.allocate(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states (1, kv_heads, q, head_dim) -> the (1, kv_heads, width, head_dim) views of
        the buffers (width: the whole capacity unless narrowed), after writing them at the device
        position (no host read: graph-safe)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        keys, values = self.keys, self.values
        if owner.writer is not None and owner.writer.fits(key_states, value_states):
            owner.writer.write(owner.storage[self.index], key_states, value_states, owner.position)
        else:
            slots = owner.slots(key_states.shape[-2])                      # (q,)
            keys.index_copy_(2, slots, key_states.to(keys.dtype))
            values.index_copy_(2, slots, value_states.to(values.dtype))
        width = owner.width
        return keys[:, :, :width], values[:, :, :width]                    # (1, kv_heads, width, head_dim)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


@dataclass(frozen=True)
class CacheWriter:
    """Another way to write a forward's new keys and values than ``index_copy_``: ``fits(keys, values)`` says
    whether it takes them; ``write(layer, keys, values, position)`` writes (1, kv_heads, T, D) keys and values into
    one layer's (2, 1, kv_heads, capacity, D) buffer at slots ``position + [0, T)``, as ``index_copy_`` does."""

    fits: Callable[[torch.Tensor, torch.Tensor], bool]
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


# Cache writers by name. A kernel module registers its own (quant/cache_write_kernel.py, as transformers'
# AttentionInterface takes attentions), a routing names it in an attribute of the model, WRITER_NAME, and new_cache
# looks it up: this module imports no kernel, and the step learns of one through the loaded model (step.py). On the
# model, not its config: a config is saved with the weights, and a routing is this process's.
WRITERS: dict[str, CacheWriter] = {}
WRITER_NAME = "_medusa_cache_writer"


class KVCache(Cache):
    """KV cache for one conversation, owned by its caller across turns (never by the model).

    ``steps`` holds the decoding steps (step.DecodeStep, maybe with a CUDA graph) bound to these
    buffers, most recently used last; they are dropped with the buffers. ``writer``: writes each
    forward's keys and values where it takes them (None: ``index_copy_`` always).
    """

    def __init__(self, num_layers: int, max_context: int, capacity: int = 0, writer: CacheWriter | None = None):
        self.writer = writer
        self.num_layers = num_layers
        self.max_context = max_context
        self.capacity = bucket(max(capacity, 1), max_context)
        self.token_ids: list[int] = []           # the committed tokens, for prefix reuse across turns
        self.storage: torch.Tensor | None = None  # (layers, 2, 1, kv_heads, capacity, head_dim)
        self.position: torch.Tensor | None = None  # (1,) long on the device: where the next forward writes
        self.slot_ids: torch.Tensor | None = None  # (capacity,) long: 0..capacity-1, made once per buffer
        self.window: int | None = None            # slots a forward attends over; None: the whole buffer
        self.steps: OrderedDict = OrderedDict()
        super().__init__(layers=[_Layer(self, i) for i in range(num_layers)])

    # ---- buffers
    def allocate(self, like: torch.Tensor) -> None:
        _, heads, _, dim = like.shape
        self.storage = like.new_zeros(self.num_layers, 2, 1, heads, self.capacity, dim)
        for i, layer in enumerate(self.layers):   # each layer's (1, kv_heads, capacity, head_dim) views
            layer.keys, layer.values = self.storage[i, 0], self.storage[i, 1]
        self.position = torch.full((1,), self.length, dtype=torch.long, device=like.device)
        self.slot_ids = torch.arange(self.capacity, device=like.device)

    @property
    def width(self) -> int:
        return self.capacity if self.window is None else self.window

    @contextmanager
    def narrowed(self, width: int | None):
        """Forwards inside attend over the first ``width`` slots only (None: all of them). An
        eager forward knows the committed length on the host, so it skips the empty tail of the
        bucket: on a CPU, attention over a 256-slot bucket cost twice that over the used slots.
        A CUDA graph needs the whole, fixed-size buffer, since its length changes under it."""
        self.window = None if width is None else min(width, self.capacity)
        try:
            yield
        finally:
            self.window = None

    def slots(self, count: int) -> torch.Tensor:
        """(count,) slots ``position + [0, count)`` where a forward of ``count`` tokens writes."""
        return self.slot_ids[:count] + self.position

    def ensure_capacity(self, needed: int) -> None:
        """Move to the bucket that holds ``needed`` entries (capped by the context), keeping the
        committed ones. Steps bound to the old buffers are dropped: they would write into them."""
        capacity = bucket(needed, self.max_context)
        if capacity <= self.capacity:
            return
        self.capacity = capacity
        self.steps.clear()
        if self.storage is not None:
            old = self.storage
            with torch.inference_mode():
                self.allocate(old[0, 0])
                self.storage[..., : self.length, :] = old[..., : self.length, :]

    # ---- committed length (host and device kept equal outside a step)
    @property
    def length(self) -> int:
        """Committed entries: the host mirror of ``position``."""
        return len(self.token_ids)

    def _sync_position(self) -> None:
        if self.position is not None:
            # The buffers are made inside generate()'s inference mode; a caller may rewind outside it.
            with torch.inference_mode():
                self.position.fill_(self.length)   # host -> device write: no sync

    def rewind(self, length: int) -> None:
        """Forget everything after the first ``length`` committed tokens (0: a new conversation,
        keeping the buffers and their captured steps)."""
        del self.token_ids[length:]
        self._sync_position()

    def reuse_prefix(self, prompt_ids: list[int]) -> int:
        """Keep the longest cached prefix of ``prompt_ids`` (at least one prompt token is
        left to run, since its logits start the reply) and return its length."""
        limit = min(len(prompt_ids) - 1, self.length)
        common = 0
        while common < limit and self.token_ids[common] == prompt_ids[common]:
            common += 1
        self.rewind(common)
        return common

    def commit(self, token_ids: list[int], *, on_device: bool = False) -> None:
        """Keep ``token_ids``, written just after the committed prefix. ``on_device``: a decoding
        step already advanced ``position`` (and copied the accepted path down) itself."""
        self.token_ids.extend(token_ids)
        if not on_device:
            self._sync_position()


def prefill_mask(past: int, new: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, new, width) additive mask for a prefill of ``new`` tokens after ``past``
    committed ones, over the first ``width`` slots: causal over the used slots, every later slot hidden."""
    q = torch.arange(new, device=device)[:, None] + past                    # (new, 1)
    k = torch.arange(width, device=device)[None, :]                         # (1, width)
    mask = torch.zeros(new, width, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None]


def tree_step_mask(allowed: torch.Tensor, position: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, T, width) additive mask of one verification step, built on the device from the
    device position (so a captured graph stays right as the conversation grows).

    allowed (T, T) bool: node i sees node j; slot_ids (width,): 0..width-1, the slots attended over. Row i sees every
    committed slot (< position) and, among the T slots the step writes at [position, position + T),
    the nodes ``allowed`` says."""
    T = allowed.shape[0]
    rel = slot_ids - position                                                # (width,) slot - position
    in_tree = (rel >= 0) & (rel < T)                                         # (width,)
    tree_ok = allowed[:, rel.clamp(0, T - 1)] & in_tree                      # (T, width)
    ok = tree_ok | (rel < 0)                                                 # (T, width)
    mask = torch.zeros(ok.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~ok, torch.finfo(dtype).min)[None, None]
