"""``y = x @ W.T`` for a few activation rows against a bitsandbytes NF4 weight, in Triton: the configs of the
kernels on bitsandbytes' storage (nf4_storage_kernels.py), measured once per (GPU, shape, row class) inside a
CUDA graph, checked against the tile kernel and cached, and their launch.

Medusa verifies a tree of 2..64 tokens per step; bitsandbytes' multi-row path is slow there
(dequantize to a full bf16 copy, then a GEMM). These kernels read the packed weight and its
QuantState exactly as bitsandbytes stores them (no repacking, no second copy) and dequantize
each tile in registers right before the multiply. A config that fails to compile is skipped.
Launches allocate only the output (and the split-K partials), never sync, and so can be captured
in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_matmul needs Triton ({err}): pip install 'triton>=3.7'") from None

from .kernel_timing import (JitLaunch, NoConfigCompiled, compile_ahead, decode_tuning, graph_time_us, pick_fastest,
                            remembered, remembering_now, rotating_copies)
from .nf4_storage_kernels import reduce_kernel, stream_kernel, tile_kernel
from .triton_runtime import check_runnable, launchable


def _kernels(interpret: bool):
    """(tile matmul, streaming matmul, reduce) kernels, for CUDA or the interpreter (see launchable)."""
    return tuple(launchable(fn, interpret) for fn in (tile_kernel, stream_kernel, reduce_kernel))


@dataclass(frozen=True)
class KernelConfig:
    block_m: int        # rows of x per program: 1 (broadcast-sum) or >= 16 (tl.dot, an MMA)
    block_n: int
    split_k: int        # programs along K; > 1 adds the reduce kernel
    num_warps: int = 4
    num_stages: int = 3
    sub: int = 0        # 0: tile_kernel; >= 1: stream_kernel taking ``sub`` scale blocks per step (K a
    #                     multiple of sub * blocksize; other K fall back to tile_kernel with the same tile)
    slots: int = 1      # stream_kernel: steps in flight (1, 2 or 4)

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
        return stream_kernel, grid, (*ptrs, m, n, k, k // 8, x2.stride(0), out.stride(0), m * n, k_per_split), \
            dict(SUB=cfg.sub, SLOTS=cfg.slots,
                 X_WORDS=x2.element_size() == 2 and x2.stride(0) % 2 == 0 and x2.data_ptr() % 4 == 0, **common), part
    return tile_kernel, grid, (*ptrs, m, n, k, x2.stride(0), out.stride(0), m * n, k_per_split), \
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


# stream_kernel configs per row class: (block_n, num_warps, slots, programs per SM to aim at with
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
