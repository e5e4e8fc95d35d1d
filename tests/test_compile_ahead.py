"""The NF4 tuners' candidates compiled side by side before any is timed (quant/kernel_timing.compile_ahead), so
that a GPU's first start does not compile them one by one in its timing loop. Run here with Triton's JIT
compiling for an H100 (sm_90) on this GPU-less machine (benchmarks/kernel_sass.NoGpuDriver): what the threads
compile is what the tuner's own launches (``_launch``, the path every matmul takes, run here to compile only) then
find in the JIT's cache, so they compile no matmul kernel more; a launch that cannot be built or compiled is left
to the tuner, which reports it; an interrupt leaves the next load able to compile ahead; both tuners hand their
whole candidate list and their own inputs over before they time anything; and one kernel serves every count of K
groups and every split."""

from __future__ import annotations

import ast
import threading

import pytest
import torch
from triton.runtime.jit import JITFunction

pytest.importorskip("triton", reason="the NF4 kernels need Triton: pip install triton")
from bitsandbytes.functional import quantize_4bit  # noqa: E402

from medusa_core.benchmarks import compile_ahead as bench  # noqa: E402
from medusa_core.benchmarks import kernel_sass as ks  # noqa: E402
from medusa_core.quant import kernel_timing as kt  # noqa: E402
from medusa_core.quant import nf4_matmul as nm  # noqa: E402
from medusa_core.quant import nf4_repacked_configs as rc  # noqa: E402
from medusa_core.quant import nf4_repacked_kernel as rk  # noqa: E402
from medusa_core.quant import nf4_repacked_matmul as rm  # noqa: E402
from medusa_core.quant import nf4_storage_kernels as sk  # noqa: E402
from medusa_core.quant.nf4_repack import repack_bnb  # noqa: E402
from medusa_core.quant.triton_runtime import launchable  # noqa: E402

N, K = 256, 512


@pytest.fixture
def jit_for_h100(monkeypatch, tmp_path):
    """Triton's JIT compiling for sm_90 into an empty cache, with JIT functions of its own (cleared after, so no
    other test launches a kernel compiled for a GPU), and compile_ahead given 2 threads."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setattr(kt, "compile_workers", lambda: 2)
    run = JITFunction.run
    # every kernel launch compiles and stops there: this machine has no GPU to launch on
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs:
                        run(self, *args, grid=grid, warmup=True, **kwargs))
    launchable.cache_clear()
    with ks.jit_compiles_for(90):
        yield
    launchable.cache_clear()


class Compiles:
    """Every compile ``fn``'s JIT makes from now on, and the threads it ran in."""

    def __init__(self, fn):
        self.keys, self.threads = [], set()
        fn.device_caches[0]                 # the JIT binds its compiler on first use: replace it after that
        inner = fn.compile

        def counted(src, *args, **kwargs):
            self.keys.append((src.hash(), repr(sorted(kwargs["options"].items()))))   # source and options
            self.threads.add(threading.get_ident())
            return inner(src, *args, **kwargs)
        fn.compile = counted


