"""Cost of one decoding step at real shapes, on random models (CUDA or CPU; ``python -m
medusa_core.bench_gpu``, its first name, runs it too).

It times step.DecodeStep, the object generate() runs, per tree size:
  eager    the step run eagerly, steps queued back to back (launch-bound on a GPU)
  graphed  its CUDA graph replayed, back to back (device time)
  loop     generate() around it: wall time per step, host work and the one sync included
and two references that are not the project's code: the stock transformers forward
with a StaticCache and a 4D tree mask captured in one CUDA graph (the limit of this
design), and transformers' own generate() (dynamic and static cache).

Speed does not depend on weight values, so the backbone and heads are random
(normal, std 0.02: never all zeros) with the shapes of Llama-7B and 5 Medusa
heads. Acceptance does depend on them, so it is not measured here: each tree is
grown from head accuracies (default: the published Vicuna-7B top-1 figures) and
its expected tokens per step divides the measured overhead into a projected speedup.

    python -m medusa_core.bench_synthetic --hf-generate --json out/gpu.json           # 7B, bf16 + NF4, on CUDA
    python -m medusa_core.bench_synthetic --quant nf4 tinygemm --json out/int4.json     # NF4 beside torch's int4
    python -m medusa_core.bench_synthetic --shape tiny --device cpu --quant none      # smoke check, no speed claims
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from .benchmarks.nf4_kernel import tuned_lines, tuning_log
from .benchmarks.step_report import QuantResult, TreeRow, environment, fold_reports, format_result, summary
from .benchmarks.step_timing import (copy_bandwidth, prefilled_cache, time_hf_generate, time_loop,
                                     time_step, time_stock_forward)
from .benchmarks.synthetic import (DTYPE, SHAPES, build_heads, build_model, check_not_zero, choice_label, cpu_run_notes,
                                   kernel_flags_error, quantize_backbone_, route_attention, route_rotary,
                                   save_random_checkpoint, weight_bytes)
from .errors import OneLineParser, check_folder, check_writable, exit_status, first_line
from .decoding.tree import TOP_K, build_tree_buffers, expected_tokens_per_step, tree_of_size
from .heads.accuracy import PUBLISHED_ACCURACIES, RANK_DECAY, rank_table
from .quant.attention_routing import ATTENTION_CHOICES, ROTARY_CHOICES
from .quant.bnb import NF4_KERNELS
from .quant.bnb import flag_error as kernel_flag_error
from .quant.norm_routing import NORM_KERNELS
from .quant.norm_routing import flag_error as norm_flag_error
from .quant.triton_runtime import check_dependent_launch, set_dependent_launch


def bench_quant(args, quant: str, device: torch.device) -> Iterator[QuantResult]:
    """One backbone precision: for NF4, one result per ``--nf4-kernel`` choice on the same weights, and for
    each, one per ``--heads-quant`` and ``--norm-kernel`` choice; each yielded as soon as it is measured (a device
    call cut short keeps what it finished)."""
    shape = SHAPES[args.shape]
    model = build_model(shape, device, args.seed)
    check_not_zero([model])
    if quant == "nf4":
        from .quant.bnb import use_nf4_kernel

        quantize_backbone_(model)
        for kernel in args.nf4_kernel:
            known, started = len(tuning_log()), time.perf_counter()
            routing = use_nf4_kernel(model, kernel)
            # the tuners' compiles and timings: most of a GPU stage's time before its first step is timed
            print(f"  [{quant}] {routing} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            for line in tuned_lines(tuning_log()[known:]):     # what this routing's tuners kept (CUDA)
                print(f"  [{quant}] tuned {line}", file=sys.stderr, flush=True)
            label = "nf4" if kernel == "auto" else f"nf4-{kernel}"
            yield from per_heads(args, model, label, routing, kernel, device, exact=kernel == "repacked-exact")
    elif quant == "tinygemm":     # the anchor: torch's int4 kernel, as gpt-fast decodes with it
        from .quant.tinygemm import quantize_linear_tinygemm_

        replaced = quantize_linear_tinygemm_(model, args.tinygemm_group)
        routing = f"tinygemm int4 (group {args.tinygemm_group}) for {replaced} layers"
        print(f"  [{quant}] {routing}", file=sys.stderr, flush=True)
        yield from per_heads(args, model, quant, routing, "auto", device)
    else:
        yield from per_heads(args, model, quant, "", "auto", device)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def per_heads(args, model, label: str, routing: str, kernel: str, device: torch.device,
              exact: bool = False) -> Iterator[QuantResult]:
    """The step with each ``--heads-quant`` choice's heads beside the same routed backbone: measured in one
    process, a routing timed afresh in another cannot pass for the heads' effect (review). NF4 heads' results
    are named apart ("-nf4-heads"), and bf16 heads' where both are measured ("-bf16-heads"), so that a fold keeps
    them beside, not over, the results of a run with bf16 heads alone."""
    shape = SHAPES[args.shape]
    both = len(args.heads_quant) > 1
    for heads_quant in args.heads_quant:
        # heads to quantize are built on the CPU and quantized onto the device, as the app's loader does
        heads = build_heads(shape, len(args.accuracies), torch.device("cpu") if heads_quant == "nf4" else device,
                            args.seed + 1)
        check_not_zero([heads])
        line = ""
        if heads_quant == "nf4":
            from .heads.quantize import quantize_projections
            from .quant.bnb import use_nf4_heads

            with peak_note("the heads' NF4 quantization", device):
                heads = quantize_projections(heads, DTYPE, device)
            with peak_note("the NF4 heads' kernel routing (a first start's tuning)", device):
                line = use_nf4_heads(heads, kernel)     # where the app's loader puts them beside this backbone
        suffix = "-nf4-heads" if heads_quant == "nf4" else "-bf16-heads" if both else ""
        yield from per_norm_kernel(args, model, heads, label + suffix,
                                   "; ".join(t for t in (routing, line) if t), device, exact)
        del heads


@contextmanager
def peak_note(what: str, device: torch.device) -> Iterator[None]:
    """Says on stderr (the runbook's log) how far ``what`` took the GPU's allocated memory above what was
    resident before it: the memory check's figure for --heads-quant nf4 (policy.CUDA_DEFAULT_WEIGHT_BYTES) was
    computed from the code, not measured."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    yield
    torch.cuda.synchronize(device)
    print(f"  peak memory of {what}: {(torch.cuda.max_memory_allocated(device) - before) / 1e9:.3f} GB above the "
          f"{before / 1e9:.3f} GB resident", file=sys.stderr, flush=True)


def per_norm_kernel(args, model, heads, label: str, routing: str, device: torch.device,
                    exact: bool = False) -> Iterator[QuantResult]:
    """The step measured with each ``--norm-kernel`` choice (exact mode brings its own norms: once). The
    label gets "-torch-norms" or "-triton-norms" for a forced choice; ``auto`` is the app's, unmarked."""
    from .quant.norm_routing import use_norm_kernel

    for norms in ["auto"] if exact else args.norm_kernel:
        started = time.perf_counter()
        line = use_norm_kernel(model, norms)
        print(f"  [{label}] {line or 'norms: as the kernel routing left them'} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        for rotary in args.rotary_kernel:       # auto unmarked (the app's routing), a forced choice marked
            rotary_line = route_rotary(model, rotary)
            for attention in ["auto"] if exact else args.attention_kernel:   # exact mode keeps its own attention
                attention_line = route_attention(model, attention)
                for dependent in args.dependent_launch:
                    set_dependent_launch(dependent == "on", device)
                    pdl_line = "dependent launch of the Triton kernels" if dependent == "on" else ""
                    try:     # off again before the result is handed on: what its consumer runs launches as usual
                        result = measure(args, model, heads, (label if norms == "auto" else f"{label}-{norms}-norms")
                                         + choice_label(rotary, attention) + ("-pdl" if dependent == "on" else ""),
                                         "; ".join(t for t in (routing, line, rotary_line, attention_line, pdl_line)
                                                   if t), device)
                    finally:
                        set_dependent_launch(False)
                    yield result
            route_attention(model, "sdpa")
    route_rotary(model, "torch")


def measure(args, model, heads, label: str, routing: str, device: torch.device) -> QuantResult:
    shape = SHAPES[args.shape]
    table = rank_table(args.accuracies, decay=args.rank_decay)
    sizes = sorted({1, *args.tree_sizes})
    trees = {n: build_tree_buffers(tree_of_size(table, n), len(args.accuracies), TOP_K, device) for n in sizes}
    on_cuda = device.type == "cuda"

    # the loop reserves room for its whole reply, so every tree gets the same bucket
    room = args.context + args.warmup + args.iters + 2 + max(sizes)
    cache, prompt = prefilled_cache(model, args.context, room, args.seed)
    loop_cache, _ = prefilled_cache(model, args.context, room, args.seed)
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    weights = weight_bytes(decoder) - weight_bytes(decoder.embed_tokens) + weight_bytes(lm_head)
    heads_bytes = weight_bytes(heads)
    kv = 2 * shape.layers * shape.hidden * args.context * torch.finfo(DTYPE).bits // 8
    rows, base_ms = [], None
    for n, tree in trees.items():
        # eager attends over the used KV slots only (KVCache.narrowed), the graph over the whole bucket
        eager = time_step(model, heads, tree, cache, False, args.iters, args.warmup)
        graphed = time_step(model, heads, tree, cache, True, args.iters, args.warmup) if on_cuda else None
        stock = time_stock_forward(model, tree, args.context, cache.capacity, args.iters, args.warmup)
        loop, tokens = time_loop(model, heads, tree, loop_cache, prompt, None, args.iters, args.warmup)
        loop_ms = 1000 * loop
        base_ms = base_ms or loop_ms
        overhead = loop_ms / base_ms
        acc = expected_tokens_per_step(tree.paths, table)
        host_ms = loop_ms - 1000 * graphed if graphed is not None else None
        read = weights + kv + (heads_bytes if tree.num_heads else 0)
        rows.append(TreeRow(
            n, tree.num_heads, 1000 * eager, _ms(graphed), loop_ms, _ms(stock), host_ms,
            None if host_ms is None else 100 * host_ms / loop_ms, overhead, acc, acc / overhead, tokens,
            read, read / loop / 1e9))
        print(f"  [{label}] tree {n}: loop {loop_ms:.3f} ms", file=sys.stderr, flush=True)
    hf: dict[str, float | str] = {}
    ratio = None
    if args.hf_generate:
        hf = {k: 1000 * v if isinstance(v, float) else v
              for k, v in time_hf_generate(model, args.context, args.iters, device).items()}
        times = [v for v in hf.values() if isinstance(v, float)]
        ratio = base_ms / min(times) if times else None
    capacity = cache.capacity
    del cache, loop_cache
    return QuantResult(label, routing, weights, heads_bytes, kv, capacity, copy_bandwidth(device, args.iters) / 1e9,
                       hf, ratio, tuple(rows))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def parser(cuda: bool) -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.bench_synthetic", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 7b on CUDA, tiny otherwise")
    p.add_argument("--quant", nargs="+", choices=("none", "nf4", "tinygemm"),
                   help="backbone precisions (default: none nf4 on CUDA, none otherwise); tinygemm: torch's int4 "
                        "kernel, the anchor gpt-fast decodes with (asymmetric int4, not NF4)")
    p.add_argument("--tinygemm-group", type=int, default=128, help="input columns per int4 scale and zero (32-256)")
    p.add_argument("--heads-quant", nargs="+", choices=("none", "nf4"), default=["none"],
                   help="the heads' vocab projections, each measured beside the same backbone: none (bf16), nf4")
    p.add_argument("--nf4-kernel", nargs="+", choices=NF4_KERNELS, default=["auto"],
                   help="who multiplies NF4 layers, one result each: auto (by measurement on CUDA, bnb elsewhere), "
                        "triton (the kernel), bnb (bitsandbytes)")
    p.add_argument("--norm-kernel", nargs="+", choices=NORM_KERNELS, default=["auto"],
                   help="RMSNorm choices, each measured (auto: as the app, timed on CUDA; torch, triton forced)")
    p.add_argument("--rotary-kernel", nargs="+", choices=ROTARY_CHOICES, default=["auto"],
                   help="rotary embedding and cache write choices, each measured: auto (as the app: timed on CUDA), "
                        "torch (transformers', index_copy_) or triton (one kernel for q and k, one for the cache "
                        "write, bit for bit the same)")
    p.add_argument("--attention-kernel", nargs="+", choices=ATTENTION_CHOICES, default=["auto"],
                   help="attention choices, each measured: auto (as the app: timed on CUDA), sdpa (transformers') or "
                        "split (Triton, split over the keys, hidden key blocks unread; not in exact mode)")
    p.add_argument("--dependent-launch", nargs="+", choices=("off", "on"), default=["off"],
                   help="each measured: the step's Triton kernels (NF4 matmul, norm, rotary, cache write, split "
                        "attention) launched as programmatic dependents of the kernel before (sm_90 and later; "
                        "not the app's yet: triton_runtime.set_dependent_launch)")
    p.add_argument("--tree-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--context", type=int, default=512, help="prefix length in the cache while timing")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--accuracies", nargs="+", type=float, default=list(PUBLISHED_ACCURACIES),
                   help="top-1 accuracy of each head (one per head), e.g. the top1 list in a calibrate report")
    p.add_argument("--rank-decay", type=float, default=RANK_DECAY, help="rank i of a head counts a * decay**i")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-generate", action="store_true", help="also time transformers' greedy generate() per token")
    p.add_argument("--json", help="write everything here")
    p.add_argument("--fold", nargs="+", metavar="JSON",
                   help="only merge: a bench_synthetic JSON, then later bench_synthetic, nf4_kernel and bench JSONs, into --json")
    p.add_argument("--save-checkpoint", metavar="DIR",
                   help="only write a random --shape model (bf16) and heads to DIR/backbone and DIR/heads, for bench")
    return p


