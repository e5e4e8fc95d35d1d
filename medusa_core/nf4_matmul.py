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

The kernel computes the transposed product (W_tile @ x_tile.T, so the weight is the MMA's tall
operand and a tiny M only pads the narrow side), accumulates in fp32, and optionally splits K over
programs with a second, deterministic reduce kernel. Configs are measured once per
(GPU, shape, row class) inside a CUDA graph and cached; launches allocate only the output (and the
split-K partials), never sync, and so can be captured in a CUDA graph.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.nf4_matmul needs Triton ({err}): pip install 'triton>=3.6'") from None

INTERPRET_ENV = "TRITON_INTERPRET"


# The kernels use core builtins only (tl.full, tl.reduce with this combine function, not tl.zeros or
# tl.sum): Triton's standard library is jit-decorated when triton is imported, so under an interpreter
# chosen later (see _kernels) its functions would refuse to run.
@triton.jit
def _add(a, b):
    return a + b


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
            acc += tl.reduce(acc1, 1, _add)[:, None]
        o_ok = n_ok[:, None] & m_ok[None, :]
        if PARTIAL:   # fp32 partial sums (splits, M, N); the reduce kernel adds bias and casts
            tl.store(out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None], acc, mask=o_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
            dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


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


@functools.cache
def _kernels(interpret: bool):
    """(matmul, reduce) kernels: compiled for CUDA, or run by Triton's interpreter for CPU tensors.
    Built on first use, so the interpreter choice follows the environment at launch time."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(_nf4_kernel), InterpretedFunction(_reduce_kernel)
    return triton.jit(_nf4_kernel), triton.jit(_reduce_kernel)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int        # rows of x per program: 1 (broadcast-sum) or >= 16 (tl.dot, an MMA)
    block_n: int
    split_k: int        # programs along K; > 1 adds the reduce kernel
    num_warps: int = 4
    num_stages: int = 3


def interpret_enabled() -> bool:
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def check_runnable(device: torch.device) -> None:
    """One-line error where Triton cannot run this kernel on ``device``."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret_enabled():
        return
    raise RuntimeError(f"the Triton NF4 kernel needs a CUDA device; on {device.type} it runs only under Triton's "
                       f"interpreter: set {INTERPRET_ENV}=1 (slow, for tests) or use --nf4-kernel bnb")


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


def _launch_options(cfg: KernelConfig, interpret: bool) -> dict:
    if interpret:
        return {}
    # no FMA contraction: the nested scale is rounded after the product, as bitsandbytes does
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False}


def dequantize_with_kernel(weight: torch.Tensor, state, block_n: int = 32) -> torch.Tensor:
    """(N, K) fp32: the matmul kernel's own dequant path (DEQUANT_ONLY), for bit-exact tests."""
    n, k = check_state(weight, state, int(state.shape[1]))
    check_runnable(weight.device)
    interpret = weight.device.type == "cpu"
    cfg = KernelConfig(1, block_n, 1)
    out = torch.empty(n, k, dtype=torch.float32, device=weight.device)
    kernel, _ = _kernels(interpret)
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


def _launch(x2, weight, state, bias, out, cfg: KernelConfig, interpret: bool) -> None:
    m, k = x2.shape
    n = out.shape[1]
    steps = triton.cdiv(k, state.blocksize)
    splits = max(1, min(cfg.split_k, steps))
    k_per_split = triton.cdiv(steps, splits) * state.blocksize   # splits end on scale-block boundaries
    splits = triton.cdiv(k, k_per_split)                          # no empty split
    kernel, reduce = _kernels(interpret)
    absmax, code2, absmax2, offset = _scale_args(state, x2.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    # partial sums of a split-K launch: allocated per call, so graph capture keeps them in its pool
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) if splits > 1 else None
    dst = part if part is not None else out
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    kernel[grid](
        x2, weight, state.code, absmax, code2, absmax2, offset, bias_arg, dst,
        m, n, k, x2.stride(0), out.stride(0), m * n, k_per_split,
        BLOCKSIZE=state.blocksize, BLOCKSIZE2=state.state2.blocksize if state.nested else 1,
        NESTED=bool(state.nested), ALIGNED=k % state.blocksize == 0, HAS_BIAS=has_bias, PARTIAL=part is not None,
        DEQUANT_ONLY=False, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **_launch_options(cfg, interpret))
    if part is not None:
        block = 1024
        reduce[(triton.cdiv(m * n, block),)](part, bias_arg, out, m, n, splits, out.stride(0),
                                             HAS_BIAS=has_bias, BLOCK=block, **({} if interpret else {"num_warps": 4}))


