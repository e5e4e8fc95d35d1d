"""The NF4 kernels as a GPU would run them, read without one: compile, disassemble, count.

    python -m medusa_core.benchmarks.kernel_sass --json out/sass.json          # the repacked kernel, 7B shapes
    python -m medusa_core.benchmarks.kernel_sass --shape 4096x11008 --rows 1 16 --candidates
    python -m medusa_core.benchmarks.kernel_sass --calibrate docs/perf/h100.json   # estimates vs a GPU's times

Triton compiles for any NVIDIA architecture on a CPU machine (its wheel ships ptxas, nvdisasm and
cuobjdump), so the machine code of every config the tuner would try can be read here: registers,
spills (local memory), shared memory, the width of each global load, and the main loop's instructions
per weight. The launch compiled is exactly the project's (each kernel module's ``kernel_call``, with
Triton's own argument specialization: pointers 16-byte aligned, sizes divisible by 16, as at run
time), so the vector widths are the ones a GPU gets.

It times nothing. From the counts it derives two lower bounds, named as estimates in the report: the
issue bound (every warp instruction of the main loop, 4 issued per clock per SM) and the
shared-memory bound (one warp load per clock per SM), at the boost clock; beside them the HBM floor,
the weight's bytes at the copy bandwidth measured on an H100. ``--calibrate`` sets the committed
kernel's bounds beside the times a GPU report measured for it: the measure of how far a bound is from
a timing (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import OneLineParser, check_writable, exit_status
from .nf4_kernel import SHAPES, parse_shape   # SHAPES (K in, N out): what the kernel benchmark times

ROWS = (1, 2, 4, 16, 32, 64)


@dataclass(frozen=True)
class Gpu:
    arch: int                  # compute capability, 90 = sm_90
    sms: int
    boost_ghz: float
    copy_tb_s: float           # the measured copy bandwidth that sets the HBM floor


# H100 SXM 80GB: 132 SMs, 1.98 GHz boost; 2.98 TB/s is the copy bandwidth measured on it (docs/performance.md)
H100 = Gpu(90, 132, 1.98, 2.98)


@dataclass(frozen=True)
class SassReport:
    k: int
    n: int
    m: int
    config: str
    registers: int
    local_bytes: int               # > 0: spills to local memory
    shared_bytes: int
    loop_instructions: int         # per thread, one pass of the main loop (one group of G columns)
    weights_per_thread: int        # weights one thread handles per pass
    instructions_per_weight: float
    shared_loads_per_weight: float  # shared-memory load instructions per weight: table lookups, and the
    #                                 layout conversions Triton routes through shared memory
    global_loads: dict             # per pass: opcode (with its width) -> count
    opcodes: dict                  # per pass: base opcode -> count, most frequent first
    load_ahead: int | None         # instructions between a global load into registers and the first that names
    #                                 what it loaded, the fewest of the pass's loads (None: it has none): the
    #                                 work the nearest load's latency can hide behind
    issue_us: float                # estimate: main-loop warp instructions at 4 per clock per SM
    shared_us: float               # estimate: shared-memory traffic (loads and stores) at 128 bytes per clock per SM
    floor_us: float                # packed words + scales at the copy bandwidth


def _triton_tools():
    import triton

    from ..quant import nf4_repacked_matmul as rm
    return triton, rm


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the project makes it (meta tensors), and what a pass of its main loop covers."""
    k: int
    n: int
    m: int
    fn: object                 # the undecorated Triton kernel function
    args: tuple
    meta: dict                 # constexprs and the compile options
    config: str
    tiles: int                 # (row tile, N tile) pairs: programs over all K splits
    block_n: int
    columns_per_pass: int      # K columns one pass of the main loop takes, for block_n rows
    extra_passes: int          # passes beyond K's, per (row tile, N tile): the stream kernel's filling ones
    num_warps: int
    floor_bytes: int           # what the weight and its scales weigh

    def jit_launch(self):
        """(triton.jit function, grid, args, keyword args): this launch as the JIT makes it, for a warmup."""
        from ..quant.triton_runtime import launchable

        return launchable(self.fn, False), (1, 1, 1), self.args, self.meta


