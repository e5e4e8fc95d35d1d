"""``y = x @ W.T`` for a few activation rows against a bitsandbytes NF4 weight, in Triton.

Medusa verifies a tree of 2..64 tokens per step; bitsandbytes' multi-row path is slow there
(dequantize to a full bf16 copy, then a GEMM). This kernel reads the packed weight and its
QuantState exactly as bitsandbytes stores them (no repacking, no second copy) and dequantizes
each tile in registers right before the multiply.

Storage (bitsandbytes 0.50): ``weight.data`` uint8 [(N*K+1)//2, 1] is W[N, K] row-major,
element 2j in the high nibble, 2j+1 in the low one; ``code`` fp32 [16] the NF4 table; one scale
per ``blocksize`` (64) consecutive elements. With double quant the scales are themselves uint8:
scale[b] = code2[absmax[b]] * absmax2[b // blocksize2] + offset.
W.flat[e] = code[nibble(e)] * scale[e // blocksize] in fp32, cast to the compute dtype.

Two kernels compute the transposed product (W_tile @ x_tile.T, so the weight is the MMA's tall
operand and a tiny M only pads the narrow side), accumulate in fp32, and optionally split K over
programs with a second, deterministic reduce kernel: _nf4_kernel (the tile kernel: any K, one scale
block at a time, loads then waits) and _nf4_stream_kernel (K a multiple of its step: keeps 2-4 steps
of packed words in flight, unpacks with shifts, scales block sums instead of weights). Configs of
both are measured once per (GPU, shape, row class) inside a CUDA graph, checked against the tile
kernel and cached; a config that fails to compile is skipped. Launches allocate only the output (and
the split-K partials), never sync, and so can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_matmul needs Triton ({err}): pip install 'triton>=3.7'") from None

from .kernel_timing import (JitLaunch, NoConfigCompiled, compile_ahead, decode_tuning, graph_time_us, pick_fastest,
                            remembered, remembering_now, rotating_copies)
from .triton_runtime import add, check_runnable, launchable


def _nf4_kernel(x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr, out_ptr,
                M, N, K, stride_xm, stride_om, stride_os, k_per_split,
                BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, ALIGNED: tl.constexpr,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DEQUANT_ONLY: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # grid: (N tiles, K splits, M tiles). A program owns W[BLOCK_N rows, its K range] and, unless
    # DEQUANT_ONLY (which writes the fp32 tile to out[N, K] instead), BLOCK_M rows of x.
    # BLOCK_M == 1: broadcast-multiply, reduced once at the end; BLOCK_M >= 16: tl.dot (an MMA).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    HALF: tl.constexpr = BLOCKSIZE // 2            # packed bytes (= element pairs) per scale block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    row = offs_n.to(tl.int64)                      # N*K passes 2**31 for vocab projections
    pair = tl.arange(0, HALF)
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    acc1 = tl.full((BLOCK_N, HALF), 0.0, tl.float32)     # BLOCK_M == 1: per-lane partial sums
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for kb in range(k_lo, k_hi, BLOCKSIZE):
        # one scale block (BLOCKSIZE columns) of BLOCK_N rows per step; 2D tiles only
        col = kb + 2 * pair                                               # (HALF,) even columns
        if ALIGNED:
            # the whole block lies inside [k_lo, k_hi): a row-only mask keeps the loads vectorized
            ok = n_ok[:, None]                                            # (BN, 1)
            x_kok = pair >= 0
        else:
            ok = n_ok[:, None] & (col < k_hi)[None, :]                    # (BN, HALF); K even: col+1 < K too
            x_kok = col < k_hi
        # byte offsets written as kb/2 + pair (not col // 2) so Triton sees them contiguous and loads
        # 16 bytes per thread along K; masked lanes read nothing, so the packed buffer is never read past
        byte = tl.max_contiguous(tl.multiple_of(kb // 2 + pair, HALF), HALF)
        packed = tl.load(w_ptr + row[:, None] * (K // 2) + byte[None, :], mask=ok, other=0)
        # the 16-entry table sits in one cache line: each gather costs one load
        code_even = tl.load(code_ptr + (packed >> 4).to(tl.int32))
        code_odd = tl.load(code_ptr + (packed & 15).to(tl.int32))
        if ALIGNED:   # K % BLOCKSIZE == 0: a scale block never straddles rows; one scale per row
            blk = row * (K // BLOCKSIZE) + kb // BLOCKSIZE                           # (BN,)
            blk_ok = n_ok
        else:         # blocks straddle rows: one scale per element pair (blocksize is even)
            blk = (row[:, None] * K + col[None, :]) // BLOCKSIZE                     # (BN, HALF)
            blk_ok = ok
        scale = tl.load(absmax_ptr + blk, mask=blk_ok, other=0)
        if NESTED:
            # bitsandbytes rounds the product before adding the offset (no FMA: see enable_fp_fusion)
            scale = (tl.load(code2_ptr + scale.to(tl.int32))
                     * tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=blk_ok, other=0)) + tl.load(offset_ptr)
        if ALIGNED:
            scale = scale[:, None]
        w_even = code_even * scale                                    # (BN, HALF) fp32
        w_odd = code_odd * scale
        if DEQUANT_ONLY:
            dst = out_ptr + row[:, None] * stride_om + col[None, :]
            tl.store(dst, w_even, mask=ok)
            tl.store(dst + 1, w_odd, mask=ok)
        else:
            # cast to the compute dtype as bitsandbytes does before its GEMM
            we = w_even.to(x_ptr.dtype.element_ty)
            wo = w_odd.to(x_ptr.dtype.element_ty)
            if BLOCK_M == 1:
                xe = tl.load(x_ptr + offs_m * stride_xm + col, mask=x_kok & m_ok, other=0)   # (HALF,)
                xo = tl.load(x_ptr + offs_m * stride_xm + col + 1, mask=x_kok & m_ok, other=0)
                acc1 += we.to(tl.float32) * xe.to(tl.float32)[None, :]
                acc1 += wo.to(tl.float32) * xo.to(tl.float32)[None, :]
            else:
                x_src = x_ptr + offs_m[None, :] * stride_xm + col[:, None]      # (HALF, BM): x.T
                x_ok = x_kok[:, None] & m_ok[None, :]
                xe = tl.load(x_src, mask=x_ok, other=0)
                xo = tl.load(x_src + 1, mask=x_ok, other=0)
                acc = tl.dot(we, xe, acc, input_precision=PRECISION)
                acc = tl.dot(wo, xo, acc, input_precision=PRECISION)
    if not DEQUANT_ONLY:
        if BLOCK_M == 1:
            acc += tl.reduce(acc1, 1, add)[:, None]
        o_ok = n_ok[:, None] & m_ok[None, :]
        if PARTIAL:   # fp32 partial sums (splits, M, N); the reduce kernel adds bias and casts
            tl.store(out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None], acc, mask=o_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
            dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def _nf4_stream_kernel(x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr, out_ptr,
                       M, N, K, row_words, stride_xm, stride_om, stride_os, k_per_split,
                       BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SLOTS: tl.constexpr,
                       X_WORDS: tl.constexpr):
    # The streaming variant: same grid and output as _nf4_kernel, for K and k_per_split multiples of
    # SLOTS * SUB * BLOCKSIZE (no K mask at all). What differs is how much weight is in flight:
    # - a step takes SUB scale blocks of BLOCK_N rows, SUB * BLOCKSIZE/2 contiguous bytes per row, as a
    #   (BLOCK_N, SUB, WORDS) tile of 32-bit words (4 bytes a register, unpacked with shifts only when
    #   multiplied) whose per-block scale broadcasts along the last axis (no gather);
    # - SLOTS raw tiles (words + scale bytes) are in flight: the loop body is unrolled over the slots;
    #   each step multiplies the oldest slot, fetches the step SLOTS ahead and shifts the slots. The shift
    #   renames values inside the unrolled body and comes full circle at the loop's end, so no register
    #   copy ever waits on a load (a ring carried by moves would wait on every refill); the loop starts
    #   one group early, and that group only fills the slots;
    # - row_words (= K/8) is an argument, so Triton specializes it as a multiple of 16 and proves every
    #   row's words 16-byte aligned (the launcher checks the weight's own pointer is 4-byte aligned);
    # - the scale multiplies per-block sums, not weights, where it can: BLOCK_M == 1 sums code*x per
    #   block, then scales; SUB == 1 with an MMA scales the (BLOCK_N, BLOCK_M) dot of the raw codes
    #   (s * sum_k code*x: reassociated, within rounding);
    # - X_WORDS (16-bit x, 4-byte aligned rows): x is read as 32-bit words, each the (even, odd) column
    #   pair the two nibbles of a byte multiply: one contiguous load per pair instead of two strided ones.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    HALF: tl.constexpr = BLOCKSIZE // 2
    STEP: tl.constexpr = SUB * BLOCKSIZE
    GROUP: tl.constexpr = SLOTS * STEP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    row = offs_n.to(tl.int64)
    sub = tl.arange(0, SUB)
    q = tl.arange(0, SUB * HALF)                                  # element pairs of a step, block-major
    WORDS: tl.constexpr = HALF // 4                              # 32-bit words of packed weight per block
    w_row = (w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + row * row_words)[:, None, None]   # (BN, 1, 1)
    blk_row = (row * (K // BLOCKSIZE))[:, None]                  # (BN, 1) first scale block of each row
    in_step = sub[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # (SUB, WORDS) word offsets within a step
    byte_shift = (tl.arange(0, 4) * 8)[None, None, None, :]
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    cdt = x_ptr.dtype.element_ty
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)   # X_WORDS: x as (even, odd) column pairs
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    w0 = tl.full((BLOCK_N, SUB, WORDS), 0, tl.int32)              # the slots, oldest first: packed words,
    s0 = tl.full((BLOCK_N, SUB), 0, absmax_ptr.dtype.element_ty)  # raw scales
    w1, s1, w2, s2, w3, s3 = w0, s0, w0, s0, w0, s0               # (unused past SLOTS: dropped by the compiler)
    for kb0 in range(k_lo - GROUP, k_hi, GROUP):
        for ph in tl.static_range(SLOTS):
            packed, raw = w0, s0
            kb = kb0 + ph * STEP
            if kb0 >= k_lo:
                if NESTED:   # (BN, SUB)
                    scale = tl.load(code2_ptr + raw.to(tl.int32)) * tl.load(
                        absmax2_ptr + (blk_row + kb // BLOCKSIZE + sub[None, :]) // BLOCKSIZE2,
                        mask=n_ok[:, None], other=0) + tl.load(offset_ptr)
                else:
                    scale = raw.to(tl.float32)
                # word >> 8b puts byte b (little endian) in the low 8 bits: (BN, SUB, HALF), column-pair order
                low = tl.reshape(packed[:, :, :, None] >> byte_shift, (BLOCK_N, SUB, HALF))
                code_even = tl.load(code_ptr + ((low >> 4) & 15))                        # (BN, SUB, HALF) fp32
                code_odd = tl.load(code_ptr + (low & 15))
                # x.T at this step's (even, odd) columns: (SUB*HALF, BM)
                if X_WORDS:
                    pairs = tl.load(x_pairs + offs_m[None, :] * (stride_xm // 2) + (kb // 2 + q)[:, None],
                                    mask=m_ok[None, :], other=0)
                    xe = (pairs & 0xFFFF).to(tl.uint16).to(cdt, bitcast=True)           # little endian: even
                    xo = (pairs >> 16).to(tl.uint16).to(cdt, bitcast=True)
                else:
                    x_src = x_ptr + offs_m[None, :] * stride_xm + (kb + 2 * q)[:, None]
                    xe = tl.load(x_src, mask=m_ok[None, :], other=0)
                    xo = tl.load(x_src + 1, mask=m_ok[None, :], other=0)
                if BLOCK_M == 1:
                    xe = tl.reshape(xe.to(tl.float32), (1, SUB, HALF))
                    xo = tl.reshape(xo.to(tl.float32), (1, SUB, HALF))
                    acc += tl.reduce(tl.reduce(code_even * xe + code_odd * xo, 2, add) * scale, 1, add)[:, None]
                else:
                    if SUB == 1:
                        we = tl.reshape(code_even, (BLOCK_N, HALF)).to(cdt)
                        wo = tl.reshape(code_odd, (BLOCK_N, HALF)).to(cdt)
                        part = tl.dot(wo, xo, tl.dot(we, xe, input_precision=PRECISION), input_precision=PRECISION)
                        acc += part * tl.reshape(scale, (BLOCK_N, 1))
                    else:
                        we = tl.reshape((code_even * scale[:, :, None]).to(cdt), (BLOCK_N, SUB * HALF))
                        wo = tl.reshape((code_odd * scale[:, :, None]).to(cdt), (BLOCK_N, SUB * HALF))
                        acc = tl.dot(wo, xo, tl.dot(we, xe, acc, input_precision=PRECISION),
                                     input_precision=PRECISION)
            # fetch the step one group ahead. Row-only mask (the loads stay 16 bytes wide), all-false past
            # k_hi: one compare, not n_ok & scalar (an int32 mask in the interpreter)
            fetch = kb + GROUP
            live = (offs_n < tl.where(fetch < k_hi, N, 0))[:, None]                   # (BN, 1)
            word = tl.max_contiguous(tl.multiple_of(fetch // 8 + in_step, [WORDS, WORDS]), [1, WORDS])
            packed = tl.load(w_row + word[None, :, :], mask=live[:, :, None], other=0)
            raw = tl.load(absmax_ptr + blk_row + fetch // BLOCKSIZE + sub[None, :], mask=live, other=0)
            if SLOTS == 1:
                w0, s0 = packed, raw
            if SLOTS == 2:
                w0, s0, w1, s1 = w1, s1, packed, raw
            if SLOTS == 4:
                w0, s0, w1, s1, w2, s2, w3, s3 = w1, s1, w2, s2, w3, s3, packed, raw
    if PARTIAL:   # fp32 partial sums (splits, M, N) for the reduce kernel
        dst = out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None]
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
        dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, splits, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # out[m, n] = sum_s part[s, m, n] (+ bias[n]), summed in a fixed order: deterministic
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _kernels(interpret: bool):
    """(tile matmul, streaming matmul, reduce) kernels, for CUDA or the interpreter (see launchable)."""
    return tuple(launchable(fn, interpret) for fn in (_nf4_kernel, _nf4_stream_kernel, _reduce_kernel))


@dataclass(frozen=True)
class KernelConfig:
    block_m: int        # rows of x per program: 1 (broadcast-sum) or >= 16 (tl.dot, an MMA)
    block_n: int
    split_k: int        # programs along K; > 1 adds the reduce kernel
    num_warps: int = 4
    num_stages: int = 3
    sub: int = 0        # 0: _nf4_kernel; >= 1: _nf4_stream_kernel taking ``sub`` scale blocks per step (K a
    #                     multiple of sub * blocksize; other K fall back to _nf4_kernel with the same tile)
    slots: int = 1      # _nf4_stream_kernel: steps in flight (1, 2 or 4)

    def __post_init__(self):
        if self.slots not in (1, 2, 4) or self.sub < 0:
            raise ValueError(f"stream kernel slots must be 1, 2 or 4 (got {self.slots}), sub >= 0 (got {self.sub})")

    def describe(self) -> str:
        kind = f"stream sub{self.sub} slots{self.slots}" if self.sub else "tile"
        return f"{kind} m{self.block_m} n{self.block_n} split{self.split_k} w{self.num_warps} s{self.num_stages}"


def check_state(weight: torch.Tensor, state, in_features: int) -> tuple[int, int]:
    """(N, K) of a bitsandbytes NF4 weight the kernel can read as stored; else a one-line error."""
    if state is None or getattr(state, "quant_type", None) != "nf4":
        raise ValueError(f"the Triton NF4 kernel reads NF4 weights only, got quant_type "
                         f"{getattr(state, 'quant_type', None)!r}: use --nf4-kernel bnb for this model")
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError("this NF4 weight was repacked by bitsandbytes' CPU path (packing_format_for_cpu): "
                         "switch kernels before the model's first forward")
    n, k = (int(s) for s in state.shape)
    if k != in_features:
        raise ValueError(f"x has {in_features} features but the NF4 weight is {n}x{k}: wrong layer")
    if k % 2 or state.blocksize % 2:
        raise ValueError(f"the Triton NF4 kernel needs an even K and blocksize, got K={k}, blocksize={state.blocksize}")
    if weight.dtype != torch.uint8 or weight.numel() != (n * k + 1) // 2:
        raise ValueError(f"NF4 weight holds {weight.numel()} {weight.dtype} values, expected {(n * k + 1) // 2} "
                         f"uint8 for {n}x{k}: not bitsandbytes' packed layout")
    return n, k


def dequantize_nf4(weight: torch.Tensor, state) -> torch.Tensor:
    """(N, K) fp32 from the storage layout alone, in plain torch: the reference for the tests."""
    n, k = (int(s) for s in state.shape)
    packed = weight.reshape(-1)[: (n * k + 1) // 2]                             # (ceil(N*K/2),) uint8
    nibbles = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[: n * k].long()   # (N*K,)
    if state.nested:
        scale = state.state2.code[state.absmax.long()] * state.state2.absmax.repeat_interleave(
            state.state2.blocksize)[: state.absmax.numel()]
        scale = scale + state.offset                                            # rounded product, then add
    else:
        scale = state.absmax.float()
    blocks = torch.arange(n * k, device=weight.device) // state.blocksize
    return (state.code.float()[nibbles] * scale[blocks]).reshape(n, k)


def _scale_args(state, device: torch.device):
    """(absmax, code2, absmax2, offset) pointers; dummies where a level is absent."""
    if not state.nested:
        return state.absmax, state.absmax, state.absmax, state.absmax
    offset = state.offset
    if not isinstance(offset, torch.Tensor):   # some checkpoints keep a Python float
        offset = torch.tensor(float(offset), dtype=torch.float32, device=device)
    return state.absmax, state.state2.code, state.state2.absmax, offset


def _launch_options(cfg: KernelConfig, interpret: bool, stream: bool = False) -> dict:
    if interpret:
        return {}
    # the tile kernel, no FMA contraction: its nested scale is rounded after the product, as bitsandbytes
    # does (its dequant path is tested bit for bit); the stream kernel is within rounding and wants FMAs
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": stream}


def dequantize_with_kernel(weight: torch.Tensor, state, block_n: int = 32) -> torch.Tensor:
    """(N, K) fp32: the matmul kernel's own dequant path (DEQUANT_ONLY), for bit-exact tests."""
    n, k = check_state(weight, state, int(state.shape[1]))
    check_runnable(weight.device)
    interpret = weight.device.type == "cpu"
    cfg = KernelConfig(1, block_n, 1)
    out = torch.empty(n, k, dtype=torch.float32, device=weight.device)
    kernel = _kernels(interpret)[0]
    absmax, code2, absmax2, offset = _scale_args(state, weight.device)
    kernel[(triton.cdiv(n, block_n), 1, 1)](
        out, weight, state.code, absmax, code2, absmax2, offset, out, out,
        1, n, k, 0, out.stride(0), 0, k,
        BLOCKSIZE=state.blocksize, BLOCKSIZE2=state.state2.blocksize if state.nested else 1,
        NESTED=bool(state.nested), ALIGNED=k % state.blocksize == 0, HAS_BIAS=False, PARTIAL=False,
        DEQUANT_ONLY=True, PRECISION="ieee", BLOCK_M=1, BLOCK_N=block_n,
        **_launch_options(cfg, interpret))
    return out


