"""Where one decoding step's device time goes, by category: the step profile issue 22 asks for.

The step (decoding/step.py) runs eagerly under torch.profiler: a graph replay launches the same
kernels but hides which op launched which. Forward hooks open a named range around every module of
a kind (the decoder's projections, its attention modules, its norms, the decoder as a whole, the
lm_head, the Medusa heads), and each op's own device time is charged to the nearest range around
it; ops outside the model (the tree's tokens, acceptance, the KV copy) fall under "outside".
A kernel the profiler links to no op (a Triton kernel: its launcher is not an op) goes to the
innermost range around it on the device's timeline; one outside every range is "unlinked", with its
name, so the categories always add up to the kernels' device time.

    python -m medusa_core.benchmarks.profile_gpu_step --json out/profile.json     # 7B shapes, bf16 and NF4, T = 1 and 16
    python -m medusa_core.benchmarks.profile_gpu_step --quant nf4 --nf4-kernel auto repacked --json out/p.json   # two kernels
    python -m medusa_core.benchmarks.profile_gpu_step --device cpu --shape tiny --quant none --context 16
        # a smoke check on the CPU: CPU op time, no claims (medusa_core.benchmarks.profile_cpu_step times the CPU)
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..decoding.config import DecodeConfig
from ..decoding.step_store import step_for
from ..decoding.tree import TOP_K, build_tree_buffers, tree_of_size
from ..heads.accuracy import PUBLISHED_ACCURACIES, rank_table
from ..errors import OneLineParser, exit_status
from ..quant.attention_routing import ATTENTION_CHOICES, ROTARY_CHOICES
from ..quant.bnb import NF4_KERNELS, use_nf4_kernel
from ..quant.norm_routing import NORM_KERNELS, use_norm_kernel
from .step_timing import prefilled_cache
from .synthetic import (SHAPES, build_heads, build_model, choice_label, cpu_run_notes, kernel_flags_error,
                        quantize_backbone_, route_attention, route_rotary)

PREFIX = "medusa:"
CATEGORIES = {
    "projections": "decoder projections (4-bit or bf16 matmuls)",
    "attention": "attention (SDPA, rotary, KV reads)",
    "norms": "norms",
    "decoder": "decoder: residuals, activations, rotary tables, other",
    "lm_head": "lm_head",
    "heads": "Medusa heads",
    "outside": "outside the model: tree tokens, acceptance, KV copy",
    "unlinked": "kernels linked to no op",
}
TOP_OPS = 6     # the largest ops or kernels listed under each category


def module_categories(model: nn.Module, heads: nn.Module | None) -> list[tuple[nn.Module, str]]:
    """(module, category) for every module a range opens around; the nearest range wins, so a
    projection inside an attention module counts as a projection."""
    decoder = model.get_decoder()
    marked = [(decoder, "decoder"), (model.get_output_embeddings(), "lm_head")]
    # the step calls heads.guesses, not forward: the heads' own blocks and projections carry the range
    marked += [(module, "heads") for module in heads.modules()] if heads is not None else []
    for module in decoder.modules():
        kind = type(module).__name__
        if isinstance(module, nn.Linear) or kind in ("FusedSlice", "RepackedNF4Linear"):
            marked.append((module, "projections"))
        elif kind.endswith("Attention"):
            marked.append((module, "attention"))
        elif "Norm" in kind:
            marked.append((module, "norms"))
    return marked


def add_ranges(marked: list[tuple[nn.Module, str]]) -> list:
    """Forward hooks opening a profiler range named PREFIX + category around each marked module."""
    handles = []
    for module, category in marked:
        open_ranges: list = []

        def enter(mod, args, name=PREFIX + category, stack=open_ranges):
            stack.append(torch.profiler.record_function(name))
            stack[-1].__enter__()

        def leave(mod, args, out, stack=open_ranges):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def category_of(event) -> str:
    """The nearest enclosing range's category, walking up the op tree; "outside" if none."""
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name.removeprefix(PREFIX)
        event = event.cpu_parent
    return "outside"


