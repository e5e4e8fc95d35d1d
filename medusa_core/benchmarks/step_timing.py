"""Timing one decoding step, the loop around it and its references, as the synthetic benchmark
(python -m medusa_core.bench_synthetic) measures them: device time on CUDA (events), wall time
elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..decoding.config import DecodeConfig
from ..decoding.generate import generate, new_cache
from ..decoding.graphs import captured
from ..decoding.kv_cache import cache_keyword, prefill_mask, tree_step_mask
from ..decoding.step_store import step_for
from ..decoding.tree import TreeBuffers, build_tree_buffers
from ..errors import first_line
from .synthetic import DTYPE


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
    """Median seconds of one DecodeStep call (run eagerly, or its graph replayed) at the cache's prefix.
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
    keyword = cache_keyword(model)
    prefix = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    model(input_ids=prefix, attention_mask=prefill_mask(0, context, capacity, DTYPE, device),
          position_ids=torch.arange(context, device=device)[None], use_cache=True, **{keyword: cache})
    tokens = torch.randint(3, model.config.vocab_size, (1, tree.size), device=device)
    position = torch.full((1,), context, device=device)
    mask = tree_step_mask(tree.allowed, position, torch.arange(capacity, device=device), DTYPE)
    positions = (tree.depths + context)[None]

    def forward():
        for layer in cache.layers:     # StaticCache advances its write position per update: set it back
            layer.cumulative_length.fill_(context)
        return model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                     **{keyword: cache}).logits

    graph, _ = captured(forward, device)
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
            per_token = (min(wall(new_tokens + 1, cache) for _ in range(3))
                         - min(wall(1, cache) for _ in range(3))) / new_tokens
            # the difference of two noisy times: where noise outweighs the tokens (a tiny model, a few tokens, a
            # busy CPU) it is no figure, said so (CI measured -0.10 ms a token)
            out[cache] = per_token if per_token > 0 else (
                f"failed: the longer run measured no slower ({1e3 * per_token:.3f} ms a token): timing noise, "
                "raise --iters")
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            out[cache] = f"failed: {type(err).__name__}: {first_line(err)}"
    return out


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write): the attainable bandwidth."""
    n = (256 if device.type == "cuda" else 16) * 2**20
    src, dst = torch.ones(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / median_seconds(lambda: dst.copy_(src), iters, 2, device)