def nf4_matmul(x: torch.Tensor, weight: torch.Tensor, state, bias: torch.Tensor | None = None, *,
               config: KernelConfig | None = None) -> torch.Tensor:
    """x (..., K) fp16/bf16/fp32 @ W.T (+ bias) -> (..., N) in x's dtype; W is the NF4 ``weight``
    with its ``state`` as bitsandbytes stores them."""
    k_in = x.shape[-1]
    n, k = check_state(weight, state, k_in)
    check_runnable(x.device)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"nf4_matmul computes in fp16, bf16 or fp32, got {x.dtype}: cast x first")
    x2 = x.reshape(-1, k)                                         # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)      # (M, N)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    interpret = x.device.type == "cpu"
    cfg = config or choose_config(m, n, k, x.dtype, x.device, state.blocksize)
    _launch(x2, weight, state, bias, out, cfg, interpret)
    return out.reshape(*x.shape[:-1], n)


def kernel_call(x2, weight, state, bias, out, cfg: KernelConfig, interpret: bool) -> tuple:
    """(kernel function, grid, args, keyword args, fp32 partials or None) of one launch: ``_launch``
    runs it, and benchmarks/kernel_sass.py compiles exactly this call for a GPU without one."""
    m, k = x2.shape
    n = out.shape[1]
    use_stream = cfg.sub > 0 and k % (cfg.slots * cfg.sub * state.blocksize) == 0 and weight.data_ptr() % 4 == 0
    step = state.blocksize * (cfg.slots * cfg.sub if use_stream else 1)
    steps = triton.cdiv(k, step)
    splits = max(1, min(cfg.split_k, steps))
    k_per_split = triton.cdiv(steps, splits) * step               # splits end on step boundaries
    splits = triton.cdiv(k, k_per_split)                          # no empty split
    absmax, code2, absmax2, offset = _scale_args(state, x2.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    # partial sums of a split-K launch: allocated per call, so graph capture keeps them in its pool
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) if splits > 1 else None
    dst = part if part is not None else out
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    common = dict(BLOCKSIZE=state.blocksize, BLOCKSIZE2=state.state2.blocksize if state.nested else 1,
                  NESTED=bool(state.nested), HAS_BIAS=has_bias, PARTIAL=part is not None,
                  PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, **_launch_options(cfg, interpret, use_stream))
    ptrs = (x2, weight, state.code, absmax, code2, absmax2, offset, bias_arg, dst)
    if use_stream:
        return _nf4_stream_kernel, grid, (*ptrs, m, n, k, k // 8, x2.stride(0), out.stride(0), m * n, k_per_split), \
            dict(SUB=cfg.sub, SLOTS=cfg.slots,
                 X_WORDS=x2.element_size() == 2 and x2.stride(0) % 2 == 0 and x2.data_ptr() % 4 == 0, **common), part
    return _nf4_kernel, grid, (*ptrs, m, n, k, x2.stride(0), out.stride(0), m * n, k_per_split), \
        dict(ALIGNED=k % state.blocksize == 0, DEQUANT_ONLY=False, **common), part


def _launch(x2, weight, state, bias, out, cfg: KernelConfig, interpret: bool) -> None:
    fn, grid, args, meta, part = kernel_call(x2, weight, state, bias, out, cfg, interpret)
    launchable(fn, interpret)[grid](*args, **meta)
    if part is not None:
        reduce_partials(part, bias, out, interpret)


def compiled_launch(x2, weight, state, cfg: KernelConfig) -> JitLaunch:
    """The matmul launch ``nf4_matmul(x2, weight, state, config=cfg)`` makes on CUDA (its split-K sum aside), for
    kernel_timing.compile_ahead."""
    out = torch.empty(x2.shape[0], state.shape[0], dtype=x2.dtype, device=x2.device)
    fn, grid, args, meta, _ = kernel_call(x2, weight, state, None, out, cfg, interpret=False)
    return launchable(fn, False), grid, args, meta


def reduce_partials(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, interpret: bool) -> None:
    """out (M, N) = sum of the split-K partials part (splits, M, N), in split order (deterministic), + bias."""
    splits, m, n = part.shape
    block = 1024
    _kernels(interpret)[2][(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else out, out, m, n, splits, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, **({} if interpret else {"num_warps": 4}))


# ---- configs: a short list per row class, measured once per (GPU, shape, dtype) -------------------

def row_class(m: int) -> int:
    """Row counts sharing a compiled tile height: 1 (broadcast-sum), 16, 32, 64 (MMA), larger -> 64 tiles."""
    return 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64


# _nf4_stream_kernel configs per row class: (block_n, num_warps, slots, programs per SM to aim at with
# split-K). Why these (ptxas/SASS for sm_90, Triton 3.6; the figures are in docs/performance.md): 32 rows
# per warp (block_n = 32 * num_warps) issues the fewest instructions per weight byte, which bounds a
# 1-row matmul on an H100; split-K's fp32 partials cost 8*M*N bytes per split, hence the low program
# targets for the wide row classes. Tuning at model load times the first STREAM_SHORT of each class
# against the tile kernel; benchmarks/nf4_kernel.py times them all (wide=True) and its table shows
# which won where: put the winners first.
STREAM_SHORT = 2
STREAM_TILES = {
    1: ((128, 4, 4, 4), (64, 4, 4, 4), (128, 4, 2, 4), (256, 8, 4, 2)),
    16: ((128, 4, 2, 2), (64, 4, 2, 2), (128, 4, 2, 1), (256, 8, 2, 1)),
    32: ((128, 4, 2, 1), (64, 4, 2, 1), (128, 8, 2, 1), (64, 4, 4, 2)),
    64: ((64, 4, 2, 1), (128, 8, 2, 1), (128, 8, 4, 1), (128, 4, 2, 1)),
}


def _split_for(n: int, k: int, block_n: int, min_k: int, programs: int) -> int:
    """The smallest power-of-two split-K giving at least ``programs`` programs, each >= ``min_k`` columns."""
    split = 1
    while triton.cdiv(n, block_n) * split < programs and k // (split * 2) >= min_k:
        split *= 2
    return split


def candidates(m_class: int, n: int, k: int, sms: int, blocksize: int = 64, wide: bool = False) -> list[KernelConfig]:
    """Configs worth timing for one row class: the known-good tile kernel first (the fallback and the
    reference the others must match), then the stream kernel's: the first STREAM_SHORT, or all if
    ``wide``. Software pipelining (num_stages > 1) made the tile kernel's MMA variants 8x slower on an
    H100 (Triton 3.6); the stream kernel pipelines by hand (its slots)."""
    out = [default_config(m_class, n, k, sms)]
    if m_class == 1:   # the tile kernel's other shape for one row (pipelined: no MMA there)
        out.append(KernelConfig(1, 32, _split_for(n, k, 32, 256, 2 * sms), 4, 3))
    for block_n, warps, slots, per_sm in STREAM_TILES[m_class][: None if wide else STREAM_SHORT]:
        group = slots * blocksize
        if k % group:
            continue            # the stream kernel would fall back to the tile kernel: nothing new to time
        cfg = KernelConfig(m_class, block_n, _split_for(n, k, block_n, 4 * group, per_sm * sms), warps, 1,
                           sub=1, slots=slots)
        if cfg not in out:      # two program targets can give the same split
            out.append(cfg)
    return out


def default_config(m: int, n: int, k: int, sms: int) -> KernelConfig:
    """Untimed choice (first use during graph capture, and the fallback): the tile kernel with enough
    programs for ~2 waves, known good on an H100 with Triton 3.6."""
    return KernelConfig(row_class(m), 64, _split_for(n, k, 64, 256, 2 * sms), 4, 1)


_TUNED: dict[tuple, KernelConfig] = {}
TUNING_LOG: dict[tuple, list[tuple[str, float | None]]] = {}   # key -> (config, µs or None if skipped) as timed


def _key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int) -> tuple:
    return torch.cuda.get_device_name(device), row_class(m), n, k, dtype, blocksize


def choose_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int = 64) -> KernelConfig:
    if device.type != "cuda":
        return KernelConfig(row_class(m), 64, 1, 4, 1)     # the interpreter: fewest programs
    key = _key(m, n, k, dtype, device, blocksize)
    cfg = _TUNED.get(key)
    if cfg is not None and not remembering_now():       # a load asks its memory (kernel_timing.remembered)
        return cfg
    if torch.cuda.is_current_stream_capturing():
        # timing needs its own graph and syncs: not inside someone else's capture; tune_shape() first
        return cfg or default_config(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count)
    return tune_shape(m, n, k, dtype, device, blocksize)


