"""Attention that computes each query row alone, over exactly the keys it may see, in order: a
tree row then gets, bit for bit, the output a 1-row step gets for the same token.

Why: with bf16 matmuls (cpu_int4.py) a last-bit difference anywhere upstream can tip a bf16
rounding, and the tip grows through 30 layers into a different greedy token. torch's CPU SDPA
is not such a function of the row alone: a row's output changes in the last fp32 bits with the
number of query rows and with masked-out key columns, enough for greedy Medusa to leave plain
decoding's answers (docs/cpu_default.md, "Attention had to become row-exact"). Here every
row is one SDPA call with no mask over a key tensor of exactly its visible slots, which is what
a plain 1-row step over the same prefix calls too: the committed prefix is a view, and a row whose
tree ancestors are not contiguous after it reads a buffer holding the prefix (copied once per layer)
with its own few slots written after it.

It is registered with transformers' ``AttentionInterface`` and used where cpu_int4 is (the CPU,
batch 1) and under the repacked NF4 kernel's exact mode (quant/bnb.py). On CUDA the same contract is
kept by a Triton kernel (rows_alone_attention.py) that lists each row's keys on the device, since a
CUDA graph cannot read indices on the host. Which keys each row reads is worked out once per
forward, by its first layer, and kept in the forward's scratch for the others (``row_keys``). The
decoding step asks for it (``decoding.step.decoder_kwargs``) in its steps and its prefill
too: a token's keys must not depend on how it was batched either, since the two decoders of a
comparison can prefill the same conversation in different pieces (the baseline's cache starts
empty when the comparison is switched on). It costs a long prompt time to its first token: one
call per token and layer instead of one per layer (docs/cpu_default.md, "The prefill too", has the
figures and the command that measures them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..decoding.step import ROW_EXACT_ATTENTION as NAME
from ..decoding.step import ROWS_ALONE as FLAG


def visible(mask: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, W) additive float or bool mask -> (T, W) bool: which keys each row sees."""
    rows = mask[0, 0]
    return rows if rows.dtype == torch.bool else rows == 0


