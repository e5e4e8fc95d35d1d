"""Cost of one decoding step at real shapes, on random models.

It times step.DecodeStep, the object generate() runs, per tree size:
  eager    its body run eagerly, steps queued back to back (launch-bound on a GPU)
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

    python -m medusa_core.bench_gpu --hf-generate --json out/gpu.json           # 7B, bf16 + NF4, on CUDA
    python -m medusa_core.bench_gpu --shape tiny --device cpu --quant none      # smoke check, no speed claims
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from .generate import DecodeConfig, generate, new_cache
from .kv_cache import prefill_mask, tree_step_mask
from .step import capture_stream, step_for
from .quantization import NF4_KERNELS
from .step_report import QuantResult, TreeRow, environment, fold_reports, format_result, summary
from .head_accuracy import PUBLISHED_ACCURACIES, RANK_DECAY, TOP_K, rank_table  # noqa: F401  (tests read them here)
from .synthetic import (
    DTYPE, SHAPES, build_heads, build_model, check_not_zero, quantize_backbone_, save_random_checkpoint, weight_bytes,
)
from .tree import Paths, TreeBuffers, build_tree_buffers, expected_length, grow_tree


# ---- trees from accuracies (pure)

def tree_for_size(table: Sequence[Sequence[float]], size: int) -> Paths:
    """The ``size``-node tree (root included) grown greedily by tree.grow_tree (paper §2.3.3).
    Entries in [0, 1] make a child worth no more than its parent, so the greedy set is the
    prefix-closed one of largest expected acceptance."""
    if size < 1:
        raise ValueError(f"tree size {size} is below 1: the root alone is size 1")
    if any(not 0 <= p <= 1 for row in table for p in row):
        raise ValueError(f"accuracies {table} must lie in [0, 1]")
    paths = grow_tree(table, size - 1)
    if len(paths) < size - 1:
        raise ValueError(f"tree size {size} needs more nodes than {len(table)} heads x top {len(table[0]) if table else 0} "
                         "with nonzero accuracy can fill: lower it")
    return paths


def expected_acceptance(table: Sequence[Sequence[float]], paths: Paths) -> float:
    """Expected tokens per step: 1 (the backbone's own token) + P(node accepted) summed over nodes,
    since each accepted node adds one token and siblings are distinct tokens (at most one is right)."""
    return expected_length(paths, table)


# ---- timing

def median_seconds(fn: Callable[[], object], iters: int, warmup: int, device: torch.device,
                   reset: Callable[[], object] = lambda: None) -> float:
    """Median time of ``fn``, with ``reset`` run before each call outside the timed span.
    CUDA: events around each call, calls queued back to back, so launch cost hides behind GPU
    work where it can (as in the loop) and the figure is device time. CPU: wall time."""
    for _ in range(warmup):
        reset()
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in marks:
            reset()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) / 1000 for s, e in marks)
    times = []
    for _ in range(iters):
        reset()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def prefilled_cache(model, context: int, capacity: int, seed: int):
    """A cache holding a random ``context``-token prefix, via the baseline step's prefill."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (context,), generator=gen).tolist()
    cache = new_cache(model, capacity)
    baseline = build_tree_buffers([], 0, device=model.get_output_embeddings().weight.device)
    step = step_for(model, None, baseline, DecodeConfig(), cache, graphs=False)
    step.prefill(prompt, step.uniforms[:1])
    cache.commit(prompt)
    return cache, prompt


@torch.inference_mode()
def time_step(model, heads, tree: TreeBuffers, cache, graphs: bool, iters: int, warmup: int) -> float:
    """Median seconds of one DecodeStep call (eager body, or graph replay) at the cache's prefix.
    The position is set back before each call, so every call verifies after the same prefix."""
    step = step_for(model, heads if tree.num_heads else None, tree, DecodeConfig(), cache, graphs=graphs)
    device = step.tokens.device
    step.tokens.copy_(torch.randint(3, model.config.vocab_size, step.tokens.shape, device=device))
    length = cache.length
    reset = lambda: cache.position.fill_(length)  # noqa: E731
    result = median_seconds(step.run, iters, warmup, device, reset)
    reset()
    return result


def time_loop(model, heads, tree: TreeBuffers, cache, prompt: list[int], graphs: bool, iters: int,
              warmup: int) -> tuple[float, float]:
    """(median wall seconds per step, tokens per step) of generate() itself, reusing the cache's
    prefix. Random heads are almost never right, so this is the verification cost of the tree."""
    config = DecodeConfig(max_new_tokens=warmup + iters + 2)
    steps = list(generate(model, prompt, heads=heads if tree.num_heads else None, tree=tree, config=config,
                          cache=cache, graphs=graphs))[1:]
    timed = [s for s in steps if s.tokens][1 + warmup:] or steps[-1:]    # the first step may capture
    cache.rewind(len(prompt))
    return statistics.median(s.seconds for s in timed), sum(len(s.tokens) for s in steps) / len(steps)


@torch.inference_mode()
def time_stock_forward(model, tree: TreeBuffers, context: int, capacity: int, iters: int, warmup: int) -> float | None:
    """The limit of this design: transformers' own forward (decoder + lm_head on T rows) with its
    StaticCache and a 4D tree mask, captured in one CUDA graph. None off CUDA."""
    from transformers import StaticCache

    device = model.get_output_embeddings().weight.device
    if device.type != "cuda":
        return None
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    prefix = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    model(input_ids=prefix, attention_mask=prefill_mask(0, context, capacity, DTYPE, device),
          position_ids=torch.arange(context, device=device)[None], past_key_values=cache, use_cache=True)
    tokens = torch.randint(3, model.config.vocab_size, (1, tree.size), device=device)
    position = torch.full((1,), context, device=device)
    mask = tree_step_mask(tree.attn_mask == 0, position, torch.arange(capacity, device=device), DTYPE)
    positions = (tree.depths + context)[None]

    def forward():
        for layer in cache.layers:     # StaticCache advances its write position per update: set it back
            layer.cumulative_length.fill_(context)
        return model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True).logits

    side = capture_stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        forward()
    return median_seconds(graph.replay, iters, warmup, device)


