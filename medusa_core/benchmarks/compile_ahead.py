"""How long a 7B NF4 load's kernel tuners spend compiling, one by one and side by side, for a GPU, without one.

    python -m medusa_core.benchmarks.compile_ahead                  # 1 thread, then every CPU of this machine
    python -m medusa_core.benchmarks.compile_ahead --threads 1 2 8 --arch 90

A GPU's first start times each NF4 tuner's candidates (quant/kernel_timing.py), and each candidate is a
kernel Triton compiles before its first launch. kernel_timing.compile_ahead compiles one tuner call's candidates
in threads before it times any. This replays the compiles a 7B load asks for, in its order and batches (each
(shape, row class) the repacked tuner times, then the Triton kernel on bitsandbytes' storage at 16 rows), through
that same function, with Triton's JIT compiling for sm_<arch> (kernel_sass.NoGpuDriver). Each thread count runs
in a process of its own with an empty Triton cache, as a first start does. It launches nothing: the seconds are
the compiles' alone, the part of a first start this machine's CPUs decide. It also counts the launches that do
not compile for that GPU (a tuner skips them, saying so): ``--arch 89`` and ``86`` are an RTX 4090's and 3090's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ..errors import OneLineParser, exit_status, first_line
from .kernel_sass import at_least

# (K in, N out) and row classes the repacked tuner times on a Llama-7B load (quant/bnb.py): q/k/v and gate/up
# fused, the output and down projections, at every row class; q/k/v and gate/up apart at the rows auto weighs
FUSED_ROWS = (1, 2, 4, 16, 32, 64)
LOAD_7B = (((4096, 12288), FUSED_ROWS), ((4096, 4096), FUSED_ROWS), ((4096, 22016), FUSED_ROWS),
           ((11008, 4096), FUSED_ROWS), ((4096, 11008), (1, 16)))
STORAGE_7B = ((4096, 4096), (4096, 11008), (11008, 4096))      # the kernel on bitsandbytes' storage, 16 rows
SMS = 132                                                       # an H100's or H200's: the candidates' splits


def batches() -> list[list]:
    """Each tuner call's launches, in a 7B load's order: what compile_ahead gets at a time."""
    from ..quant import nf4_matmul as nm
    from ..quant import nf4_repacked_configs as rc
    from .kernel_sass import bnb_storage_launch, repacked_launch

    out = []
    for (k, n), rows in LOAD_7B:
        for m in rows:
            out.append([repacked_launch(k, n, rc.row_class(m), cfg).jit_launch
                        for cfg in rc.candidates(m, n, -(-k // 128), SMS)])
    for k, n in STORAGE_7B:
        out.append([bnb_storage_launch(k, n, 16, cfg).jit_launch for cfg in nm.candidates(16, n, k, SMS)])
    return out


def measure(threads: int, arch: int) -> dict:
    """Compile a 7B load's batches with ``threads`` workers, in this process (its Triton cache should be empty)."""
    from ..quant import kernel_timing
    from .kernel_sass import jit_compiles_for

    work = batches()
    failed: list[str] = []
    start = time.perf_counter()
    with jit_compiles_for(arch):
        for launches in work:
            if threads > 1:
                kernel_timing.compile_ahead(launches, workers=threads)
            # one by one: as before compile_ahead, each launch compiled when the tuner first runs it. After it: what
            # it left uncompiled, which a tuner's run would compile, or fail to, and skip
            for build in launches:
                fn, grid, args, meta = build()
                try:
                    fn.warmup(*args, grid=grid, **meta)
                except Exception as err:  # a config this GPU's compiler refuses: counted, as the tuner skips it
                    failed.append(first_line(err, 160))
        seconds = time.perf_counter() - start
        kernels = sum(len(fn.device_caches[0][0]) for fn in _kernels())     # each JIT function's compiled keys
    return dict(threads=threads, arch=arch, launches=sum(map(len, work)), tuner_calls=len(work),
                kernels=kernels, seconds=round(seconds, 1), failed=len(failed), first_failure=failed[:1])


def _kernels() -> list:
    from ..quant.nf4_repacked_kernel import repacked_kernel
    from ..quant.nf4_storage_kernels import stream_kernel, tile_kernel
    from ..quant.triton_runtime import launchable

    return [launchable(fn, False) for fn in (repacked_kernel, tile_kernel, stream_kernel)]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m medusa_core.benchmarks.compile_ahead", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=at_least(1, "a thread count"), nargs="+",
                        default=sorted({1, len(os.sched_getaffinity(0))}))
    parser.add_argument("--arch", type=at_least(75, "a compute capability Triton compiles for (sm_75 and later)"),
                        default=90)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)    # a child: one thread count
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.threads[0], args.arch)))
        return 0
    print(f"a 7B NF4 load's tuner compiles for sm_{args.arch} on this machine ({len(os.sched_getaffinity(0))} CPUs)")
    for threads in args.threads:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            env.pop("TRITON_INTERPRET", None)
            done = subprocess.run([sys.executable, "-m", __spec__.name, "--one", "--threads", str(threads),
                                   "--arch", str(args.arch)], env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"error: {threads} thread(s): {(done.stderr.strip().splitlines() or ['no output'])[-1]}",
                  file=sys.stderr)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{r['threads']:>3} thread(s): {r['kernels']} kernels from {r['launches']} launches in "
              f"{r['tuner_calls']} tuner calls, {r['seconds']} s" +
              (f"; {r['failed']} launches did not compile ({r['first_failure'][0]})" if r["failed"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