def repacked_weight():
    dense = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    return repack_bnb([quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")], 128)


def warm(launch) -> None:
    fn, grid, args, meta = launch
    fn.warmup(*args, grid=grid, **meta)


def test_a_tuners_candidates_compiled_ahead_leave_its_own_launches_nothing_to_compile(jit_for_h100):
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    configs = rc.candidates(16, N, K // 128, 132)
    fn = launchable(rk.repacked_kernel, False)
    ahead = Compiles(fn)
    rm.compile_candidates(configs, w, [x])
    assert len(ahead.keys) >= len(configs) // 2, ahead.keys
    assert threading.get_ident() not in ahead.threads       # compiled on the pool, not in the tuner's thread
    later = Compiles(fn)
    for cfg in configs:             # what repacked_matmul(x, w, config=cfg), the tuner's run, launches
        rm._launch(x, w, None, torch.empty(16, N, dtype=x.dtype), cfg, interpret=False)
    assert later.keys == []


def test_exact_modes_candidates_are_compiled_for_every_row_count_its_check_calls_with(jit_for_h100):
    w = repacked_weight()
    x = torch.randn(64, K, dtype=torch.bfloat16)
    configs = rc.exact_candidates(N, K // 128, 132)
    fn = launchable(rk.repacked_kernel, False)
    rm.compile_candidates(configs, w, [x[:m] for m in sorted({1, *rm.EXACT_CHECK_ROWS, 16})])
    later = Compiles(fn)
    for cfg in configs:             # _time_exact's calls: each row alone, then 3, 17 and 64 rows; timed at 1 and 16
        for rows in [x[i:i + 1] for i in range(64)] + [x[:m] for m in (*rm.EXACT_CHECK_ROWS, 1, 16)]:
            rm._launch(rows, w, None, torch.empty(rows.shape[0], N, dtype=x.dtype), cfg, interpret=False)
    assert later.keys == []


def test_the_kernel_on_bitsandbytes_storage_is_compiled_ahead_as_its_tuner_launches_it(jit_for_h100):
    packed, state = quantize_4bit(torch.randn(N, K) * 0.02, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(16, K, dtype=torch.bfloat16)
    configs = nm.candidates(16, N, K, 132, 64, wide=True)
    kernels = [launchable(f, False) for f in (sk.tile_kernel, sk.stream_kernel)]
    assert {nm.compiled_launch(x, packed, state, cfg)[0] for cfg in configs} == set(kernels)   # tile and stream
    kt.compile_ahead([lambda cfg=cfg: nm.compiled_launch(x, packed, state, cfg) for cfg in configs])
    later = [Compiles(f) for f in kernels]
    for cfg in configs:             # what nf4_matmul(x, packed, state, config=cfg), the tuner's run, launches
        nm._launch(x, packed, state, None, torch.empty(16, N, dtype=x.dtype), cfg, interpret=False)
    assert [c.keys for c in later] == [[], []]


def test_a_launch_that_cannot_be_built_or_compiled_is_left_to_the_tuners_own_run(jit_for_h100):
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    good = rc.fast_config(16, N, K // 128, 132)
    fn, grid, args, meta = rm.compiled_launch(x, w, good)
    broken = {**meta, "BLOCK_N": 48}             # not a power of two: tl.arange refuses it when it compiles

    def unbuildable():
        raise ValueError("prefetch takes at most 4 scale blocks per group")

    kt.compile_ahead([unbuildable, lambda: (fn, grid, args, broken), lambda: rm.compiled_launch(x, w, good)])
    later = Compiles(fn)
    warm(rm.compiled_launch(x, w, good))
    assert later.keys == []                      # the good one was compiled beside the two that failed
    with pytest.raises(Exception, match="power of 2|arange"):
        fn.warmup(*args, grid=grid, **broken)    # the tuner's run meets the error itself, and pick_fastest says it


def test_an_interrupt_while_compiling_ahead_leaves_the_next_load_able_to_compile_ahead(jit_for_h100):
    # Ctrl+C during a load: the interrupt reaches the caller, and Triton's asynchronous mode is not left on in its
    # context (Triton 3.6 would leave it on, and every later compile in that thread would go to a closed pool)
    from triton.runtime import _async_compile

    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    configs = rc.candidates(16, N, K // 128, 132)[:3]
    fn = launchable(rk.repacked_kernel, False)
    fn.device_caches[0]
    compile = fn.compile

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    fn.compile = interrupted
    with pytest.raises(KeyboardInterrupt):
        rm.compile_candidates(configs, w, [x])
    fn.compile = compile
    assert _async_compile.active_mode.get() is None and ast.parse is kt._PARSE
    rm.compile_candidates(configs, w, [x])
    later = Compiles(fn)
    warm(rm.compiled_launch(x, w, configs[0]))
    assert later.keys == []


def test_one_cpu_compiles_nothing_ahead(jit_for_h100, monkeypatch):
    monkeypatch.setattr(kt, "compile_workers", lambda: 1)
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    ahead = Compiles(launchable(rk.repacked_kernel, False))
    rm.compile_candidates(rc.candidates(16, N, K // 128, 132)[:3], w, [x])
    assert ahead.keys == []                      # the tuner's first run of each compiles it, as without threads


@pytest.mark.parametrize("tuner", ["repacked", "repacked exact", "bitsandbytes storage"])
def test_each_tuner_hands_its_whole_candidate_list_and_its_inputs_over_before_it_times_any(monkeypatch, tuner):
    # the tuners themselves need a GPU to time: here its properties and the timing are stood in, and what the
    # tuner compiles ahead is set beside what it then times
    events = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"multi_processor_count": 132, "L2_cache_size": 1 << 20}))
    w = repacked_weight()
    monkeypatch.setattr(rm, "tuning_weight", lambda n, k, dtype, device, group: (w, [w], torch.Generator()))
    monkeypatch.setattr(rm, "compile_candidates", lambda configs, weight, xs: events.append(
        ("ahead", list(configs), [x.shape[0] for x in xs])))
    monkeypatch.setattr(nm, "compile_ahead", lambda launches: events.append(
        ("ahead", [p.args[-1] for p in launches], sorted({p.args[0].shape[0] for p in launches}))))

    def pick(configs, run, time_us, where):
        events.append(("timed", list(configs)))
        return configs[0], [(configs[0].describe(), 1.0)]
    monkeypatch.setattr(rm, "pick_fastest", pick)
    monkeypatch.setattr(nm, "pick_fastest", pick)
    cpu = torch.device("cpu")
    if tuner == "repacked exact":
        rm._time_exact(N, K, torch.bfloat16, cpu, 128, ("gpu", "exact"))
        rows = [1, 3, 16, 17, 64]
    elif tuner == "repacked":
        rm._time_candidates(16, N, K, torch.bfloat16, cpu, 128, ("gpu", 16))
        rows = [16]
    else:
        nm._time_candidates(16, N, K, torch.bfloat16, cpu, 64, True, ("gpu", 16))
        rows = [16]
    (what, compiled, xs), (then, timed) = events
    assert (what, then) == ("ahead", "timed") and compiled == timed and len(timed) > 1 and xs == rows


def test_one_kernel_serves_every_count_of_k_groups_and_every_split(jit_for_h100):
    # Triton would compile another kernel where the group count is divisible by 16 or a split's share is 1:
    # twice the compiles at a first start, for the same main loop (triton_runtime.unspecialized)
    fn = launchable(rk.repacked_kernel, False)
    compiles = Compiles(fn)
    for k in (2048, 1408):                                  # 16 and 11 groups of 128
        dense = torch.randn(N, k, generator=torch.Generator().manual_seed(0)) * 0.02
        w = repack_bnb([quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")], 128)
        x = torch.randn(16, k, dtype=torch.bfloat16)
        for split in (2, 16):                               # shares of 8 and 1 groups (6 and 1 at 11 groups)
            warm(rm.compiled_launch(x, w, rc.RepackedConfig(True, 16, 64, split, plane_lookup=True)))
    assert len(compiles.keys) == 1, compiles.keys


def test_the_sass_tool_compiles_the_kernel_a_launch_compiles(jit_for_h100):
    # kernel_sass counts the machine code of the kernel a GPU's launch compiles: the same specialization
    # (unspecialized arguments included), constants and options, so the same cubin
    k, n, m = 1408, N, 16
    cfg = rc.RepackedConfig(True, 16, 64, 2, plane_lookup=True)
    fn = launchable(rk.repacked_kernel, False)
    ahead = Compiles(fn)
    warm(ks.repacked_launch(k, n, m, cfg).jit_launch())
    (compiled,) = fn.device_caches[0][0].values()
    counted = ks.compile_launch(ks.repacked_launch(k, n, m, cfg), 90)
    assert len(ahead.keys) == 1 and counted.asm["cubin"] == compiled.asm["cubin"]


def test_the_threads_parse_one_at_a_time_and_the_parser_is_given_back(jit_for_h100):
    # Triton parses the kernel's source in each compile; CPython 3.11's parser fails one of two parses running at
    # once ("AST constructor recursion depth mismatch"), which would leave that kernel to the tuner's loop
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    fn = launchable(rk.repacked_kernel, False)
    fn.device_caches[0]
    compile, parsers = fn.compile, []

    def seen(*args, **kwargs):
        parsers.append(ast.parse)
        return compile(*args, **kwargs)
    fn.compile = seen
    rm.compile_candidates(rc.candidates(16, N, K // 128, 132)[:3], w, [x])
    assert parsers and all(p is kt._one_parse_at_a_time for p in parsers)
    assert ast.parse is kt._PARSE


def test_the_benchmark_counts_the_kernels_a_load_compiles_with_or_without_threads(jit_for_h100, monkeypatch):
    # benchmarks/compile_ahead.py on a load of one shape at one row class: one by one and side by side compile the
    # same kernels, and the count is the distinct kernels among the launches
    monkeypatch.setattr(bench, "LOAD_7B", (((K, N), (16,)),))
    monkeypatch.setattr(bench, "STORAGE_7B", ())
    launches = len(rc.candidates(16, N, K // 128, bench.SMS))
    counts = []
    for threads in (1, 2):
        launchable.cache_clear()
        r = bench.measure(threads, 90)
        assert (r["launches"], r["tuner_calls"], r["threads"], r["failed"]) == (launches, 1, threads, 0)
        counts.append(r["kernels"])
    assert counts[0] == counts[1] and 1 < counts[0] <= launches


@pytest.mark.parametrize("threads", [1, 2])
def test_the_benchmark_counts_launches_that_do_not_compile_for_the_gpu(jit_for_h100, monkeypatch, threads):
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    fn, grid, args, meta = rm.compiled_launch(x, w, rc.fast_config(16, N, K // 128, 132))
    monkeypatch.setattr(bench, "batches", lambda: [[lambda: (fn, grid, args, meta),
                                                     lambda: (fn, grid, args, {**meta, "BLOCK_N": 48})]])
    r = bench.measure(threads, 90)
    assert (r["launches"], r["kernels"], r["failed"]) == (2, 1, 1) and "arange" in r["first_failure"][0], r


def test_the_benchmark_refuses_a_thread_count_below_one_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--threads", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "0 is below 1: give a thread count" in err, err


def test_a_config_triton_refuses_is_skipped_with_a_line_that_says_why(jit_for_h100, capsys):
    # Triton's compile errors open with where ("at 22:31:"), then the kernel's source; the tuner's one line ends
    # with what
    w = repacked_weight()
    x = torch.randn(16, K, dtype=torch.bfloat16)
    good = rc.fast_config(16, N, K // 128, 132)
    fn, grid, args, meta = rm.compiled_launch(x, w, good)

    def run(cfg):
        fn.warmup(*args, grid=grid, **(meta if cfg == good else {**meta, "BLOCK_N": 48}))
        return torch.ones(3)
    bad = rc.RepackedConfig(True, 16, 32, 2)
    best, _ = kt.pick_fastest([good, bad], run, time_us=lambda cfg: 1.0, where="256x512")
    (line,) = capsys.readouterr().out.splitlines()
    assert best == good and line.startswith(f"kernel tuning: {bad.describe()} skipped for 256x512 (CompilationError: at ")
    assert line.endswith("arange's range must be a power of 2)"), line
