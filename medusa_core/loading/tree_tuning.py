"""The tree chosen by measurement on the machine that runs it, once, and remembered.

A tree is a property of (model, heads, machine): what a node is worth comes from the heads
(heads/accuracy.py), what it costs from this machine's verification step, which no table of
another machine's figures predicts (2 CPU cores with AVX-512 and bf16 instructions, an AVX2-only
CPU and an H100 have different cost curves by tree size). So at the first load of a (model,
heads, machine, mode) the step is timed at a few tree sizes, the grown tree of each size is
scored by expected tokens per step over the measured step time, and the best is kept, or plain
decoding when no tree pays. The result is cached in the user's cache directory under a key of
everything that decides it; later starts read it.

The step timed is the one replies run: generate() around step.DecodeStep (a CUDA graph replay on
CUDA), wall time per step with its one sync, on a short chat prompt.
"""

from __future__ import annotations

import atexit
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import LoadError
from ..decoding.tree import build_tree_buffers, expected_tokens_per_step, grow_tree
from ..quant.kernel_timing import with_work_beside
from .kernel_memory import memory_key
from .smollm2 import cache_write_failed
from .this_machine import (BUSY_SHARE, cpu_share_now, entry_path, file_stamp, machine_identity, machine_line,
                           with_cpu_share, write_atomic)

TUNER_VERSION = 4          # part of the cache key: a change in how trees are measured re-tunes
CPU_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)             # tree sizes timed, root included: every CPU row costs
CUDA_SIZES = (1, 2, 4, 8, 16, 32, 64)
MIN_SPEEDUP = 1.05         # a tree must be expected this much faster than plain decoding to be used:
                           # below it, timing noise could make it slower (docs/cpu_default.md, "Tuned
                           # on the machine that runs it")
CYCLES, WARMUP = 20, 2     # steps timed per size (one per cycle, time_in_cycles), after warm-up steps
PRUNE_AFTER = 6            # cycles before sizes that cannot win stop being timed
# Wall seconds of timed cycles after which the timing stops (at PRUNE_AFTER cycles at least) and chooses from
# what it has: a quiet 2-core CPU times all 20 cycles in 5-13 s, but on one busy with other programs every
# start tuned for 5-7 minutes before the first answer (QA), and a choice measured under load is not cached
TIMING_BUDGET_S = 45.0
REPORT_EVERY = 5           # cycles between progress lines
RUN_STEPS = 16             # steps timed per reply, then it is decoded again from the cached prompt
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
Progress = Callable[[str], None]