@torch.inference_mode()
def time_hf_generate(model, context: int, new_tokens: int, device: torch.device) -> dict[str, float | str]:
    """transformers' greedy generate() per token (prefill removed by differencing two runs),
    for the dynamic and the static cache (the static one is compiled by transformers)."""
    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def wall(n: int, cache: str | None) -> float:
        sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, cache_implementation=cache)
        sync()
        return time.perf_counter() - t0

    out: dict[str, float | str] = {}
    for cache in ("dynamic", "static"):
        try:
            wall(new_tokens + 1, cache)                                # warm-up (static: allocation, compile)
            # best of 3 each: the figure to beat is transformers at its best
            out[cache] = (min(wall(new_tokens + 1, cache) for _ in range(3))
                          - min(wall(1, cache) for _ in range(3))) / new_tokens
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            out[cache] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return out


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write): the attainable bandwidth."""
    n = (256 if device.type == "cuda" else 16) * 2**20
    src, dst = torch.ones(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / median_seconds(lambda: dst.copy_(src), iters, 2, device)


# ---- one backbone precision

def bench_quant(args, quant: str, device: torch.device) -> list[QuantResult]:
    """One backbone precision: for NF4, one result per ``--nf4-kernel`` choice on the same weights."""
    shape = SHAPES[args.shape]
    model = build_model(shape, device, args.seed)
    heads = build_heads(shape, len(args.accuracies), device, args.seed + 1)
    check_not_zero([model, heads])
    if args.heads_quant == "nf4":
        from .heads_quant import quantize_projections
        quantize_projections(heads, DTYPE)
    results = []
    if quant == "nf4":
        from .quantization import use_nf4_kernel

        quantize_backbone_(model)
        for kernel in args.nf4_kernel:
            routing = use_nf4_kernel(model, kernel)
            print(f"  [{quant}] {routing}", file=sys.stderr, flush=True)
            results.append(measure(args, model, heads, "nf4" if kernel == "auto" else f"nf4-{kernel}", routing, device))
    else:
        results.append(measure(args, model, heads, quant, "", device))
    del model, heads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def measure(args, model, heads, label: str, routing: str, device: torch.device) -> QuantResult:
    shape = SHAPES[args.shape]
    table = rank_table(args.accuracies, decay=args.rank_decay)
    sizes = sorted({1, *args.tree_sizes})
    trees = {n: build_tree_buffers(tree_for_size(table, n), len(args.accuracies), TOP_K, DTYPE, device) for n in sizes}
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
        acc = expected_acceptance(table, tree.paths)
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


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m medusa_core.bench_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 7b on CUDA, tiny otherwise")
    p.add_argument("--quant", nargs="+", choices=("none", "nf4"), help="backbone precisions (default: none nf4 on CUDA, none otherwise)")
    p.add_argument("--heads-quant", choices=("none", "nf4"), default="none", help="NF4 heads' vocab projections")
    p.add_argument("--nf4-kernel", nargs="+", choices=NF4_KERNELS, default=["auto"],
                   help="who multiplies NF4 layers, one result each: auto (by measurement on CUDA, bnb elsewhere), "
                        "triton (the kernel), bnb (bitsandbytes)")
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
                   help="only merge: a bench_gpu JSON, then later bench_gpu, bench_nf4 and bench JSONs, into --json")
    p.add_argument("--save-checkpoint", metavar="DIR",
                   help="only write a random --shape model (bf16) and heads to DIR/backbone and DIR/heads, for bench")
    args = p.parse_args(argv)
    if args.fold:
        if not args.json:
            print("error: --fold needs --json OUT to write the merged report to", file=sys.stderr)
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
    device = torch.device(args.device)
    args.shape = args.shape or ("7b" if device.type == "cuda" else "tiny")
    args.quant = args.quant or (["none", "nf4"] if device.type == "cuda" else ["none"])
    try:
        if device.type == "cuda" and not cuda:
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU: use --device cpu --shape tiny")
        room = SHAPES[args.shape].max_position
        if args.context + max(args.tree_sizes) + args.iters + args.warmup + 2 > room:
            raise ValueError(f"--context {args.context} + tree + steps exceeds the {room}-token context: lower --context")
        if min(args.iters, args.warmup + 1, args.context) < 1:
            raise ValueError("--iters and --context must be at least 1 and --warmup at least 0")
        for n in args.tree_sizes:       # fail before building a 7B model
            tree_for_size(rank_table(args.accuracies, decay=args.rank_decay), n)
        if "nf4" in args.quant or args.heads_quant == "nf4":
            import bitsandbytes  # noqa: F401  (fails here, not after building the bf16 model)
    except ImportError as err:
        print(f"error: NF4 needs bitsandbytes ({err}): pip install bitsandbytes==0.50.2, or pass --quant none", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    if args.save_checkpoint:
        try:
            backbone, heads_dir = save_random_checkpoint(SHAPES[args.shape], len(PUBLISHED_ACCURACIES), Path(args.save_checkpoint),
                                                        args.seed, device)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"wrote {backbone} and {heads_dir}: python -m medusa_core.bench --model {backbone} --heads {heads_dir}")
        return 0
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
                       "results": [asdict(r) for r in results]}
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
