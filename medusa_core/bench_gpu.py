"""Cost of one decoding step at real shapes (issue 6), on random models.

Speed does not depend on weight values, so the backbone and heads are random
(normal, std 0.02: never all zeros) with the shapes of Llama-7B and 5 Medusa
heads. Acceptance does depend on them, so it is not measured here: each tree is
grown from head accuracies (default: the published Vicuna-7B top-1 figures) and
its expected tokens per step divides the measured overhead into a projected speedup.

    python -m medusa_core.bench_gpu --json out/gpu.json --plot out/gpu.png     # 7B, bf16 + NF4, on CUDA
    python -m medusa_core.bench_gpu --shape tiny --device cpu --quant none      # smoke check, no speed claims
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .acceptance import accept_match
from .calibrate import expected_length, grow_tree
from .generate import DecodeConfig, generate, new_cache
from .synthetic import DTYPE, SHAPES, build_heads, build_model, check_not_zero, quantize_backbone_, weight_bytes
from .kv_cache import StepMask, causal_mask
from .tree import Paths, TreeBuffers, build_tree_buffers

PUBLISHED_ACCURACIES = (0.56, 0.32, 0.20, 0.15, 0.12)   # Medusa-1 heads 0-4, Vicuna-7B (DESIGN §2)
# Only top-1 accuracies are published. Assumed: head k's rank-i guess is right with a[k] * 0.35**i.
# 0.35 keeps each head's ranks (exclusive events) summing below 1 and makes the 64-node tree
# expect 2.42 tokens per step, inside the published 2.3-2.6 for Vicuna-7B heads.
RANK_DECAY = 0.35
TOP_K = 10          # ranks a tree may use, as in the reference's trees


# ---- trees from accuracies (pure)

def rank_table(accuracies: Sequence[float], top_k: int = TOP_K, decay: float = RANK_DECAY) -> list[list[float]]:
    """(K, top_k) probability that head k's rank-i guess is right: a[k] * decay**i."""
    table = [[a * decay**i for i in range(top_k)] for a in accuracies]
    for k, row in enumerate(table):
        if sum(row) > 1 + 1e-9:   # a head's ranks are distinct tokens: at most one is right
            raise ValueError(f"head {k}'s rank accuracies sum to {sum(row):.2f} > 1 with accuracy {accuracies[k]} "
                             f"and rank decay {decay}: lower --rank-decay or the accuracy")
    return table


def tree_for_size(table: Sequence[Sequence[float]], size: int) -> Paths:
    """The ``size``-node tree (root included) grown greedily by calibrate.grow_tree (paper §2.3.3).
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

def median_seconds(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    """Median time of ``fn``. CUDA: events around each call, calls queued back to back, so launch
    cost hides behind GPU work (as in the loop) and the figure is device time. CPU: wall time."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in marks:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) / 1000 for s, e in marks)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Components:
    decoder: float      # seconds: decoder forward of T tree tokens over a cache of --context
    lm_head: float      # lm_head on T rows
    heads: float        # heads on the 1 accepted row, top-k and candidate gather
    accept: float       # targets, acceptance walk, path/bonus gathers
    kv_copy: float      # compaction of the deepest path's KV (commit_path); 0 when it is already in place