@dataclass(frozen=True)
class TunedTree:
    """The tuner's choice and why. ``paths`` empty: plain decoding (no tree pays here)."""

    paths: list[list[int]]
    nodes: int                          # root included
    expected_tokens_per_step: float
    expected_speedup: float             # over plain decoding, from the measured step times
    best_speedup: float                 # the best tree's, even when it did not pay
    best_nodes: int
    step_ms: dict[str, float]           # size -> ms per step (non-decreasing in size, see monotone_fit)
    seconds: float                      # how long measuring took
    accuracy_source: str
    machine: str
    cpu_share: float | None = None      # CPU: this process's share of its threads' CPU time while timing
    cached: bool = False
    accuracy: list[list[float]] | None = None   # the heads' table the choice was made from (speedup_of)
    not_kept: str = ""                  # why a choice measured on a quiet CPU could not be cached (the fix named)
    earlier: bool = False               # measured by an earlier load in this process and not cached (_NOT_CACHED)
    beside_answer: bool = False         # timed while an answer on the model this load replaces still ran

    @property
    def pays(self) -> bool:
        return self.nodes > 1

    @property
    def contended(self) -> bool:
        """Measured while other programs (or this app's answer: busy_with) used the CPU: not remembered (tuned_tree)."""
        return self.cpu_share is not None and self.cpu_share < BUSY_SHARE

    @property
    def busy_with(self) -> str:
        """What kept the CPU busy while a contended tuning timed its steps (QA: a load beside an answer still
        running in this app blamed other programs, with nothing else running)."""
        return "an answer on the model this load replaces" if self.beside_answer else "other programs"

    def speedup_of(self, paths: Sequence[Sequence[int]]) -> tuple[float, bool] | None:
        """Another tree's expected speedup over plain decoding on this machine, from the same measured
        step times and accuracies as the choice, and whether it is only an upper bound: a tree larger
        than any timed costs at least what the largest did. None where the accuracies cannot value it
        (deeper than the table)."""
        if self.accuracy is None or any(len(path) > len(self.accuracy) for path in paths):
            return None
        value = expected_tokens_per_step(paths, self.accuracy)
        times = sorted((int(n), ms) for n, ms in self.step_ms.items())
        size = len(paths) + 1
        if size >= times[-1][0]:
            return value * times[0][1] / times[-1][1], size > times[-1][0]
        # between two timed sizes: linear in the number of rows verified
        (low, low_ms), (high, high_ms) = next((a, b) for a, b in zip(times, times[1:]) if a[0] <= size <= b[0])
        ms = low_ms + (high_ms - low_ms) * (size - low) / (high - low)
        return value * times[0][1] / ms, False

    @property
    def heads_limited(self) -> bool:
        """No tree pays because the heads are rarely right, not because a tree step costs too much here:
        even the largest tree timed, at no more than a plain step's cost, would not reach MIN_SPEEDUP."""
        return self.accuracy is not None and self.ceiling_tokens_per_step < MIN_SPEEDUP

    @property
    def ceiling_tokens_per_step(self) -> float:
        """The most tokens a step any timed tree size is expected to accept (its speedup were it free)."""
        if not self.accuracy:
            return 1.0
        return max(expected_tokens_per_step(grow_tree(self.accuracy, int(n) - 1), self.accuracy) for n in self.step_ms)

    @property
    def no_speedup_cause(self) -> str:
        if self.heads_limited:
            return "with these heads"
        # the pane title says it too, not only the status line (QA: "no speedup on this device ... 0.27x" from a
        # busy tuning, where the same machine measured 1.35x quiet)
        return "on this device" + (f" (as measured while {self.busy_with} used the CPU)" if self.contended else "")

    def line(self) -> str:
        """One line for the page and the console: which tree runs by default and why (the status line
        shows it after an answer with another tree too: a tester read it as that answer's tree)."""
        when = "read from the cache; --retune measures again" if self.cached else \
            f"measured in {self.seconds:.0f} s" if self.seconds >= 1 else "measured in under a second"
        if self.earlier:
            when = f"{when} by an earlier load in this process"
        if self.contended and not self.cached:
            when += (" while an answer on the model this load replaces still ran" if self.beside_answer else
                     f" while other programs were using the CPU (this app got {self.cpu_share:.0%} of it)") + \
                ", so it is not kept in the cache"
        if self.not_kept:
            when += f", not kept: {self.not_kept}"
        if self.earlier:
            when += "; a load on a quiet CPU, or a restart, measures again" if self.contended else \
                "; restarting the app measures again"
        if self.pays:
            return (f"tree tuned for this machine (the default): {self.nodes} nodes, expected {self.expected_speedup:.2f}x "
                    f"({self.expected_tokens_per_step:.2f} tokens/step; {when})")
        if self.heads_limited:
            # the device is not to blame: a faster machine would not change this, better heads would
            return (f"Medusa gives no speedup with these heads: they are rarely right (the largest tree timed expects "
                    f"{self.ceiling_tokens_per_step:.2f} tokens a step even were it as cheap as a plain step, under "
                    f"{MIN_SPEEDUP}x), so plain decoding runs by default ({when})")
        return (f"Medusa gives no speedup on this device: the best tree ({self.best_nodes} nodes) is expected at "
                f"{self.best_speedup:.2f}x, under {MIN_SPEEDUP}x, so plain decoding runs by default ({when})")


# ---------------------------------------------------------------- what decides the choice