def tuned_us(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int = 64) -> float:
    """µs of the fastest config timed for M's row class and this shape on this GPU (tuned first if not yet)."""
    key = _key(m, n, k, dtype, device, blocksize)
    if key not in _TUNED or remembering_now():
        tune_shape(m, n, k, dtype, device, blocksize)
    return min(us for _, us in TUNING_LOG[key] if us is not None)


def tune_shape(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int = 64,
               wide: bool = False) -> KernelConfig:
    """Time every candidate for this row class (``wide``: the long list) on a random NF4 weight of shape
    (n, k), rotating among copies larger than L2 (the model's layers are not L2-resident either); cache
    the fastest for choose_config (and, inside kernel_timing.remembering, across starts)."""
    key = _key(m, n, k, dtype, device, blocksize)
    best, TUNING_LOG[key] = remembered(
        "triton-nf4", (*key, wide), lambda: _time_candidates(m, n, k, dtype, device, blocksize, wide, key),
        lambda saved: decode_tuning(KernelConfig, saved))
    _TUNED[key] = best
    return best


def _time_candidates(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int, wide: bool,
                     key: tuple) -> tuple[KernelConfig, list]:
    from bitsandbytes.functional import quantize_4bit

    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    packed, state = quantize_4bit(w, blocksize=blocksize, compress_statistics=True, quant_type="nf4")
    del w
    copies = rotating_copies(packed, state, props.L2_cache_size)
    x = torch.randn(row_class(m) if m > 1 else 1, k, device=device, dtype=dtype, generator=gen)
    configs = candidates(row_class(m), n, k, props.multi_processor_count, blocksize, wide)
    compile_ahead([functools.partial(compiled_launch, x, packed, state, cfg) for cfg in configs])
    best, log = pick_fastest(
        configs,
        run=lambda cfg: nf4_matmul(x, packed, state, config=cfg),
        time_us=lambda cfg: graph_time_us([functools.partial(nf4_matmul, x, p, s, config=cfg) for p, s in copies],
                                          replays=3),
        where=f"{n}x{k} M<={row_class(m)} on {key[0]}")
    if best is None:
        TUNING_LOG[key] = log       # the skipped configs, for the benchmark's print
        raise NoConfigCompiled(f"no Triton NF4 config compiled for {n}x{k} on {key[0]}")
    return best, log
