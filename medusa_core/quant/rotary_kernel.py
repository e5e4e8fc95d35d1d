"""Rotary position embedding of the queries and keys in one Triton launch, bit for bit what transformers'
``apply_rotary_pos_emb`` computes.

Why: transformers applies the rotation as ten elementwise kernels a layer (for q and for k: ``x * cos``,
the negation and the concatenation of ``rotate_half``, ``* sin`` and the sum), each a launch that reads and
writes the rows. In the graphed 7B NF4 step on an H100 the attention modules took 1.18 ms of 4.26 at one
row, 37 µs a layer for a few KB of queries and keys and 0.27 GB of cache in all (docs/performance.md, the third
run of 2026-11-27): small kernels, not bytes. One launch does both rotations.

Bit for bit: each value is rounded where transformers' eager ops round it. ``x * cos`` and
``rotate_half(x) * sin`` are each rounded to the input dtype, then added in fp32 and rounded again, as
PyTorch's elementwise kernels compute a 16-bit op in fp32 and round its result; the products of two 16-bit
values are exact in fp32, and fp32 inputs are multiplied and added without a fused multiply-add (FP fusion
off), as the eager ops do. So a step through it gives the same tokens as one without it, on any device, and
nothing else of the project's exactness changes. Inputs of another layout or of mixed dtypes, and anything
that needs a gradient, go to transformers' function.

Measured on an H200 (2026-11-28): 0.60 ms off the graphed 7B NF4 step's 4.45. It runs where ``use_rotary_kernel``
puts it: on CUDA where attention_routing.py's ``auto`` times it faster at load, or where a flag forces it.
transformers looks the function up in the model family's module at every call, so it is put there: it holds
for every model of that family in the process, which, bit for bit the same, changes only their speed.

With it, the caches made for the routed model write each layer's new keys and values in one launch too
(quant/cache_write_kernel.py, the same bits as ``index_copy_``): the two are timed together, as the step runs
them one after the other in every layer.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.rotary_kernel needs Triton ({err}): pip install 'triton>=3.7'") from None

from ..decoding.kv_cache import WRITER_NAME
from . import cache_write_kernel
from .triton_runtime import check_runnable, dependent_launch, interpret_enabled, launchable, start_as_dependent

ROTARY_KERNELS = ("torch", "triton")
# the model families whose apply_rotary_pos_emb is the plain rotate-half rotation this kernel computes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_heads,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t, so_qb, so_qh, so_qt, so_kb, so_kh, so_kt,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    # grid: (tokens, q heads + kv heads, batch); one program rotates one head's row of one token
    if PDL:
        start_as_dependent()
    t, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)       # rotate_half: (-x2, x1)
    c = tl.load(cos_ptr + b * sc_b + t * sc_t + d, mask=ok, other=0).to(tl.float32)
    s = tl.load(sin_ptr + b * sc_b + t * sc_t + d, mask=ok, other=0).to(tl.float32)
    if head < q_heads:
        src = q_ptr + b * sq_b + head * sq_h + t * sq_t
        dst = qo_ptr + b * so_qb + head * so_qh + t * so_qt
    else:
        src = k_ptr + b * sk_b + (head - q_heads) * sk_h + t * sk_t
        dst = ko_ptr + b * so_kb + (head - q_heads) * so_kh + t * so_kt
    x = tl.load(src + d, mask=ok, other=0)
    xp = tl.load(src + partner, mask=ok, other=0).to(tl.float32)
    rotated = tl.where(d < half, -xp, xp)
    # rounded where the eager ops round: each product to the input dtype, then the sum
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    r = (rotated * s).to(x.dtype).to(tl.float32)
    tl.store(dst + d, (a + r).to(x.dtype), mask=ok)


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """Whether the kernel computes this call: (B, heads, T, D) queries and keys of one dtype, cos and sin
    (B, T, D) of it, rows contiguous, nothing that needs a gradient, on CUDA (or the interpreter's CPU)."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or cos.shape[1:] != (t, d) or cos.shape[0] not in (1, b) or d % 2:
        return False
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1 or not q.is_floating_point():
        return False
    if any(x.stride(-1) != 1 for x in (q, k, cos, sin)) or cos.stride() != sin.stride():
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, cos, sin)):
        return False
    if len({x.device for x in (q, k, cos, sin)}) != 1:
        return False
    return q.is_cuda or (q.device.type == "cpu" and interpret_enabled())


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, D), k (B, Hkv, T, D), cos and sin (B or 1, T, D) -> (q rotated, k rotated), each in its input's
    layout: what ``apply_rotary_pos_emb(q, k, cos, sin)`` returns, bit for bit."""
    check_runnable(q.device)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() + k.numel() == 0:
        return q_out, k_out
    interpret = q.device.type == "cpu"
    fn, grid, args, meta = kernel_call(q, k, cos, sin, q_out, k_out, interpret)
    launchable(fn, interpret)[grid](*args, **meta)
    return q_out, k_out


def kernel_call(q, k, cos, sin, q_out, k_out, interpret: bool) -> tuple:
    """(kernel function, grid, args, constexprs) of one launch: ``fused_rotary`` runs it, and
    benchmarks/kernel_sass.py compiles exactly this call for a GPU without one."""
    b, heads, t, d = q.shape
    cb = cos.stride(0) if cos.shape[0] == b else 0          # one table for the batch broadcasts
    # FP fusion off: an fp32 x * cos + r * sin contracted to one FMA would round once where eager rounds twice
    opts = {} if interpret else {"num_warps": 1 if d <= 128 else 2, "num_stages": 1, "enable_fp_fusion": False}
    args = (q, k, cos, sin, q_out, k_out, heads, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), cb, cos.stride(1), q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0),
            k_out.stride(1), k_out.stride(2))
    return _rotary_kernel, (t, heads + k.shape[1], b), args, dict(D=d, BLOCK_D=triton.next_power_of_2(d), **opts,
                                                                  **dependent_launch(interpret))


def _family_module(model: nn.Module):
    """The transformers module whose ``apply_rotary_pos_emb`` the model's attention calls, or None."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        return None
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@functools.cache
def _dispatcher(original):
    """``original``'s stand-in: the kernel where it fits the call, ``original`` elsewhere."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _fits(q, k, cos, sin, unsqueeze_dim):
            return fused_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _name_writer(model: nn.Module, name: str | None) -> None:
    """Name the cache writer of the caches made for ``model`` from now on (None: ``index_copy_``)."""
    if name is not None:
        setattr(model, WRITER_NAME, name)
    elif hasattr(model, WRITER_NAME):
        delattr(model, WRITER_NAME)


def use_rotary_kernel(model: nn.Module, choice: str) -> str:
    """Route the model family's rotary embedding by ``choice`` (torch | triton), and with the kernel the model's
    cache writes (quant/cache_write_kernel.py); one line saying what runs."""
    if choice not in ROTARY_KERNELS:
        raise ValueError(f"rotary kernel {choice!r} is unknown: use one of {', '.join(ROTARY_KERNELS)}")
    module = _family_module(model)
    _name_writer(model, None)
    if module is None:
        if choice == "triton":
            family = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(f"--rotary-kernel triton: the {family} family's rotary is not the plain rotate-half one "
                             f"this kernel computes (it serves {', '.join(FAMILIES)}): use --rotary-kernel torch")
        return "rotary: transformers' own"
    current = module.apply_rotary_pos_emb
    original = getattr(current, "original", current)
    if choice == "torch":
        module.apply_rotary_pos_emb = original
        return "rotary: transformers' own"
    device = model.get_output_embeddings().weight.device if hasattr(model, "get_output_embeddings") else None
    if device is not None:
        check_runnable(device)          # a CPU without the interpreter: one line naming the fix
    module.apply_rotary_pos_emb = _dispatcher(original)
    _name_writer(model, cache_write_kernel.NAME)
    return "rotary: one Triton kernel for the queries and keys of each layer, one for its cache write"


def routed(model: nn.Module) -> str:
    """"triton" where the model family's rotary runs the kernel, else "torch"."""
    module = _family_module(model)
    return "triton" if module is not None and hasattr(module.apply_rotary_pos_emb, "original") else "torch"