def tuning_key(model, heads_dir: Path | None, mode: str, accuracy: Sequence[Sequence[float]],
               sizes: Sequence[int], device: torch.device) -> dict:
    """Everything the choice depends on: machine, torch, model and heads files, mode, accuracies; on CUDA also
    what the kernel timings depend on (Triton, bitsandbytes, the kernels' source), since a step's cost moves with
    the kernels they choose (review: an upgrade timed the kernels again and kept the tree of the old ones)."""
    source = str(getattr(model, "name_or_path", "") or "")
    model_files = file_stamp(Path(source)) if source and Path(source).exists() else []
    kernels = {k: v for k, v in memory_key(device).items() if k != "machine"} if device.type == "cuda" else {}
    return {"tuner": TUNER_VERSION, "machine": machine_identity(device), "model": source,
            "model_config": model.config.to_json_string(use_diff=True), "model_files": model_files,
            "heads_files": file_stamp(heads_dir) if heads_dir is not None else [], "mode": mode,
            "accuracy": [[round(p, 6) for p in row] for row in accuracy], "sizes": list(sizes), **kernels}


def cache_file(key: dict, root: Path) -> Path:
    """One folder per key: the choice and its report (``choice.json``) and the tree (``tree_file``)."""
    return entry_path(key, root, "tuned-trees", "choice.json")


def tree_file(entry: Path) -> Path:
    """The tree's paths file beside the entry: what the engine's tree picker reads (and shows by name)."""
    return entry.with_name("tuned.json")


# ---------------------------------------------------------------- measuring