@torch.inference_mode()
def time_components(model, heads, tree: TreeBuffers, cache, context: int, iters: int, warmup: int) -> Components:
    """Each part of generate()'s step body, alone. The forward writes its T entries after the
    ``context`` committed ones without committing them, so the prefix stays fixed."""
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device = lm_head.weight.device
    step_mask = StepMask(tree.attn_mask.to(DTYPE), cache.capacity)
    tokens = torch.randint(3, lm_head.out_features, (tree.size,), device=device)          # (T,)

    def forward():
        return decoder(input_ids=tokens[None], attention_mask=step_mask.at(context),
                       position_ids=(tree.depths + context)[None], past_key_values=cache,
                       use_cache=True).last_hidden_state[0]                              # (T, H)

    hidden = forward()
    logits = lm_head(hidden)                                                            # (T, V)

    def propose():
        guesses = torch.topk(heads(hidden[0], lm_head)[: tree.num_heads], tree.top_k, dim=-1).indices   # (K, top_k)
        return torch.cat([tokens[:1], guesses.flatten()])[tree.candidate_index]          # (T,)

    def accept():
        targets = logits.argmax(-1)                                                     # (T,)
        best, length = accept_match(tokens, targets, tree.leaf_paths)
        path = tree.leaf_paths.index_select(0, best)[0]
        return targets.index_select(0, path.gather(0, length - 1))

    deepest = tree.leaf_paths[-1]                        # sorted by depth: the last leaf is a deepest one
    deepest = deepest[deepest >= 0]
    moves = deepest.tolist() != list(range(len(deepest)))    # generate() copies only a path not in place

    def kv_copy():
        cache.commit_path(deepest, [0] * len(deepest))
        cache.rewind(context)

    run = lambda fn: median_seconds(fn, iters, warmup, device)
    return Components(run(forward), run(lambda: lm_head(hidden)), run(propose) if tree.num_heads else 0.0,
                      run(accept), run(kv_copy) if moves else 0.0)


