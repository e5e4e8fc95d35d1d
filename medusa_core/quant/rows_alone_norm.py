"""RMSNorm in one kernel, in which a row's output is a function of that row alone (Triton): exact
mode's norm, and on CUDA the step's wherever it times faster than transformers' (norm_routing.py).

Why one kernel: transformers' LlamaRMSNorm runs as several elementwise kernels (cast, square, mean, add,
rsqrt, multiply, cast, weight), each reading and writing the row; one program here reads a row once.

Why a row alone: torch's CUDA reductions choose how to split a row's sum from the number of rows (few
rows: a row spread over several blocks), so a row can round differently in a 16-row tree than alone, and
in bf16 one last bit grows through the layers into a different greedy token. Here one program takes one
row and sums its squares in one fixed order (below): the same order for every row whatever the row
count. The arithmetic is transformers' LlamaRMSNorm's (fp32 inside, the
normalized row cast back to the input dtype, then times the weight), so it agrees with it to rounding.

Two ways to the sum of squares, chosen by where it runs, both one fixed order for every row: under the
interpreter a pairwise tree written out (reshape and split: fast there), compiled a ``tl.reduce`` (each
thread its own elements, then lanes, then warps: fixed by the compiled layout, not by the grid). Compiled,
the tree is not safe: Triton 3.6 (the H100 image's) lays each level's reshape out as the whole row in every
thread, 255 registers, 1.2 KB of stack and 14,000 instructions a row (3.9 keeps it at 43 registers), and
on the H100 of 2026-11-27 the norm took 39 µs a call where transformers' several kernels took 17.
"""

from __future__ import annotations


import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.rows_alone_norm needs Triton ({err}): pip install 'triton>=3.7'") from None

from .triton_runtime import add, check_runnable, dependent_launch, launchable, start_as_dependent


def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, eps, H: tl.constexpr, BLOCK_H: tl.constexpr,
                     LOG_H: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr = False):
    # grid: (rows,). TREE (the interpreter): the sum as a written-out halving tree, not tl.reduce, which
    # takes the interpreter seconds a row (see rows_alone_attention.py); compiled: tl.reduce (module doc)
    if PDL:
        start_as_dependent()
    row = tl.program_id(0)
    col = tl.arange(0, BLOCK_H)
    ok = col < H
    x = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0)
    xf = x.to(tl.float32)                                                          # (BH,)
    sq = (xf * xf)[None, :]                                                        # (1, BH)
    if TREE:
        for level in tl.static_range(LOG_H):
            lo, hi = tl.split(tl.reshape(sq, (1, BLOCK_H >> (level + 1), 2)))
            sq = lo + hi
        total = tl.reshape(sq, (1,))                                               # (1,)
    else:
        total = tl.reduce(sq, 1, add)                                             # (1,)
    # IEEE-rounded square root and division (tl.sqrt is the approximate one): the same bits on any GPU
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, H * 1.0) + eps))             # (1,)
    normed = (xf * inv).to(x.dtype)                                                # back to the input dtype
    w = tl.load(w_ptr + col, mask=ok, other=0)
    tl.store(out_ptr + row * stride_o + col, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def rows_alone_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> weight * (x / rms(x)) in torch's result dtype of the two, each row on its own."""
    check_runnable(x.device)
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match rows of {h}: wrong layer")
    rows = x.reshape(-1, h)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)    # (R, H)
    interpret = x.device.type == "cpu"
    if rows.shape[0]:
        _, grid, args, meta = kernel_call(rows, weight, out, eps, interpret)
        launchable(_rms_norm_kernel, interpret)[grid](*args, **meta)
    return out.reshape(x.shape)


def kernel_call(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, interpret: bool) -> tuple:
    """(kernel function, grid, args, constexprs) of one launch over rows (R, H): ``rows_alone_rms_norm``
    runs it, and benchmarks/kernel_sass.py compiles exactly this call for a GPU without one."""
    h = rows.shape[-1]
    block = triton.next_power_of_2(h)
    # FP fusion named, not left to Triton's default (which 3.10 flips): every launch compiles alike
    opts = {} if interpret else {"num_warps": 4 if block <= 2048 else 8, "num_stages": 2, "enable_fp_fusion": True}
    return (_rms_norm_kernel, (rows.shape[0],), (rows, weight, out, rows.stride(0), out.stride(0), eps),
            dict(H=h, BLOCK_H=block, LOG_H=block.bit_length() - 1, TREE=interpret, **opts,
                 **dependent_launch(interpret)))


class RowsAloneRMSNorm(nn.Module):
    """Stands where an RMSNorm stood: its weight (the same parameter, under the same state_dict key) and
    epsilon, the kernel above. ``exact``: put in by exact mode, which takes it out again (else by the norm
    routing). The original is kept unregistered, to put back."""

    def __init__(self, norm: nn.Module, exact: bool = True):
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.exact = exact
        self.original = (norm,)         # a tuple: not a submodule (no second copy of it in modules())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_alone_rms_norm(x, self.weight, self.eps)
