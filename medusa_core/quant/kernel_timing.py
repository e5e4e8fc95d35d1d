"""Timing kernel candidates as the decoding step runs them: inside a CUDA graph (no launch
overhead), cycling through copies of the weight that together exceed L2 (a model's layers are not
L2-resident either), and keeping the fastest config that agrees with a reference. The NF4 tuners
(nf4_matmul, nf4_repacked_matmul), the bitsandbytes routing, the norm routing and the kernel benchmark
use it.

What a routing measures can be remembered across starts (``remembered`` inside ``remembering``): the
app's loader keeps it on disk per GPU (loading/kernel_memory.py), so a second start routes as the first
did without timing again. Outside ``remembering`` (the benchmarks) everything is timed afresh."""

from __future__ import annotations

import ast
import contextlib
import contextvars
import copy
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ..decoding.graphs import captured
from ..errors import first_line

Config = TypeVar("Config")     # a kernel's config: any object with describe() -> str
T = TypeVar("T")
# What auto weighs on CUDA, for the NF4 kernel (quant/bnb.py) and the norms (quant/norm_routing.py): a plain
# step's rows and a 16-node tree step's (the NF4 default tree, mc_sim_7b_16). At the H100's figures
# (docs/performance.md) this picks the repacked kernel: 57.5 µs against 70.4 for a 4096->11008 projection.
AUTO_ROWS = (1, 16)


class NoConfigCompiled(RuntimeError):
    """A tuner found not one candidate that compiles and runs on this GPU. ``what`` says so without a fix
    (auto falls back and says why; a kernel forced by name is a one-line error naming --nf4-kernel bnb)."""

    def __init__(self, what: str):
        super().__init__(f"{what}: use --nf4-kernel bnb")
        self.what = what


@dataclasses.dataclass
class Memory:
    """Measurements kept under string keys (JSON values: ``entries``, as read from disk and as added now);
    the names this load took from what was kept before it (``read``) and measured itself (``measured``), and the
    seconds its measuring took. ``retune``: measure each one again, once."""

    entries: dict[str, Any]
    retune: bool = False
    read: set[str] = dataclasses.field(default_factory=set)
    measured: set[str] = dataclasses.field(default_factory=set)
    seconds: float = 0.0
    disturbed: bool = False      # a measurement ran beside other work on the device (``beside``): not to be kept


_ACTIVE = threading.local()     # the loading thread's Memory: an answer's thread may tune at its first step


@contextlib.contextmanager
def remembering(memory: Memory) -> Iterator[Memory]:
    """Within: ``remembered`` reads from and adds to ``memory`` (in this thread)."""
    before = getattr(_ACTIVE, "memory", None)
    _ACTIVE.memory = memory
    try:
        yield memory
    finally:
        _ACTIVE.memory = before


@contextlib.contextmanager
def beside(activity: Callable[[], tuple[bool, int]]) -> Iterator[None]:
    """Within (in this thread): ``activity()`` says whether other work runs on the device now and how many pieces
    of it ever started, e.g. the answers of the model being replaced. A measurement that work overlaps (running
    as it starts or ends, or started meanwhile) marks the memory ``disturbed``: its timings route this load,
    and are not kept for later ones (QA: a Load beside a running answer would have kept skewed timings until
    --retune; the CPU's measurements have the same guard, loading/this_machine.BUSY_SHARE)."""
    before = getattr(_ACTIVE, "activity", None)
    _ACTIVE.activity = activity
    try:
        yield
    finally:
        _ACTIVE.activity = before


def with_work_beside(run: Callable[[], T]) -> tuple[T, bool]:
    """``run()``'s result and whether the work ``beside`` names overlapped it: running as it started or ended, or
    started meanwhile. Outside ``beside``, never."""
    activity = getattr(_ACTIVE, "activity", None) or (lambda: (False, 0))
    running, started = activity()
    value = run()
    running_after, started_after = activity()
    return value, running or running_after or started_after != started


