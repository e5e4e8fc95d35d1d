"""``y = x @ W.T`` for 1..64 rows against a repacked NF4 weight (nf4_repack.py), in Triton: the tile chosen per
row count (nf4_repacked_configs.py; on a GPU the fastest its tuner timed, remembered per GPU and shape) and the
launch of the kernel (nf4_repacked_kernel.py), its split-K sum included.

Exact mode: every row's result does not depend on M, because every M runs one kernel: on CUDA the
tensor-core path with one 64-row tile, block_n and split for every M (exact_config), measured row-exact
on an H100; under the interpreter the GEMV with one split, whose elementwise lanes never mix rows. So a
16-row verification gives each row the bits a 1-row step gives it. Fast mode picks GEMV or tensor
cores per M, so its rows may differ by rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

try:
    import triton
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_repacked_matmul needs Triton ({err}): "
                      "pip install 'triton>=3.7'") from None

from . import nf4_matmul as nm
from . import nf4_prmt
from .kernel_timing import (JitLaunch, NoConfigCompiled, compile_ahead, decode_tuning, graph_time_us, pick_fastest,
                            remembered, remembering_now, rotation_count)
from .nf4_repack import RepackedNF4
from .nf4_repacked_configs import (PREFETCH_MAX_SCALES, RepackedConfig, candidates, exact_candidates, exact_config,
                                   fast_config, next_pow2, row_class, scaled_fits)
from .nf4_repacked_kernel import repacked_kernel
from .triton_runtime import check_runnable, dependent_launch, launchable


TUNING_BLOCKSIZE = 64     # the tuners' weights: bitsandbytes' default blocks, what the loader quantizes in
_TUNED: dict[tuple, RepackedConfig] = {}
TUNING_LOG: dict[tuple, list[tuple[str, float | None]]] = {}   # key -> (config, µs or None if skipped)


def _key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int) -> tuple:
    return torch.cuda.get_device_name(device), row_class(m), n, k, dtype, group


def tune_shape(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """CUDA only: time candidates() for M's row class on a random NF4 (n, k) weight, rotating among
    copies larger than L2, each inside a CUDA graph; cache the fastest for choose_config (and, inside
    kernel_timing.remembering, across starts)."""
    key = _key(m, n, k, dtype, device, group)
    best, TUNING_LOG[key] = remembered("repacked", key, lambda: _time_candidates(m, n, k, dtype, device, group, key),
                                       lambda saved: decode_tuning(RepackedConfig, saved))
    _TUNED[key] = best
    return best


def tuned_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                 group: int = 128) -> RepackedConfig | None:
    """What tune_shape kept for M's row class of this shape in this process, None if it has not run."""
    return _TUNED.get(_key(m, n, k, dtype, device, group))


def tuning_weight(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int):
    """(a random repacked NF4 (n, k) weight, copies of it that together exceed L2, a generator for inputs)."""
    from bitsandbytes.functional import quantize_4bit

    from .nf4_repack import repack_bnb

    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device=device).manual_seed(0)
    dense = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    w = repack_bnb([quantize_4bit(dense, blocksize=TUNING_BLOCKSIZE, compress_statistics=True, quant_type="nf4")],
                   group)
    del dense
    copies = [w] + [dataclasses.replace(w, words=w.words.clone(), scales=w.scales.clone(),
                                        arrivals=w.arrivals.clone())
                    for _ in range(rotation_count(w.nbytes, props.L2_cache_size) - 1)]
    return w, copies, gen