def monotone_fit(seconds: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing step times by size (least squares: pool adjacent violators).
    A bigger tree never costs less, so a size measured faster than a smaller one is load noise and
    is averaged with it; a real jump stays. A straight line did not keep it: on 2 CPU cores torch's
    fp32 sgemm changes strategy at a few rows, the line smoothed that jump away and chose a tree past
    it that `bench` then measured slower than a smaller one (docs/cpu_default.md, "What a verified
    row costs on 2 CPU cores")."""
    pools: list[tuple[float, list[int]]] = []        # (mean seconds, sizes), means non-decreasing
    for n in sorted(seconds):
        mean, sizes = seconds[n], [n]
        while pools and pools[-1][0] > mean:
            prev_mean, prev_sizes = pools.pop()
            mean = (prev_mean * len(prev_sizes) + mean * len(sizes)) / (len(prev_sizes) + len(sizes))
            sizes = prev_sizes + sizes
        pools.append((mean, sizes))
    return {n: mean for mean, sizes in pools for n in sizes}


def step_seconds(model, heads, tree, prompt_ids: list[int], cache) -> Iterator[float]:
    """Wall seconds of each decoding step after ``prompt_ids``, without end: a reply is cut after
    RUN_STEPS steps (or ends sooner) and decoded again from the cached prompt, so every size is timed
    over the same number of steps after the prompt (a tree covers more positions in them: its
    accepted tokens)."""
    from ..decoding.config import DecodeConfig
    from ..decoding.generate import generate

    config = DecodeConfig(max_new_tokens=reply_tokens(tree))     # stop ids: the model's EOS only
    while True:
        timed = 0
        run = generate(model, prompt_ids, heads=heads if tree.num_heads else None, tree=tree, config=config, cache=cache)
        try:
            for step in run:
                if step.prefill or not step.tokens:
                    continue
                timed += 1
                yield step.seconds
                if timed == RUN_STEPS:
                    break
        finally:
            run.close()
        if not timed:
            raise LoadError("the tree tuner's prompt got an empty answer, so there was no step to time: "
                            "start with --tree to choose a tree without measuring")


def reply_tokens(tree) -> int:
    """Room for RUN_STEPS steps of ``tree``: a step emits at most depth + 1 tokens."""
    return RUN_STEPS * (tree.num_heads + 1) + 1


def paired_seconds(times: dict[int, list[float]]) -> dict[int, float]:
    """Seconds per step by size from steps timed in cycles (``times[n][c]``: size n's step in cycle c,
    size 1 in every cycle): the plain step's median, times each size's median over cycles of its
    step over the plain step of the same cycle. A slow phase that slows a whole cycle cancels in the
    ratio, and a spike in a minority of cycles is outvoted."""
    base = times[1]
    plain = statistics.median(base)
    return {n: plain * statistics.median(t / base[c] for c, t in enumerate(steps)) for n, steps in times.items()}


def measure_step_seconds(model, heads, trees: dict[int, object], prompt_ids: list[int], lengths: dict[int, float],
                         progress: Progress, cycles: int = CYCLES) -> dict[int, float]:
    """Seconds per step by tree size: each size runs its own generation loop on its own cache, and
    the loops are timed in turn (time_in_cycles). ``lengths``: expected tokens per step by size."""
    from ..decoding.generate import new_cache

    # One capacity for all: a CUDA graph attends over its cache's whole capacity, so sizes timed at
    # different capacities would differ by more than their trees. The smallest that holds every size:
    # all the caches are alive at once (a 7B's 256 slots are 128 MB each, 7 sizes on CUDA), and a
    # chat's own capacity moves with the conversation anyway.
    capacity = len(prompt_ids) + max(reply_tokens(tree) + tree.size for tree in trees.values())
    loops = {n: step_seconds(model, heads, trees[n], prompt_ids, new_cache(model, capacity)) for n in sorted(trees)}
    try:
        return time_in_cycles(loops, lengths, progress, cycles)
    finally:
        for loop in loops.values():
            loop.close()


def time_in_cycles(loops: dict[int, Iterator[float]], lengths: dict[int, float], progress: Progress,
                   cycles: int = CYCLES, budget_s: float = TIMING_BUDGET_S) -> dict[int, float]:
    """Seconds per step by size (paired_seconds) from loops that each take one step in turn, a cycle.
    Timing each size in a block of steps let load fall on one size: on 2 shared cores a slow phase
    lasts a few hundred ms (a block of 12 plain steps measured at 29 ms each, the blocks around it at
    19.5), as long as a block, and three fresh starts on one machine chose 1.39x, 0.95x and 1.30x.
    Warm-up cycles first (on CUDA they capture each tree's graph); after PRUNE_AFTER cycles, sizes
    that cannot win are no longer timed (_worth_timing). Past ``budget_s`` of timed cycles (a busy machine),
    the timing stops there, after PRUNE_AFTER cycles at least."""
    sizes = sorted(loops)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    started = None
    for cycle in range(-WARMUP, cycles):
        if cycle == 0:
            started = time.perf_counter()     # warm-up (CUDA graph captures) is not the machine being slow
        elif cycle >= PRUNE_AFTER and (elapsed := time.perf_counter() - started) > budget_s:
            # the time these steps took, not the budget: PRUNE_AFTER steps may take longer (it said "45 s" where
            # they took 110, and the page said the tuning took 132)
            progress(f"tuning the tree for this machine: stopped after {cycle} of {cycles} steps, {elapsed:.0f} s "
                     "(the CPU is slow or busy): choosing from them")
            break
        if cycle % REPORT_EVERY == 0 or cycle == -WARMUP:
            when = "warm-up" if cycle < 0 else f"step {cycle + 1} of {cycles}"
            progress(f"tuning the tree for this machine: timing trees of {', '.join(map(str, sizes))} "
                     f"node{'s' if sizes != [1] else ''} ({when})")
        for n in sizes:
            took = next(loops[n])
            if cycle >= 0:
                times[n].append(took)
        if cycle + 1 == PRUNE_AFTER and 1 in sizes:
            sizes = _worth_timing(paired_seconds(times), lengths, sizes)
            for n in set(loops) - set(sizes):
                loops[n].close()           # its cache (and graph) can go now
    return paired_seconds(times)


def _worth_timing(seconds: dict[int, float], lengths: dict[int, float], sizes: list[int]) -> list[int]:
    """The sizes still worth timing after PRUNE_AFTER cycles. A tree costing c baseline steps gives at
    most max(lengths) / c, and a bigger tree costs at least as much: from the first size whose bound
    is below what a smaller tree already gives (or below MIN_SPEEDUP), no bigger one can win."""
    kept, best_so_far, longest = [], MIN_SPEEDUP, max(lengths.values())
    for n in sizes:
        cost = seconds[n] / seconds[1]
        if n > 1 and longest / cost < best_so_far:
            break
        kept.append(n)
        best_so_far = max(best_so_far, lengths[n] / cost)
    return kept


def choose(acc: Sequence[Sequence[float]], seconds: dict[int, float]) -> tuple[int, float, int, float, dict[int, float]]:
    """(chosen size, its expected speedup, best size, best speedup, fitted seconds): the size with the
    most expected tokens per second; plain decoding (1) unless that beats it by MIN_SPEEDUP."""
    # the baseline skips the heads and the tree bookkeeping: it keeps its own measurement, and is the floor of
    # every tree's (a plain step measured slower than a 3-node one under load gave heads that never hit, 1.00
    # tokens a step, "expected 1.13x", and their tree ran)
    trees = monotone_fit({n: s for n, s in seconds.items() if n > 1})
    fitted = {**seconds, **{n: max(s, seconds[1]) for n, s in trees.items()}}
    speedup = {n: expected_tokens_per_step(grow_tree(acc, n - 1), acc) * fitted[1] / fitted[n] for n in fitted}
    best = max((n for n in speedup if n > 1), key=lambda n: speedup[n], default=1)
    chosen = best if speedup[best] >= MIN_SPEEDUP else 1
    return chosen, speedup[chosen], best, speedup[best], fitted


def tune(model, heads, tokenizer, acc: Sequence[Sequence[float]], accuracy_source: str,
         progress: Progress, sizes: Sequence[int]) -> TunedTree:
    """Measure this machine at tree ``sizes`` and choose (see the module docstring)."""
    from .chat_format import render_chat

    device = model.get_output_embeddings().weight.device
    started = time.perf_counter()
    depth = min(heads.config.num_heads, len(acc))
    grown = {n: grow_tree(acc[:depth], n - 1) for n in sizes}
    grown = {n: paths for n, paths in grown.items() if len(paths) == n - 1}   # sizes the accuracies can fill
    trees = {n: build_tree_buffers(paths, depth, top_k=len(acc[0]), device=device)
             for n, paths in grown.items()}
    prompt_ids = render_chat(tokenizer, PROMPT)
    lengths = {n: expected_tokens_per_step(paths, acc) for n, paths in grown.items()}
    with torch.inference_mode():
        (seconds, share), answering = with_work_beside(
            lambda: with_cpu_share(lambda: measure_step_seconds(model, heads, trees, prompt_ids, lengths, progress)))
    chosen, speedup, best, best_speedup, fitted = choose(acc, seconds)
    paths = [list(p) for p in grown[chosen]] if chosen > 1 else []
    return TunedTree(paths=paths, nodes=chosen, expected_tokens_per_step=round(expected_tokens_per_step(grown[chosen], acc), 4),
                     expected_speedup=round(speedup, 4), best_speedup=round(best_speedup, 4), best_nodes=best,
                     step_ms={str(n): round(1e3 * s, 3) for n, s in sorted(fitted.items())},
                     seconds=round(time.perf_counter() - started, 2), accuracy_source=accuracy_source,
                     machine=machine_line(machine_identity(device)),
                     cpu_share=round(share, 3) if device.type == "cpu" else None, beside_answer=answering,
                     accuracy=[list(map(float, row)) for row in acc])


# ---------------------------------------------------------------- remembered

def read_cached(entry: Path, key: dict) -> TunedTree | None:
    """The cached choice for ``key``, or None if there is none (or it was written for another key)."""
    if not entry.is_file() or not tree_file(entry).is_file():
        return None
    try:
        saved = json.loads(entry.read_text())
        if saved.get("key") != key or json.loads(tree_file(entry).read_text()) != saved["result"]["paths"]:
            return None     # another key, or a tree file another start rewrote: measured again
        # an entry written before the table was kept beside it: the key holds it (to 6 digits)
        return TunedTree(**{"accuracy": key["accuracy"], **saved["result"], "cached": True})
    except (OSError, ValueError, TypeError, KeyError):
        return None          # a damaged entry (an interrupted write of an older version) or an unreadable one:
        #                      measured again (QA: a file this user could not read failed every load)


def write_cached(entry: Path, key: dict, tuned: TunedTree) -> None:
    """Write the entry and its tree file, each atomically."""
    write_atomic(tree_file(entry), json.dumps(tuned.paths) + "\n")
    write_atomic(entry, json.dumps({"key": key, "result": {**asdict(tuned), "cached": False}}, indent=1) + "\n")


# Choices this process measured and could not cache (a busy CPU, an unwritable cache), by cache entry: a later
# load of the same model in this process runs them again rather than tuning for minutes once more (QA: Unload
# then Load on a busy machine waited 105 s for a tree the same process had measured 25 minutes before). A busy
# choice only while the CPU is still busy: on a quiet one the load measures again, and keeps what it measures
# (a busy tuning had turned Medusa off for the process, where the quiet machine measured 1.35x)
_NOT_CACHED: dict[Path, tuple[dict, TunedTree, Path]] = {}


def tuned_tree(model, heads, tokenizer, acc: Sequence[Sequence[float]], accuracy_source: str, *, heads_dir: Path | None,
               mode: str, cache_root: Path, retune: bool = False,
               progress: Progress = lambda line: None) -> tuple[TunedTree, Path]:
    """The cached choice for this (model, heads, machine, mode), measured first if there is none or
    ``retune``; returns it with the tree file the engine reads (its paths, [] for plain decoding)."""
    device = model.get_output_embeddings().weight.device
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    key = tuning_key(model, heads_dir, mode, acc, sizes, device)
    entry = cache_file(key, cache_root)
    cached = None if retune else read_cached(entry, key)
    if cached is not None:
        return cached, tree_file(entry)
    earlier = None if retune else _NOT_CACHED.get(entry)
    if earlier is not None and earlier[0] == key and earlier[2].is_file() and \
            (not earlier[1].contended or cpu_share_now() < BUSY_SHARE):
        return replace(earlier[1], earlier=True), earlier[2]
    tuned = tune(model, heads, tokenizer, acc, accuracy_source, progress, sizes)
    if not tuned.contended:
        try:
            write_cached(entry, key, tuned)
            _NOT_CACHED.pop(entry, None)
            return tuned, tree_file(entry)
        except OSError as err:
            # the choice is measured and this load runs it; a cache it cannot keep it in costs the next start
            # the minutes of tuning, not this one its model (QA: the load failed after tuning)
            tuned = replace(tuned, not_kept=cache_write_failed("the tuned tree", err))
    # this start runs the tree from a file of its own: the cache, and an entry a quiet start may be writing at
    # this moment, stay as they are
    own = own_tree_file(tuned.paths, tree_file(entry).name)
    _NOT_CACHED[entry] = (key, tuned, own)
    return tuned, own


# this process's own tree files' folders (own_tree_file)
_OWN_TREES: list[Path] = []


def remove_own_tree_files() -> None:
    """At the process's exit, and by launch.py where it ends without the exit handlers."""
    for folder in _OWN_TREES:
        shutil.rmtree(folder, ignore_errors=True)


def own_tree_file(paths: list[list[int]], name: str) -> Path:
    """A tree file for this process only, removed when it exits (each busy start once left one behind for good)."""
    folder = Path(tempfile.mkdtemp(prefix="medusa-chat-tree-"))
    if not _OWN_TREES:
        atexit.register(remove_own_tree_files)
    _OWN_TREES.append(folder)
    own = folder / name
    own.write_text(json.dumps(paths) + "\n")
    return own