def remembering_now() -> bool:
    """Whether this thread is inside ``remembering``. There the tuners ask ``remembered`` before their own
    in-process caches, so that the memory holds, and its counts say, everything a load used (QA: a second
    load in one process took its timings from those caches unsaid, and --retune did not reach them)."""
    return getattr(_ACTIVE, "memory", None) is not None


def remembered(what: str, key: tuple, measure: Callable[[], T], decode: Callable[[Any], T]) -> T:
    """``measure()``; inside ``remembering``, what an earlier measure of (``what``, ``key``) gave instead
    (``decode`` turns its JSON back into the value; an entry it cannot read is measured again). A measure
    that raises is not remembered: a kernel that failed to tune is tried again at the next start."""
    memory = getattr(_ACTIVE, "memory", None)
    if memory is None:
        return measure()
    name = f"{what} {json.dumps([str(part) for part in key])}"
    if name in memory.measured or (not memory.retune and name in memory.entries):
        try:
            value = decode(memory.entries[name])
        except (TypeError, ValueError, KeyError, IndexError):
            pass            # written by an older version of the tuner: measured again below, and replaced
        else:
            if name not in memory.measured:
                memory.read.add(name)
            return value
    start = time.perf_counter()
    depth = getattr(_ACTIVE, "depth", 0)
    _ACTIVE.depth = depth + 1
    try:
        value, overlapped = with_work_beside(measure)
    finally:
        _ACTIVE.depth = depth
    if depth == 0:          # a measure that measures more inside (a warm-up that tunes) counts its time once
        memory.seconds += time.perf_counter() - start
    memory.disturbed = memory.disturbed or overlapped
    memory.entries[name] = as_json(value)
    memory.measured.add(name)
    memory.read.discard(name)
    return value


def as_json(value: Any) -> Any:
    """``value`` with dataclasses as dicts and tuples as lists: what ``remembered`` stores."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [as_json(v) for v in value]
    return value


def decode_tuning(config_class: type[Config], saved: Any) -> tuple[Config, list[tuple[str, float | None]]]:
    """A tuner's remembered (fastest config, [(config, µs or None)]) back from ``as_json``'s form."""
    best, log = saved
    return config_class(**best), [(str(name), None if us is None else float(us)) for name, us in log]


JitLaunch = tuple[Any, tuple, tuple, dict]     # (triton.jit function, grid, args, keyword args) of one kernel launch


MAX_COMPILE_WORKERS = 16     # each compile holds its own IR (tens of MB) and, at its end, a ptxas process


def compile_workers() -> int:
    """Threads for compile_ahead: the CPUs this process may run on, at most MAX_COMPILE_WORKERS."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, MAX_COMPILE_WORKERS)


def compile_ahead(launches: list[Callable[[], JitLaunch]], workers: int | None = None) -> None:
    """Compile the kernels of ``launches`` side by side before a tuner times any of them, so that its timing loop
    finds its matmul kernels compiled. One by one, a 7B load's tuner compiles took 84-96 s on a 2-core Zen 4
    (docs/performance.md, "Compiled side by side"). Triton's own asynchronous mode puts each compile in the JIT
    function's cache under the key the tuner's launch looks up; its compiler lets threads overlap.

    Each item builds one launch, the same call the tuner then makes. A launch that cannot be built or does not
    compile is left to the tuner's own run, which raises the same error there and reports it with its skipped
    configs: nothing is decided here. ``workers``: threads (compile_workers() unless given)."""
    workers = min(len(launches), workers or compile_workers())
    if workers < 2:
        return                  # one compile or one CPU: the tuner's first run of each compiles as before
    # in a context of its own: Triton 3.6 leaves its asynchronous mode switched on in the caller's context when an
    # interrupt (Ctrl+C during a load) leaves the block before every compile is collected
    contextvars.copy_context().run(_compile_side_by_side, launches, workers)


_PARSE = ast.parse
_PARSE_LOCK = threading.Lock()          # one ast.parse at a time while compiling side by side
_PARSERS = threading.Lock()             # guards _parsers: the compile_ahead calls under way
_parsers = 0


def _one_parse_at_a_time(*args, **kwargs):
    with _PARSE_LOCK:
        return _PARSE(*args, **kwargs)


