"""Where a repacked NF4 call's time goes: the kernel timed whole, without its table lookup, and loading only.

    python -m medusa_core.benchmarks.kernel_ladder --json out/ladder.json
    python -m medusa_core.benchmarks.kernel_ladder --shapes 4096x11008 --rows 1 16

On the H200 (2026-11-28) one row of 4096->11008 took 18.9 µs where its repacked bytes take 6.1 at the copy
bandwidth, and the tuner's configs all landed within 10% of each other: no knob it turns finds the lost time.
This takes the kernel apart instead. Per shape and row count, each config below is timed at three rungs on the
same grid, over the same words and scales (the kernel's LADDER constexpr, 0 in every real call):

- ``full``: the kernel as every call runs it;
- ``table-free``: each code is its nibble's bits, one integer instruction where the lookup's shared-memory load
  was; the table's copy in shared memory, its refills and their barriers are gone, and with them registers;
- ``read-only``: the words and scales loaded and folded by XOR: no x, no lookup, no arithmetic. Not the same
  schedule: with nothing to wait for, ptxas unrolls the loop, the registers drop (40-44), and on the tensor-core
  configs the loads are plain ones where the kernel's feed its dots through asynchronous copies. It is what the
  grid's bytes cost with nothing else in the way.

Beside them the floor: the repacked bytes at this GPU's copy bandwidth. ``read-only`` over the floor is what the
grid's loads cost (programs, bytes in flight); ``table-free`` over ``read-only`` what unpacking and multiplying
cost; ``full`` over ``table-free`` what the lookup costs, its registers included. The configs: the untimed
default for the row count (``fast_config``), with its split-K sum in the same launch where it splits K at one
row (what the H200's tuner kept at one row on four of the five 7B shapes; the fused gate/up kept the second
launch, by 1.2 µs). From 5 rows also other lookups of the same tile: ``select`` and ``prmt``, its table
compiled in as constants, and ``scaled``, a table of each scale block's weights built in registers (exact lookups
with no shared memory, RepackedConfig.decode; timed ``full`` only, their other rungs being the plane tile's
kernels), and the whole group in one dot (its read-only rung is the plane
tile's: not timed twice). Timed as the tuner times: inside a CUDA graph, rotating among weight copies that
together exceed L2. Under ``TRITON_INTERPRET=1`` the rungs run on the CPU (tests/test_kernel_ladder.py checks
what each computes); times need a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import OneLineParser, check_writable, exit_status, first_line
from .kernel_sass import at_least
from .nf4_kernel import copy_bandwidth, parse_shape

RUNGS = {"full": 0, "table-free": 1, "read-only": 2}    # name -> the kernel's LADDER
SHAPES = ((4096, 11008), (11008, 4096), (4096, 22016))   # (K in, N out): up, down, and the fused gate/up
ROWS = (1, 16)


@dataclass(frozen=True)
class Rung:
    k: int
    n: int
    m: int
    config: str
    rung: str
    us: float | None                # None: failed (see error)
    floor_us: float                 # the repacked words and scales at the copy bandwidth
    error: str = ""


def configs(m: int, n: int, k: int, sms: int, group: int = 128, decodes: tuple[str, ...] | None = None) -> list:
    """The configs a row count is taken apart at (see the module docstring); ``decodes``: the lookups with no
    shared memory (default: the tuner's, rc.REGISTER_DECODES)."""
    from ..quant import nf4_repacked_configs as rc

    first = rc.fast_config(m, n, -(-k // group), sms)
    if not first.dot:
        return [dataclasses.replace(first, serial=True) if first.split_k > 1 else first]
    register = [dataclasses.replace(first, decode=d) for d in (rc.REGISTER_DECODES if decodes is None else decodes)]
    return [first, *register, dataclasses.replace(first, plane_lookup=False, whole_group=True)]


def run_rung(x: torch.Tensor, w, cfg, rung: str) -> torch.Tensor:
    """One call of the kernel at a rung: ``full`` is repacked_matmul itself."""
    from ..quant.nf4_repacked_matmul import repacked_matmul

    return repacked_matmul(x, w, config=cfg, ladder=RUNGS[rung])


def bench_shape(k: int, n: int, rows: tuple[int, ...], device: torch.device, bandwidth: float,
                dtype: torch.dtype = torch.bfloat16) -> list[Rung]:
    """Every (row count, config, rung) of one shape; a rung that fails prints one line and the next goes on."""
    from ..quant import nf4_repacked_matmul as rm
    from ..quant.kernel_timing import graph_time_us
    from ..quant.nf4_repack import dequantize_reference

    w, copies, gen = rm.tuning_weight(n, k, dtype, device, 128)
    floor_us = w.nbytes / bandwidth * 1e6
    reference = dequantize_reference(w)                                  # (N, K) fp32
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        expected = x.float() @ reference.T
        # prmt is inline PTX, which the interpreter (the CPU test of this loop) cannot run
        for cfg in configs(m, n, k, sms, decodes=None if device.type == "cuda" else ("select",)):
            for rung in RUNGS:
                if (rung == "read-only" and cfg.whole_group) or (rung != "full" and cfg.decode != "gather"):
                    continue        # the plane tile's kernel: loading only, or (select, prmt) with no lookup at all
                try:
                    if rung == "full":      # the rungs below it time the same grid; this one must also be right
                        y = run_rung(x, w, cfg, rung).float()
                        error = float((y - expected).norm() / expected.norm())
                        if not error <= 1e-2:
                            raise RuntimeError(f"wrong result: relative error {error:.1e}")
                    us = graph_time_us([functools.partial(run_rung, x, c, cfg, rung) for c in copies], replays=5)
                    out.append(Rung(k, n, m, cfg.describe(), rung, round(us, 2), round(floor_us, 2)))
                except Exception as err:  # fail soft per rung: one line, then the next
                    line = first_line(err) or type(err).__name__
                    print(f"  {k}->{n} M={m} {cfg.describe()} {rung}: FAILED ({type(err).__name__}: {line})")
                    out.append(Rung(k, n, m, cfg.describe(), rung, None, round(floor_us, 2), line))
                print(f"  {k}->{n} M={m} {cfg.describe():<44} {rung:<11} "
                      f"{'-' if out[-1].us is None else f'{out[-1].us:7.2f}'} us  (floor {floor_us:.2f})", flush=True)
    del copies
    return out


def table(results: list[Rung]) -> list[str]:
    """One line per (shape, rows, config): each rung's µs and its multiple of the floor."""
    lines = [f"{'shape':>12} {'M':>3} {'config':<44} {'floor':>6} " + " ".join(f"{r:>18}" for r in RUNGS)]
    seen: dict[tuple, dict[str, float | None]] = {}
    floors = {}
    for r in results:
        seen.setdefault((r.k, r.n, r.m, r.config), {})[r.rung] = r.us
        floors[(r.k, r.n, r.m, r.config)] = r.floor_us
    for key, rungs in seen.items():
        k, n, m, config = key
        cells = []
        for name in RUNGS:
            us = rungs.get(name)
            cells.append(f"{'-':>18}" if us is None else f"{us:>8.2f} ({us / floors[key]:4.1f}x)".rjust(18))
        lines.append(f"{f'{k}->{n}':>12} {m:>3} {config:<44} {floors[key]:>6.2f} " + " ".join(cells))
    return lines


def parser(cuda: bool = True) -> argparse.ArgumentParser:
    """(``cuda``: the other benchmarks' signature; this one runs on CUDA only, so nothing defaults by it.)"""
    p = OneLineParser(prog="python -m medusa_core.benchmarks.kernel_ladder",
                      description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("out/ladder.json"),
                   help="where to write the results (rewritten after each shape, so a run cut short keeps them)")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=list(SHAPES), metavar="KxN",
                   help="projections, in features x out features (default: 4096x11008 11008x4096 4096x22016)")
    p.add_argument("--rows", type=at_least(1, "a row count"), nargs="+", default=list(ROWS), metavar="M",
                   help="row counts (default: 1 16; Medusa's trees verify 1 to 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the kernel ladder times kernels on a CUDA GPU and this torch sees none: run it on the GPU "
              "machine (docs/performance.md, the runbook's ladder stage)", file=sys.stderr)
        return 2
    try:
        check_writable(args.json)           # now, not after the run
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    env = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "copy_bandwidth_gbps": round(bandwidth / 1e9, 1)}
    print(f"{env['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results: list[Rung] = []
    for k, n in args.shapes:
        results += bench_shape(k, n, tuple(args.rows), device, bandwidth)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "rungs": [asdict(r) for r in results]}, indent=1))
    print("\n" + "\n".join(table(results)))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
