"""A forward's new keys and values written into the KV cache (decoding/kv_cache.py) in one Triton launch a layer,
at the slots the device position says.

Why: the cache writes them with two ``index_copy_`` launches a layer, after a third that adds the device position
to the slot numbers. In the graphed 7B NF4 step on an H200 these 96 launches took 0.20 ms of the one-node step's
3.51 ms of kernels (0.16 the copies, 0.04 the additions; docs/performance.md, 2026-11-28), to move 16 KB a layer.
One launch reads the position itself and copies both.

A copy, so the cache holds the bits ``index_copy_`` puts there. It runs where the rotary kernel runs: both are
exact, both handle the rows a forward adds at its position, and attention_routing.py times the two together
against transformers' rotary and ``index_copy_``. The routing names it on the model; the caches made
for the model then write through it (decoding/kv_cache.py, ``WRITERS``). What it does not take (a gradient to
keep, rows not laid out along their last dimension, no CUDA and no interpreter) the cache writes with
``index_copy_``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.cache_write_kernel needs Triton ({err}): pip install 'triton>=3.7'") from None

from ..decoding.kv_cache import WRITERS, CacheWriter
from .triton_runtime import check_runnable, dependent_launch, interpret_enabled, launchable, start_as_dependent

NAME = "triton"                # its name among the cache writers (decoding/kv_cache.py)


def _cache_write_kernel(k_ptr, v_ptr, cache_ptr, position_ptr, kv_heads, capacity, stride_kh, stride_kt, stride_vh,
                        stride_vt, stride_ckv, stride_ch, stride_cw, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False):
    # grid: (tokens, 2 * kv heads); one program copies one head's key (or value) row of one token to its slot
    if PDL:
        start_as_dependent()
    t, j = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(position_ptr) + t
    head = j % kv_heads
    if j < kv_heads:
        src = k_ptr + head * stride_kh + t * stride_kt
    else:
        src = v_ptr + head * stride_vh + t * stride_vt
    x = tl.load(src + d, mask=d < D, other=0)
    dst = cache_ptr + (j // kv_heads) * stride_ckv + head * stride_ch + slot * stride_cw + d
    # a slot past the buffer is never written: the cache grows before a forward that needs it (ensure_capacity).
    # One comparison, not (d < D) & (slot < capacity): the interpreter refuses a mask of that block and a scalar
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=d < tl.where(slot < capacity, D, 0))


def fits(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel writes these (1, kv_heads, T, D) keys and values (see the module docstring)."""
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] != 1 or keys.dtype != values.dtype:
        return False
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.device != values.device:
        return False
    if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
        return False
    return keys.is_cuda or (keys.device.type == "cpu" and interpret_enabled())


def write_cache(layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
    """layer (2, 1, kv_heads, capacity, D): one layer's keys then values; keys and values (1, kv_heads, T, D) written
    at slots ``position + [0, T)``; position (1,) int64 on the device. What ``index_copy_`` at those slots writes."""
    check_runnable(keys.device)
    if not fits(keys, values) or layer.dim() != 5 or layer.shape[2] != keys.shape[1] or layer.shape[4] != keys.shape[3]:
        raise ValueError(f"write_cache takes (1, kv_heads, T, D) keys and values with rows along D into a (2, 1, "
                         f"kv_heads, capacity, D) layer; got keys {tuple(keys.shape)}, layer {tuple(layer.shape)}")
    if keys.shape[2] == 0:
        return
    interpret = keys.device.type == "cpu"
    fn, grid, args, meta = kernel_call(layer, keys, values, position, interpret)
    launchable(fn, interpret)[grid](*args, **meta)


def kernel_call(layer, keys, values, position, interpret: bool) -> tuple:
    """(kernel function, grid, args, constexprs) of the one launch: ``write_cache`` runs it, and
    benchmarks/kernel_sass.py compiles exactly this call."""
    _, kv_heads, tokens, dim = keys.shape
    # FP fusion named, as every launch of the project names it (a copy has nothing to fuse)
    opts = {} if interpret else {"num_warps": 1, "num_stages": 1, "enable_fp_fusion": False}
    args = (keys, values, layer, position, kv_heads, layer.shape[3], keys.stride(1), keys.stride(2), values.stride(1),
            values.stride(2), layer.stride(0), layer.stride(2), layer.stride(3))
    return _cache_write_kernel, (tokens, 2 * kv_heads), args, dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), **opts,
                                                                   **dependent_launch(interpret))


WRITERS[NAME] = CacheWriter(fits, write_cache)