class RangeTree:
    """Our ranges on the device's timeline, nested as the modules they wrap: the innermost one around a
    kernel in O(depth) after a sort (a step profile holds thousands of ranges and of Triton kernels)."""

    def __init__(self, ranges):
        spans = sorted(((r.time_range.start, r.time_range.end, r.name.removeprefix(PREFIX)) for r in ranges),
                       key=lambda span: (span[0], -span[1]))          # an outer range before an inner one
        self.starts = [start for start, _, _ in spans]
        self.spans, self.parent, open_ = spans, [], []
        for index, (start, end, _) in enumerate(spans):
            while open_ and spans[open_[-1]][1] < end:                 # ended before this one: not around it
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(index)

    def category(self, kernel) -> str | None:
        """The category of the innermost range whose span holds ``kernel``'s, or None."""
        index = bisect.bisect_right(self.starts, kernel.time_range.start) - 1
        # the latest range to start before the kernel, else the innermost range around that one, and so on
        while index >= 0 and self.spans[index][1] < kernel.time_range.end:
            index = self.parent[index]
        return self.spans[index][2] if index >= 0 else None


def attribute(events, on_cuda: bool) -> tuple[dict[str, float], Counter, Counter]:
    """Microseconds per category: each op's own device time (its own CPU time off CUDA); a kernel no op
    launched (Triton's launcher is not an op) goes to the innermost range around it on the device,
    else to "unlinked"; the unlinked kernels' time by name; and every category's time by (category, op or
    kernel name), which says what inside a category costs (the H100's attention took 28% of the NF4 step,
    and the categories alone could not say whether SDPA, rotary or the KV write)."""
    per: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    ops: Counter = Counter()
    host_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for event in host_events:
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        per[category_of(event)] += us
        if us:
            ops[category_of(event), event.name] += us
    unlinked: Counter = Counter()
    if on_cuda:
        device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        # Our ranges come back on the device too, as annotations spanning their kernels and the idle gaps
        # between them: they are no kernels (counted as such, they once made an 8 ms step read 100 ms).
        ranges = RangeTree(e for e in device_events if e.name.startswith(PREFIX))
        claimed = Counter(k.name for e in host_events for k in e.kernels)
        for k in device_events:
            if k.name.startswith(PREFIX):
                continue
            if claimed[k.name] > 0:     # an op's kernel, already in per through the op
                claimed[k.name] -= 1
                continue
            category = ranges.category(k)
            per[category or "unlinked"] += k.device_time
            ops[category or "unlinked", k.name] += k.device_time
            if category is None:
                unlinked[k.name] += k.device_time
    return per, unlinked, ops


@torch.inference_mode()
def profile_step(model, heads, size: int, context: int, steps: int, seed: int) -> dict:
    """One tree size: ms per step by category, over ``steps`` eager steps after the same prefix."""
    device = model.get_output_embeddings().weight.device
    table = rank_table(PUBLISHED_ACCURACIES)
    tree = build_tree_buffers(tree_of_size(table, size), len(PUBLISHED_ACCURACIES), TOP_K, device)
    cache, _ = prefilled_cache(model, context, context + size + 2, seed)
    step = step_for(model, heads if tree.num_heads else None, tree, DecodeConfig(), cache, graphs=False)
    step.tokens.copy_(torch.randint(3, model.config.vocab_size, step.tokens.shape, device=device))
    length = cache.length
    for _ in range(2):                              # lazy inits and kernel compiles happen here
        cache.position.fill_(length)
        step.run()
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    handles = add_ranges(module_categories(model, heads if tree.num_heads else None))
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                cache.position.fill_(length)
                step.run()
            if on_cuda:
                torch.cuda.synchronize(device)
    finally:
        for handle in handles:
            handle.remove()
    per, unlinked, ops = attribute(prof.events(), on_cuda)
    ms = {k: v / 1000 / steps for k, v in per.items()}
    top = {category: {name: us / 1000 / steps for (_, name), us in
                      sorted(((key, us) for key, us in ops.items() if key[0] == category), key=lambda kv: -kv[1])[:TOP_OPS]}
           for category in CATEGORIES if per[category]}
    return {"tree_size": size, "ms_per_step": ms, "total_ms": sum(ms.values()), "top_ops_ms": top,
            "unlinked_kernels_ms": {name: us / 1000 / steps for name, us in unlinked.most_common(10)},
            "time": "device (kernels)" if on_cuda else "CPU op time"}


def format_profile(label: str, row: dict) -> str:
    total = row["total_ms"] or 1.0
    lines = [f"== {label}, T = {row['tree_size']}: {row['total_ms']:.3f} ms per step ({row['time']}) =="]
    for k, v in row["ms_per_step"].items():
        if v:
            lines.append(f"  {CATEGORIES[k]:<55}{v:9.3f} ms {100 * v / total:5.1f}%")
            lines += [f"      {name[:60]:<60}{op_ms:8.3f} ms" for name, op_ms in row.get("top_ops_ms", {}).get(k, {}).items()]
    lines += [f"    unlinked: {name[:70]} {v:.3f} ms" for name, v in row["unlinked_kernels_ms"].items()]
    return "\n".join(lines)


