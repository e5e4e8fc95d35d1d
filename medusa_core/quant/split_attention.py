"""Attention of the decoding step's few query rows over the cache, split over the keys (flash-decoding),
skipping every block of keys that no row sees, in Triton.

Why: a graphed step attends over its whole capacity bucket (decoding/kv_cache.py), not over the slots in
use, because its position moves under the graph. SDPA with an additive mask reads every key and value of
the bucket, hidden or not: with the app's 512 new tokens after a short prompt the bucket is 1024 slots,
most of them empty, and at 7B shapes that is 16 MB a layer where a few MB are seen. And a 1-row step gives
SDPA one query row a head: 32 programs for 132 SMs (H100) walk the whole cache each. Here each (head, split)
program walks a slice of the slots in blocks of BLOCK_W keys: a block whose mask hides it from every row is
not read at all (the mask says so; nothing about the cache is assumed), the others are scored with
``tl.dot`` (the rows padded to 16), and each head's last split to finish merges the splits' partial softmax
sums in the same launch (an arrival count per head, as the NF4 kernel's serial split-K sum): a merge kernel of
its own cost 0.13 ms of the H200's 3.51 ms one-node step, 32 launches of 4 µs.

Fast, not exact: a row's sums are split and merged in an order that depends on the bucket and the number of
rows, as SDPA's do. Exact mode keeps its own attention (rows_alone_attention.py). What the kernel does not
compute (more than MAX_ROWS rows, as a prefill has; a bool or missing mask; attention sinks, softcapping;
gradients; fp32 on CUDA; no CUDA and no interpreter) goes to transformers' SDPA.

Measured on an H200 (2026-11-28): 0.42 ms off the graphed 7B NF4 16-node step's 7.28. It runs where
``use_split_attention`` puts it: on CUDA where attention_routing.py's ``auto`` times it faster at load, or where a
flag forces it.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.split_attention needs Triton ({err}): pip install 'triton>=3.7'") from None

from .triton_runtime import (add, check_runnable, dependent_launch, helper, interpret_enabled, launchable, maximum,
                             start_as_dependent)

NAME = "medusa_split"          # its name in transformers' AttentionInterface
ATTENTION_KERNELS = ("sdpa", "split")
BLOCK_W = 64                   # keys per block: the unit a mask can hide from the read
MAX_ROWS = 64                  # a tree's rows; a prefill's longer runs go to SDPA
PROGRAMS_PER_SM = 2            # (head, split) programs aimed at per SM


def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, arrivals_ptr, rows, width,
                  blocks_per_split, scale, hidden, stride_qh, stride_qt, stride_kh, stride_kw, stride_vh, stride_vw,
                  stride_mt, stride_mw, stride_ot, stride_oh, SERIAL: tl.constexpr, GROUP: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                  LOG_T: tl.constexpr, LOG_W: tl.constexpr, TREE: tl.constexpr, IEEE: tl.constexpr,
                  PDL: tl.constexpr = False):
    # grid: (query heads, splits). Heads of one GQA group read the same keys (from L2 after the first).
    if PDL:
        start_as_dependent()
    h = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    kvh = h // GROUP
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < rows
    d_ok = d < D
    q = tl.load(q_ptr + h * stride_qh + t[:, None] * stride_qt + d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0)                               # (BT, BD)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)                                    # running max
    total = tl.full((BLOCK_T,), 0.0, tl.float32)                                          # running sum
    acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
    first = split * blocks_per_split * BLOCK_W
    last = tl.minimum(first + blocks_per_split * BLOCK_W, width)
    # a program's blocks wait on their loads one after another (the loop's loads are conditional, so Triton's
    # pipeliner leaves them): the mask's next block is loaded a block ahead, and a seen block's values with its
    # keys. Compiled for sm_90 (Triton 3.6) the values' loads then leave before the scores are computed, and their
    # wait overlaps the scores and the softmax, where they left after the softmax: a block waited on the mask, then
    # the keys, then the values
    w = first + tl.arange(0, BLOCK_W)
    bias_next = tl.load(mask_ptr + t[:, None] * stride_mt + w[None, :] * stride_mw,
                        mask=t_ok[:, None] & (w < last)[None, :], other=float("-inf"))       # (BT, BW)
    for start in range(first, last, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        w_ok = w < width
        bias = bias_next.to(tl.float32)
        w_next = w + BLOCK_W
        bias_next = tl.load(mask_ptr + t[:, None] * stride_mt + w_next[None, :] * stride_mw,
                            mask=t_ok[:, None] & (w_next < last)[None, :], other=float("-inf"))
        # a block every row's mask hides is skipped: its keys and values are never read. TREE (the
        # interpreter): maxima and sums as written-out halvings (its tl.reduce takes seconds a block)
        if TREE:
            top = bias
            for level in tl.static_range(LOG_W):
                lo, hi = tl.split(tl.reshape(top, (BLOCK_T, BLOCK_W >> (level + 1), 2)))
                top = tl.maximum(lo, hi)
            top = tl.reshape(top, (1, BLOCK_T))
            for level in tl.static_range(LOG_T):
                lo, hi = tl.split(tl.reshape(top, (1, BLOCK_T >> (level + 1), 2)))
                top = tl.maximum(lo, hi)
            seen = tl.reshape(top, (1,))
        else:
            seen = tl.reduce(tl.reduce(bias, 1, maximum), 0, maximum)
        if seen > hidden:
            kv_ok = w_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kvh * stride_kh + w[:, None] * stride_kw + d[None, :], mask=kv_ok, other=0)   # (BW, BD)
            v = tl.load(v_ptr + kvh * stride_vh + w[:, None] * stride_vw + d[None, :], mask=kv_ok, other=0)   # (BW, BD)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale + bias                                                           # (BT, BW) fp32
            if TREE:
                top = s
                for level in tl.static_range(LOG_W):
                    lo, hi = tl.split(tl.reshape(top, (BLOCK_T, BLOCK_W >> (level + 1), 2)))
                    top = tl.maximum(lo, hi)
                top = tl.reshape(top, (BLOCK_T,))
            else:
                top = tl.reduce(s, 1, maximum)
            m_new = tl.maximum(m, top)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row that has seen nothing yet: no NaN
            alpha = tl.exp(m - base)
            p = tl.exp(s - base[:, None])                                                  # (BT, BW)
            if TREE:
                p_sum = p
                for level in tl.static_range(LOG_W):
                    lo, hi = tl.split(tl.reshape(p_sum, (BLOCK_T, BLOCK_W >> (level + 1), 2)))
                    p_sum = lo + hi
                p_sum = tl.reshape(p_sum, (BLOCK_T,))
            else:
                p_sum = tl.reduce(p, 1, add)
            total = total * alpha + p_sum
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
    # partials laid out (heads, splits, BT[, BD]): merged by _merge_kernel, or (SERIAL) here by whichever split
    # of this head stores its partials last
    part = h * splits + split
    tl.store(m_ptr + part * BLOCK_T + t, m)
    tl.store(l_ptr + part * BLOCK_T + t, total)
    tl.store(acc_ptr + (part * BLOCK_T + t[:, None]) * BLOCK_D + d[None, :], acc)
    if SERIAL:
        # every thread's partials stored before the count says so: a barrier, then one thread's release at GPU
        # scope (as the NF4 kernel's serial split-K sum, quant/nf4_repacked_kernel.py)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            tl.debug_barrier()    # the acquire above precedes every thread's reads below
            _merged(m_ptr, l_ptr, acc_ptr, out_ptr, h, rows, splits, stride_ot, stride_oh, D, BLOCK_D, BLOCK_T)
            tl.store(arrivals_ptr + h, 0)     # zero again for the next call (and the next replay of a graph)


@helper
def _merged(m_ptr, l_ptr, acc_ptr, out_ptr, h, rows, splits, stride_ot, stride_oh,
            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    # one head's rows: its splits' partial softmax sums merged in split order, stored as (rows, D) of out.
    # .cg: from L2, where the other programs' partials are, never a stale line of this SM's L1
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    top = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    for split in range(0, splits):
        top = tl.maximum(top, tl.load(m_ptr + (h * splits + split) * BLOCK_T + t, cache_modifier=".cg"))
    base = tl.where(top == float("-inf"), 0.0, top)           # a row no split saw: zeros, not 0/0
    total = tl.full((BLOCK_T,), 0.0, tl.float32)
    acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
    for split in range(0, splits):
        part = (h * splits + split) * BLOCK_T + t                                         # (BT,)
        weight = tl.exp(tl.load(m_ptr + part, cache_modifier=".cg") - base)   # 0 for a split that saw nothing
        total += weight * tl.load(l_ptr + part, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(t[:, None] < rows) & (d[None, :] < D))


def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, rows, splits, stride_ot, stride_oh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    # grid: (query heads,); one program merges one head's rows (a call without arrival counts)
    _merged(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0), rows, splits, stride_ot, stride_oh, D, BLOCK_D, BLOCK_T)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """(head, split) programs that fill this GPU; a few under the interpreter, so tests merge uneven splits."""
    if device.type != "cuda":
        return 8
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def split_count(heads: int, width: int, device: torch.device) -> tuple[int, int]:
    """(splits, blocks per split) for ``heads`` query heads over ``width`` slots: enough programs to fill the
    device, no split without a block. From shapes alone, so a captured graph replays the same launch."""
    blocks = triton.cdiv(width, BLOCK_W)
    per_split = triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(_programs_wanted(device), heads))))
    return triton.cdiv(blocks, per_split), per_split


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """query (1, heads, T, D), key/value (1, kv_heads, W, D), mask (1, 1, T, W) additive float -> (1, T, heads, D)
    in query's dtype: SDPA's attention with that mask, up to rounding; key blocks the mask hides from every row
    (entries at the mask dtype's lowest value, as the step writes them, or -inf) are never read.

    arrivals: (heads,) int32 zeros on query's device, the split kernel's workspace (zero again after each call):
    with it, each head's last split merges the partials in the same launch; without it, a second kernel does
    (the same merge of the same partials)."""
    check_runnable(query.device)
    if not fits(query, key, value, mask):
        raise ValueError(f"split_attention takes batch 1, at most {MAX_ROWS} rows, query heads a multiple of kv heads "
                         f"and a (1, 1, T, W) float mask; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"mask {tuple(mask.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    _, heads, rows, dim = q.shape
    if arrivals is not None and (arrivals.dtype != torch.int32 or arrivals.numel() < heads
                                 or arrivals.device != q.device):
        raise ValueError(f"split_attention's arrivals must be {heads} int32 counts on {q.device}; got "
                         f"{arrivals.numel()} {arrivals.dtype} on {arrivals.device}: pass zeros of that shape, or None")
    out = torch.empty(1, rows, heads, dim, dtype=q.dtype, device=q.device)                 # (1, T, heads, D)
    interpret = q.device.type == "cpu"
    calls = kernel_calls(q, k, v, mask, out, dim ** -0.5 if scale is None else scale, interpret, arrivals)
    for fn, grid, args, meta in calls:
        launchable(fn, interpret)[grid](*args, **meta)
    return out


def kernel_calls(q, k, v, mask, out, scale: float, interpret: bool,
                 arrivals: torch.Tensor | None = None) -> list[tuple]:
    """[(kernel function, grid, args, constexprs)] of the launches (the split kernel, then the merge kernel unless
    ``arrivals`` lets the split kernel merge), with the partials' buffers: ``split_attention`` runs them, and
    benchmarks/kernel_sass.py compiles exactly these calls."""
    _, heads, rows, dim = q.shape
    width = k.shape[2]
    splits, per_split = split_count(heads, width, q.device)
    block_t = max(16, triton.next_power_of_2(rows))            # tl.dot takes 16 rows at least
    block_d = max(16, triton.next_power_of_2(dim))
    m = torch.empty(heads * splits * block_t, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(heads * splits * block_t * block_d, dtype=torch.float32, device=q.device)
    hidden = float(torch.finfo(mask.dtype).min)
    # FP fusion named, not left to Triton's default (which 3.10 flips): every launch compiles alike
    warps = 8 if block_t * block_d >= 64 * 64 else 4       # 64 rows at 7B: 162 registers a thread, not 205
    opts = {} if interpret else {"num_warps": warps, "num_stages": 2, "enable_fp_fusion": True}
    serial = arrivals is not None
    split_args = (q, k, v, mask, m, total, acc, out, arrivals if serial else m, rows, width, per_split, scale, hidden,
                  q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), mask.stride(2),
                  mask.stride(3), out.stride(1), out.stride(2))
    split_meta = dict(SERIAL=serial, GROUP=heads // k.shape[1], D=dim, BLOCK_D=block_d, BLOCK_T=block_t,
                      BLOCK_W=BLOCK_W, LOG_T=block_t.bit_length() - 1, LOG_W=BLOCK_W.bit_length() - 1, TREE=interpret,
                      IEEE=q.dtype == torch.float32, **opts, **dependent_launch(interpret))
    calls = [(_split_kernel, (heads, splits), split_args, split_meta)]
    if not serial:
        merge_opts = {} if interpret else {"num_warps": 1 if block_t * block_d <= 16 * 128 else 4, "num_stages": 1,
                                           "enable_fp_fusion": True}
        merge_args = (m, total, acc, out, rows, splits, out.stride(1), out.stride(2))
        calls.append((_merge_kernel, (heads,), merge_args, dict(D=dim, BLOCK_D=block_d, BLOCK_T=block_t, **merge_opts)))
    return calls


def _arrivals(module, heads: int, device: torch.device) -> torch.Tensor | None:
    """``module``'s (an attention layer's) arrival counts for the merge in the split kernel's launch: kernel
    workspace, zero between calls, as an NF4 weight's (quant/nf4_fused.py). One set per layer, not per process: a
    load times the kernel on its own model's layers while the app may answer on another's. Made at the layer's
    first call; None inside a capture that comes first (its allocation would be the graph's), where the merge
    kernel sums instead. The step and the timings warm up before they capture, so they run the one launch."""
    counts = getattr(module, "_split_arrivals", None)
    if counts is not None and counts.numel() >= heads and counts.device == device:
        return counts
    if module is None or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None
    module._split_arrivals = torch.zeros(heads, dtype=torch.int32, device=device)   # a plain attribute: no
    return module._split_arrivals                                                   # state_dict entry, no .to()


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernels compute this call (see the module docstring); SDPA computes the rest."""
    if mask is None or mask.dtype == torch.bool or not mask.is_floating_point() or query.dim() != 4 or mask.dim() != 4:
        return False
    _, heads, rows, dim = query.shape
    if query.shape[0] != 1 or not 1 <= rows <= MAX_ROWS or heads % key.shape[1] or key.shape != value.shape:
        return False
    if mask.shape[:2] != (1, 1) or mask.shape[2] != rows or mask.shape[3] != key.shape[2] or dim > 256:
        return False
    if len({query.dtype, key.dtype, value.dtype}) != 1 or len({query.device, key.device, mask.device}) != 1:
        return False
    if query.is_cuda and query.dtype not in (torch.bfloat16, torch.float16):
        return False        # fp32's exact dot spilled to the stack at every size compiled for sm_90
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        return False
    return query.is_cuda or (query.device.type == "cpu" and interpret_enabled())


def split_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs):
    """transformers' attention function: the kernels where they fit the call, SDPA elsewhere.
    query (1, heads, T, D), key/value (1, kv_heads, W, D) -> ((1, T, heads, D), None)."""
    special = dropout or any(kwargs.get(k) is not None for k in ("s_aux", "softcap", "position_bias"))
    mask = attention_mask[:, :, :, :key.shape[2]] if attention_mask is not None and attention_mask.dim() == 4 else None
    if special or not fits(query, key, value, mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return split_attention(query, key, value, mask, scaling, _arrivals(module, query.shape[1], query.device)), None


AttentionInterface.register(NAME, split_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)    # masks transformers builds itself (generate()) are SDPA's


def use_split_attention(model, choice: str) -> str:
    """Route ``model``'s attention by ``choice`` (sdpa | split); one line saying what runs. Exact mode's
    attention (rows alone) is not replaced: its rows must not depend on the call."""
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {choice!r} is unknown: use one of {', '.join(ATTENTION_KERNELS)}")
    config = model.config
    current = config._attn_implementation
    if choice == "sdpa":
        if current == NAME:
            config._attn_implementation = getattr(config, "_medusa_split_before", "sdpa")
        return "attention: transformers' SDPA"
    if current not in ("sdpa", NAME):
        raise ValueError(f"--attention-kernel split: this model's attention is {current!r}, not SDPA (exact mode keeps "
                         "its own): use --attention-kernel auto")
    check_runnable(model.get_output_embeddings().weight.device)
    if current != NAME:
        config._medusa_split_before = current
    config._attn_implementation = NAME
    return "attention: split over the keys in Triton, hidden key blocks skipped"