@contextlib.contextmanager
def _parsing_one_at_a_time() -> Iterator[None]:
    """Within: ast.parse serialized. Triton parses the kernel's source in each compile (3.6), and CPython 3.11
    counts ast.parse's recursion depth in state the threads share: two parses at once failed one of them with
    "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905; 3 of 8 runs of
    tests/test_compile_ahead.py under Triton 3.6 on Python 3.11.7). A parse takes a millisecond of a compile's
    half second."""
    global _parsers
    with _PARSERS:
        _parsers += 1
        ast.parse = _one_parse_at_a_time
    try:
        yield
    finally:
        with _PARSERS:
            _parsers -= 1
            if not _parsers:
                ast.parse = _PARSE


def _compile_side_by_side(launches: list[Callable[[], JitLaunch]], workers: int) -> None:
    import triton

    with (_parsing_one_at_a_time(), ThreadPoolExecutor(workers) as pool,
          triton.AsyncCompileMode(pool, ignore_errors=True)):
        for build in launches:
            try:
                fn, grid, args, meta = build()
                fn.warmup(*args, grid=grid, **meta)     # compiles on the pool; the JIT's cache gets it on exit
            except Exception:  # raised again by the tuner's own run of this config, which reports it
                continue


def pick_fastest(configs: list[Config], run: Callable[[Config], torch.Tensor],
                 time_us: Callable[[Config], float], where: str) -> tuple[Config | None, list]:
    """(fastest config, [(config, µs or None)]) of ``configs``. The first one that runs is the reference
    (each tuner lists its known-good config first); a config that fails to compile or run, or whose
    result is off the reference by more than 1e-2 (relative), is skipped with one printed line."""
    best, best_us, reference, log = None, float("inf"), None, []
    for cfg in configs:
        try:
            y = run(cfg).float()
            if reference is None:
                reference = y
            error = float((y - reference).norm() / reference.norm().clamp_min(1e-30))
            if not error <= 1e-2:
                raise RuntimeError(f"wrong result: relative error {error:.1e} against the first config")
            us = time_us(cfg)
        except Exception as err:  # e.g. a tile Triton cannot compile for this GPU: skipped, loudly
            print(f"kernel tuning: {cfg.describe()} skipped for {where} ({type(err).__name__}: {first_line(err, 120)})")
            log.append((cfg.describe(), None))
            continue
        log.append((cfg.describe(), us))
        if us < best_us:
            best, best_us = cfg, us
    return best, log


def rotation_count(nbytes: int, l2_bytes: int, at_least: int = 2) -> int:
    """How many copies of an ``nbytes`` weight make cycling through them stream from HBM, not L2
    (twice L2 in all, at most 16)."""
    return max(at_least, min(16, -(-2 * l2_bytes // max(nbytes, 1))))


def rotating_copies(packed: torch.Tensor, state, l2_bytes: int, at_least: int = 2) -> list[tuple]:
    """Enough (packed, state) copies that cycling through them streams from HBM, not L2."""
    count = rotation_count(packed.numel() + state.absmax.numel() * state.absmax.element_size(), l2_bytes, at_least)
    out = [(packed, state)]
    for _ in range(count - 1):
        s = copy.copy(state)
        s.absmax = state.absmax.clone()
        out.append((packed.clone(), s))
    return out


def graph_time_us(calls: list[Callable[[], object]], replays: int = 5, repeat: int = 4) -> float:
    """Median µs per call: ``calls`` (cycled ``repeat`` times) captured back to back in one CUDA graph,
    replayed and timed with CUDA events; launch overhead is gone, as in the decoding loop's graph."""
    # the step's capture: a load times kernels while an answer may still run, and capture, on the model it
    # replaces, in another thread (a global-mode capture on a stream of its own failed either); no collection
    # before each of these many short captures (0.3 s each)
    graph, _ = captured(lambda: [fn() for _ in range(repeat) for fn in calls],
                        torch.device("cuda", torch.cuda.current_device()),
                        warm_up=lambda: [fn() for fn in calls], warmups=1, collect=False)
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