def repacked_launch(k: int, n: int, m: int, cfg, dtype: torch.dtype = torch.bfloat16, group: int = 128,
                    ladder: int = 0) -> Launch:
    """``repacked_matmul`` of m rows against an (n, k) repacked weight, with ``cfg`` (``ladder``: a rung of
    benchmarks/kernel_ladder.py)."""
    _, rm = _triton_tools()
    from ..quant.nf4_repack import ROW_TILES, ROWS as R, RepackedNF4, repacked_nbytes

    from bitsandbytes.functional import get_4bit_type

    meta = torch.device("meta")
    n_pad, k_pad = -(-n // R) * R, -(-k // group) * group
    nf4 = tuple(get_4bit_type("nf4", device="cpu").tolist())    # what the select lookup compiles in (as a GPU does)
    w = RepackedNF4(torch.empty(n_pad // R, k_pad // group, R, group // 8, dtype=torch.int32, device=meta),
                    torch.empty(n_pad // R, k_pad // group, R, group // 64, device=meta),
                    torch.empty(16, device=meta), n, k, 64, group,
                    torch.empty(ROW_TILES * n_pad // R, dtype=torch.int32, device=meta), nf4)
    fn, grid, args, kw, _ = rm.kernel_call(torch.empty(m, k, dtype=dtype, device=meta), w, None,
                                           torch.empty(m, n, dtype=dtype, device=meta), cfg, interpret=False,
                                           ladder=ladder)
    return Launch(k, n, m, fn, args, kw, cfg.describe(), grid[0] * grid[1], cfg.block_n, group, 0, cfg.num_warps,
                  repacked_nbytes(n, k, 64, group))


def attention_launch(heads: int, kv_heads: int, dim: int, rows: int, width: int = 1024,
                     dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``rows_alone_attention`` (exact mode's attention) of ``rows`` query rows over ``width`` cache slots."""
    from ..quant import rows_alone_attention as ra

    meta = torch.device("meta")
    q = torch.empty(1, heads, rows, dim, dtype=dtype, device=meta)
    k = torch.empty(1, kv_heads, width, dim, dtype=dtype, device=meta)
    slots = torch.empty(rows, width, dtype=torch.int32, device=meta)
    fn, grid, args, kw = ra.kernel_call(q, k, k, slots, slots[:, 0], torch.empty(1, rows, heads, dim, dtype=dtype,
                                                                                   device=meta), dim ** -0.5, False)
    # for compile_launch and resources (no per-weight counts: it is no matmul); the floor: keys and values once
    return Launch(width, heads * dim, rows, fn, args, kw, f"rows_alone w{ra.BLOCK_W}", grid[0] * grid[1], 1,
                  ra.BLOCK_W, 0, kw["num_warps"], 2 * kv_heads * width * dim * dtype.itemsize)


def split_attention_launch(heads: int, kv_heads: int, dim: int, rows: int, width: int = 1024,
                           dtype: torch.dtype = torch.bfloat16, merge: bool = False, serial: bool = False) -> Launch:
    """``split_attention`` (fast attention over the keys in splits) of ``rows`` query rows over ``width`` cache
    slots: its split kernel (with ``serial``, the one that merges in its launch, as the step runs it), or its merge
    kernel with ``merge``."""
    from ..quant import split_attention as sa

    meta = torch.device("meta")
    q = torch.empty(1, heads, rows, dim, dtype=dtype, device=meta)
    k = torch.empty(1, kv_heads, width, dim, dtype=dtype, device=meta)
    mask = torch.empty(1, 1, rows, width, dtype=dtype, device=meta)
    arrivals = torch.empty(heads, dtype=torch.int32, device=meta) if serial else None
    calls = sa.kernel_calls(q, k, k, mask, torch.empty(1, rows, heads, dim, dtype=dtype, device=meta), dim ** -0.5,
                            False, arrivals)
    fn, grid, args, kw = calls[1 if merge else 0]
    # for compile_launch and resources (no per-weight counts: it is no matmul); the floor: keys and values once
    name = f"split w{sa.BLOCK_W}" + (" merge" if merge else " serial" if serial else "")
    return Launch(width, heads * dim, rows, fn, args, kw, name, math.prod(grid), 1, sa.BLOCK_W, 0, kw["num_warps"],
                  2 * kv_heads * width * dim * dtype.itemsize)


def norm_launch(hidden: int, rows: int = 16, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``rows_alone_rms_norm`` (exact mode's norm) over ``rows`` rows of ``hidden``."""
    from ..quant import rows_alone_norm as rn

    meta = torch.device("meta")
    x = torch.empty(rows, hidden, dtype=dtype, device=meta)
    fn, grid, args, kw = rn.kernel_call(x, torch.empty(hidden, dtype=dtype, device=meta), x, 1e-5, False)
    # for compile_launch and resources (no per-weight counts: it is no matmul)
    return Launch(hidden, hidden, rows, fn, args, kw, "rms_norm", grid[0], 1, hidden, 0, kw["num_warps"],
                  2 * rows * hidden * dtype.itemsize)


def rotary_launch(heads: int, kv_heads: int, dim: int, tokens: int = 16, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``fused_rotary`` (quant/rotary_kernel.py) of ``tokens`` tokens' queries and keys, laid out as the attention
    module makes them ((B, T, heads, D) projections seen as (B, heads, T, D))."""
    from ..quant import rotary_kernel as rk

    meta = torch.device("meta")
    q = torch.empty(1, tokens, heads, dim, dtype=dtype, device=meta).transpose(1, 2)
    k = torch.empty(1, tokens, kv_heads, dim, dtype=dtype, device=meta).transpose(1, 2)
    cos = torch.empty(1, tokens, dim, dtype=dtype, device=meta)
    fn, grid, args, kw = rk.kernel_call(q, k, cos, cos, q, k, False)
    # for compile_launch and resources (no per-weight counts: it is no matmul); the floor: q and k read and written
    return Launch(dim, (heads + kv_heads) * dim, tokens, fn, args, kw, "rotary", grid[0] * grid[1] * grid[2], 1, dim, 0,
                  kw["num_warps"], 2 * (heads + kv_heads) * tokens * dim * dtype.itemsize)


def cache_write_launch(kv_heads: int, dim: int, tokens: int = 16, capacity: int = 1024,
                       dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``write_cache`` (quant/cache_write_kernel.py) of ``tokens`` tokens' keys and values, laid out as the attention
    module makes them, into one layer of a ``capacity``-slot cache."""
    from ..quant import cache_write_kernel as cw

    meta = torch.device("meta")
    keys = torch.empty(1, tokens, kv_heads, dim, dtype=dtype, device=meta).transpose(1, 2)
    layer = torch.empty(2, 1, kv_heads, capacity, dim, dtype=dtype, device=meta)
    fn, grid, args, kw = cw.kernel_call(layer, keys, keys, torch.empty(1, dtype=torch.long, device=meta), False)
    # for compile_launch and resources (no per-weight counts: it is no matmul); the floor: the rows read and written
    return Launch(dim, 2 * kv_heads * dim, tokens, fn, args, kw, "cache write", grid[0] * grid[1], 1, dim, 0,
                  kw["num_warps"], 4 * kv_heads * tokens * dim * dtype.itemsize)


def head_launch(k: int, n: int, rows: int = 16, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``rows_alone_linear`` (exact mode's lm_head) of ``rows`` rows against a dense (n, k) weight."""
    from ..quant import rows_alone_linear as rl

    meta = torch.device("meta")
    x = torch.empty(rows, k, dtype=dtype, device=meta)
    fn, grid, args, kw = rl.kernel_call(x, torch.empty(n, k, dtype=dtype, device=meta), None,
                                        torch.empty(rows, n, dtype=dtype, device=meta), False)
    return Launch(k, n, rows, fn, args, kw, f"rows_alone m{kw['BLOCK_M']} n{rl.BLOCK_N}", grid[0] * grid[1],
                  rl.BLOCK_N, rl.LANES, 0, kw["num_warps"], n * k * dtype.itemsize)


def bnb_storage_launch(k: int, n: int, m: int, cfg, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """``nf4_matmul`` (the committed kernel reading bitsandbytes' double-quant storage) with ``cfg``."""
    from types import SimpleNamespace

    from ..quant import nf4_matmul as nm
    from ..quant.nf4_repack import bnb_nbytes

    meta = torch.device("meta")
    blocks = n * k // 64
    state = SimpleNamespace(code=torch.empty(16, device=meta), absmax=torch.empty(blocks, dtype=torch.uint8, device=meta),
                            state2=SimpleNamespace(code=torch.empty(256, device=meta), blocksize=256,
                                                   absmax=torch.empty(-(-blocks // 256), device=meta)),
                            offset=torch.empty((), device=meta), nested=True, blocksize=64, shape=(n, k))
    fn, grid, args, kw, _ = nm.kernel_call(torch.empty(m, k, dtype=dtype, device=meta),
                                           torch.empty(n * k // 2, 1, dtype=torch.uint8, device=meta), state, None,
                                           torch.empty(m, n, dtype=dtype, device=meta), cfg, interpret=False)
    columns = 64 * (kw["SLOTS"] * kw["SUB"] if "SUB" in kw else 1)
    # the stream kernel's loop starts one pass early in each split, to fill its slots
    return Launch(k, n, m, fn, args, kw, cfg.describe(), grid[0] * grid[2], cfg.block_n, columns,
                  grid[1] if "SUB" in kw else 0, cfg.num_warps,
                  bnb_nbytes(n, k))


class NoGpuDriver:
    """The few questions Triton's JIT asks its driver before it compiles, answered for sm_<arch> on a machine
    with no GPU, so that a JIT function's ``warmup`` (compile, no launch) runs here as on that GPU: how
    kernel_timing.compile_ahead is tested and timed without one."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


@contextlib.contextmanager
def jit_compiles_for(arch: int) -> Iterator[None]:
    """Within: Triton's JIT compiles for sm_<arch> (NoGpuDriver); its kernels cannot be launched."""
    from triton.runtime.driver import driver

    before = driver._active             # None on a machine with no GPU: reset_active() would look for one
    driver.set_active(NoGpuDriver(arch))
    try:
        yield
    finally:
        driver._active = before


def compile_launch(launch: Launch, arch: int):
    """Compile the launch for sm_<arch> with Triton's own argument specialization: a CompiledKernel."""
    triton, _ = _triton_tools()
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl

    meta = dict(launch.meta)
    options = {key: meta.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl") if key in meta}
    parameters = inspect.signature(launch.fn).parameters
    names = list(parameters)
    signature, constexprs, attrs = {}, {}, {}
    unspecialized = set(getattr(launch.fn, "do_not_specialize", ()))      # triton_runtime.unspecialized
    for i, (name, value) in enumerate(zip(names, launch.args)):
        # what a launch does
        kind, spec = native_specialize_impl(CUDABackend, value, False, name not in unspecialized, True)
        if kind == "constexpr":        # an int equal to 1
            constexprs[(i,)] = spec
        elif spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
        signature[name] = kind
    for name in names[len(launch.args):]:
        signature[name] = "constexpr"
        if name not in meta and parameters[name].default is inspect.Parameter.empty:
            raise TypeError(f"{launch.fn.__name__}: the launch gives no {name}, which has no default")
        constexprs[(names.index(name),)] = meta[name] if name in meta else parameters[name].default   # as the JIT
    # JITFunction, not triton.jit: under TRITON_INTERPRET=1 (the tests) triton.jit returns the interpreter's
    source = ASTSource(JITFunction(launch.fn), signature, constexprs, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except RuntimeError as err:
        if "InterpretedFunction" not in str(err):
            raise
        # a helper the kernel calls was jit-decorated for the interpreter when its module was imported
        raise RuntimeError(f"{launch.fn.__name__} calls a helper imported under TRITON_INTERPRET=1: run this "
                           "in a process without it") from None


def _tool(name: str) -> str:
    triton, _ = _triton_tools()
    return getattr(triton.knobs.nvidia, name).path


def disassemble(path: Path) -> list[str]:
    """The SASS instructions of a cubin file, in order, predicates kept, addresses and comments dropped."""
    text = subprocess.run([_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            lines.append(label.group(1) + ":")
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            lines.append(ins.group(1))
    return lines


def resources(path: Path) -> dict[str, int]:
    """REG, LOCAL, STACK, SHARED of the kernel in a cubin file, as cuobjdump reports them (STACK: an
    array ptxas could not keep in registers, in local memory like a spill)."""
    text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)],
                          capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|LOCAL|STACK|SHARED):(\d+)", text))
    return {key: int(found.get(key, 0)) for key in ("REG", "LOCAL", "STACK", "SHARED")}


def shared_clocks_of(op: str) -> int:
    """Clocks of an SM's shared-memory bandwidth (128 bytes a clock) one warp's instruction takes."""
    if op.startswith("LDSM"):                 # ldmatrix: .x4 moves 4 8x8 matrices of 16-bit values, 512 bytes
        return int(re.search(r"\.(\d)$", op).group(1)) if re.search(r"\.\d$", op) else 1
    if not op.startswith(("LDS", "STS")):
        return 0
    width = re.search(r"\.(32|64|128)\b", op)
    return int(width.group(1)) // 32 if width else 1     # LDS/STS: 4 bytes a lane unless widened


def opcode(ins: str) -> str:
    """``@!P0 LDG.E.128 R4, desc[UR6][R2.64]`` -> ``LDG.E.128``."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", ins).split()[0]


def main_loop(lines: list[str]) -> list[str]:
    """The instructions of the largest backward branch's body: the kernel's loop over K groups."""
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.endswith(":")}
    best: list[str] = []
    for i, line in enumerate(lines):
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", line)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = [ins for ins in lines[labels[target.group(1)]: i + 1] if not ins.endswith(":")]
            best = max(best, body, key=len)
    if not best:
        raise ValueError("no loop found in the kernel's SASS: is K a single group?")
    return best


def _named_registers(ins: str) -> set[int]:
    """The general registers an instruction names: R7 is 7, a 64-bit address R2.64 is 2 and 3 (RZ is none)."""
    regs: set[int] = set()
    for number, pair in re.findall(r"\bR(\d+)(\.64)?", ins):
        regs.update((int(number), int(number) + 1) if pair else (int(number),))
    return regs


def load_ahead(loop: list[str]) -> int | None:
    """The fewest instructions from a global load into registers (LDG) to the first instruction of the loop
    that names a register it loads, counted around the loop, so a load read in the next pass counts the rest
    of this one: the work that hides the nearest load's latency. Reading or writing that register waits for
    the load alike. An asynchronous copy into shared memory (LDGSTS) loads no register. None: no such load."""
    nearest = None
    for i, ins in enumerate(loop):
        op = opcode(ins)
        if not op.startswith("LDG."):
            continue
        first = int(re.search(r"\bR(\d+)\b", ins[ins.index(op) + len(op):]).group(1))    # the destination
        wide = re.search(r"\.(64|128)\b", op)
        loaded = set(range(first, first + (int(wide.group(1)) // 32 if wide else 1)))
        for step in range(1, len(loop) + 1):
            if loaded & _named_registers(loop[(i + step) % len(loop)]):
                nearest = step if nearest is None else min(nearest, step)
                break
    return nearest


def report(launch: Launch, gpu: Gpu, workdir: Path) -> SassReport:
    """Compile ``launch`` for the GPU and count its main loop."""
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compile_launch(launch, gpu.arch).asm["cubin"])
    res = resources(cubin)
    loop = main_loop(disassemble(cubin))
    ops = Counter(opcode(ins) for ins in loop)
    per_thread = launch.block_n * launch.columns_per_pass // (32 * launch.num_warps)
    lds = sum(count for op, count in ops.items() if op.startswith("LDS"))
    shared_clocks = sum(count * shared_clocks_of(op) for op, count in ops.items())     # per warp and pass
    # every (row tile, N tile) runs the loop once per pass over K, in each of the program's warps
    passes = launch.tiles * (-(-launch.k // launch.columns_per_pass) + launch.extra_passes) * launch.num_warps
    per_us = gpu.sms * gpu.boost_ghz * 1e3           # clocks of all SMs per µs
    return SassReport(
        k=launch.k, n=launch.n, m=launch.m, config=launch.config, registers=res["REG"], local_bytes=res["LOCAL"] + res["STACK"],
        shared_bytes=res["SHARED"], loop_instructions=len(loop), weights_per_thread=per_thread,
        instructions_per_weight=round(len(loop) / per_thread, 2), shared_loads_per_weight=round(lds / per_thread, 2),
        global_loads={op: c for op, c in sorted(ops.items()) if op.startswith("LDG")},
        opcodes=dict(Counter(opcode(ins).split(".")[0] for ins in loop).most_common()),
        load_ahead=load_ahead(loop),
        issue_us=round(passes * len(loop) / (4 * per_us), 2),
        shared_us=round(passes * shared_clocks / per_us, 2),
        floor_us=round(launch.floor_bytes / (gpu.copy_tb_s * 1e6), 2))


def configs_for(m: int, n: int, k: int, gpu: Gpu, every: bool, group: int = 128) -> list[tuple[str, object]]:
    """(mode, config) pairs: the untimed fast choice, exact mode's, and with ``every`` each config the
    tuner would time."""
    from ..quant import nf4_repacked_configs as rc

    groups = -(-k // group)
    out = [("fast", rc.fast_config(m, n, groups, gpu.sms)), ("exact", rc.exact_config(n, groups, gpu.sms))]
    if every:
        out += [("candidate", cfg) for cfg in rc.candidates(m, n, groups, gpu.sms)[1:]]
    return out


def parse_bnb_storage_config(text: str):
    """``KernelConfig.describe()``'s text back: "stream sub1 slots2 m1 n128 split8 w4 s1", "tile m64 n64 ..."."""
    from ..quant.nf4_matmul import KernelConfig

    fields = dict(re.findall(r"\b(sub|slots|m|n|split|w|s)(\d+)\b", text))
    if not text.startswith(("stream", "tile")) or not {"m", "n", "split", "w", "s"} <= set(fields):
        raise ValueError(f"{text!r} is not a KernelConfig description (e.g. 'tile m64 n64 split2 w4 s1')")
    return KernelConfig(int(fields["m"]), int(fields["n"]), int(fields["split"]), int(fields["w"]), int(fields["s"]),
                        sub=int(fields.get("sub", 0)), slots=int(fields.get("slots", 1)))


def calibrate(report_json: Path, gpu: Gpu, workdir: Path) -> list[dict]:
    """The committed kernel (nf4_matmul over bitsandbytes' storage) at the configs a GPU run chose and
    timed (a report with ``nf4_matmul.rows``, e.g. docs/perf/h100.json): its estimates beside its
    measured µs. How far the issue bound falls short of a measurement is what to expect of it elsewhere."""
    if not report_json.is_file():       # QA: "[Errno 2] No such file or directory: ..." named no fix
        raise ValueError(f"--calibrate {report_json} is not a file: give a GPU run's report with the kernel's timings, "
                         "such as docs/perf/h100.json")
    data = json.loads(report_json.read_text())
    rows = data.get("nf4_matmul", data).get("rows", [])
    out = []
    for row in rows:
        if row["method"] != "triton" or not row.get("variant") or row.get("us") is None:
            continue
        r = report(bnb_storage_launch(row["k"], row["n"], row["m"], parse_bnb_storage_config(row["variant"])),
                   gpu, workdir)
        out.append(dict(mode="measured", measured_us=round(row["us"], 2),
                        measured_over_issue=round(row["us"] / r.issue_us, 2), **asdict(r)))
    if not out:
        raise ValueError(f"{report_json} has no timed nf4_matmul rows with their config: pass a kernel benchmark report")
    return out


def at_least(low: int, what: str):
    """An argparse type: an int of at least ``low``, else one line naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give {what}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}: give {what}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m medusa_core.benchmarks.kernel_sass", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, nargs="+", default=list(SHAPES), help="KxN, e.g. 4096x11008")
    parser.add_argument("--rows", type=at_least(1, "a row count"), nargs="+", default=list(ROWS))
    parser.add_argument("--arch", type=at_least(75, "a compute capability Triton compiles for (sm_75 and later)"),
                        default=H100.arch,
                        help="compute capability: 90 is sm_90 (H100); the estimates keep the H100's SMs and clock")
    parser.add_argument("--candidates", action="store_true", help="every config the tuner would time, too")
    parser.add_argument("--calibrate", type=Path, metavar="REPORT",
                        help="instead: the committed bnb-storage kernel at the configs a GPU report timed "
                             "(e.g. docs/perf/h100.json), estimates beside the measured µs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        check_writable(args.json)           # now, not after minutes of compiling (QA)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    gpu = Gpu(args.arch, H100.sms, H100.boost_ghz, H100.copy_tb_s)
    try:
        _triton_tools()
    except ImportError as err:
        print(err, file=sys.stderr)
        return 2
    import tempfile

    from triton.errors import TritonError    # compilation and ptxas errors

    if args.calibrate:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rows = calibrate(args.calibrate, gpu, Path(tmp))
            except (OSError, ValueError, KeyError, RuntimeError, TritonError, subprocess.SubprocessError) as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
        print(f"{'K->N':>12} {'M':>3} {'config':<40} {'instr/w':>7} {'issue':>6} {'measured':>8} {'ratio':>5}")
        for r in rows:
            shape = f"{r['k']}->{r['n']}"
            print(f"{shape:>12} {r['m']:>3} {r['config']:<40} {r['instructions_per_weight']:>7} "
                  f"{r['issue_us']:>6} {r['measured_us']:>8} {r['measured_over_issue']:>5}")
        _write(args.json, gpu, rows)
        return 0
    rows = []
    print(f"{'K->N':>12} {'M':>3} {'mode':>9} {'config':<40} {'reg':>4} {'spill':>5} {'instr/w':>7} "
          f"{'lds/w':>5} {'ahead':>5} {'issue':>6} {'smem':>6} {'floor':>6}  (µs: estimates for {H100.sms} SMs at "
          f"{H100.boost_ghz} GHz, not timings)")
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in args.shape:
            for m in args.rows:
                for mode, cfg in configs_for(m, n, k, gpu, args.candidates):
                    try:
                        r = report(repacked_launch(k, n, m, cfg), gpu, Path(tmp))
                    except (RuntimeError, ValueError, TritonError, subprocess.SubprocessError) as err:   # go on
                        print(f"{f'{k}->{n}':>12} {m:>3} {mode:>9} {cfg.describe()}: FAILED ({err})")
                        continue
                    rows.append(dict(mode=mode, **asdict(r)))
                    print(f"{f'{k}->{n}':>12} {m:>3} {mode:>9} {r.config:<40} {r.registers:>4} {r.local_bytes:>5} "
                          f"{r.instructions_per_weight:>7} {r.shared_loads_per_weight:>5} {r.load_ahead or '-':>5} "
                          f"{r.issue_us:>6} {r.shared_us:>6} "
                          f"{r.floor_us:>6}")
    _write(args.json, gpu, rows)
    return 0


def _write(path: Path | None, gpu: Gpu, rows: list[dict]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(gpu=asdict(gpu), rows=rows), indent=1))


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
