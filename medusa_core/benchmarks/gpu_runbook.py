"""Issue 22's GPU measurements, most valuable first, inside one device call's time limit.

    python3 -m medusa_core.benchmarks.gpu_runbook --out $OUT                    # every stage, 570 s in all
    python3 -m medusa_core.benchmarks.gpu_runbook --out $OUT --from exactness   # a later call: the rest
    python3 -m medusa_core.benchmarks.gpu_runbook --out $OUT --stages first-start cuda-e2e   # as the first said

A lent GPU comes with 15 minutes of device time for a whole session and 10 minutes per command, and a
machine found cold costs a minute or more to start: few, full calls are worth more than many small
ones, and a call that runs past its limit is killed. Each stage runs as its own process with the time
that is left, and is stopped before the deadline, so the command returns on its own and $OUT comes
back whole. Each benchmark rewrites its JSON after every result, so a stage cut short keeps what it
measured. ``runbook.json`` says per stage: the command, its exit status, its seconds, and whether the
deadline cut it or left it unstarted; a stage that writes nothing until it ends is not started with less
time left than it needs (``Stage.least_s``), and the run's last line names the stages a next call takes. Each
stage's output is in ``<stage>.log``.

The device tool brings back at most 8 files from $OUT, and the stages write over 20 (a log and a result each):
the stages write in a folder of their own, and --out gets ``runbook.tar.gz`` (all of it, rewritten after each
stage) and a copy of ``runbook.json``. Back on the development machine, ``tar xzf runbook.tar.gz``, and the
JSONs fold into one report (docs/performance.md):
``python -m medusa_core.bench_synthetic --fold docs/perf/h100.json step.json anchors.json nf4.json profile.json
exactness.json first_start.json nf4_heads.json dependent_launch.json --json docs/perf/h100.json``
(``ladder.json`` is read as it is: its table is in ``ladder.log``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OneLineParser, check_folder, exit_status, first_line

# the device tool stops a command at 600 s; 30 s are left for stopping a stage and writing the manifest
DEFAULT_BUDGET_S = 570
MIN_STAGE_S = 30      # a stage is not started with less left: it would be cut before measuring anything
STOP_GRACE_S = 10     # after SIGTERM, how long a stage may take to exit before SIGKILL


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    module: str                 # run as `python -m module *args`
    args: tuple[str, ...]       # "{out}" stands for the output folder
    # a stage that writes nothing until it ends, or nothing until its 7B model is built and routed, is not started
    # with less time left than this (0: the runbook's minimum): the H200 run of 2026-11-29 took 125 s for
    # first-start and 104 for profile, which a cut call would only have wasted
    least_s: float = 0


# In order of value (docs/performance.md, "Issue 22 on a GPU"). Correctness on CUDA first: the CUDA tests,
# and the kernels compiled by the GPU machine's own Triton (test_kernel_sass.py: its Triton 3.6 compiled
# the norm that 3.9 compiles well to 14,000 instructions a row). One pytest process: four side by side
# (pytest-xdist) took 412 s against one's 242 s on the H100 of 2026-11-27, each test 5x slower beside the
# others. Then where a call's time goes (the kernel ladder: the 1-row call runs at a third of the bandwidth and
# no tuner knob moves it) and what it waits on (ncu's counters: stalls, DRAM throughput, warps); the kernel
# table (every kernel, 64 rows, bitsandbytes, the fused shapes tuned) and the anchors (torch's int4 and bf16).
# Then the NF4 step as the app routes it (auto kernel, norms, rotary and attention) and in exact mode, against
# transformers' rotary and SDPA; the same step with NF4 heads beside bf16 ones (not yet measured); the NF4 and
# bf16 profiles; the app's loading path started twice on a saved 7B (its bench no longer captures per answer);
# and the greedy-equality count (exact mode first, 8 prompts: the same 8/8, 0/8, 0/8 in three runs). Last,
# the CUDA tests that decode whole answers through a tuned or exact step: 113 of the CUDA tests' 223 s on the H200
# of 2026-11-28 (67 s the first, which tunes every candidate), time the first call's step needs now that the
# ladder, kernel table and anchors precede it. The kernels' own tests still come first, and a tuner checks each
# candidate's result before timing it. Each JSON is rewritten after every result, so a stage cut short keeps its
# rows.
END_TO_END_TESTS = (
    "tests/test_cuda_repacked.py::"
    "test_auto_times_both_kernels_on_this_gpu_and_decodes_in_a_graph_what_it_decodes_eagerly",
    "tests/test_cuda_repacked.py::"
    "test_a_captured_step_through_fused_repacked_layers_decodes_what_the_eager_step_does[repacked-exact]",
    "tests/test_cuda_repacked.py::"
    "test_bf16_exact_mode_decodes_plain_decodings_tokens_where_this_gpu_keeps_the_rest_row_invariant",
)
STAGES = (
    Stage("cuda-tests", "the CUDA tests (the repacked kernel, the Triton norms, rotary and split attention, the "
          "graphed step) and the kernels as this machine's Triton compiles them, but the end-to-end decodes",
          "pytest",
          ("-q", "-p", "no:cacheprovider", "tests/test_kernel_sass.py", "tests/test_cuda_repacked.py",
           "tests/test_cuda_graphs.py", "tests/test_cuda_rotary.py", "tests/test_cuda_split_attention.py",
           "tests/test_dependent_launch.py",
           *(f"--deselect={t}" for t in END_TO_END_TESTS), "--junitxml={out}/cuda_tests.xml")),
    Stage("ladder", "the repacked kernel taken apart at 1 and 16 rows: whole, without its table lookup, loading only",
          "medusa_core.benchmarks.kernel_ladder", ("--json", "{out}/ladder.json")),
    Stage("counters", "the repacked kernel's hardware counters at 1 and 16 rows (ncu): DRAM throughput, warps, stalls",
          "medusa_core.benchmarks.kernel_counters", ("--json", "{out}/counters.json")),
    Stage("kernels", "every NF4 kernel per projection and row count, the tuners' timings",
          "medusa_core.benchmarks.nf4_kernel", ("--json", "{out}/nf4.json")),
    Stage("anchors", "torch's int4 (gpt-fast's kernel) and bf16 in the same 7B step, norms as the app routes them",
          "medusa_core.bench_synthetic",
          ("--quant", "tinygemm", "none", "--tree-sizes", "1", "16", "64", "--json", "{out}/anchors.json")),
    Stage("step", "the 7B NF4 step as the app routes it (auto rotary and attention) and in exact mode, each also "
          "with transformers' rotary, and (fast mode) with SDPA", "medusa_core.bench_synthetic",
          ("--quant", "nf4", "--nf4-kernel", "auto", "repacked-exact", "--rotary-kernel", "auto", "torch",
           "--attention-kernel", "auto", "sdpa", "--tree-sizes", "1", "16", "64", "--json", "{out}/step.json")),
    # unmeasured since it was built (11-30), and short: before the stages a GPU has measured already. Both heads in
    # one process, beside one routing of the backbone: against the step stage's row, a routing timed afresh in
    # another process could pass for the heads' effect (review). NF4 heads first, the part never run, which its
    # log also gives the quantization's and the tuning's peak memory for
    Stage("nf4-heads", "the 7B NF4 step as the app routes it with the heads' projections in bf16 and in NF4 "
          "(--heads-quant nf4, on the kernel auto times faster for them)", "medusa_core.bench_synthetic",
          ("--quant", "nf4", "--heads-quant", "nf4", "none", "--tree-sizes", "1", "16", "64",
           "--json", "{out}/nf4_heads.json"), least_s=70),
    # built 12-01, never run: the step's Triton kernels launched as programmatic dependents, beside the same routing
    # launched as it is, in one process (quant/triton_runtime.py set_dependent_launch)
    Stage("dependent-launch", "the 7B NF4 step as the app routes it, its Triton kernels launched as they are and as "
          "programmatic dependents of the kernel before", "medusa_core.bench_synthetic",
          ("--quant", "nf4", "--dependent-launch", "off", "on", "--tree-sizes", "1", "16", "64",
           "--json", "{out}/dependent_launch.json"), least_s=70),
    # the NF4 and bf16 steps as the app routes them: transformers' rotary and SDPA beside them (two H200 runs) said
    # what the Triton kernels gain, which the step stage's rows keep saying; the bf16 step had no profile since
    Stage("profile", "the 7B NF4 and bf16 steps' device time by category as the app routes them, T = 1 and 16",
          "medusa_core.benchmarks.profile_gpu_step",
          ("--quant", "nf4", "none", "--nf4-kernel", "auto", "--json", "{out}/profile.json"), least_s=60),
    Stage("first-start", "a random 7B checkpoint through the app's loader twice: the first start's kernel timings, "
          "the second's reading them, and bench against transformers' generate()",
          "medusa_core.benchmarks.first_start", ("--json", "{out}/first_start.json"), least_s=140),
    Stage("exactness", "how often greedy NF4 Medusa equals plain decoding, per kernel (random 7B)",
          "medusa_core.benchmarks.nf4_exactness",
          ("--kernels", "repacked-exact", "auto", "bnb", "--count", "8", "--json", "{out}/exactness.json")),
    Stage("cuda-e2e", "the CUDA tests that decode through a tuned or exact step", "pytest",
          ("-q", "-p", "no:cacheprovider", *END_TO_END_TESTS, "--junitxml={out}/cuda_e2e.xml"), least_s=120),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


@dataclass(frozen=True)
class StageResult:
    name: str
    command: list[str]
    status: str                 # "done", "failed", "cut" (stopped at the deadline) or "not started"
    returncode: int | None
    seconds: float
    log: str | None


def command_of(stage: Stage, out: Path) -> list[str]:
    return [sys.executable, "-m", stage.module, *(a.replace("{out}", str(out)) for a in stage.args)]


def run_stage(command: list[str], log: Path, seconds: float, grace_s: float = STOP_GRACE_S) -> tuple[int, bool]:
    """(exit status, cut): the command with its output in ``log``, stopped after ``seconds`` (SIGTERM, then
    SIGKILL ``grace_s`` later)."""
    with log.open("w") as sink:
        # its own process group, so that stopping it also stops what it started (pytest's, compilers)
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=seconds), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def pack(folder: Path, archive: Path) -> None:
    """Every file in ``folder`` into the gzipped tar ``archive``, replaced whole: a call killed while packing
    leaves the previous archive."""
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                tar.add(path, arcname=path.name)
    os.replace(part, archive)


def run_stages(stages: list[Stage], out: Path, deadline: float, commands: dict[str, list[str]] | None = None,
               min_stage_s: float = MIN_STAGE_S, grace_s: float = STOP_GRACE_S,
               archive: Path | None = None) -> list[StageResult]:
    """Each stage in order with the time left before ``deadline`` (time.monotonic()), less ``grace_s`` to
    stop it; runbook.json in ``out`` is rewritten after each, and ``out`` packed into ``archive`` where one is
    given (with runbook.json beside it). ``commands`` replaces a stage's command by name (tests)."""
    out.mkdir(parents=True, exist_ok=True)
    results: list[StageResult] = []
    for stage in stages:
        command = (commands or {}).get(stage.name) or command_of(stage, out)
        left = deadline - time.monotonic() - grace_s
        if left < max(min_stage_s, stage.least_s):     # a later, shorter stage may still fit
            results.append(StageResult(stage.name, command, "not started", None, 0.0, None))
        else:
            print(f"[{stage.name}] {stage.what}: {' '.join(command)} ({left:.0f} s left)", flush=True)
            log = out / f"{stage.name}.log"
            started = time.monotonic()
            code, cut = run_stage(command, log, left, grace_s)
            status = "cut" if cut else "done" if code == 0 else "failed"
            results.append(StageResult(stage.name, command, status, code, round(time.monotonic() - started, 1),
                                       log.name))
            print(f"[{stage.name}] {status} (exit {code}) in {results[-1].seconds:.0f} s; output in {log}", flush=True)
        manifest = json.dumps([asdict(r) for r in results], indent=1) + "\n"
        (out / "runbook.json").write_text(manifest)
        if archive is not None:
            pack(out, archive)
            (archive.parent / "runbook.json").write_text(manifest)
    return results


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.gpu_runbook", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where runbook.tar.gz (every JSON and log) and runbook.json go ($OUT)")
    p.add_argument("--stages", nargs="+", choices=STAGE_NAMES, help="these stages only (default: all, in order)")
    p.add_argument("--from", dest="start", choices=STAGE_NAMES, help="this stage and the ones after it")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run; stages are stopped before it ends")
    return p