def fold_command(args) -> int:
    """--fold: merge earlier JSON reports into --json; nothing is measured."""
    if not args.json:
        print("error: --fold needs --json OUT to write the merged report to", file=sys.stderr)
        return 1
    for name in args.fold:    # each named, with what to give (the errors named neither the file nor the fix)
        what = "give a JSON report written by bench_synthetic, the nf4 kernel benchmark or the GPU runbook"
        try:
            json.loads(Path(name).read_text(encoding="utf-8"))
        except OSError as err:
            print(f"error: --fold {name} cannot be read ({err.strerror or err}): {what}", file=sys.stderr)
            return 1
        except ValueError as err:
            print(f"error: --fold {name} is not JSON ({first_line(err, 120)}): {what}", file=sys.stderr)
            return 1
    try:
        report = fold_reports(Path(args.fold[0]), [Path(f) for f in args.fold[1:]])
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


def checked_device(args, cuda: bool) -> torch.device:
    """The device, with the defaults that depend on it filled into ``args``; ValueError or
    ImportError (bitsandbytes) before anything is built."""
    try:
        device = torch.device(args.device)
    except RuntimeError:         # torch's own error lists every device type it knows
        raise ValueError(f"--device {args.device!r} is unknown: use cpu, cuda or cuda:N") from None
    args.shape = args.shape or ("7b" if device.type == "cuda" else "tiny")
    args.quant = args.quant or (["none", "nf4"] if device.type == "cuda" else ["none"])
    if device.type == "cuda" and not cuda:
        raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU: use --device cpu --shape tiny")
    room = SHAPES[args.shape].max_position
    steps = args.iters + args.warmup + 2
    if args.context + max(args.tree_sizes) + steps > room:
        raise ValueError(f"--context {args.context} + the largest tree ({max(args.tree_sizes)} nodes) + {steps} steps "
                         f"exceeds the {room}-token context: lower --context or --tree-sizes")
    errors = [kernel_flag_error(kernel, str(device)) for kernel in args.nf4_kernel if "nf4" in args.quant] + \
        [norm_flag_error(norms, "auto", str(device)) for norms in args.norm_kernel]
    if error := next((e for e in errors if e), None):
        raise ValueError(error)
    for flag, value, least in (("--iters", args.iters, 1), ("--context", args.context, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:       # QA: one message for the three named none of them
            raise ValueError(f"{flag} {value} must be at least {least}")
    # QA: a bad value came back as a 5 x 10 table of rank accuracies that named neither flag
    if not 0 < args.rank_decay <= 1:
        raise ValueError(f"--rank-decay {args.rank_decay}: give a number in (0, 1], by which each rank's accuracy "
                         "falls from the one before")
    bad = [a for a in args.accuracies if not 0 <= a <= 1]       # NaN included
    if bad:
        raise ValueError(f"--accuracies {bad[0]}: give each head's top-1 accuracy as a number from 0 to 1")
    for n in args.tree_sizes:       # fail before building a 7B model
        tree_of_size(rank_table(args.accuracies, decay=args.rank_decay), n)
    if error := kernel_flags_error(args.rotary_kernel, args.attention_kernel, device):
        raise ValueError(error)
    if "on" in args.dependent_launch:     # refused now (an older GPU, or no GPU), not after the model is built
        try:
            check_dependent_launch(device)
        except ValueError as err:
            raise ValueError(f"--dependent-launch on: {err}") from None
    if "tinygemm" in args.quant:     # every projection's shape, before a 7B model is built
        from .quant.tinygemm import check_shape

        s = SHAPES[args.shape]
        for n, k in ((s.hidden, s.hidden), (s.intermediate, s.hidden), (s.hidden, s.intermediate)):
            check_shape(n, k, args.tinygemm_group, device)
    if args.json is not None:       # said now, not after the whole run, whose results it would lose
        check_writable(args.json)
    if args.save_checkpoint is not None:     # said now, not by mkdir's traceback after the model is built
        check_folder(args.save_checkpoint, "--save-checkpoint")
    if "nf4" in args.quant or "nf4" in args.heads_quant:
        import bitsandbytes  # noqa: F401  (fails here, not after building the bf16 model)
    return device


def save_checkpoint_command(args, device: torch.device) -> int:
    """--save-checkpoint: a random model and heads on disk, for ``python -m medusa_core.bench``."""
    try:
        backbone, heads_dir = save_random_checkpoint(SHAPES[args.shape], len(PUBLISHED_ACCURACIES), Path(args.save_checkpoint),
                                                    args.seed, device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {backbone} and {heads_dir}: python -m medusa_core.bench --model {backbone} --heads {heads_dir}")
    return 0


def bench_command(args, device: torch.device, cuda: bool) -> int:
    """Time every tree size, per backbone precision, and print (and write) the results."""
    for line in cpu_run_notes(device, cuda, args.shape, args.quant, args.nf4_kernel):
        print(line, flush=True)
    env = environment(device)
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"heads' top-1 accuracies {args.accuracies}; rank i of head k counts a[k] * {args.rank_decay}**i")
    results = []
    for quant in args.quant:
        for result in bench_quant(args, quant, device):
            results.append(result)
            print(format_result(result, args.shape, args.context), flush=True)
            if args.json:   # after every result: a later failure keeps what was measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                out = {"env": env, "args": vars(args), "summary": summary(results),
                       "results": [asdict(r) for r in results], "tuning": tuning_log()}
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parser(cuda).parse_args(argv)
    if args.fold:
        return fold_command(args)
    try:
        device = checked_device(args, cuda)
    except ImportError as err:
        print(f"error: NF4 needs bitsandbytes ({err}): pip install bitsandbytes==0.50.2, or pass --quant none", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return save_checkpoint_command(args, device) if args.save_checkpoint else bench_command(args, device, cuda)


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
