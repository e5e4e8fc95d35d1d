"""``y = x @ W.T (+ b)`` for a dense weight in which each row of x gets bits that do not depend on the
other rows in the call (Triton): exact mode's lm_head.

Why: a GEMM library picks its kernel, tiling and split of K from the row count (cuBLAS a GEMV for one
row and a tiled GEMM for 16; this CPU's fp32 GEMM already differs at 5 rows), so a tree row's logits
can differ in the last bits from the 1-row step's, and a greedy argmax near a tie can flip. Here the
products stay elementwise in fp32 lanes (BLOCK_M, BLOCK_N, LANES) over the whole K range, one lane per
column residue, and the lanes are summed at the end by a fixed pairwise tree: the same order for every
row whatever BLOCK_M or M. No split of K. It runs on CUDA cores (one FMA per weight per row), which is
the price of exactness a GPU session measures; it reads the weight once per 8 rows, where calling the
head one row at a time would read it once per row.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.rows_alone_linear needs Triton ({err}): pip install 'triton>=3.7'") from None

from .triton_runtime import check_runnable, launchable

BLOCK_N = 32        # output features per program
LANES = 32          # columns per step: the lanes each (row, output) accumulates in
MAX_BLOCK_M = 8     # rows per program (more rows: more programs, the same arithmetic per row)


def _rows_alone_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              LANES: tl.constexpr, LOG_LANES: tl.constexpr):
    # grid: (M tiles, N tiles): the row tiles of one weight tile side by side, the later ones from L2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 offsets: a long prefill times a large vocabulary passes 2**31 elements
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    lane = tl.arange(0, LANES)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N, LANES), 0.0, tl.float32)
    for k0 in range(0, K, LANES):
        col = k0 + lane
        k_ok = col < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0).to(tl.float32)                                            # (BM, L)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + col[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0).to(tl.float32)                                            # (BN, L)
        acc += x[:, None, :] * w[None, :, :]                                           # (BM, BN, L)
    for level in tl.static_range(LOG_LANES):                                           # lanes: a fixed tree
        lo, hi = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, LANES >> (level + 1), 2)))
        acc = lo + hi
    y = tl.reshape(acc, (BLOCK_M, BLOCK_N))
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def kernel_call(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                interpret: bool) -> tuple:
    """(kernel function, grid, args, constexprs) of one launch: ``rows_alone_linear`` runs it, and
    benchmarks/kernel_sass.py compiles exactly this call for a GPU without one."""
    m, k = x2.shape
    n = weight.shape[0]
    block_m = min(triton.next_power_of_2(m), MAX_BLOCK_M)
    # FP fusion named, not left to Triton's default (which 3.10 flips): every launch compiles alike
    opts = {} if interpret else {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True}
    args = (x2, weight, bias if bias is not None else out, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, LANES=LANES,
                LOG_LANES=LANES.bit_length() - 1, **opts)
    return _rows_alone_linear_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N)), args, meta


def rows_alone_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T (+ bias) -> (..., N) in x's dtype, each row's bits independent of the rest."""
    check_runnable(x.device)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_floating_point():
        raise ValueError(f"rows_alone_linear takes a dense (N, K) weight matching x's {x.shape[-1]} features, got "
                         f"{weight.dtype} {tuple(weight.shape)}: wrong layer")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)        # (M, N)
    interpret = x.device.type == "cpu"
    if x2.shape[0]:
        _, grid, args, meta = kernel_call(x2, w, bias, out, interpret)
        launchable(_rows_alone_linear_kernel, interpret)[grid](*args, **meta)
    return out.reshape(*x.shape[:-1], w.shape[0])


class RowsAloneHead(nn.Module):
    """Stands where the lm_head stood in exact mode: the same module inside, multiplied by the kernel
    above (a head whose weight is not dense, quantized, is called one row at a time instead: the very
    call a 1-row step makes, at one read of its weight per row). ``weight`` is the wrapped module's (no
    setter): re-tying weights (resize_token_embeddings) needs nf4_fused.leave_exact first."""

    def __init__(self, dense: nn.Module):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = dense.in_features, dense.out_features

    @property
    def weight(self) -> torch.Tensor:       # the heads read its rows (tied to the embeddings in some models)
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:                       # (..., H) -> (..., V)
        if self.weight.is_floating_point():
            return rows_alone_linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])                                      # (R, H)
        out = torch.cat([self.dense(rows[i:i + 1]) for i in range(rows.shape[0])])   # (R, V)
        return out.reshape(*x.shape[:-1], out.shape[-1])