def _time_candidates(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int,
                     key: tuple) -> tuple[RepackedConfig, list]:
    props = torch.cuda.get_device_properties(device)
    w, copies, gen = tuning_weight(n, k, dtype, device, group)
    x = torch.randn(row_class(m), k, device=device, dtype=dtype, generator=gen)
    configs = candidates(m, n, -(-k // group), props.multi_processor_count,
                         scaled_fits(TUNING_BLOCKSIZE, group, dtype, device))
    compile_candidates(configs, w, [x])
    best, log = pick_fastest(
        configs,
        run=lambda cfg: repacked_matmul(x, w, config=cfg),
        time_us=lambda cfg: graph_time_us([functools.partial(repacked_matmul, x, c, config=cfg) for c in copies],
                                             replays=3),
        where=f"repacked {n}x{k} M<={row_class(m)} on {key[0]}")
    if best is None:
        TUNING_LOG[key] = log       # the skipped configs, for the benchmark's print
        raise NoConfigCompiled(f"no repacked NF4 config compiled for {n}x{k} on {key[0]}")
    return best, log


_EXACT: dict[tuple, RepackedConfig] = {}   # exact mode's config per (GPU, N, K, dtype, group), checked row-exact
EXACT_CHECK_ROWS = (3, 17, 64)             # the calls whose rows are checked against rows alone (tiles part-filled)


def _exact_key(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int) -> tuple:
    return torch.cuda.get_device_name(device), "exact", n, k, dtype, group


def tune_exact(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """CUDA only: exact mode's config for this shape on this GPU: of exact_candidates(), those whose every row of a
    3-, 17- and 64-row call has the bits that row gets alone here, the fastest over a 1-row and a 16-row call
    (kernel_timing.AUTO_ROWS); kept for choose_config and, inside kernel_timing.remembering, across starts.
    The check runs on the GPU, not on faith: on the H100 a GEMV exact mode that held under the interpreter was
    not row-exact (docs/performance.md). No candidate passing is NoConfigCompiled, naming the shape."""
    key = _exact_key(n, k, dtype, device, group)
    best, TUNING_LOG[key] = remembered("repacked-exact", key, lambda: _time_exact(n, k, dtype, device, group, key),
                                       lambda saved: decode_tuning(RepackedConfig, saved))
    _EXACT[key] = best
    return best


def exact_tuned(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """Exact mode's config for this shape on this GPU, tuned first if this process has not (or inside a load, so
    that its memory counts what it used)."""
    key = _exact_key(n, k, dtype, device, group)
    return tune_exact(n, k, dtype, device, group) if key not in _EXACT or remembering_now() else _EXACT[key]


def _time_exact(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int,
                key: tuple) -> tuple[RepackedConfig, list]:
    from .kernel_timing import AUTO_ROWS

    props = torch.cuda.get_device_properties(device)
    w, copies, gen = tuning_weight(n, k, dtype, device, group)
    x = torch.randn(max(EXACT_CHECK_ROWS), k, device=device, dtype=dtype, generator=gen)

    def checked(cfg: RepackedConfig) -> torch.Tensor:
        alone = torch.cat([repacked_matmul(x[i:i + 1], w, config=cfg) for i in range(x.shape[0])])
        for m in EXACT_CHECK_ROWS:
            if not torch.equal(repacked_matmul(x[:m], w, config=cfg), alone[:m]):
                raise RuntimeError(f"not row-exact: a row of a {m}-row call differs from that row alone")
        return alone

    configs = exact_candidates(n, -(-k // group), props.multi_processor_count,
                               scaled_fits(TUNING_BLOCKSIZE, group, dtype, device))
    # every row count the check and the timing call with: a row count is part of a compiled kernel's key
    compile_candidates(configs, w, [x[:m] for m in sorted({1, *EXACT_CHECK_ROWS, *AUTO_ROWS})])
    best, log = pick_fastest(
        configs, run=checked,
        time_us=lambda cfg: sum(graph_time_us([functools.partial(repacked_matmul, x[:m], c, config=cfg)
                                               for c in copies], replays=3) for m in AUTO_ROWS),
        where=f"repacked exact {n}x{k} on {key[0]}")
    if best is None:
        TUNING_LOG[key] = log
        raise NoConfigCompiled(f"no repacked NF4 config gave every row of {n}x{k} the bits it gets alone on {key[0]}")
    return best, log


def tuned_us(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> float:
    """µs of the fastest config timed for M's row class and this shape on this GPU (tuned first if not yet)."""
    key = _key(m, n, k, dtype, device, group)
    if key not in _TUNED or remembering_now():
        tune_shape(m, n, k, dtype, device, group)
    return min(us for _, us in TUNING_LOG[key] if us is not None)


def choose_config(m: int, w: RepackedNF4, dtype: torch.dtype, device: torch.device, exact: bool) -> RepackedConfig:
    groups = -(-w.k // w.group)
    if device.type != "cuda":      # the interpreter: fewest programs (each costs Python time), the same paths
        # exact: numpy's elementwise sums give a row the same bits whatever block_m is; only the split is
        # fixed. Not the tensor cores: numpy's matmul is position-dependent on some CPUs (AVX2 OpenBLAS)
        cfg = RepackedConfig(False, min(next_pow2(m), 64), 64, 1) if exact else fast_config(m, w.n, groups, 0)
    elif exact:     # the config tune_exact checked and timed on this GPU, else the one measured exact on an H100
        cfg = _EXACT.get(_exact_key(w.n, w.k, dtype, device, w.group)) or \
            exact_config(w.n, groups, torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        cfg = _TUNED.get(_key(m, w.n, w.k, dtype, device, w.group)) or \
            fast_config(m, w.n, groups, torch.cuda.get_device_properties(device).multi_processor_count)
    if cfg.prefetch and w.group // w.blocksize > PREFETCH_MAX_SCALES:
        cfg = dataclasses.replace(cfg, prefetch=0, x_ahead=False)   # a weight of small blocks: the kernel cannot
    if cfg.decode == "scaled" and not scaled_fits(w.blocksize, w.group, dtype, device):
        # tuned on bitsandbytes' blocks of 64, kept for the shape: a weight of smaller blocks looks its codes up in
        # shared memory instead, into the same weights for the same dots, so the same bits
        cfg = dataclasses.replace(cfg, decode="gather")
    if cfg.serial and not serial_fits(m, w, cfg):
        # a prefill's rows (class 64's config serves any M above 64) outnumber the arrival counts: the reduce
        # kernel adds the same partials in the same order, so the result has the same bits
        cfg = dataclasses.replace(cfg, serial=False)
    return cfg


def serial_fits(m: int, w: RepackedNF4, cfg: RepackedConfig) -> bool:
    """Whether ``w``'s arrival counts cover every output tile of an M-row call with ``cfg``."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n)
    return w.arrivals is not None and tiles <= w.arrivals.numel()


def repacked_matmul(x: torch.Tensor, w: RepackedNF4, bias: torch.Tensor | None = None, *, exact: bool = False,
                    config: RepackedConfig | None = None, ladder: int = 0) -> torch.Tensor:
    """x (..., K) fp16/bf16/fp32 @ W.T (+ bias) -> (..., N) in x's dtype. ``exact``: each row's bits do
    not depend on how many rows are in the call. ``ladder``: benchmarks/kernel_ladder.py's rungs only."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features but the NF4 weight is {w.n}x{w.k}: wrong layer")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the repacked NF4 kernel computes in fp16, bf16 or fp32, got {x.dtype}: cast x first")
    check_runnable(x.device)
    x2 = x.reshape(-1, w.k)                                       # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)    # (M, N)
    if m:
        cfg = config or choose_config(m, w, x.dtype, x.device, exact)
        if cfg.decode in ("prmt", "scaled") and x.device.type == "cpu":
            raise ValueError(f"decode {cfg.decode} is inline PTX, which Triton's interpreter cannot run: use decode "
                             "select, whose values are the same, on the CPU")
        _launch(x2, w, bias, out, cfg, x.device.type == "cpu", ladder)
    return out.reshape(*x.shape[:-1], w.n)


def _constexprs(w: RepackedNF4, dot: bool, interpret: bool, cfg: RepackedConfig | None) -> dict:
    lanes = w.group // 8
    opts = {} if interpret or cfg is None else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                                "enable_fp_fusion": True}
    return dict(GROUP=w.group, BLOCKSIZE=w.blocksize, LOG_LANES=lanes.bit_length() - 1, DOT=dot,
                EVEN_K=w.k % w.group == 0, **opts)


def kernel_call(x2, w: RepackedNF4, bias, out, cfg: RepackedConfig, interpret: bool, ladder: int = 0) -> tuple:
    """(kernel function, grid, args, keyword args, fp32 partials or None) of one launch: ``_launch``
    runs it, and benchmarks/kernel_sass.py compiles exactly this call for a GPU without one. ``ladder``: the
    kernel with parts taken out, for benchmarks/kernel_ladder.py only (the kernel's LADDER)."""
    m = x2.shape[0]
    if cfg.prefetch and w.group // w.blocksize > PREFETCH_MAX_SCALES:
        raise ValueError(f"prefetch takes at most {PREFETCH_MAX_SCALES} scale blocks per group, and group {w.group} "
                         f"holds {w.group // w.blocksize} of {w.blocksize}: repack with group 128 or use prefetch=False")
    if cfg.decode == "scaled" and x2.dtype not in nf4_prmt.CASTS:
        raise ValueError(f"decode scaled looks up 16-bit weights and x is {x2.dtype}: use bf16 or fp16 x, or decode "
                         "gather")
    if cfg.decode == "scaled" and not scaled_fits(w.blocksize, w.group, x2.dtype):
        raise ValueError(f"decode scaled needs scale blocks of at least {w.group // 2} values at group {w.group}, and "
                         f"this weight's hold {w.blocksize}: repack with group 128 over blocks of 64 or more, or use "
                         "decode gather")
    if cfg.decode != "gather" and len(w.table) != 16:
        raise ValueError(f"decode {cfg.decode} compiles the weight's 16-entry table into the kernel, and this weight "
                         f"has {len(w.table)} values on the host: make it with nf4_repack.repack, which reads them")
    groups = -(-w.k // w.group)
    splits = max(1, min(cfg.split_k, groups))
    per_split = -(-groups // splits)
    splits = -(-groups // per_split)                              # no empty split
    # partials of a split-K launch: allocated per call, so a CUDA graph keeps them in its pool
    part = torch.empty(splits, m, w.n, dtype=torch.float32, device=x2.device) if splits > 1 else None
    serial = cfg.serial and part is not None
    if serial and not serial_fits(m, w, cfg):
        raise ValueError(f"serial split-K needs an arrival count per output tile: {m} rows of {w.n} outputs with "
                         f"{cfg.describe()} are more tiles than this weight's counts (choose_config drops serial)")
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(w.n, cfg.block_n), splits)
    args = (x2, w.words, w.scales, w.code, bias if has_bias else out, part if part is not None else out, out,
            w.arrivals if serial else out, m, w.n, w.k, groups, x2.stride(0), out.stride(0), m * w.n,
            out.stride(0), per_split)
    meta = dict(HAS_BIAS=has_bias, PARTIAL=part is not None, DEQUANT_ONLY=False,
                PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch, X_AHEAD=cfg.x_ahead, PLANE_LOOKUP=cfg.plane_lookup,
                SERIAL=serial, WHOLE_GROUP=cfg.whole_group, LADDER=ladder, DECODE=cfg.decode,
                TABLE=w.table if cfg.decode == "select" else None,
                PRMT=nf4_prmt.halves(w.table) if cfg.decode == "prmt" else None,
                SCALED=nf4_prmt.scaled(w.table, x2.dtype) if cfg.decode == "scaled" else None,
                **_constexprs(w, cfg.dot, interpret, cfg), **dependent_launch(interpret))
    return repacked_kernel, grid, args, meta, part


def compiled_launch(x2, w: RepackedNF4, cfg: RepackedConfig) -> JitLaunch:
    """The matmul launch ``repacked_matmul(x2, w, config=cfg)`` makes on CUDA (its split-K sum aside)."""
    out = torch.empty(x2.shape[0], w.n, dtype=x2.dtype, device=x2.device)
    fn, grid, args, meta, _ = kernel_call(x2, w, None, out, cfg, interpret=False)
    return launchable(fn, False), grid, args, meta


def compile_candidates(configs: list[RepackedConfig], w: RepackedNF4, xs: list[torch.Tensor]) -> None:
    """Each config's kernel for each input in ``xs``, compiled side by side before a tuner times them
    (kernel_timing.compile_ahead)."""
    compile_ahead([functools.partial(compiled_launch, x, w, cfg) for cfg in configs for x in xs])


def _launch(x2, w: RepackedNF4, bias, out, cfg: RepackedConfig, interpret: bool, ladder: int = 0) -> None:
    _, grid, args, meta, part = kernel_call(x2, w, bias, out, cfg, interpret, ladder)
    launchable(repacked_kernel, interpret)[grid](*args, **meta)
    if part is not None and not meta["SERIAL"]:
        nm.reduce_partials(part, bias, out, interpret)


def dequantize_repacked(w: RepackedNF4, block_n: int = 32) -> torch.Tensor:
    """(N, K) fp32 through the kernel's own lookup and scale (DEQUANT_ONLY), for bit-exact tests."""
    check_runnable(w.words.device)
    interpret = w.words.device.type == "cpu"
    out = torch.empty(w.n, w.k, dtype=torch.float32, device=w.words.device)
    groups = -(-w.k // w.group)
    launchable(repacked_kernel, interpret)[(1, triton.cdiv(w.n, block_n), groups)](
        out, w.words, w.scales, w.code, out, out, out, out, 0, w.n, w.k, groups, 0, out.stride(0), 0, 0, 1,
        HAS_BIAS=False, PARTIAL=False, DEQUANT_ONLY=True, PRECISION="ieee", BLOCK_M=1, BLOCK_N=block_n,
        **_constexprs(w, False, interpret, None))
    return out