def parser(cuda: bool) -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.profile_gpu_step", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 7b on CUDA, tiny otherwise")
    p.add_argument("--quant", nargs="+", choices=("none", "nf4"), help="default: none nf4 on CUDA, none otherwise")
    p.add_argument("--nf4-kernel", nargs="+", default=["auto"], choices=NF4_KERNELS,
                   help="who multiplies NF4 layers; each is profiled on the same weights (rows nf4-KERNEL_tT)")
    p.add_argument("--norm-kernel", nargs="+", default=["auto"], choices=NORM_KERNELS,
                   help="who computes the RMSNorms; each is profiled (torch, triton: rows LABEL-torch-norms_tT)")
    p.add_argument("--rotary-kernel", nargs="+", default=["auto"], choices=ROTARY_CHOICES,
                   help="who rotates the queries and keys and writes the cache; each is profiled (auto: as the app; a forced choice: rows "
                        "LABEL-triton-rotary_tT or LABEL-torch-rotary_tT)")
    p.add_argument("--attention-kernel", nargs="+", default=["auto"], choices=ATTENTION_CHOICES,
                   help="who attends; each is profiled (auto: as the app; a forced choice: rows LABEL-split-attention_tT "
                        "or LABEL-sdpa-attention_tT; exact mode: its own only)")
    p.add_argument("--tree-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--context", type=int, default=512, help="prefix length in the cache")
    p.add_argument("--steps", type=int, default=20, help="profiled steps per tree size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the profile here after every row (benchmarks.step_report folds it into docs/perf)")
    return p


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parser(cuda).parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not cuda:
        print(f"error: --device {args.device}: this torch sees no CUDA GPU: use --device cpu --shape tiny", file=sys.stderr)
        return 1
    if error := kernel_flags_error(args.rotary_kernel, args.attention_kernel, device):
        print(f"error: {error}", file=sys.stderr)
        return 1
    for flag, value in (("--steps", args.steps), ("--context", args.context), *(("--tree-sizes", n)
                                                                               for n in args.tree_sizes)):
        if value < 1:       # CLI QA: --steps 0 ended in a ZeroDivisionError after the model was built
            print(f"error: {flag} {value} must be at least 1", file=sys.stderr)
            return 1
    shape_name = args.shape or ("7b" if device.type == "cuda" else "tiny")
    shape = SHAPES[shape_name]
    if args.context + max(args.tree_sizes) + 2 > shape.max_position:
        print(f"error: --context {args.context} leaves no room in the {shape.max_position}-token context: lower it",
              file=sys.stderr)
        return 1
    quants = args.quant or (["none", "nf4"] if device.type == "cuda" else ["none"])
    for line in cpu_run_notes(device, cuda, shape_name, quants, args.nf4_kernel):
        print(line, flush=True)
    profile = {}
    for quant in quants:
        model = build_model(shape, device, args.seed)
        heads = build_heads(shape, len(PUBLISHED_ACCURACIES), device, args.seed + 1)
        kernels = [None]
        if quant == "nf4":
            quantize_backbone_(model)
            kernels = args.nf4_kernel
        for kernel in kernels:
            if kernel is not None:      # once per kernel: auto's timing must not route each norm choice anew
                print(use_nf4_kernel(model, kernel), flush=True)
            for norms in ["auto"] if kernel == "repacked-exact" else args.norm_kernel:
                label = "bf16" if kernel is None else "nf4" if kernel == "auto" else f"nf4-{kernel}"
                label += "" if norms == "auto" else f"-{norms}-norms"      # as bench_synthetic labels its results
                print(use_norm_kernel(model, norms) or "norms: as the kernel routing left them", flush=True)
                for rotary in args.rotary_kernel:
                    print(route_rotary(model, rotary) or "rotary: as the app routes it here", flush=True)
                    for attention in ["auto"] if kernel == "repacked-exact" else args.attention_kernel:
                        print(route_attention(model, attention) or "attention: as the app routes it here", flush=True)
                        row_label = label + choice_label(rotary, attention)
                        for size in args.tree_sizes:
                            row = profile_step(model, heads, size, args.context, args.steps, args.seed)
                            profile[f"{row_label}_t{size}"] = row
                            print(format_profile(row_label, row), flush=True)
                            if args.json:   # a device call has a time limit: a run cut short keeps what it profiled
                                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                                Path(args.json).write_text(json.dumps({"step_profile": profile}, indent=1) + "\n")
                    route_attention(model, "sdpa")
                route_rotary(model, "torch")
        del model, heads
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