def check_flags(args) -> str | None:
    """What the flags show wrong, as one line, before anything is checked or run on the machine."""
    # nan left no deadline (a stage then outruns the device call); under a stage's minimum nothing ran, without a word
    least = MIN_STAGE_S + STOP_GRACE_S
    if not math.isfinite(args.budget_s):
        return f"--budget-s {args.budget_s:g} is not a finite number of seconds: give one, e.g. {DEFAULT_BUDGET_S}"
    if args.budget_s < least:
        return (f"--budget-s {args.budget_s:g} leaves no stage time to run: give at least {least} seconds "
                f"({MIN_STAGE_S} s for a stage and {STOP_GRACE_S} s to stop it), e.g. {DEFAULT_BUDGET_S}")
    if args.stages and args.start:      # --from was ignored beside --stages
        return (f"--from {args.start} with --stages: give --stages for those stages only, or --from for "
                f"{args.start} and the ones after it, not both")
    try:
        check_folder(args.out)
    except ValueError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    # the budget counts from the start: the imports below (torch, bitsandbytes, transformers) take seconds of a
    # cold machine, and the device tool's limit counts them too (review)
    started = time.monotonic()
    p = parser()
    args = p.parse_args(argv)
    if error := check_flags(args):
        p.error(error)
    import torch

    if not torch.cuda.is_available():
        print("error: this torch sees no CUDA GPU: run the runbook through the device tool", file=sys.stderr)
        return 2
    try:
        import bitsandbytes  # noqa: F401  (the NF4 stages need it; the GPU image has none)
    except ImportError:
        print("error: bitsandbytes is not installed: carry .gpuwheels and run docs/performance.md's install line "
              "before the runbook", file=sys.stderr)
        return 2
    try:        # the carried transformers checks the image's huggingface-hub and tokenizers at import
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"error: transformers does not import here ({first_line(err, 200)}): carry a transformers "
              "wheel (5.23 or later, requirements.txt) whose huggingface-hub and tokenizers the image has "
              "(docs/performance.md, \"Making the wheels, on this (networked) machine\")", file=sys.stderr)
        return 2
    deadline = started + args.budget_s
    names = args.stages or STAGE_NAMES[STAGE_NAMES.index(args.start or STAGE_NAMES[0]):]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="runbook-"))
    results = run_stages([s for s in STAGES if s.name in names], work, deadline,
                         archive=args.out / "runbook.tar.gz")
    print("\n" + "\n".join(f"{r.name:<12} {r.status:<12} {r.seconds:>6.0f} s" for r in results))
    print(f"every JSON and log: {args.out / 'runbook.tar.gz'}")
    if rest := [r.name for r in results if r.status in ("cut", "not started")]:
        print(f"not done: the next call takes --stages {' '.join(rest)}")
    return 0 if all(r.status == "done" for r in results) else 1


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