# ---- configs: a short list per row class, measured once per (GPU, shape, dtype) -------------------

def row_class(m: int) -> int:
    """Row counts sharing a compiled tile height: 1 (broadcast-sum), 16, 32, 64 (MMA), larger -> 64 tiles."""
    return 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64


def candidates(m_class: int, n: int, k: int, sms: int) -> list[KernelConfig]:
    """Tiles worth timing for one row class; split-K fills the GPU when N alone gives few programs.
    Software pipelining (num_stages > 1) made the MMA variants 8x slower on an H100 (Triton 3.6)."""
    tiles = [(32, 4, 1), (64, 4, 1), (128, 8, 1)]
    if m_class == 1:
        tiles += [(32, 4, 3), (64, 4, 3)]
    out = []
    for block_n, warps, stages in tiles:
        programs = triton.cdiv(n, block_n)
        for split in (1, 2, 4, 8):
            if split > 1 and (programs * (split // 2) >= 4 * sms or k // split < 256):
                continue
            out.append(KernelConfig(m_class, block_n, split, warps, stages))
    return out


def default_config(m: int, n: int, k: int, sms: int) -> KernelConfig:
    """Untimed choice (first use during graph capture): enough programs for ~2 waves."""
    block_n, split = 64, 1
    while triton.cdiv(n, block_n) * split < 2 * sms and k // (split * 2) >= 256:
        split *= 2
    return KernelConfig(row_class(m), block_n, split, 4, 1)


_TUNED: dict[tuple, KernelConfig] = {}


def choose_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int = 64) -> KernelConfig:
    if device.type != "cuda":
        return KernelConfig(row_class(m), 64, 1, 4, 1)     # the interpreter: fewest programs
    key = (torch.cuda.get_device_name(device), row_class(m), n, k, dtype, blocksize)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if torch.cuda.is_current_stream_capturing():
        # timing needs its own graph and syncs: not inside someone else's capture; tune_shape() first
        return default_config(m, n, k, sms)
    return tune_shape(m, n, k, dtype, device, blocksize)


def tune_shape(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, blocksize: int = 64) -> KernelConfig:
    """Time every candidate for this row class on a random NF4 weight of shape (n, k), rotating among
    copies larger than L2 (the model's layers are not L2-resident either); cache the fastest."""
    from bitsandbytes.functional import quantize_4bit

    key = (torch.cuda.get_device_name(device), row_class(m), n, k, dtype, blocksize)
    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    packed, state = quantize_4bit(w, blocksize=blocksize, compress_statistics=True, quant_type="nf4")
    del w
    copies = rotating_copies(packed, state, props.L2_cache_size)
    x = torch.randn(row_class(m) if m > 1 else 1, k, device=device, dtype=dtype, generator=gen)
    best, best_us = None, float("inf")
    for cfg in candidates(row_class(m), n, k, props.multi_processor_count):
        calls = [functools.partial(nf4_matmul, x, p, s, config=cfg) for p, s in copies]
        try:
            us = graph_time_us(calls, replays=3)
        except Exception as err:  # a tile that fails to compile on this GPU is skipped, loudly
            print(f"nf4_matmul: config {cfg} failed on {key[0]} ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
            continue
        if us < best_us:
            best, best_us = cfg, us
    if best is None:
        raise RuntimeError(f"no Triton NF4 config compiled for {n}x{k} on {key[0]}: use --nf4-kernel bnb")
    _TUNED[key] = best
    return best


def rotating_copies(packed: torch.Tensor, state, l2_bytes: int, at_least: int = 2) -> list[tuple]:
    """Enough (packed, state) copies that cycling through them streams from HBM, not L2."""
    size = packed.numel() + state.absmax.numel() * state.absmax.element_size()
    count = max(at_least, min(16, -(-2 * l2_bytes // max(size, 1))))
    out = [(packed, state)]
    for _ in range(count - 1):
        s = copy.copy(state)
        s.absmax = state.absmax.clone()
        out.append((packed.clone(), s))
    return out


def graph_time_us(calls: list[Callable[[], object]], replays: int = 5, repeat: int = 4) -> float:
    """Median µs per call: ``calls`` (cycled ``repeat`` times) captured back to back in one CUDA graph,
    replayed and timed with CUDA events; launch overhead is gone, as in the decoding loop's graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):        # warm-up compiles and fills allocator pools outside capture
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in calls:
                fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (repeat * len(calls)))
    del graph
    return sorted(times)[len(times) // 2]