def exact_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs):
    """query (1, heads, T, D), key/value (1, kv_heads, W, D) -> ((1, T, heads, D), None)."""
    # per-row SDPA knows no attention sinks, softcapping or position biases: such models keep SDPA
    special = any(kwargs.get(k) is not None for k in ("s_aux", "softcap", "position_bias"))
    shared = kwargs.pop(FLAG, None)         # the forward's scratch (decoding.step.decoder_kwargs)
    if shared is None or attention_mask is None or query.shape[0] != 1 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    on_device = kernel_path(query)
    rows = row_keys(shared, attention_mask, key.shape[2], on_device)
    if on_device:       # no host read: the kernel walks each row's listed slots itself
        from .rows_alone_attention import attend_listed

        return attend_listed(query, key, value, *rows, scaling), None
    prefix, counts, tails, lead = rows
    _, heads, t, dim = query.shape
    kv_heads = key.shape[1]
    # a row's query heads as (kv_heads, heads per kv head): the group that shares a kv head becomes
    # the rows of one call, with no GQA expansion of the keys (1.3-1.4x faster from 1,000 keys on)
    grouped = query.transpose(1, 2).reshape(t, 1, kv_heads, heads // kv_heads, dim)   # (T, 1, kv, g, D)
    gathered = None
    outs = []
    for i in range(t):
        n = counts[i]
        if prefix[i]:
            k, v = key[:, :, :n], value[:, :, :n]
        else:
            if gathered is None:
                gathered = gather_buffers(shared, key, value, lead, max(c for c, p in zip(counts, prefix) if not p))
            k, v = gathered
            k[:, :, lead:n], v[:, :, lead:n] = key[:, :, tails[i]], value[:, :, tails[i]]   # its ancestors, itself
            k, v = k[:, :, :n], v[:, :, :n]                                                  # (1, kv_heads, n, D)
        outs.append(F.scaled_dot_product_attention(grouped[i], k, v, scale=scaling))  # (1, kv_heads, g, D)
    return torch.stack(outs, 1).reshape(1, t, heads, dim), None                   # (1, T, heads, D)


def gather_buffers(shared: dict, key: torch.Tensor, value: torch.Tensor, lead: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (1, kv_heads, width, D) buffers holding this layer's first ``lead`` keys and values: the slots
    every row off the first chain reads first (the committed prefix and the tree's root). Each such row then
    writes only its own last few slots after them, where a copy of all its keys per row used to cost a
    17-node step on 2 CPU cores more than its SDPA calls. Allocated once per forward, kept in its scratch."""
    shape = (1, key.shape[1], width, key.shape[3])
    kept = shared.get("gathered")
    if kept is None or kept[0].shape != shape or kept[0].dtype != key.dtype:
        kept = shared["gathered"] = (key.new_empty(shape), value.new_empty(shape))
    kept[0][:, :, :lead] = key[:, :, :lead]
    kept[1][:, :, :lead] = value[:, :, :lead]
    return kept


def kernel_path(query: torch.Tensor) -> bool:
    """CUDA runs the Triton kernel (no host read inside a graph); the CPU one SDPA call per row."""
    return query.is_cuda


def row_keys(shared: dict, mask: torch.Tensor, width: int, on_device: bool) -> tuple:
    """Which keys each row reads, from the forward's mask, worked out by the forward's first layer
    and kept in ``shared`` for the others (they get the same mask object; another mask is worked out
    again). On the device: visible_slots' (slots (T, W), counts (T,)). On the host: (prefix (T,) bool
    list, counts (T,) int list, tails, lead): the rows that are not a prefix all see slots 0..lead-1, and
    tails has per row its visible slots after those, ascending ((n - lead,) tensor; None where prefix)."""
    kept = shared.get("rows")
    if kept is not None and kept[0] is mask and kept[1] == width:   # one forward runs on one device
        return kept[2]
    seen = visible(mask)[:, :width]                                                   # (T, <= W)
    if on_device:
        from .rows_alone_attention import visible_slots

        if seen.shape[1] < width:                                                     # slots past the mask: unseen
            seen = torch.cat([seen, seen.new_zeros(seen.shape[0], width - seen.shape[1])], 1)
        rows = visible_slots(seen)
    else:
        # reading the mask's indices on the host is no device sync on the CPU
        counts = seen.sum(1)                                                          # (T,)
        # a row that sees exactly the first n slots (every prefill row, a plain step, a tree's first
        # chain) reads a view; found for all rows at once, not with one nonzero per row
        prefix = (seen == (torch.arange(seen.shape[1]) < counts[:, None])).all(1).tolist()   # (T,)
        # the rest read a run of leading slots they share (the committed prefix, the root), then a few
        # of their own: the run is copied once per layer, each row's own slots (its tail) after it
        others = ~torch.tensor(prefix)
        lead = int(seen[others].int().cumprod(1).sum(1).min()) if others.any() else 0
        tails = [None if p else seen[i, lead:].nonzero().squeeze(1) + lead for i, p in enumerate(prefix)]
        rows = (prefix, counts.tolist(), tails, lead)
    shared["rows"] = (mask, width, rows)
    return rows


AttentionInterface.register(NAME, exact_rows_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)    # masks transformers builds itself (generate()) are SDPA's


def use_exact_rows(model) -> None:
    """Route ``model``'s attention through ``exact_rows_attention`` (the layers read the shared config)."""
    if model.config._attn_implementation != NAME:
        model.config._medusa_attention_before = model.config._attn_implementation
    model.config._attn_implementation = NAME


def stop_exact_rows(model) -> None:
    """Give ``model`` back the attention it had before ``use_exact_rows``."""
    if model.config._attn_implementation == NAME:
        model.config._attn_implementation = getattr(model.config, "_medusa_attention_before", "sdpa")