def time_steps(model, heads, tree: TreeBuffers, context: int, iters: int, warmup: int, seed: int) -> tuple[float, float]:
    """(median wall seconds per step, tokens per step) of generate() itself after a random
    ``context``-token prompt: host work and the step's one sync included. Random heads are
    almost never right, so this is the verification cost of the tree."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (context,), generator=gen).tolist()
    config = DecodeConfig(max_new_tokens=warmup + iters + 1)
    steps = [s for s in generate(model, prompt, heads=heads if tree.num_heads else None, tree=tree, config=config)][1:]
    timed = [s for s in steps if s.tokens][warmup:] or steps[-1:]
    return statistics.median(s.seconds for s in timed), sum(len(s.tokens) for s in steps) / len(steps)


@torch.inference_mode()
def time_hf_generate(model, context: int, new_tokens: int, device: torch.device) -> dict[str, float | str]:
    """transformers' greedy generate() per token (prefill removed by differencing two runs),
    for each cache it offers without compiling: the baseline should be within 1.2x of the best."""
    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def wall(n: int, cache: str | None) -> float:
        sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       cache_implementation=cache)
        sync()
        return time.perf_counter() - t0

    out: dict[str, float | str] = {}
    for cache in ("dynamic", "static"):
        try:
            wall(new_tokens + 1, cache)                                # warm-up (static: allocation)
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

@dataclass(frozen=True)
class TreeRow:
    size: int                   # nodes including the root (1 = the baseline step)
    depth: int
    step_ms: float              # generate()'s step, wall clock (random heads: no KV copy)
    kv_copy_ms: float           # added by trained heads, which usually accept a path not in place
    overhead: float             # (step + kv copy) / baseline step
    expected_acceptance: float  # tokens per step, from the accuracies
    projected_speedup: float    # expected acceptance / overhead
    host_ms: float              # step - (decoder + lm_head + heads + accept): device idle, waiting on Python
    host_pct: float
    decoder_ms: float
    lm_head_ms: float
    heads_ms: float
    accept_ms: float
    tokens_per_step_random_heads: float
    bytes_read: int             # weights (+ heads) + KV per step
    bandwidth_gbs: float        # bytes_read / step


@dataclass(frozen=True)
class QuantResult:
    quant: str
    weights_bytes: int          # decoder layers + lm_head (the embedding table is not read, only T rows)
    heads_bytes: int
    kv_bytes: int               # the --context prefix, keys + values, all layers
    copy_bandwidth_gbs: float   # attainable: a large device copy
    hf_generate_ms: dict[str, float | str]
    baseline_over_best_hf: float | None
    rows: tuple[TreeRow, ...]


def bench_quant(args, quant: str, device: torch.device) -> QuantResult:
    shape = SHAPES[args.shape]
    num_heads = len(args.accuracies)
    model = build_model(shape, device, args.seed)
    heads = build_heads(shape, num_heads, device, args.seed + 1)
    check_not_zero([model, heads])
    if quant == "nf4":
        quantize_backbone_(model)
    if args.heads_quant == "nf4":
        from .heads_quant import quantize_projections
        quantize_projections(heads, DTYPE)
    table = rank_table(args.accuracies, decay=args.rank_decay)
    sizes = sorted({1, *args.tree_sizes})
    trees = {n: build_tree_buffers(tree_for_size(table, n), num_heads, TOP_K, DTYPE, device) for n in sizes}

    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    cache = new_cache(model, args.context + sizes[-1])
    prefix = torch.randint(3, shape.vocab, (1, args.context), device=device)
    with torch.inference_mode():
        decoder(input_ids=prefix, attention_mask=causal_mask(0, args.context, DTYPE, device),
                position_ids=torch.arange(args.context, device=device)[None], past_key_values=cache, use_cache=True)
    cache.commit(prefix[0].tolist())

    weights = weight_bytes(decoder) - weight_bytes(decoder.embed_tokens) + weight_bytes(lm_head)
    heads_bytes = weight_bytes(heads)
    kv = 2 * shape.layers * shape.hidden * args.context * torch.finfo(DTYPE).bits // 8
    rows, base_ms = [], None
    for n, tree in trees.items():
        c = time_components(model, heads, tree, cache, args.context, args.iters, args.warmup)
        step, tokens = time_steps(model, heads, tree, args.context, args.iters, args.warmup, args.seed)
        step_ms, copy_ms = 1000 * step, 1000 * c.kv_copy
        base_ms = base_ms or step_ms
        overhead = (step_ms + copy_ms) / base_ms
        acc = expected_acceptance(table, tree.paths)
        host_ms = step_ms - 1000 * (c.decoder + c.lm_head + c.heads + c.accept)
        read = weights + kv + (heads_bytes if tree.num_heads else 0)
        rows.append(TreeRow(n, tree.num_heads, step_ms, copy_ms, overhead, acc, acc / overhead, host_ms,
                            100 * host_ms / step_ms, 1000 * c.decoder, 1000 * c.lm_head, 1000 * c.heads,
                            1000 * c.accept, tokens, read, read / step / 1e9))
    hf: dict[str, float | str] = {}
    ratio = None
    if args.hf_generate:
        hf = {k: 1000 * v if isinstance(v, float) else v
              for k, v in time_hf_generate(model, args.context, args.iters, device).items()}
        times = [v for v in hf.values() if isinstance(v, float)]
        ratio = base_ms / min(times) if times else None
    result = QuantResult(quant, weights, heads_bytes, kv, copy_bandwidth(device, args.iters) / 1e9, hf, ratio, tuple(rows))
    del model, heads, cache, trees
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- report

def format_result(r: QuantResult, shape: str, context: int) -> str:
    gb = lambda b: f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.3f} MB"
    base = r.rows[0]
    lines = [
        f"== backbone {'NF4 (bf16 compute)' if r.quant == 'nf4' else 'bf16'}, {shape} shapes, context {context} ==",
        f"bytes read per baseline step: weights {gb(r.weights_bytes)} + KV {gb(r.kv_bytes)}; Medusa steps add heads {gb(r.heads_bytes)}",
        f"baseline step {base.step_ms:.3f} ms -> {base.bandwidth_gbs:.0f} GB/s read; device copy bandwidth "
        f"{r.copy_bandwidth_gbs:.0f} GB/s ({100 * base.bandwidth_gbs / r.copy_bandwidth_gbs:.0f}% of it)",
    ]
    if r.hf_generate_ms:
        cells = ", ".join(f"{k} {v:.3f} ms/token" if isinstance(v, float) else f"{k} {v}" for k, v in r.hf_generate_ms.items())
        verdict = f"; baseline / best = {r.baseline_over_best_hf:.2f} (target <= 1.2)" if r.baseline_over_best_hf else ""
        lines.append(f"transformers generate(): {cells}{verdict}")
    head = f"{'size':>5}{'depth':>6}{'step ms':>10}{'+copy ms':>10}{'overhead':>10}{'exp. acc':>10}{'proj. speedup':>15}{'host ms (%)':>16}"
    lines += [head, "-" * len(head)]
    for w in r.rows:
        lines.append(f"{w.size:>5}{w.depth:>6}{w.step_ms:>10.3f}{w.kv_copy_ms:>10.3f}{w.overhead:>10.3f}"
                     f"{w.expected_acceptance:>10.3f}{w.projected_speedup:>14.2f}x{w.host_ms:>10.3f} ({w.host_pct:4.1f}%)")
    head = f"{'size':>5}{'decoder':>10}{'lm_head':>10}{'heads':>10}{'accept':>10}{'kv copy':>10}{'sum':>10}{'GB/s':>8}   (ms)"
    lines += ["components, each timed alone:", head, "-" * len(head)]
    for w in r.rows:
        parts = (w.decoder_ms, w.lm_head_ms, w.heads_ms, w.accept_ms, w.kv_copy_ms)
        lines.append(f"{w.size:>5}" + "".join(f"{p:>10.3f}" for p in parts) + f"{sum(parts):>10.3f}{w.bandwidth_gbs:>8.1f}")
    return "\n".join(lines)


def environment(device: torch.device) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
        "transformers": ver("transformers"), "bitsandbytes": ver("bitsandbytes"),
    }


def plot(results: list[QuantResult], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed (pip install matplotlib to write {path})"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        sizes = [w.size for w in r.rows]
        left.plot(sizes, [w.overhead for w in r.rows], marker="o", label=r.quant)
        right.plot(sizes, [w.projected_speedup for w in r.rows], marker="o", label=r.quant)
    for ax, title in ((left, "overhead (step / baseline step)"), (right, "projected speedup")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size (nodes)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m medusa_core.bench_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 7b on CUDA, tiny otherwise")
    p.add_argument("--quant", nargs="+", choices=("none", "nf4"), help="backbone precisions (default: none nf4 on CUDA, none otherwise)")
    p.add_argument("--heads-quant", choices=("none", "nf4"), default="none", help="NF4 heads' vocab projections")
    p.add_argument("--tree-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--context", type=int, default=512, help="prefix length in the cache while timing")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--accuracies", nargs="+", type=float, default=list(PUBLISHED_ACCURACIES),
                   help="top-1 accuracy of each head (one per head), e.g. the demo model's from calibrate")
    p.add_argument("--rank-decay", type=float, default=RANK_DECAY, help="rank i of a head counts a * decay**i")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-generate", action="store_true", help="also time transformers' greedy generate() per token")
    p.add_argument("--json", help="write everything here")
    p.add_argument("--plot", help="write overhead and projected speedup per tree size here (PNG)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.shape = args.shape or ("7b" if device.type == "cuda" else "tiny")
    args.quant = args.quant or (["none", "nf4"] if device.type == "cuda" else ["none"])
    try:
        if device.type == "cuda" and not cuda:
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU: use --device cpu --shape tiny")
        room = SHAPES[args.shape].max_position
        if args.context + max(args.tree_sizes) + args.iters + args.warmup + 1 > room:
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

    env = environment(device)
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"heads' top-1 accuracies {args.accuracies}; rank i of head k counts a[k] * {args.rank_decay}**i")
    results = []
    for quant in args.quant:
        results.append(bench_quant(args, quant, device))
        print(format_result(results[-1], args.shape, args.context), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"env": env, "args": vars(args), "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(plot(results, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
